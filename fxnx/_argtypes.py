"""argparse ``type=`` functions for the ``fxnx`` command: each checks one option.

They run while the command line is parsed, so a bad value is argparse's usage
error (exit 2) before any model is built or file read. The torch-dependent ones
import lazily: ``fxnx info`` and ``fxnx draw`` never call them.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from . import render as _render

__all__ = [
    "MAX_DPI",
    "MAX_INPUT_ELEMENTS",
    "Output",
    "bounded",
    "drawing",
    "dtype",
    "graph_file",
    "graph_output",
    "routes",
    "rule",
    "shape",
    "writable",
]

#: Example inputs over this many elements (4 GiB of float32) are refused before allocating.
MAX_INPUT_ELEMENTS = 2**30
#: The highest ``--dpi``: the one fxnx.draw accepts.
MAX_DPI = _render.MAX_DPI


def shape(text: str) -> tuple[int, ...]:
    """A tensor shape such as ``1,3,224,224``: positive sizes, at most MAX_INPUT_ELEMENTS in all.

    Examples
    --------
    >>> shape("1,3,224,224")
    (1, 3, 224, 224)
    >>> shape("100000,100000,3,3")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: '100000,100000,3,3' has 90,000,000,000 elements, more than \
the 1,073,741,824 fxnx allocates for an example input: give a batch of 1 and a smaller size
    """
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape: give comma-separated integers such as 1,3,224,224"
        ) from None
    if any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be a positive integer")
    if math.prod(dims) > MAX_INPUT_ELEMENTS:
        raise argparse.ArgumentTypeError(
            f"{text!r} has {math.prod(dims):,} elements, more than the {MAX_INPUT_ELEMENTS:,} "
            "fxnx allocates for an example input: give a batch of 1 and a smaller size"
        )
    return dims


def bounded(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type for a whole number from ``low`` to ``high`` (no upper limit if None).

    Examples
    --------
    >>> bounded(1, 2400)("96")
    96
    >>> bounded(1)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 0 is out of range: give 1 or more
    """
    span = f"{low} or more" if high is None else f"{low} to {high}"

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {span}")
        return value

    return whole_number


def dtype(text: str) -> Any:
    """The ``torch.dtype`` named ``text`` (``float32``, ``int64``); nothing else torch holds.

    Examples
    --------
    >>> dtype("int64")
    torch.int64
    >>> dtype("Tensor")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 'Tensor' is not a torch dtype: give float32, float64, \
bfloat16, int64 or another torch.dtype name
    """
    from ._models import DTYPES

    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch dtype: give float32, float64, bfloat16, int64 or another "
            "torch.dtype name"
        )
    return DTYPES[text]


def routes(text: str) -> str | tuple[str, ...]:
    """``auto`` or a comma-separated list of known capture routes.

    Examples
    --------
    >>> routes("export,make_fx")
    ('export', 'make_fx')
    """
    if text == "auto":
        return text
    from .capturing.registry import ROUTES

    names = tuple(text.split(","))
    unknown = [name for name in names if name not in ROUTES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown capture route {unknown[0]!r}: give auto or a comma-separated list of "
            + ", ".join(ROUTES)
        )
    return names


def rule(text: str) -> str:
    """The name of a credit rule preset in ``fxnx.PRESETS`` (``exact``, ``usf``, ...)."""
    from .credit import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown rule {text!r}; known rules: {', '.join(PRESETS)}")
    return text


def writable(text: str) -> Path:
    """A file path whose nearest existing folder fxnx may write in (missing folders are made).

    Examples
    --------
    >>> writable(__file__ + "/graph.pkl")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: cannot write .../_argtypes.py/graph.pkl: .../_argtypes.py is a file...
    """
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a file name")
    path = Path(text)
    _check_folder(path.parent, text)
    return path


def _check_folder(folder: Path, text: str) -> None:
    """Refuse ``text`` unless ``folder`` is one, or can be made in its nearest existing folder."""
    folder = folder.absolute()
    try:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        is_dir = existing.is_dir()
    except OSError as err:  # a name too long, a folder that cannot be searched
        raise argparse.ArgumentTypeError(f"cannot write {text[:80]}: {err.strerror}") from None
    if not is_dir:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no permission to write in {existing}")


class Output(NamedTuple):
    """Where ``fxnx convert -o`` writes: a graph file, or a folder to write ``MODEL.pkl`` in."""

    path: Path
    folder: bool


def graph_output(text: str) -> Output:
    """``convert -o``: a folder (one that exists, or any path ending with a separator, as for
    ``cp``), or a ``.pkl`` file name, to which ``.pkl`` is added when it has no suffix.

    Examples
    --------
    >>> graph_output("graphs/")
    Output(path=PosixPath('graphs'), folder=True)
    >>> graph_output("resnet18")
    Output(path=PosixPath('resnet18'), folder=False)
    >>> graph_output("resnet18.png")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: cannot write the graph to 'resnet18.png': give a .pkl file name, \
or a folder (one that exists, or a path ending in /)
    """
    if _names_folder(text):
        _check_folder(Path(text), text)
        return Output(Path(text), folder=True)
    path = writable(text)
    if path.suffix.lower() not in ("", ".pkl"):
        raise argparse.ArgumentTypeError(
            f"cannot write the graph to {path.name!r}: give a .pkl file name, or a folder "
            f"(one that exists, or a path ending in {os.sep})"
        )
    return Output(path, folder=False)


def graph_file(text: str) -> Path:
    """A :func:`writable` file path for a graph: .pkl or .json.

    Examples
    --------
    >>> graph_file("graph.txt")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: cannot save the graph to 'graph.txt': give a .pkl or .json file name
    """
    return _file_named(text, (".pkl", ".json"), "cannot save the graph to {name!r}: give a .pkl or "
                       ".json file name")


def drawing(text: str) -> Path:
    """A :func:`writable` file path for a drawing: .png, .svg, .pdf or .dot.

    Examples
    --------
    >>> drawing("graph.jpeg")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: cannot draw to 'graph.jpeg': give a .png, .svg, .pdf or .dot \
file name
    """
    return _file_named(text, tuple(f".{fmt}" for fmt in _render.FORMATS),
                       "cannot draw to {name!r}: give a .png, .svg, .pdf or .dot file name")


def _file_named(text: str, suffixes: tuple[str, ...], refusal: str) -> Path:
    """A :func:`writable` path that ends in one of ``suffixes`` and is not a folder."""
    path = writable(text)
    if path.suffix.lower() not in suffixes:
        raise argparse.ArgumentTypeError(refusal.format(name=path.name))
    if _names_folder(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name")
    return path


def _names_folder(text: str) -> bool:
    """Whether ``text`` is a folder, or ends with a separator as only a folder's name may."""
    try:
        return text.endswith(tuple(filter(None, (os.sep, os.altsep)))) or Path(text).is_dir()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write {text[:80]}: {err.strerror}") from None
