"""Models and example inputs for the command line.

A model is named by one of

- a torchvision name (``resnet18``), built without weights;
- ``timm:NAME``, ``timm.create_model(NAME, pretrained=False)``;
- ``hf:TYPE``, a Hugging Face model type (``bert``) built from its default config
  with random weights, or ``hf:FOLDER``, a local folder holding ``config.json``
  (a path: it has a ``/`` or starts with ``.`` or ``~``), whose weights are loaded
  when it has them. Nothing is ever downloaded;
- ``package.module:factory``, where ``factory()`` returns a ``torch.nn.Module``.

``options`` (``--config KEY=VALUE``) are keyword arguments of the builder, or
attributes of a Hugging Face config. Whatever goes wrong while importing, finding
or calling the builder, even a ``sys.exit`` in it, comes back as one
:class:`~fxnx.errors.FxnxError` that names the spec.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ._argtypes import InputSpec
from ._errors import FxnxTypeError, FxnxValueError, first_line, warn_user

__all__ = [
    "DTYPES",
    "default_inputs",
    "example_inputs",
    "load_model",
    "model_for",
    "model_stem",
]

#: The dtypes ``--dtype`` accepts, by the name torch gives them (``float32``, ``int64``);
#: not the quantized ones (``qint8``), which plain tensors cannot have.
DTYPES = {
    name: value for name, value in vars(torch).items()
    if isinstance(value, torch.dtype) and not str(value).startswith("torch.q")
}

_EXPECTED = (
    "give a torchvision model name (such as resnet18), timm:NAME, hf:TYPE, hf:FOLDER or "
    "package.module:factory where factory() returns a torch.nn.Module"
)

#: The files ``save_pretrained`` writes the weights to, one of which a checkpoint folder holds.
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json")
#: The length of the token ids fxnx makes for a Hugging Face model given no inputs.
_HF_TOKENS = 16


def load_model(spec: str, options: Mapping[str, Any] | None = None) -> nn.Module:
    """Build the model ``spec`` names; raise one :class:`FxnxError` saying why if it cannot.

    Examples
    --------
    >>> load_model("torch.nn:Identity")
    Identity()
    >>> load_model("torch.nn:Linear", {"in_features": 3, "out_features": 2})
    Linear(in_features=3, out_features=2, bias=True)
    >>> load_model("os:getcwd")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fxnx.errors.FxnxTypeError: cannot load model 'os:getcwd': getcwd() returned a value of type str, not a ...
    """
    options = dict(options or {})
    prefix, colon, target = spec.partition(":")
    if not colon:
        return _torchvision(spec, options)
    if prefix == "timm":
        return _timm(spec, target, options)
    if prefix == "hf":
        return _hf(spec, target, options)
    return _factory(spec, options)


def model_stem(spec: str) -> str:
    """The file name ``fxnx convert`` gives the graph of ``spec`` (without its suffix).

    Examples
    --------
    >>> model_stem("timm:resnet50"), model_stem("hf:./checkpoints/tiny-bert/")
    ('resnet50', 'tiny-bert')
    """
    target = spec.rpartition(":")[2]
    if spec.startswith("hf:") and _is_path(target):
        return Path(target).expanduser().resolve().name or "model"
    return target or "model"


def _factory(spec: str, options: dict[str, Any]) -> nn.Module:
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
        model = factory(**options)
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


def _package(name: str, spec: str, kind: str, install: str) -> ModuleType:
    """Import the package a model name needs, or say in one line what to install."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] != name:
            raise FxnxValueError(
                f"model {spec!r} is {kind}, and {name} fails to import: it needs {err.name}, "
                f"which is missing (pip install {install} brings it)"
            ) from None
        raise FxnxValueError(
            f"model {spec!r} is {kind}, and {name} is not installed: pip install {install}, "
            "or give your own model as package.module:factory"
        ) from None
    except Exception as err:  # a build made for another torch fails in its own import
        raise FxnxValueError(
            f"model {spec!r} is {kind}, and {name} fails to import "
            f"({type(err).__name__}: {first_line(err)}): it must be a build made for torch "
            f"{torch.__version__} (pip install {install} picks one)"
        ) from None


def _unknown(spec: str, kind: str, names: Sequence[str], name: str, hint: str) -> FxnxValueError:
    close = difflib.get_close_matches(name, names, n=3)
    return FxnxValueError(
        f"unknown model {spec!r}: not {kind}"
        + (f" (did you mean {', '.join(close)}?)" if close else "")
        + f"; {hint}"
    )


def _build(spec: str, builder: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return builder(*args, **kwargs)
    except (Exception, SystemExit) as err:
        raise FxnxValueError(f"cannot build {spec!r}: {_describe(err)}") from err


def _torchvision(name: str, options: dict[str, Any]) -> nn.Module:
    torchvision = _package("torchvision", name, "a torchvision name", "'fxnx[vision]'")
    names = torchvision.models.list_models()
    if name not in names:
        raise _unknown(name, "a torchvision model name", names, name,
                       "for timm or Hugging Face give timm:NAME or hf:TYPE, for your own model "
                       "package.module:factory")
    return _build(name, torchvision.models.get_model, name, weights=None, **options)


def _timm(spec: str, name: str, options: dict[str, Any]) -> nn.Module:
    timm = _package("timm", spec, "a timm name", "timm")
    if not timm.is_model(name):
        raise _unknown(spec, "a timm model name", timm.list_models(), name,
                       "timm.list_models() lists them")
    return _build(spec, timm.create_model, name, pretrained=False, **options)


def _is_path(target: str) -> bool:
    return any(sep and sep in target for sep in (os.sep, os.altsep)) or target.startswith((".", "~"))


def _hf(spec: str, target: str, options: dict[str, Any]) -> nn.Module:
    transformers = _package("transformers", spec, "a Hugging Face model", "transformers")
    if _is_path(target):
        return _hf_folder(transformers, spec, Path(target).expanduser(), options)
    types = list(transformers.CONFIG_MAPPING.keys())
    if target not in types:
        raise _unknown(spec, "a Hugging Face model type", types, target,
                       "give a model type such as bert, gpt2 or vit, or a checkpoint folder as "
                       "hf:./FOLDER (fxnx never downloads)")
    _check_options(spec, _build(spec, transformers.AutoConfig.for_model, target), options)
    config = _build(spec, transformers.AutoConfig.for_model, target, **options)
    with _quiet(transformers):
        return _build(spec, transformers.AutoModel.from_config, config)


def _hf_folder(transformers: ModuleType, spec: str, folder: Path, options: dict[str, Any]) -> nn.Module:
    if not (folder / "config.json").is_file():
        what = "has no config.json" if folder.is_dir() else "is not a folder"
        raise FxnxValueError(
            f"cannot load model {spec!r}: {folder} {what}; give a folder written by "
            "save_pretrained (fxnx never downloads)"
        )
    load = functools.partial(_build, spec, transformers.AutoConfig.from_pretrained, str(folder),
                             local_files_only=True)
    _check_options(spec, load(), options)
    config = load(**options)
    architectures = getattr(config, "architectures", None) or []
    cls: Any = getattr(transformers, architectures[0], None) if architectures else None
    cls = cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else transformers.AutoModel
    if not any((folder / name).is_file() for name in _HF_WEIGHTS):
        warn_user(f"{folder} holds no weights ({', '.join(_HF_WEIGHTS[::2])}): {spec} has random "
                  "weights")
        return _build(spec, cls.from_config, config)
    with _quiet(transformers):
        model, loading = _build(spec, cls.from_pretrained, str(folder), config=config,
                                local_files_only=True, output_loading_info=True)
    random = sorted(loading.get("missing_keys", ())) + sorted(
        str(key[0] if isinstance(key, tuple) else key) for key in loading.get("mismatched_keys", ()))
    if random:
        warn_user(f"{len(random)} weights of {type(model).__name__} are not in {folder} (or have "
                  f"another shape there) and are random: {', '.join(random[:3])}"
                  + (", ..." if len(random) > 3 else ""))
    return model


@contextlib.contextmanager
def _quiet(transformers: ModuleType) -> Iterator[None]:
    """Without transformers' progress bars and log lines: what matters comes back as a warning."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _check_options(spec: str, config: Any, options: dict[str, Any]) -> None:
    """Refuse a ``--config`` option that is no attribute of the model's config: a config takes
    any keyword, so a misspelled one would be an attribute nothing reads. The options are then
    given to the config's constructor, which derives the rest from them (Llama's head_dim)."""
    known = sorted(config.to_dict())
    for key in options:
        if not hasattr(config, key):
            close = difflib.get_close_matches(key, known, n=3)
            raise FxnxValueError(
                f"--config {key}: the config of {spec!r} ({type(config).__name__}) has no "
                f"attribute {key!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
            )


# --- example inputs ----------------------------------------------------------------------------


def default_inputs(spec: str, model: nn.Module) -> tuple[InputSpec, ...]:
    """The example inputs fxnx makes for ``model`` when none are given; empty if it has none.

    A timm model: one image of its configured input size. A Hugging Face model:
    token ids of length 16 below its vocabulary size (and decoder token ids for an
    encoder-decoder), or an image of its configured size.

    Examples
    --------
    >>> default_inputs("torch.nn:Identity", torch.nn.Identity())
    ()
    """
    if spec.startswith("timm:"):
        size = getattr(model, "pretrained_cfg", {}).get("input_size")
        return (InputSpec(None, (1, *size)),) if size else ()
    if spec.startswith("hf:"):
        return _hf_inputs(spec, model)
    return ()


def _hf_inputs(spec: str, model: nn.Module) -> tuple[InputSpec, ...]:
    config = getattr(model, "config", None)
    params = inspect.signature(model.forward).parameters
    made: list[InputSpec] = []
    if "input_ids" in params:
        vocab = _config_value(config, "vocab_size", "get_text_config")
        ids = ("randint", vocab) if isinstance(vocab, int) and vocab > 0 else ("zeros", None)
        made.append(InputSpec("input_ids", (1, _HF_TOKENS), torch.int64, *ids))
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            made.append(InputSpec("decoder_input_ids", (1, _HF_TOKENS), torch.int64, *ids))
    if "pixel_values" in params:
        size = _config_value(config, "image_size", "vision_config")
        channels = _config_value(config, "num_channels", "vision_config") or 3
        if isinstance(size, int):
            size = (size, size)
        if isinstance(size, (tuple, list)) and len(size) == 2 and isinstance(channels, int):
            made.append(InputSpec("pixel_values", (1, channels, *size)))
    if not made:
        taken = ", ".join(name for name, p in params.items() if p.kind not in (p.VAR_POSITIONAL,
                                                                             p.VAR_KEYWORD))
        raise FxnxValueError(
            f"fxnx makes no default example input for {spec!r} (its forward takes {taken}): "
            "give them with --input NAME=SHAPE[:DTYPE][:VALUES]"
        )
    return tuple(made)


def _config_value(config: Any, name: str, nested: str) -> Any:
    """``config.name``, or the same attribute of its text or vision part (multimodal configs)."""
    value = getattr(config, name, None)
    if value is None and config is not None:
        part = getattr(config, nested, None)
        part = part() if callable(part) else part
        value = getattr(part, name, None)
    return value


def example_inputs(
    specs: Sequence[InputSpec], dtype: torch.dtype, seed: int
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """The positional and keyword inputs ``specs`` describe, ``dtype`` where they name none,
    random values drawn in order from one generator seeded with ``seed``.

    Examples
    --------
    >>> from fxnx._argtypes import input_spec
    >>> args, kwargs = example_inputs([input_spec("2"), input_spec("m=2:int64:ones")],
    ...                               torch.float64, seed=0)
    >>> args[0].dtype, kwargs
    (torch.float64, {'m': tensor([1, 1])})
    """
    generator = torch.Generator().manual_seed(seed)
    args: list[torch.Tensor] = []
    kwargs: dict[str, torch.Tensor] = {}
    for spec in specs:
        tensor = _make(spec, spec.dtype or dtype, generator)
        if spec.name is None:
            args.append(tensor)
        else:
            kwargs[spec.name] = tensor
    return tuple(args), kwargs


def _make(spec: InputSpec, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    values = spec.values or ("randn" if dtype.is_floating_point or dtype.is_complex else "zeros")
    what = "an example input" if spec.name is None else f"example input {spec.name!r}"
    size = ",".join(map(str, spec.shape))
    if values == "randn" and not (dtype.is_floating_point or dtype.is_complex):
        raise FxnxValueError(
            f"cannot make {what} of shape {size} and dtype {dtype} from randn, which draws "
            "floats: give a float dtype, or randint=N, zeros or ones"
        )
    try:
        if values == "randn":
            return torch.randn(spec.shape, dtype=dtype, generator=generator)
        if values == "randint":
            return torch.randint(spec.high or 1, spec.shape, dtype=dtype, generator=generator)
        return (torch.ones if values == "ones" else torch.zeros)(spec.shape, dtype=dtype)
    except (RuntimeError, MemoryError) as err:
        raise FxnxValueError(
            f"cannot make {what} of shape {size} and dtype {dtype}: "
            f"{type(err).__name__}: {first_line(err)}; give a smaller shape or another dtype"
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
