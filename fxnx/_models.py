"""Models and example inputs for the command line.

A model is a torchvision name (``resnet18``, built without weights) or
``package.module:factory``, where ``factory()`` returns a ``torch.nn.Module``.
Whatever goes wrong while importing, finding or calling the factory, even a
``sys.exit`` in it, comes back as one :class:`~fxnx.errors.FxnxError` that names
the spec.
"""

from __future__ import annotations

import difflib
import functools
import importlib

import torch
from torch import nn

from .errors import FxnxTypeError, FxnxValueError, first_line

__all__ = ["DTYPES", "example_input", "load_model", "model_for"]

#: The dtypes ``--dtype`` accepts, by the name torch gives them (``float32``, ``int64``);
#: not the quantized ones (``qint8``), which plain tensors cannot have.
DTYPES = {
    name: value for name, value in vars(torch).items()
    if isinstance(value, torch.dtype) and not str(value).startswith("torch.q")
}

_EXPECTED = (
    "give a torchvision model name (such as resnet18) or package.module:factory "
    "where factory() returns a torch.nn.Module"
)


def load_model(spec: str) -> nn.Module:
    """Build the model ``spec`` names; raise one :class:`FxnxError` saying why if it cannot.

    Examples
    --------
    >>> load_model("torch.nn:Identity")
    Identity()
    >>> load_model("os:getcwd")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fxnx.errors.FxnxTypeError: cannot load model 'os:getcwd': getcwd() returned a value of type str, not a ...
    """
    if ":" not in spec:
        return _torchvision(spec)
    module_name, _, attr = spec.partition(":")
    where = f"cannot load model {spec!r}"
    if not module_name or not attr:
        raise FxnxValueError(f"{where}: it is not of the form package.module:factory; {_EXPECTED}")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:
        raise FxnxValueError(
            f"{where}: importing {module_name} failed ({_describe(err)}); {_EXPECTED}"
        ) from err
    try:
        factory = functools.reduce(getattr, attr.split("."), module)
    except AttributeError as err:
        raise FxnxValueError(f"{where}: {module_name} has no {attr!r}; {_EXPECTED}") from err
    if not callable(factory):
        raise FxnxTypeError(
            f"{where}: {attr} is a value of type {type(factory).__name__}, not a function; {_EXPECTED}"
        )
    try:
        model = factory()
    except (Exception, SystemExit) as err:
        raise FxnxValueError(f"{where}: {attr}() {_describe(err)}; {_EXPECTED}") from err
    if not isinstance(model, nn.Module):
        raise FxnxTypeError(
            f"{where}: {attr}() returned a value of type {type(model).__name__}, not a torch.nn.Module; {_EXPECTED}"
        )
    return model


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"raised {type(err).__name__}: {first_line(err)}"


def _torchvision(name: str) -> nn.Module:
    try:
        import torchvision
    except ModuleNotFoundError:
        raise FxnxValueError(
            f"model {name!r} is a torchvision name, and torchvision is not installed: "
            "pip install 'fxnx[vision]', or give your own model as package.module:factory"
        ) from None
    except Exception as err:  # a torchvision built for another torch fails in its own import
        raise FxnxValueError(
            f"model {name!r} is a torchvision name, and torchvision fails to import "
            f"({type(err).__name__}: {first_line(err)}): it must be the build made for torch "
            f"{torch.__version__} (pip install 'fxnx[vision]' picks one)"
        ) from None

    names = torchvision.models.list_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        raise FxnxValueError(
            f"unknown model {name!r}: not a torchvision model name"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
            + "; for your own model give package.module:factory"
        )
    try:
        return torchvision.models.get_model(name, weights=None)
    except (Exception, SystemExit) as err:
        raise FxnxValueError(f"cannot build torchvision's {name}: {_describe(err)}") from err


def example_input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An example input: standard normal for float and complex dtypes, zeros otherwise.

    Zeros are valid token ids for any embedding, and a valid image for integer pixels.

    Examples
    --------
    >>> example_input((2, 3), torch.int64)
    tensor([[0, 0, 0],
            [0, 0, 0]])
    >>> example_input((1, 4), torch.float64).dtype
    torch.float64
    """
    try:
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, dtype=dtype)
        return torch.zeros(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as err:
        size = ",".join(map(str, shape))
        raise FxnxValueError(
            f"cannot make an example input of shape {size} and dtype {dtype}: "
            f"{type(err).__name__}: {first_line(err)}; give a smaller --input-shape or another --dtype"
        ) from err


def model_for(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` in eval mode, cast to ``dtype`` when that is a float or complex dtype.

    Integer inputs are token ids or pixels: the model keeps its own dtype for them.

    Examples
    --------
    >>> model_for(torch.nn.Linear(2, 2), torch.int64).weight.dtype
    torch.float32
    >>> model_for(torch.nn.Linear(2, 2), torch.float64).weight.dtype
    torch.float64
    """
    model = model.eval()
    return model.to(dtype) if dtype.is_floating_point or dtype.is_complex else model
