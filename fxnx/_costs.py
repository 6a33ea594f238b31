"""What each node costs: FLOPs and multiply-adds as torch counts them, and kernel windows.

FLOPs are torch's own: a dispatch mode counts the operators each node runs the way
:class:`torch.utils.flop_counter.FlopCounterMode` does, with its formulas
(``flop_registry``): an ATen operator that has a formula counts it, one that has none is
decomposed where torch can decompose it, and anything else counts nothing. Torch's
formulas count matrix products, convolutions and attention, two FLOPs per multiply-add,
so ``macs`` is half of ``flops``.

It costs little because nothing runs just to be counted where something runs anyway:

* :func:`propagate_and_count` counts while shape propagation runs the nodes (graphs traced by
  ``symbolic_trace`` or ``torch.export``, with real, fake or ``meta`` tensors). A node that
  calls a layer, function, method or ATen operator fxnx knows is counted from its values'
  shapes with torch's formula for the operator it reaches (convolutions, linear layers,
  matrix products), or is 0 (activations, norms, pooling, shape changes: no operator with a
  formula), with no dispatch mode at all; only the other nodes run inside the counting
  mode, entered around each alone (a dispatch mode around the whole propagation costs
  about a tenth of a ResNet-50's conversion);
* :func:`node_flops` counts graphs whose shapes ``make_fx`` recorded without a
  propagation (``level="aten"`` and ``"joint"``): it runs each node again on ``meta``
  tensors (shapes without data) made from the recorded metadata, and runs an ATen node
  only if its operator has a formula or decomposes, an operator only once per argument
  shapes.

The CPU's flash-attention kernel, for which torch's registry has no formula (so
``FlopCounterMode`` counts 0 for attention on the CPU), is counted with torch's formula
for flash attention: two batched matrix products forward, as the math kernel and the
fused CUDA kernels count. ``FlopCounterMode`` on the CPU agrees where attention runs the
math kernel (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``).
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import types
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils.flop_counter import flop_registry

from ._callinfo import fetch_attr
from ._capture import TRACING_LOCK
from ._capture.ladder import WITH_OUTPUT
from ._capture.shapes import _ShapeProp
from ._capture.shapes import propagate as propagate_shapes
from ._capture.tracer import mha_fast_path_off
from ._compat import (
    OpOverload,
    TorchDispatchMode,
    cpu_attention_formulas,
    decomposes,
    global_module_hooks,
    is_fake,
    op_schema,
)
from ._errors import ShapePropagationError
from ._state import random_state_kept

__all__ = ["kernel", "node_flops", "propagate_and_count"]

#: Argument types an operator's cached result may depend on by value.
_KEYED = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device,
                    torch.layout, torch.memory_format})


class _Unknown(Exception):
    """A node's input whose value the recorded metadata does not give (``x.item()``)."""


class _Counter(TorchDispatchMode or object):  # type: ignore[misc]
    """Counts FLOPs as FlopCounterMode does, as the operators run: an operator with a
    formula counts it, one without is decomposed where torch can, the rest count 0.

    An operator that may count, called again with arguments of the same shapes, strides
    and dtypes (every BatchNorm of one width in a ResNet), adds what it counted the first
    time and runs as it is, without its decomposition.
    """

    def __init__(self) -> None:
        super().__init__()
        self.formulas = {**flop_registry, **cpu_attention_formulas(flop_registry)}
        self.flops = self.macs = self.other = 0  # other: FLOPs of formulas not of ATen's
        self._may_count: dict[Any, bool] = {}
        self._seen: dict[Any, Any] = {}  # operator and argument signature to what it counted

    def take(self) -> tuple[int, int | None]:
        """The FLOPs and multiply-adds counted since the last take."""
        counted = self.flops, (None if self.other else self.macs)
        self.flops = self.macs = self.other = 0
        return counted

    def may_count(self, op: Any) -> bool:
        """Whether the ATen operator ``op`` can count anything: it has a formula or decomposes."""
        may = self._may_count.get(op)
        if may is None:
            may = self._may_count[op] = op.overloadpacket in self.formulas or (
                op is not torch.ops.prim.device.default and decomposes(op))
        return may

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.may_count(func):
            return func(*args, **kwargs)
        key = _key(func, args, kwargs)
        seen = self._seen.get(key) if key is not None else None
        if seen is not None:
            self._add(seen)
            return func(*args, **kwargs)
        before = self.flops, self.macs, self.other
        out = self._count(func, args, kwargs)
        if key is not None:
            self._seen[key] = (self.flops - before[0], self.macs - before[1], self.other - before[2])
        return out

    def _add(self, counted: tuple[int, int, int]) -> None:
        self.flops, self.macs, self.other = (
            self.flops + counted[0], self.macs + counted[1], self.other + counted[2])

    def _count(self, func: Any, args: Any, kwargs: Any) -> Any:
        """FlopCounterMode's rule for an operator that may count."""
        formula = self.formulas.get(func.overloadpacket)
        if formula is None:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.flops += flops
            if func.namespace == "aten":  # torch's formulas: two FLOPs per multiply-add
                self.macs += flops // 2
            else:
                self.other += flops
        return out


class _MetaCounter(_Counter):
    """A :class:`_Counter` that runs every operator on ``meta`` tensors.

    Tensors that are not on ``meta`` (the model's parameters and buffers, constants) are
    replaced by ``meta`` tensors of the same shape, so nothing the user owns is written.
    An operator that writes none of its arguments runs once per argument signature: called
    again, it adds what it counted and gives tensors of the shapes it gave.
    """

    def __init__(self) -> None:
        super().__init__()
        self._meta: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = self._on_meta((tuple(args), kwargs or {}))
        key = _key(func, args, kwargs) if _functional(func) else None
        seen = self._seen.get(key) if key is not None else None
        if seen is not None:
            self._add(seen[0])
            return _rebuilt(seen[1])
        before = self.flops, self.macs, self.other
        out = self._count(func, args, kwargs) if self.may_count(func) else func(*args, **kwargs)
        if key is not None and (described := _description(out)) is not None:
            counted = self.flops - before[0], self.macs - before[1], self.other - before[2]
            self._seen[key] = (counted, described)
        return out

    def _on_meta(self, value: Any) -> Any:
        """``value`` with its tensors on ``meta``."""
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                return value
            kept = self._meta.get(id(value))
            if kept is None or kept[1] is not value:
                kept = self._meta[id(value)] = (value.to("meta"), value)
            return kept[0]
        if type(value) in (list, tuple):
            return type(value)(self._on_meta(v) for v in value)
        if type(value) is dict:
            return {k: self._on_meta(v) for k, v in value.items()}
        return value


def _key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` and the signature of its arguments; None where it cannot be said."""
    key = _signature(args)
    if kwargs and key is not None:
        key = key, _signature(kwargs)
        if key[1] is None:
            return None
    return None if key is None else (func, key)


def _signature(value: Any) -> Any:
    """What an operator's result may depend on in ``value``: the shapes, strides and dtypes
    of tensors, other values themselves; None where that cannot be said."""
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:
            return None
        return value.shape, value.stride(), value.dtype, value.device
    if type(value) in (list, tuple, torch.Size):
        if all(type(v) is int for v in value):  # sizes, strides, paddings: most lists
            return type(value), tuple(value)
        parts = tuple(_signature(v) for v in value)
        return None if None in parts else (type(value), parts)
    if type(value) is dict:
        parts = tuple((k, _signature(v)) for k, v in value.items())
        return None if any(p is None for _, p in parts) else (dict, parts)
    if type(value) in _KEYED:
        return type(value), value
    return None


@cache
def _functional(func: Any) -> bool:
    """Whether ``func`` writes none of its arguments and returns no view of them."""
    schema = op_schema(func)
    return (schema is not None and not schema.is_mutable
            and all(r.alias_info is None for r in schema.returns))


def _description(value: Any) -> Any:
    """What :func:`_rebuilt` needs to make ``value`` again (None if it cannot)."""
    if type(value) is torch.Tensor:
        return torch.Tensor, value.shape, value.stride(), value.dtype
    if type(value) in (list, tuple):
        parts = tuple(_description(v) for v in value)
        return None if None in parts else (type(value), parts)
    return (type(value), value) if type(value) in _KEYED else None


def _rebuilt(described: Any) -> Any:
    kind = described[0]
    if kind is torch.Tensor:
        return torch.empty_strided(described[1], described[2], dtype=described[3], device="meta")
    if kind is list or kind is tuple:
        return kind(_rebuilt(d) for d in described[1])
    return described[1]


class _CountingShapeProp(_ShapeProp):
    """Shape propagation that records each node's FLOPs and multiply-adds in ``counts``.

    A node whose call :meth:`known_count` knows is counted from its values' shapes with
    torch's formula, or is 0, without a dispatch mode; any other node runs inside the
    :class:`_Counter`, entered around that node alone.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.counter = _Counter()
        self.counts: dict[str, tuple[int | None, int | None]] = {}
        self.hooks_everywhere = any(global_module_hooks())  # they run in every module's call
        self.known: dict[int, bool] = {}  # id of a module to whether its call is known

    def call(self, n: fx.Node, args: Any, kwargs: Any) -> Any:
        count = self.known_count(n, args, kwargs)
        if count is None:  # count what it runs
            with self.counter:
                result = super().call(n, args, kwargs)
            self.counts[n.name] = self.counter.take()
        else:
            result = super().call(n, args, kwargs)
            self.counts[n.name] = count(result)
        return result

    def known_count(self, n: fx.Node, args: Any, kwargs: Any) -> _Count | None:
        """How to count ``n`` from its result, where its target is known (else None)."""
        if n.op in ("placeholder", "get_attr", "output"):
            return _nothing
        if not (_plain(args) and _plain(kwargs)):
            return None
        if n.op == "call_module":
            module = self.submodules.get(str(n.target))
            known = _MODULES.get(type(module))
            if module is None or known is None or not self.runs_as_known(module, known[0]):
                return None
            return known[1](module, args, kwargs)
        if n.op == "call_method":
            rule = _METHODS.get(str(n.target)) if args and type(args[0]) in _TENSORS else None
        elif isinstance(n.target, OpOverload):
            rule = _op_rule(n.target, self.counter)
        else:
            rule = _FUNCTIONS.get(n.target) if isinstance(n.target, _FUNCTION_TYPES) else None
        return None if rule is None else rule(None, args, kwargs)

    def runs_as_known(self, module: nn.Module, forward: Any) -> bool:
        """Whether calling ``module`` runs ``forward`` (its class's, as fxnx knows it) and
        nothing else: no hook, no ``forward`` set on the instance, no tensor of a class of
        its own (whose methods could run operators of their own)."""
        known = self.known.get(id(module))
        if known is None:
            known = self.known[id(module)] = (
                type(module).forward is forward and not self.hooks_everywhere
                and _runs_its_class_forward(module))
        return known


def propagate_and_count(
    gm: fx.GraphModule, model: Any, inputs: list[Any], fake: bool
) -> tuple[dict[str, tuple[int | None, int | None]] | None, Any]:
    """Propagate shapes as :func:`fxnx._capture.shapes.propagate` does, counting each
    node's FLOPs and multiply-adds as it runs; return them by node name, and the graph's
    output.

    torch's fused transformer fast path is off meanwhile, as while tracing: under
    ``no_grad`` ``nn.MultiheadAttention`` would run one fused operator that no formula
    counts, projections included. Where counting gets in the way of running a node (an
    operator torch's dispatch modes cannot run), shapes are propagated without it and the
    counts are None.

    Raises
    ------
    ShapePropagationError
        As :func:`fxnx._capture.shapes.propagate`: the inputs do not fit the model.
    """
    if TorchDispatchMode is None:  # pragma: no cover
        return None, propagate_shapes(gm, model, inputs, fake)
    counting = _CountingShapeProp(gm)
    try:
        with mha_fast_path_off():
            output = propagate_shapes(gm, model, inputs, fake, interpreter=counting)
    except ShapePropagationError:
        # raises again if counting was not the cause
        return None, propagate_shapes(gm, model, inputs, fake)
    return counting.counts, output


setattr(propagate_and_count, WITH_OUTPUT, True)  # noqa: B010  (the ladder compares the output)


# --- FLOPs from shapes --------------------------------------------------------------------------
#
# What FlopCounterMode counts for a call of a known layer or function, without running a
# dispatch mode: torch's own formula (``flop_registry``) applied to the shapes of the
# operator the call reaches, or 0 for calls whose operators have no formula and decompose
# into none that has. A rule takes (module or None, args, kwargs) before the call runs and
# gives a function of its result, or None where it cannot say (the node is then counted by
# running it in the counting mode). tests/test_costs_known.py holds each rule to
# FlopCounterMode.

_Count = Callable[[Any], tuple[int | None, int | None]]
_Rule = Callable[[Any, Any, Any], _Count | None]
_aten = torch.ops.aten
_TENSORS: set[type] = {torch.Tensor, nn.Parameter}  # fake tensors' class joins on first sight
_SCALARS = frozenset({int, float, bool, str, type(None), type(...), torch.dtype, torch.device,
                      torch.layout, torch.memory_format, torch.Size})
_FUNCTION_TYPES = (types.BuiltinFunctionType, types.FunctionType)


def _plain(value: Any) -> bool:
    """Whether ``value`` holds only tensors of torch's own classes and plain Python values:
    nothing whose methods could run operators of their own."""
    kind = type(value)
    if kind in _TENSORS or kind in _SCALARS:
        return True
    if kind is list or kind is tuple:
        return all(_plain(v) for v in value)
    if kind is dict:
        return all(_plain(v) for v in value.values())
    if kind is slice:
        return _plain((value.start, value.stop, value.step))
    if is_fake(value):
        _TENSORS.add(kind)
        return True
    return False


def _runs_its_class_forward(module: nn.Module) -> bool:
    """Whether ``module`` has no hook (torch keeps a module's hooks in attributes named so),
    no ``forward`` of its own and, in its attributes and their tables (parameters, buffers),
    only tensors of torch's own classes. One pass over its attributes."""
    for name, value in vars(module).items():
        if "hook" in name or name == "forward":
            if value:
                return False
        elif isinstance(value, dict):
            for v in value.values():
                if isinstance(v, torch.Tensor) and type(v) not in _TENSORS:
                    return False
        elif isinstance(value, torch.Tensor) and type(value) not in _TENSORS:
            return False
    return True


def _nothing(result: Any) -> tuple[int, int]:
    return 0, 0


def _zero(module: Any, args: Any, kwargs: Any) -> _Count:
    return _nothing


def _shape_formula(op: Any) -> Callable[..., Any]:
    """torch's formula for ``op``, taking shapes: without the wrapper that first maps every
    tensor in the arguments to its shape (a pytree walk that costs more than the formula)."""
    formula = flop_registry[op]
    return getattr(formula, "__wrapped__", formula)


def _of_aten(flops: Any) -> tuple[int, int]:
    """FLOPs from one of torch's ATen formulas, and multiply-adds: two FLOPs each."""
    return int(flops), int(flops) // 2


def _arg(args: Any, kwargs: Any, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _dense(*values: Any) -> bool:
    """Whether every value is a strided tensor of torch's own classes (the operators a
    sparse tensor reaches are not the dense ones)."""
    return all(type(v) in _TENSORS and v.layout is torch.strided for v in values)


def _conv_count(x: Any, weight: Any, transposed: bool) -> _Count | None:
    """aten.convolution's formula, for a batched input (an unbatched one gets a batch of 1
    on the way: left to the counting mode)."""
    if not _dense(x, weight) or x.dim() != weight.dim():
        return None
    formula = _shape_formula(_aten.convolution)
    return lambda out: _of_aten(formula(x.shape, weight.shape, None, None, None, None,
                                        transposed, out_shape=out.shape))


def _linear_count(x: Any, weight: Any) -> _Count | None:
    """aten.mm's formula for the rows of ``x`` by the weight, which every way torch's linear
    takes (addmm, mm, matmul folded to mm) counts."""
    if not _dense(x, weight) or weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return None
    rows, (outputs, inputs) = math.prod(x.shape[:-1]), weight.shape
    flops = _shape_formula(_aten.mm)((rows, inputs), (inputs, outputs))
    return lambda out: _of_aten(flops)


def _matmul_count(a: Any, b: Any) -> _Count | None:
    """aten.bmm's formula over the broadcast batch, where both operands are matrices or
    batches of them (a vector operand may reach mv or dot, which have no formula)."""
    if not _dense(a, b) or min(a.dim(), b.dim()) < 2:
        return None
    batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    flops = _shape_formula(_aten.bmm)((batch, *a.shape[-2:]), (batch, *b.shape[-2:]))
    return lambda out: _of_aten(flops)


def _module_conv(module: Any, args: Any, kwargs: Any) -> _Count | None:
    return _conv_count(_arg(args, kwargs, 0, "input"), module.weight, module.transposed)


def _module_linear(module: Any, args: Any, kwargs: Any) -> _Count | None:
    return _linear_count(_arg(args, kwargs, 0, "input"), module.weight)


def _function_conv(transposed: bool) -> _Rule:
    def rule(module: Any, args: Any, kwargs: Any) -> _Count | None:
        x, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        return _conv_count(x, weight, transposed)
    return rule


def _function_linear(module: Any, args: Any, kwargs: Any) -> _Count | None:
    return _linear_count(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"))


def _function_matmul(module: Any, args: Any, kwargs: Any) -> _Count | None:
    return _matmul_count(*args) if len(args) == 2 and not kwargs else None


def _op_rule(op: Any, counter: _Counter) -> _Rule | None:
    """The rule of an ATen operator: 0 if it may not count, its formula applied to its
    arguments as FlopCounterMode applies it, a composite's rule, else None."""
    if op in _OPS_SEEN:
        return _OPS_SEEN[op]
    rule = _COMPOSITES.get(op)
    if rule is None:
        if not counter.may_count(op):
            rule = _zero
        elif (formula := counter.formulas.get(op.overloadpacket)) is not None and _functional(op):
            rule = _formula_rule(op, formula)
    _OPS_SEEN[op] = rule
    return rule


def _formula_rule(op: Any, formula: Any) -> _Rule:
    keywords = frozenset(a.name for a in op_schema(op).arguments if a.kwarg_only)

    def rule(module: Any, args: Any, kwargs: Any) -> _Count | None:
        if not keywords.issuperset(kwargs):  # as the dispatcher passes them: by position
            return None

        def count(out: Any) -> tuple[int, int | None]:
            flops = int(formula(*args, **kwargs, out_val=out))
            return (flops, flops // 2) if op.namespace == "aten" else (flops, None)
        return count
    return rule


def _functional_overloads(*names: str) -> list[Any]:
    """The overloads of these ATen operators that write none of their arguments."""
    packets = [getattr(_aten, name, None) for name in names]
    overloads = [getattr(p, o) for p in packets if p is not None for o in p.overloads()]
    return [op for op in overloads if _functional(op)]


_F = torch.nn.functional
_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d,
                 nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
#: Layers counted without running a mode, each with its ``forward`` (a class whose forward
#: was replaced is not known): the weighted ones by formula, the rest count 0 (none of their
#: operators has a formula or decomposes into one that has).
_MODULES: dict[type, tuple[Any, _Rule]] = {
    **{cls: (cls.forward, _module_conv) for cls in _CONV_MODULES},
    nn.Linear: (nn.Linear.forward, _module_linear),
    **{cls: (cls.forward, _zero) for cls in (
        nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
        nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus,
        nn.Softmax, nn.LogSoftmax, nn.GLU,
        nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
        nn.Identity, nn.Flatten, nn.Unflatten, nn.PixelShuffle, nn.PixelUnshuffle,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
        nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ReflectionPad1d,
        nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d, nn.Embedding,
    )},
}
#: Functions counted without running a mode, as the graph calls them.
_FUNCTIONS: dict[Any, _Rule] = {
    **{f: _function_conv(False) for f in (_F.conv1d, _F.conv2d, _F.conv3d)},
    **{f: _function_conv(True) for f in (
        _F.conv_transpose1d, _F.conv_transpose2d, _F.conv_transpose3d)},
    _F.linear: _function_linear,
    **{f: _function_matmul for f in (torch.matmul, operator.matmul, torch.mm, torch.bmm)},
    **{f: _zero for f in (
        operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
        operator.mod, operator.pow, operator.neg, operator.getitem, operator.eq, operator.ne,
        operator.lt, operator.le, operator.gt, operator.ge, operator.iadd, operator.imul,
        getattr,
        torch.add, torch.sub, torch.mul, torch.div, torch.cat, torch.stack, torch.flatten,
        torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze,
        torch.split, torch.chunk, torch.narrow, torch.where, torch.relu, torch.sigmoid,
        torch.tanh, torch.exp, torch.sqrt, torch.rsqrt, torch.pow, torch.abs, torch.clamp,
        torch.sum, torch.mean, torch.softmax, torch.cumsum, torch.argmax, torch.tril,
        torch.triu, torch.masked_fill, torch.gather, torch.roll, torch.zeros, torch.ones,
        torch.arange, torch.full, torch.zeros_like, torch.ones_like,
        _F.relu, _F.relu6, _F.gelu, _F.silu, _F.mish, _F.hardswish, _F.hardsigmoid,
        _F.hardtanh, _F.leaky_relu, _F.elu, _F.softmax, _F.log_softmax, _F.dropout,
        _F.layer_norm, _F.group_norm, _F.batch_norm, _F.normalize, _F.pad, _F.embedding,
        _F.max_pool1d, _F.max_pool2d, _F.max_pool3d, _F.avg_pool1d, _F.avg_pool2d,
        _F.avg_pool3d, _F.adaptive_avg_pool1d, _F.adaptive_avg_pool2d, _F.adaptive_avg_pool3d,
        _F.adaptive_max_pool2d,
    )},
}
#: Tensor methods counted without running a mode, by name.
_METHODS: dict[str, _Rule] = {
    **{name: _function_matmul for name in ("matmul", "mm", "bmm")},
    **{name: _zero for name in (
        "view", "reshape", "permute", "transpose", "t", "contiguous", "size", "dim", "flatten",
        "unsqueeze", "squeeze", "expand", "expand_as", "view_as", "reshape_as", "chunk",
        "split", "unbind", "narrow", "to", "type_as", "float", "half", "int", "long", "bool",
        "clone", "detach", "repeat", "add", "sub", "mul", "div", "add_", "mul_", "neg", "exp",
        "pow", "sqrt", "rsqrt", "abs", "clamp", "relu", "sigmoid", "tanh", "softmax", "sum",
        "mean", "argmax", "masked_fill", "gather", "new_zeros", "new_ones", "fill_", "zero_",
    )},
}
#: ATen operators' rules as :func:`_op_rule` found them.
_OPS_SEEN: dict[Any, _Rule | None] = {}
#: ATen composites with a rule of their own (for others, :func:`_op_rule` finds one).
_COMPOSITES: dict[Any, _Rule] = {
    _aten.linear.default: _function_linear,
    _aten.matmul.default: _function_matmul,
    **{op: _function_conv(False) for op in _functional_overloads("conv1d", "conv2d", "conv3d")},
    **{op: _function_conv(True) for op in _functional_overloads(
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")},
}


def node_flops(
    gm: fx.GraphModule, inputs: list[Any] | None = None
) -> dict[str, tuple[int | None, int | None]]:
    """FLOPs and multiply-adds of each node of ``gm``, by node name.

    ``gm`` carries the metadata of shape propagation (``meta["tensor_meta"]``);
    ``inputs``, one value per placeholder, give the inputs that are not tensors (flags).
    A node whose inputs neither gives (a value read with ``.item()``), or whose call
    fails on ``meta`` tensors, counts ``(None, None)``.

    Examples
    --------
    >>> from torch.fx.passes.shape_prop import ShapeProp
    >>> gm = fx.symbolic_trace(nn.Linear(3, 2))
    >>> _ = ShapeProp(gm).propagate(torch.zeros(4, 3))
    >>> node_flops(gm)  # 4 rows x 3 inputs x 2 outputs multiply-adds
    {'input_1': (0, 0), 'weight': (0, 0), 'bias': (0, 0), 'linear': (48, 24), 'output': (0, 0)}
    """
    if TorchDispatchMode is None:  # pragma: no cover
        return {node.name: (None, None) for node in gm.graph.nodes}
    counter = _MetaCounter()
    submodules = dict(gm.named_modules(remove_duplicate=False))
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    values: dict[fx.Node, Any] = {
        node: value for node, value in zip(placeholders, inputs or (), strict=False)
        if "tensor_meta" not in node.meta and type(value) in _KEYED
    }

    def value_of(node: fx.Node) -> Any:
        if node not in values:
            try:
                values[node] = _recorded_value(node, gm)
            except _Unknown:
                values[node] = _Unknown
        if values[node] is _Unknown:
            raise _Unknown(node.name)
        return values[node]

    counts: dict[str, tuple[int | None, int | None]] = {}
    # The lock: other threads' tracing must not patch the modules this calls.
    with TRACING_LOCK, torch.no_grad(), random_state_kept():
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr", "output") or (
                isinstance(node.target, OpOverload) and not counter.may_count(node.target)
            ):
                counts[node.name] = (0, 0)
                continue
            try:
                args, kwargs = fx.map_arg((node.args, node.kwargs), value_of)
                with counter:
                    out = _call(node, args, kwargs, gm, submodules)
            except Exception:  # cannot be run on meta tensors: its cost is unknown
                counter.take()
                out = _Unknown
                counts[node.name] = (None, None)
            else:
                counts[node.name] = counter.take()
            if "tensor_meta" not in node.meta:  # a value that is not a tensor (x.size(0))
                values[node] = out
    return counts


def _call(node: fx.Node, args: Any, kwargs: Any, gm: fx.GraphModule,
          submodules: dict[str, nn.Module]) -> Any:
    if node.op == "call_module":
        module = submodules.get(str(node.target))
        if module is None:  # a path named_modules() skipped (a module registered twice)
            module = gm.get_submodule(str(node.target))
        with _attributes_kept(module):
            return module(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    return node.target(*args, **kwargs)  # type: ignore[operator]


def _recorded_value(node: fx.Node, gm: fx.GraphModule) -> Any:
    """A node's value as the metadata records it: tensors as ``meta`` tensors."""
    if "tensor_meta" in node.meta:
        return _from_metadata(node.meta["tensor_meta"])
    if node.op == "get_attr":
        return fetch_attr(gm, str(node.target))
    if "val" in node.meta and type(node.meta["val"]) in _KEYED:  # tracers' non-tensor values
        return node.meta["val"]
    return _Unknown


def _from_metadata(meta: Any) -> Any:
    if isinstance(meta, TensorMetadata):
        if not all(type(d) is int for d in meta.shape):
            raise _Unknown(f"symbolic shape {tuple(meta.shape)}")
        if meta.stride is None:
            return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    if isinstance(meta, (list, tuple)):
        items = [_from_metadata(m) for m in meta]
        try:
            return type(meta)(items)
        except TypeError:  # a named tuple
            return type(meta)(*items)
    if isinstance(meta, dict):
        return {k: _from_metadata(m) for k, m in meta.items()}
    return meta


@contextlib.contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[None]:
    """Undo attributes a module's forward sets (a cache ``self.k = x``): they would hold
    ``meta`` tensors. torch.nn's own layers set none and are not watched."""
    watched = [m for m in module.modules() if not type(m).__module__.startswith("torch.nn.")]
    saved = [(m, dict(vars(m)), {k: dict(v) for k, v in vars(m).items() if type(v) is dict})
             for m in watched]
    try:
        yield
    finally:
        for m, attributes, tables in saved:
            state = vars(m)
            state.clear()
            state.update(attributes)
            for name, table in tables.items():
                state[name].clear()
                state[name].update(table)


# --- kernel windows -----------------------------------------------------------------------------

_CONV = re.compile(r"_?conv(_transpose)?([123])d|_?convolution")
_POOL = re.compile(r"_?(max|avg)_pool([123])d(_with_indices)?")
_POOL_MODULES = {cls: int(cls.__name__[-2]) for cls in (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)}
#: F.max_pool2d and its kin take ``*args``: their parameters, in order.
_POOL_PARAMETERS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")


def kernel(
    node: fx.Node, module: nn.Module | None, info: dict[str, Any],
    shape_of: Callable[[str], Any],
) -> dict[str, Any] | None:
    """The window of a convolution or pooling node, or None for any other node.

    ``info`` is the node's ``node_call_info``; ``shape_of(name)`` gives the output shape
    of the node of that name (the weight's). Layers give their attributes; functions and
    ATen operators their arguments.

    Examples
    --------
    >>> conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
    >>> gm = fx.symbolic_trace(conv)
    >>> node = list(gm.graph.nodes)[1]
    >>> kernel(node, conv, {}, lambda name: None)
    {'kernel_size': (3, 3), 'stride': (2, 2), 'padding': (1, 1), 'dilation': (1, 1), 'groups': 1, 'transposed': False}
    """
    if module is not None:
        return _module_kernel(module)
    if node.op != "call_function":
        return None
    target = node.target
    name = target.overloadpacket.__name__ if isinstance(target, OpOverload) else getattr(target, "__name__", "")
    if (conv := _CONV.fullmatch(name)) is not None:
        weight = shape_of(info["weight"]) if isinstance(info.get("weight"), str) else None
        size = tuple(weight[2:]) if isinstance(weight, tuple) and len(weight) > 2 else None
        dims = int(conv.group(2)) if conv.group(2) else (len(size) if size else None)
        if dims is None:
            return None
        return _window(size, info.get("stride", 1), info.get("padding", 0),
                       info.get("dilation", 1), dims, groups=info.get("groups", 1),
                       transposed=bool(conv.group(1) or info.get("transposed", False)))
    if (pool := _POOL.fullmatch(name)) is not None:
        if "args" in info:  # bound to (*args, **kwargs)
            info = {**dict(zip(_POOL_PARAMETERS, info["args"], strict=False)), **info["kwargs"]}
        dims = int(pool.group(2))
        size = _tuple(info["kernel_size"], dims)
        return _window(size, info.get("stride") or size, info.get("padding", 0),
                       info.get("dilation", 1), dims)
    return None


def _module_kernel(module: nn.Module) -> dict[str, Any] | None:
    if isinstance(module, _CONV_MODULES):
        dims = len(module.kernel_size)
        return _window(module.kernel_size, module.stride, module.padding, module.dilation, dims,
                       groups=module.groups, transposed=module.transposed)
    for cls, dims in _POOL_MODULES.items():
        if isinstance(module, cls):
            return _window(module.kernel_size, module.stride or module.kernel_size,
                           module.padding, getattr(module, "dilation", 1), dims)
    return None


def _window(size: Any, stride: Any, padding: Any, dilation: Any, dims: int,
            groups: int | None = None, transposed: bool = False) -> dict[str, Any]:
    return {
        "kernel_size": None if size is None else _tuple(size, dims),
        "stride": _tuple(stride, dims),
        "padding": padding if isinstance(padding, str) else _tuple(padding, dims),
        "dilation": _tuple(dilation, dims),
        "groups": groups,
        "transposed": transposed,
    }


def _tuple(value: Any, dims: int) -> tuple[int, ...]:
    """An int or a sequence as one int per spatial dimension (torch's ``_ntuple``)."""
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value) * (dims if len(value) == 1 else 1)
    return (int(value),) * dims
