"""argparse ``type=`` functions for the ``fxnx`` command: each checks one option.

They run while the command line is parsed, so a bad value is argparse's usage
error (exit 2) before any model is built or file read. The torch-dependent ones
import lazily: ``fxnx info`` and ``fxnx draw`` never call them.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ._drawing.fit import MAX_DPI as _MAX_DPI
from ._drawing.graphviz import FORMATS as _FORMATS
from ._errors import FxnxError, first_line

__all__ = [
    "MAX_DPI",
    "MAX_INPUT_ELEMENTS",
    "VALUES",
    "InputSpec",
    "Output",
    "TorchMissingError",
    "bounded",
    "drawing",
    "dtype",
    "graph_file",
    "graph_output",
    "input_spec",
    "model_option",
    "positional_input",
    "routes",
    "rule",
    "shape",
    "writable",
]

#: Example inputs over this many elements (4 GiB of float32) are refused before allocating.
MAX_INPUT_ELEMENTS = 2**30
#: The highest ``--dpi``: the one fxnx.draw accepts.
MAX_DPI = _MAX_DPI


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
    _needs_torch()
    from ._models import DTYPES

    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch dtype: give float32, float64, bfloat16, int64 or another "
            "torch.dtype name"
        )
    return DTYPES[text]


class TorchMissingError(FxnxError, ImportError):
    """The command needs torch, and importing it failed (raised while arguments are parsed)."""


def _needs_torch() -> None:
    """Import torch, or raise one :class:`TorchMissingError` that says what to install."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] != "torch":
            how = f"fails to import (it needs {err.name}, which is missing)"
        else:
            how = "is not installed"
        raise TorchMissingError(
            f"this command builds models with torch, which {how}: pip install torch "
            "(fxnx info and fxnx draw work without it)"
        ) from None
    except Exception as err:  # a broken build raises OSError (a missing library) and others
        raise TorchMissingError(
            f"this command builds models with torch, which fails to import "
            f"({type(err).__name__}: {first_line(err)}): reinstall torch (pip install torch); "
            "fxnx info and fxnx draw work without it"
        ) from None


#: What ``--input ...:VALUES`` may ask for; ``randint=N`` gives whole numbers from 0 to N-1.
VALUES = ("zeros", "ones", "randn", "randint=N")

_INPUT_FORM = "[NAME=]SHAPE[:DTYPE][:VALUES], such as 1,3,224,224 or input_ids=1,16:int64:randint=1000"


class InputSpec(NamedTuple):
    """One example input of ``--input`` or ``--input-shape``, before it is made.

    ``name`` is None for a positional input, else the keyword of ``forward`` it is
    passed as. ``dtype`` None stands for the command's ``--dtype``. ``values`` is
    ``"zeros"``, ``"ones"``, ``"randn"`` or ``"randint"`` (below ``high``); None
    stands for randn for a float or complex dtype and zeros for any other.
    """

    name: str | None
    shape: tuple[int, ...]
    dtype: Any = None
    values: str | None = None
    high: int | None = None

    def __str__(self) -> str:
        text = ",".join(map(str, self.shape))
        if self.name is not None:
            text = f"{self.name}={text}"
        if self.dtype is not None:
            text += ":" + str(self.dtype).removeprefix("torch.")
        if self.values == "randint":
            text += f":randint={self.high}"
        elif self.values is not None:
            text += f":{self.values}"
        return text


def positional_input(text: str) -> InputSpec:
    """``--input-shape``: the shape of one positional input, of the command's ``--dtype``.

    Examples
    --------
    >>> positional_input("1,3,32,32")
    InputSpec(name=None, shape=(1, 3, 32, 32), dtype=None, values=None, high=None)
    """
    return InputSpec(None, shape(text))


def input_spec(text: str) -> InputSpec:
    """``--input [NAME=]SHAPE[:DTYPE][:VALUES]``: one example input, positional or by keyword.

    Examples
    --------
    >>> str(input_spec("input_ids=1,16:int64:randint=1000"))
    'input_ids=1,16:int64:randint=1000'
    >>> input_spec("mask=1,16:long:ones").dtype
    torch.int64
    >>> input_spec("1,16:lnog")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 'lnog' in '1,16:lnog' is neither a torch dtype (float32, int64, ...) nor values (zeros, ones, randn, randint=N): write [NAME=]SHAPE[:DTYPE][:VALUES], such as 1,3,224,224 or input_ids=1,16:int64:randint=1000
    """
    head, *fields = text.split(":")
    name, equals, size = head.rpartition("=")
    if equals and not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{name!r} in {text!r} is not a keyword of forward (a Python name such as "
            f"attention_mask): write {_INPUT_FORM}"
        )
    try:
        dims = shape(size)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err} (in {text!r})") from None
    kind, values, high = None, None, None
    for field in fields:
        value_kind, _, bound = field.partition("=")
        if value_kind in ("zeros", "ones", "randn", "randint") and values is None:
            values, high = value_kind, _high(value_kind, bound, field, text)
        elif kind is None and values is None:
            kind = _input_dtype(field, text)
        else:
            raise argparse.ArgumentTypeError(
                f"{field!r} in {text!r} is one field too many: write {_INPUT_FORM}"
            )
    return InputSpec(name or None, dims, kind, values, high)


def _input_dtype(field: str, text: str) -> Any:
    _needs_torch()
    from ._models import DTYPES

    if field not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{field!r} in {text!r} is neither a torch dtype (float32, int64, ...) nor values "
            f"({', '.join(VALUES)}): write {_INPUT_FORM}"
        )
    return DTYPES[field]


def _high(kind: str, bound: str, field: str, text: str) -> int | None:
    """randint's N (values 0 to N-1); no bound for the other values."""
    if kind != "randint":
        if bound:
            raise argparse.ArgumentTypeError(
                f"{field!r} in {text!r}: {kind} takes no '=': write {kind}"
            )
        return None
    try:
        high = int(bound)
    except ValueError:
        high = 0
    if high < 1:
        raise argparse.ArgumentTypeError(
            f"{field!r} in {text!r}: write randint=N with N a whole number of 1 or more, for "
            "values from 0 to N-1 (token ids below a vocabulary of N)"
        )
    return high


def model_option(text: str) -> tuple[str, Any]:
    """``--config KEY=VALUE``: a keyword for the model's builder, VALUE read as a Python literal.

    A VALUE that is not a literal (``gelu``) stays a string.

    Examples
    --------
    >>> model_option("num_hidden_layers=2")
    ('num_hidden_layers', 2)
    >>> model_option("hidden_act=gelu")
    ('hidden_act', 'gelu')
    >>> model_option("layers")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 'layers' is not KEY=VALUE: write for example num_hidden_layers=2
    """
    key, equals, value = text.partition("=")
    if not equals or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE: write for example num_hidden_layers=2"
        )
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return key, value


def routes(text: str) -> str | tuple[str, ...]:
    """``auto`` or a comma-separated list of known capture routes.

    Examples
    --------
    >>> routes("export,make_fx")
    ('export', 'make_fx')
    """
    if text == "auto":
        return text
    _needs_torch()
    from ._capture.registry import ROUTES

    names = tuple(text.split(","))
    unknown = [name for name in names if name not in ROUTES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown capture route {unknown[0]!r}: give auto or a comma-separated list of "
            + ", ".join(ROUTES)
        )
    return names


def rule(text: str) -> str:
    """The name of a credit rule preset in ``fxnx.credit.PRESETS`` (``exact``, ``usf``, ...)."""
    _needs_torch()
    from ._credit.presets import PRESETS

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
    return _file_named(text, tuple(f".{fmt}" for fmt in _FORMATS),
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
