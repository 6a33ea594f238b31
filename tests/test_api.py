"""The public surface: about thirty names on ``fxnx``, each with one home, torch-free until needed.

The leak test is httpx's: a public module holds its ``__all__`` and nothing else that looks
public, so ``fxnx.analysis.skip_connections`` and ``fxnx.skip_connections`` cannot both be
spellings of one function. Everything else lives in modules whose names start with ``_``.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import fxnx

from blocktorch import run_without_torch

PUBLIC = ["fxnx", "fxnx.contract", "fxnx.credit", "fxnx.errors", "fxnx.frames", "fxnx.plot"]


def _loaded(name: str) -> types.ModuleType:
    module = importlib.import_module(name)
    for attr in module.__all__:
        getattr(module, attr)  # load the lazy ones
    return module


def test_the_top_level_is_about_thirty_names_sorted():
    names = [n for n in fxnx.__all__ if n != "__version__"]
    assert names == sorted(names)
    assert 25 <= len(names) <= 32, names


def test_every_module_under_fxnx_is_private_or_listed_public():
    found = {f"fxnx.{m.name}" for m in pkgutil.iter_modules(fxnx.__path__)}
    public = {m for m in found if not m.rsplit(".", 1)[1].startswith("_")}
    assert public == set(PUBLIC[1:]), "a new public module must be listed here and in fxnx._MODULES"
    assert set(fxnx._MODULES) == {m.rsplit(".", 1)[1] for m in public}


@pytest.mark.parametrize("name", PUBLIC)
def test_a_public_module_holds_its_all_and_nothing_else(name):
    module = _loaded(name)
    names = [n for n in module.__all__ if not n.startswith("__")]
    assert names == sorted(names)
    visible = {n for n in vars(module) if not n.startswith("_")}
    extra = {n for n in module.__all__ if n.startswith("__")}
    allowed = set(module.__all__) - extra
    if name == "fxnx":
        allowed |= {m.rsplit(".", 1)[1] for m in PUBLIC[1:]}
    assert visible <= allowed, f"{name} leaks {sorted(visible - allowed)}"


def test_each_public_name_has_one_home():
    homes: dict[int, str] = {}
    for name in PUBLIC:
        module = _loaded(name)
        for attr in module.__all__:
            value = getattr(module, attr)
            if isinstance(value, (str, int)):
                continue
            spelled = f"{name}.{attr}"
            assert id(value) not in homes, f"{spelled} is also {homes[id(value)]}"
            homes[id(value)] = spelled
            defined = getattr(value, "__module__", None) or ""
            if callable(value):  # held privately, or (exceptions) named by their public home
                assert defined.startswith("fxnx._") or defined == name, f"{spelled}: {defined}"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fxnx.nope  # noqa: B018


def test_import_fxnx_does_not_import_torch():
    done = run_without_torch(
        """
        import sys, fxnx
        assert "torch" not in sys.modules
        fxnx.read_pickle, fxnx.errors.GraphFileError, fxnx.contract.NODE_ATTRIBUTES
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
