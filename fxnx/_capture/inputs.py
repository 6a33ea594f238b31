"""The example inputs, bound to ``forward``'s signature, and the values a graph runs on.

Keyword inputs stay keywords all the way to each route; inputs the caller did
not pass stay at their defaults and are fixed while tracing symbolically, so
they are not placeholders. Every tensor is copied once, so a model that writes
into its input never writes into the caller's.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .._compat import pytree, view_base
from .._errors import CaptureError, FxnxTypeError

__all__ = [
    "FIXED_KWARGS",
    "Inputs",
    "bind_inputs",
    "copied_inputs",
    "device_of",
    "empty_inputs",
    "placeholder_values",
    "memory_of",
    "qualname",
    "shared_memory",
    "whole_memory",
]

#: Keyword inputs fxnx sets when ``forward`` has them and the caller did not pass them, and
#: why. ``use_cache``: a cache is state kept for generation, not dataflow, and torch.export and
#: make_fx cannot return Hugging Face's Cache objects. Recorded in ``G.graph["fixed_kwargs"]``.
FIXED_KWARGS = {"use_cache": False}


@dataclass(frozen=True)
class Inputs:
    """The example inputs, bound to ``forward``'s signature.

    Attributes
    ----------
    args, kwargs
        As the caller gave them (keywords stay keywords), plus :data:`FIXED_KWARGS`
        that apply. ``torch.export`` and ``make_fx`` take these.
    arguments : dict
        Every ``forward`` parameter's value, defaults filled in (a ``*args``
        parameter holds a tuple): what symbolic tracing's placeholders take.
    fixed : dict
        The keyword inputs fxnx added.
    defaulted : dict
        Parameters the caller did not pass, at their defaults. Symbolic tracing
        fixes them (``if mask is not None`` takes the branch the call takes), so
        they are not inputs of the graph.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arguments: dict[str, Any]
    fixed: dict[str, Any]
    defaulted: dict[str, Any] = field(default_factory=dict)


def empty_inputs(model: Any, input_shape: Sequence[Any], dtype: torch.dtype) -> tuple[Any, ...]:
    """Empty tensors of ``dtype`` on the model's device, one per shape in ``input_shape``."""
    shapes = [input_shape] if all(isinstance(d, int) for d in input_shape) else list(input_shape)
    device = device_of(model)
    return tuple(torch.empty(tuple(shape), dtype=dtype, device=device) for shape in shapes)


def device_of(model: Any) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a function)."""
    if isinstance(model, nn.Module):
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            return tensor.device  # the first: no list of every tensor
    return torch.device("cpu")


def _bind_inputs(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    concrete_args: Mapping[str, Any],
) -> Inputs | None:
    """The example inputs bound to ``forward``'s parameters.

    Returns None when no inputs were given and ``forward`` needs some: the
    graph is then converted without shapes.
    """
    forward = model.forward if isinstance(model, nn.Module) else model
    try:
        sig = inspect.signature(forward)
    except (ValueError, TypeError):  # a TorchScript module's compiled forward
        raise CaptureError(
            f"{qualname(model)}'s forward has no Python signature: it is compiled "
            "(torch.jit.trace or torch.jit.script), and fxnx captures a model from its Python "
            "code. Convert the module before it was compiled"
        ) from None
    # A keyword given at its default (mask=None, flag=False) is the call without it: bound as
    # if left out, so it is fixed while tracing as a default is, and G is the same graph. Not
    # where forward is wrapped: the default its signature shows is the inner function's, and
    # the wrapper may fill a keyword left out with another value.
    if getattr(forward, "__wrapped__", None) is None:
        kwargs = {k: v for k, v in kwargs.items() if not _at_default(sig.parameters.get(k), v)}
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in concrete_args
    ]
    if not args and not kwargs and required:
        return None
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError as err:
        raise FxnxTypeError(
            f"the example inputs do not fit {qualname(model)}.forward{sig}: {err}"
        ) from err
    both = sorted(bound.arguments.keys() & concrete_args.keys())
    if both:
        raise FxnxTypeError(
            f"{both[0]!r} is given both as an input of {qualname(model)}.forward and in "
            "concrete_args, which fixes it while tracing; give it in one place"
        )
    missing = [p.name for p in required if p.name not in bound.arguments]
    if missing:
        raise FxnxTypeError(
            f"the example inputs do not fit {qualname(model)}.forward{sig}: "
            f"missing {', '.join(map(repr, missing))}; pass them positionally or in kwargs="
        )
    fixed = {
        name: value for name, value in FIXED_KWARGS.items()
        if name in sig.parameters and name not in bound.arguments and name not in concrete_args
    }
    bound = sig.bind_partial(*args, **kwargs, **fixed)
    defaulted = {
        p.name: p.default for p in sig.parameters.values()
        if p.name not in bound.arguments and p.name not in concrete_args
        and p.default is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    bound.apply_defaults()
    arguments = {
        name: concrete_args.get(name, bound.arguments.get(name)) for name in sig.parameters
    }
    return Inputs(tuple(args), {**kwargs, **fixed}, arguments, fixed, defaulted)


def _at_default(parameter: inspect.Parameter | None, value: Any) -> bool:
    """Whether ``value`` is ``parameter``'s default: the very object, or an equal number,
    string or boolean of the same type."""
    if parameter is None or parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
        return False
    default = parameter.default
    return value is default or (type(value) is type(default) and type(value) in _PLAIN and value == default
                                and str(value) == str(default))  # -0.0 is not 0.0


#: Values compared with a default by equality: immutable, so an equal one is the same input.
_PLAIN = (bool, int, float, str)


def bind_inputs(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    concrete_args: Mapping[str, Any] | None = None,
    *,
    copy: bool = True,
) -> Inputs | None:
    """The example inputs bound to ``forward``, every tensor copied (see :func:`capture`)
    unless ``copy`` is false (a call that is the model's own forward)."""
    bound = _bind_inputs(model, args, dict(kwargs or {}), concrete_args or {})
    return copied_inputs(bound) if copy else bound


def placeholder_values(inputs: Inputs | None, gm: fx.GraphModule, level: str) -> list[Any] | None:
    """The values to run ``gm`` on, as torch.fx's Interpreter takes them.

    A module-level graph (symbolic tracing) has one placeholder per ``forward``
    parameter, the values of a ``*args`` placeholder spread at the end; an
    ATen-level one (export, make_fx) one per pytree leaf of the inputs.
    """
    if inputs is None:
        return None
    if level != "module":
        return pytree.tree_leaves((inputs.args, inputs.kwargs))
    values: list[Any] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or str(node.target).startswith("**"):
            continue
        name = str(node.target).lstrip("*")
        if name not in inputs.arguments:  # torch.fx names a concrete argument's placeholder x_1
            name = name.rpartition("_")[0]
        value = inputs.arguments.get(name, node.args[0] if node.args else None)
        if str(node.target).startswith("*"):
            values.extend(value or ())
        else:
            values.append(value)
    return values


def copied_inputs(inputs: Inputs | None) -> Inputs | None:
    """The inputs with every tensor copied once (meta and fake tensors copy for free).

    A tensor passed twice stays one tensor, and inputs that share memory (``x`` and ``x[0]``)
    are views of one copy of it where they can be (see :func:`_copied_together`): a model
    that writes into one of them is seen to change the others, as in its own call."""
    if inputs is None:
        return None
    copies: dict[int, torch.Tensor] = {}
    for group in shared_memory(pytree.tree_leaves((inputs.args, inputs.kwargs))):
        copies.update(_copied_together(group))

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in copies:
            copies[id(t)] = t.clone()
        return copies[id(t)]

    args, kwargs, arguments = pytree.tree_map(copy, (inputs.args, inputs.kwargs, inputs.arguments))
    return Inputs(args, kwargs, arguments, inputs.fixed, inputs.defaulted)


def shared_memory(values: Sequence[Any]) -> list[list[torch.Tensor]]:
    """The groups of two or more distinct plain dense tensors among ``values`` that share
    memory (and dtype)."""
    groups: dict[tuple[int, torch.dtype], dict[int, torch.Tensor]] = {}
    for t in values:
        key = memory_of(t) if isinstance(t, torch.Tensor) else None
        if key is not None:
            groups.setdefault(key, {})[id(t)] = t
    return [list(group.values()) for group in groups.values() if len(group) > 1]


def _copied_together(group: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Copies of tensors that share memory, by ``id``, as views of one copy of it: of their
    common base (views of one tensor: the copies keep its autograd history), or of the
    memory itself where none takes credit. Empty where neither holds (tensors that take
    credit but are no views of one tensor): each is then copied alone."""
    bases = {id(b): b for b in map(view_base, group)}
    if len(bases) == 1:
        base = next(iter(bases.values()))
        whole = base.clone()  # dense, laid out as the base, at offset 0
        if whole.stride() != base.stride():
            return {}
        shift = base.storage_offset()
    elif not any(t.requires_grad for t in group):
        whole, shift = whole_memory(group[0]).clone(), 0
    else:
        return {}
    return {id(t): whole.as_strided(t.size(), t.stride(), t.storage_offset() - shift) for t in group}


def whole_memory(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of ``t``'s dtype over the whole of its memory (no copy)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def memory_of(t: torch.Tensor) -> tuple[int, torch.dtype] | None:
    """Where a plain dense tensor's memory lies (with its dtype: views of a copy read it as
    the tensor does); None for others (meta, fake, sparse, subclasses, no memory), which are
    copied one by one."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), t.dtype) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # no memory to read
        return None


def qualname(model: Any) -> str:
    return type(model).__qualname__ if isinstance(model, nn.Module) else model.__qualname__
