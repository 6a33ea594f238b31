"""Which inputs of a node are a layer's weight: a parameter, or the parameter through
operations that keep it a weight, and which are computed from parameters otherwise.

A feedback rule puts ``B`` where a layer's weight ``W`` was. ``W`` reaches the layer as
the parameter itself (``F.linear(x, self.weight)``), or through a chain of operations on
it alone (:data:`_STEPS`): views (``self.W.T``, ``self.W[:, :]``, ``self.W.view(5, 5)``) and
copies (``self.W.to(x.dtype)``, ``self.W.reshape(...)``, ``self.W * self.scale`` with a
number, as an equalised learning rate scales it). The same chain taken of ``B`` is what the
rule puts in its place (:class:`Chain`). A chain of views alone shares the parameter's
memory, which routing inside autograd's own backward relies on (``Chain.copies`` is False).

A weight computed from parameters otherwise (``weight_norm``'s ``g · v / ‖v‖``, a
product of two parameters) has no one parameter for ``B`` to stand in for: such an input
is named in ``NodeCall.computed_weights``, and a feedback rule refuses the node
(:func:`.rules._weightless`), where it was routed exactly without a word.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from .._callinfo import fetch_attr
from .._compat import ATEN_CAST_AND_VIEW, pytree
from .nodecall import call_target

__all__ = ["Chain", "origin", "param_inputs"]

_aten = torch.ops.aten
_TO_COPY, _UNSAFE_VIEW = ATEN_CAST_AND_VIEW
#: Calls that view their first argument without copying it: transposes and permutations, as
#: a symbolic trace records them (``W.T``, ``W.t()``, ``torch.transpose(W, 0, 1)``) and as
#: ``torch.export`` does, views and indexing.
_VIEWS = frozenset({
    ("call_method", "t"), ("call_method", "transpose"), ("call_method", "permute"),
    ("call_method", "view"), ("call_method", "squeeze"), ("call_method", "unsqueeze"),
    ("call_method", "expand"),
    ("call_function", torch.t), ("call_function", torch.transpose), ("call_function", torch.permute),
    ("call_function", torch.squeeze), ("call_function", torch.unsqueeze), ("call_function", operator.getitem),
    ("call_function", _aten.t.default), ("call_function", _aten.transpose.int),
    ("call_function", _aten.permute.default), ("call_function", _aten.numpy_T.default),
    ("call_function", _aten.view.default), ("call_function", _UNSAFE_VIEW),
    ("call_function", _aten.slice.Tensor), ("call_function", _aten.select.int),
    ("call_function", _aten.squeeze.dim), ("call_function", _aten.unsqueeze.default),
    ("call_function", _aten.expand.default), ("call_function", _aten.alias.default),
})
#: Calls that may copy their first argument and keep it the same weight: reshapes, a copy, a
#: scale by a number.
_COPIES = frozenset({
    ("call_method", "reshape"), ("call_method", "flatten"), ("call_method", "contiguous"),
    ("call_method", "clone"), ("call_method", "mul"), ("call_method", "div"),
    ("call_function", torch.reshape), ("call_function", torch.flatten), ("call_function", torch.mul),
    ("call_function", torch.div), ("call_function", operator.mul), ("call_function", operator.truediv),
    ("call_function", _aten.reshape.default), ("call_function", _aten.clone.default),
    ("call_function", _aten.contiguous.default), ("call_function", _aten.flatten.using_ints),
    ("call_function", _aten.mul.Tensor), ("call_function", _aten.mul.Scalar),
    ("call_function", _aten.div.Tensor), ("call_function", _aten.div.Scalar),
})
#: Casts (``W.to(x.dtype)``: their arguments may be read off the input): left out of the
#: chain taken of ``B``, which is cast to the dtype the layer got.
_CASTS = frozenset({
    ("call_method", "to"), ("call_method", "float"), ("call_method", "double"), ("call_method", "half"),
    ("call_method", "bfloat16"), ("call_method", "type_as"),
    ("call_function", _TO_COPY), ("call_function", _aten.to.dtype),
})
_STEPS = _VIEWS | _COPIES | _CASTS


class Chain:
    """The operations that made a layer's weight of its parameter, taken of another tensor
    laid out like the parameter (``B``): ``chain(B)``. ``copies``: whether one may copy."""

    def __init__(self, steps: list[fx.Node]) -> None:
        self.steps = [(n.op, n.target, n.args[1:], dict(n.kwargs)) for n in steps if _kind(n) not in _CASTS]
        self.copies = any(_kind(n) not in _VIEWS for n in steps)

    def __call__(self, T: Tensor) -> Tensor:
        for op, target, rest, kwargs in self.steps:
            T = call_target(op, target, None, (T, *rest), kwargs)
        return T


def origin(node: fx.Node, param: str | None, origins: Mapping[str, tuple[str, ...] | None]) -> tuple[str, ...] | None:
    """The parameters (frozen ones too) ``node``'s value is computed from, where it is computed from
    parameters and constants alone (a weight, however made, a parametrization's module
    included); None where an input enters it. ``origins`` holds the nodes before it; ``param`` names the
    parameter a ``get_attr`` node reads."""
    if node.op == "get_attr":
        return (param,) if param is not None else ()
    if node.op not in ("call_function", "call_method", "call_module"):  # (a parametrization's
        return None  # module: a call on parameters alone)
    found: list[str] = []
    for source in node.all_input_nodes:
        upstream = origins.get(source.name)
        if upstream is None:
            return None
        found += [p for p in upstream if p not in found]
    return tuple(found)


def param_inputs(
    gm: fx.GraphModule, sources: list[fx.Node], params: Mapping[str, str],
    origins: Mapping[str, tuple[str, ...] | None],
) -> dict[str, Any]:
    """``param_inputs``, ``param_views`` and ``computed_weights`` of a node whose input
    occurrences come from ``sources``: the occurrences that are a parameter, frozen or not
    (``params``: get_attr node name to the parameter's qualified name) or a chain of
    :data:`_STEPS` from one, and those computed from parameters otherwise."""
    found: dict[int, tuple[str, Tensor]] = {}
    views: dict[int, Chain] = {}
    computed: dict[int, str] = {}
    for k, src in enumerate(sources):
        steps: list[fx.Node] = []
        node = src
        while node.name not in params and _a_step(node):
            steps.append(node)
            node = node.args[0]  # type: ignore[assignment]
        if node.name in params:
            found[k] = (params[node.name], fetch_attr(gm, node.target))  # type: ignore[arg-type]
            if steps:
                views[k] = Chain(steps[::-1])
        elif origins.get(src.name):
            computed[k] = f"{src.name!r}, computed from {', '.join(map(repr, origins[src.name] or ()))}"
    return {"param_inputs": found, "param_views": views, "computed_weights": computed}


def _kind(node: fx.Node) -> tuple[str, Any]:
    return node.op, node.target


def _a_step(node: fx.Node) -> bool:
    """Whether ``node`` keeps its first argument a weight (:data:`_STEPS`, ``W.T``, ``W.mT``),
    every other argument a constant."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in ("T", "mT")
    try:
        kind = _kind(node)
        known, cast = kind in _STEPS, kind in _CASTS
    except TypeError:  # an unhashable target
        return False
    return known and (cast or not any(isinstance(a, fx.Node) for a in pytree.tree_leaves((node.args[1:], node.kwargs))))
