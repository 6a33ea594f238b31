"""Any other rule: the node inside an autograd.Function whose backward is the rule.

A user's rule, attention, a layer without a transport of its own, anything under
autocast: its node runs inside an :class:`autograd.Function <torch.autograd.Function>`
(:class:`_RuleNode`) whose backward calls the rule with the node's
:class:`~fxnx._credit.nodecall.NodeCall`, and checks what it returns against the
node's inputs and parameters (:func:`checked`). The rule reads the node's inputs
and parameters as the forward pass left them: one written in place in between is
refused, as autograd refuses a saved tensor written since it was saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from .._compat import pytree, version
from .._errors import FxnxTypeError, FxnxValueError
from .nodecall import Credit, NodeCall, fresh_leaf, run_node
from .plan import Entry, swapped_in
from .rules import RoutingState


@dataclasses.dataclass
class FunctionSpec:
    entry: Entry
    params: list[tuple[str, Tensor]]

    @classmethod
    def of(cls, entry: Entry) -> FunctionSpec:
        return cls(entry, list(entry.call.params.items()))


def function_call(spec: FunctionSpec, state: RoutingState, *values: Any) -> Any:
    module = spec.entry.call.module
    if module is not None:  # its parameters are the Function's inputs: they must be the module's
        swapped = swapped_in(module)
        if swapped:
            raise FxnxValueError(f"node {spec.entry.call.name!r}: its layer's parameters are not the model's own." + swapped)
    flat: list[Tensor] = []
    for value in values:
        flat.extend(t for t in pytree.tree_leaves(value) if isinstance(t, Tensor))
    holder: list[Any] = []  # the output's structure, filled in by the forward
    outs = _RuleNode.apply(spec, state, values, holder, *flat, *(p for _, p in spec.params))
    feed = iter(outs if isinstance(outs, tuple) else (outs,))
    leaves, tree = holder
    return pytree.tree_unflatten([next(feed) if isinstance(v, Tensor) else v for v in leaves], tree)


class _RuleNode(torch.autograd.Function):
    """One node run on leaves of its own (its own small autograd graph), whose backward is
    its rule: ``rule(call, credit, state) -> (input credits, parameter credits)``."""

    @staticmethod
    def forward(ctx: Any, spec: FunctionSpec, state: RoutingState, values: tuple[Any, ...], holder: list[Any], *flat: Tensor) -> Any:  # type: ignore[override]
        entry = spec.entry
        leaves = [fresh_leaf(v) if _wants(v) else detached(v) for v in values]
        args, kwargs = rebuilt(entry, leaves)
        out = run_node(entry.node, entry.call.module, args, kwargs)
        skeleton = entry.call
        ctx.call = dataclasses.replace(
            skeleton, inputs=leaves, output=out, args=args, kwargs=kwargs,
            wanted=[_wants(v) for v in values],
        )
        ctx.spec, ctx.state, ctx.values = spec, state, values
        ctx.autocast = _autocast_now()
        ctx.set_materialize_grads(False)
        leaves_out, tree = pytree.tree_flatten(out)
        tensors = [t.detach() for t in leaves_out if isinstance(t, Tensor)]
        # What carries no gradient in the node's own run carries none here: integers, and
        # floats of operations without a derivative (histc), which autograd gives no history;
        # marked so, later nodes (an integer cumsum of them) take them as constants.
        ctx.mark_non_differentiable(*(
            d for d, t in zip(tensors, (t for t in leaves_out if isinstance(t, Tensor)), strict=True)
            if not (t.requires_grad and (t.is_floating_point() or t.is_complex()))
        ))
        ctx.tree = tree
        # What the rule may read: the inputs' tensors and the parameters, then the feedback
        # weights it holds (Kolen–Pollack's B, updated in place by update_feedback)
        rule = spec.entry.rule
        held = [] if getattr(rule, "stateful", False) else [  # a rule may be a function
            t for t in pytree.tree_leaves(getattr(rule, "feedback", None)) if isinstance(t, Tensor)
        ]
        ctx.read, ctx.inputs = (*flat, *held), len(flat)
        ctx.versions = [version(t) for t in ctx.read]
        holder.extend((leaves_out, tree))
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        spec, call = ctx.spec, ctx.call
        _check_once(spec, call)
        for i, (t, saved) in enumerate(zip(ctx.read, ctx.versions, strict=True)):
            if version(t) != saved:
                raise RuntimeError(
                    written_since(t, saved, f"node {call.name!r}'s rule reads in the backward pass")
                    if i < ctx.inputs else feedback_written(call.name)
                )
        feed = iter(grads)
        leaves_out = pytree.tree_flatten(call.output)[0]
        credit = pytree.tree_unflatten(
            [next(feed) if isinstance(t, Tensor) else None for t in leaves_out], ctx.tree
        )
        n_flat = sum(isinstance(t, Tensor) for v in ctx.values for t in pytree.tree_leaves(v))
        none = (None, None, None, None, *([None] * (n_flat + len(spec.params))))
        if all(g is None for g in pytree.tree_leaves(credit)):
            return none
        # a rule may differentiate its node's own small graph, which it recomputes as the
        # forward pass computed it: under the same autocast
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for device, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            routed = spec.entry.rule(call, credit, ctx.state)
        inputs, params = checked(call, routed, spec.entry.rule_name)
        out: list[Tensor | None] = [None, None, None, None]
        for value, c in zip(ctx.values, inputs, strict=True):
            tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, Tensor)]
            got = [g for g, t in zip(pytree.tree_leaves(c), pytree.tree_leaves(value), strict=False) if isinstance(t, Tensor)] if c is not None else []
            out.extend(got if got else [None] * len(tensors))
        out.extend(params.get(name) for name, _ in spec.params)
        ctx.call = None  # free the node's graph once routed
        return tuple(out)


def _autocast_now() -> list[tuple[str, torch.dtype]]:
    """The devices autocast is on for, with its dtype on each (empty, most often)."""
    return [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]


_AUTOCAST_DEVICES = ("cpu", "cuda")


def written_since(t: Tensor, saved: int, reader: str) -> str:
    """Autograd's words for a tensor written in place since ``reader`` (naming the node) took
    it in the forward pass."""
    return (
        f"one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a tensor of shape {list(t.shape)} that {reader} is at version "
        f"{version(t)}; expected version {saved} instead. Write it out of place "
        "(x = x + 1, not x.add_(1)) or call backward before changing it"
    )


def feedback_written(node: str) -> str:
    """The same, for a node's feedback weights."""
    return (
        f"node {node!r}: its feedback weights B were modified by an inplace operation "
        "(update_feedback, or a write into router.feedback) between the forward pass and its "
        "backward pass, which reads B as the forward pass used it: call backward first"
    )


def _check_once(spec: FunctionSpec, call: NodeCall | None) -> None:
    """Refuse what a rule run on its node's own small graph cannot give: a second backward
    pass through the node (its recorded call is freed by the first, lest every step keep its
    node's values until the next), and a differentiable credit (``create_graph=True``: the
    node's small graph starts from leaves of its own, so the credit would not depend on the
    model's parameters, and a gradient penalty would miss this node's terms)."""
    where = f"node {spec.entry.call.name!r} (rule {spec.entry.rule_name!r}, run on the node's own graph)"
    if call is None:
        raise FxnxValueError(
            f"backward ran twice through {where}: its recorded call is freed after one backward "
            "pass, so retain_graph=True (or autograd.grad twice) cannot route it again. Run the "
            "forward again for each backward pass, or route this node with rule 'exact'"
        )
    if torch.is_grad_enabled():
        raise FxnxValueError(
            f"create_graph=True needs credit differentiable in the model's parameters, and "
            f"{where} gives none: a gradient penalty would miss its terms. Route this node with "
            "rule 'exact' (rules={name: fxnx.credit.Exact()}) for higher-order gradients"
        )


def _wants(value: Any) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


def checked(call: NodeCall, routed: Any, name: str) -> tuple[list[Credit], dict[str, Tensor | None]]:
    """What a rule returned, checked against its node: one credit per input occurrence, each
    like that input (its shape; floating dtypes cast to the input's, as autograd casts), and
    credit only for the node's own parameters, each of its parameter's shape."""
    where = f"rule {name!r} at node {call.name!r}"
    if not (isinstance(routed, (tuple, list)) and len(routed) == 2 and isinstance(routed[0], (list, tuple))
            and isinstance(routed[1], dict)):
        raise FxnxTypeError(
            f"{where} returned {type(routed).__qualname__} {routed!r:.60}; a rule returns "
            "(input_credits, param_credits): a list with one credit (or None) per input "
            "occurrence of call.inputs, and a dict of parameter name to credit"
        )
    inputs, params = routed
    if len(inputs) != len(call.inputs):
        raise FxnxValueError(
            f"{where} returned {len(inputs)} input credits; the node has {len(call.inputs)} "
            f"input occurrences ({', '.join(map(repr, call.labels))}): give None where no credit flows"
        )
    fixed: list[Credit] = []
    for k, (c, x) in enumerate(zip(inputs, call.inputs, strict=True)):
        if c is None or not call.wanted[k]:
            fixed.append(None)
            continue
        arg = f"input {call.labels[k]!r} (from {call.sources[k]!r})"
        c_leaves, c_spec = pytree.tree_flatten(c)
        x_leaves, x_spec = pytree.tree_flatten(x)
        if len(c_leaves) != len(x_leaves):
            raise FxnxValueError(f"{where}: credit for {arg} has structure {c_spec}, the input {x_spec}")
        fixed.append(pytree.tree_unflatten(
            [_like(g, t, f"{where}: credit for {arg}") for g, t in zip(c_leaves, x_leaves, strict=True)], x_spec
        ))
    own = call.params
    for pname in params:
        if pname not in own:
            raise FxnxValueError(
                f"{where} returned credit for parameter {pname!r}, which is not the node's own "
                f"(its parameters: {sorted(own) or 'none'}; parameters passed as arguments get "
                "their credit as input credits)"
            )
    return fixed, {p: _like(g, own[p], f"{where}: credit for parameter {p!r}") for p, g in params.items() if g is not None}


def _like(g: Any, x: Any, what: str) -> Tensor | None:
    if g is None or not isinstance(x, Tensor) or not x.requires_grad:
        return None
    if not isinstance(g, Tensor):
        raise FxnxTypeError(f"{what} is {type(g).__qualname__} {g!r:.40}, expected a tensor of shape {tuple(x.shape)}")
    if g.shape != x.shape:
        raise FxnxValueError(f"{what} has shape {tuple(g.shape)}, expected {tuple(x.shape)}")
    if g.dtype != x.dtype:
        if not (g.is_floating_point() and x.is_floating_point()):
            raise FxnxTypeError(f"{what} has dtype {g.dtype}, expected {x.dtype}")
        g = g.to(x.dtype)
    if g.device != x.device:
        raise FxnxValueError(f"{what} is on {g.device}, expected {x.device}")
    return g


# ----------------------------------------------------------------------------------------------
# A node's arguments from the values of its input occurrences, and a removed edge's detach:
# what a rule's node runs on here, and what graft.py runs its other nodes on.


def detached(value: Any) -> Any:
    """An edge removed from G: the value flows on, no credit flows back."""
    if isinstance(value, Tensor):
        return value.detach()
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


def rebuilt(entry: Entry, values: Sequence[Any]) -> tuple[Any, Any]:
    """``entry``'s node arguments with ``values`` in the places of its input occurrences."""
    feed = iter(values)
    node = entry.node
    return (
        fx.node.map_arg(node.args, lambda _: next(feed)),
        fx.node.map_arg(node.kwargs, lambda _: next(feed)),
    )
