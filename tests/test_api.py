"""The public surface: flat, sorted, importable, and torch-free until torch is needed."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import fxnx

from blocktorch import run_without_torch

MODULES = sorted(m.name for m in pkgutil.iter_modules(fxnx.__path__) if not m.name.startswith("_"))


def test_all_is_sorted_and_every_name_imports():
    assert fxnx.__all__ == sorted(fxnx.__all__)
    for name in fxnx.__all__:
        assert getattr(fxnx, name) is not None, name


@pytest.mark.parametrize("module", [m for m in MODULES if m != "__main__"])
def test_every_module_has_a_sorted_all_reexported_flat(module):
    mod = importlib.import_module(f"fxnx.{module}")
    assert mod.__all__ == sorted(mod.__all__)
    if module != "cli":
        for name in mod.__all__:
            assert getattr(fxnx, name) is getattr(mod, name), f"fxnx.{name}"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fxnx.nope  # noqa: B018


def test_import_fxnx_does_not_import_torch():
    done = run_without_torch(
        """
        import sys, fxnx
        assert "torch" not in sys.modules
        try:
            fxnx.convert
        except ImportError as err:
            print("lazy:", err)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("lazy: torch is blocked")


def test_py_typed_is_shipped():
    assert (importlib.resources.files("fxnx") / "py.typed").is_file()
