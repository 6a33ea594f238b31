"""Direct feedback alignment's taps: the credit at the model's output, sent on as ``e·B``.

Direct feedback alignment runs the layer on its inputs detached (its parameters
get exact credit; :mod:`.graft`); an autograd function at the model's output
(:class:`_Tap`) takes ``e``, the credit there (kept for every rule's state too),
and one on the layer's output (:class:`_Receive`) sends each such input ``e·B``
when the backward pass reaches the layer (one projection alive at a time, as
exact credit would be). An ``nn.Linear`` is both in one autograd function
(:class:`_DirectLinear`). A layer whose output is written in place, or
that no edge of ``G`` joins to the output, gets its ``e·B`` at the output.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import at_pass_end, graph_task, linear_parameters, pytree, version
from .._errors import FxnxValueError
from .feedback import check_bytes, readable
from .native import PLAIN_TENSORS
from .plan import Entry
from .ruled import detached, feedback_written
from .rules import RoutingState, per_sample

#: Names the backward pass that calls it (autograd's graph task).
backward_pass = graph_task()


class TapSpec:
    """The direct-feedback inputs a tap projects onto, ``(entry, occurrence)`` each, and what
    it keeps across calls: the input shapes last checked, and each input's sender (see
    :meth:`DirectFeedbackAlignment.sender`) with the key it is valid for."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Entry, int]] = []
        self.checked: Any = None
        self.drawn = True
        self.senders: list[tuple[Any, Any]] = []
        self.reach: Any = None  # the forward whose receivers were last checked (see _unreached)
        self.unreached: set[int] = set()  # places whose node the backward pass does not reach

    def add(self, entry: Entry, k: int) -> int:
        """Project onto ``entry``'s input occurrence ``k``; its place among the pairs."""
        self.pairs.append((entry, k))
        self.senders.append((None, None))
        self.drawn = False
        return len(self.pairs) - 1

    def drawn_now(self) -> list[tuple[Tensor, int] | None]:
        """Each place's ``B`` with its write counter, where it is drawn (see :meth:`send`)."""
        found: list[tuple[Tensor, int] | None] = []
        for j in range(len(self.pairs)):
            B = self._feedback(j)
            found.append(None if B is None else (B, version(B)))
        return found

    def _feedback(self, j: int) -> Tensor | None:
        """Place ``j``'s ``B`` as its rule holds it now (None before its first draw)."""
        entry, k = self.pairs[j]
        drawn = getattr(entry.rule, "_B", ())
        return drawn[k] if k < len(drawn) else None

    def send(self, j: int, e: Tensor | None, shape: torch.Size, dtype: torch.dtype, state: RoutingState) -> Tensor | None:
        """Place ``j``'s projection of ``e``, with its ``B`` as the forward pass left it
        (``state._drawn``): a write into it since, or another ``B`` given, is refused, as
        autograd refuses a write into what it saved. None where ``e`` is (a backward pass
        that never reached the output: :func:`output_credit`)."""
        if e is None:
            return None
        if state._drawn is not None and state._drawn[j] is not None:
            then, stamp = state._drawn[j]
            if version(then) != stamp or self._feedback(j) is not then:
                raise RuntimeError(feedback_written(self.pairs[j][0].call.name))
        key = (e.shape[1], e.dtype, shape, dtype)
        known, sender = self.senders[j]
        if known != key:
            entry, k = self.pairs[j]
            sender = entry.rule.sender(entry.call, k, e, shape, dtype)
            self.senders[j] = (key, sender)
        return sender(e)


def tap_output(spec: TapSpec, state: RoutingState, out: Any, *projected: Any) -> Any:
    leaves, tree = pytree.tree_flatten(out)
    slots = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
    if not slots:
        return out
    if state._received and spec.reach != (slots, state._received):  # once per kind of forward
        state._received -= _unreached(spec, [leaves[i] for i in slots], projected, state._received)
        spec.reach = (slots, set(state._received))
    tapped = _Tap.apply(spec, state, (leaves, tree, slots), *(leaves[i] for i in slots), *projected)
    for i, t in zip(slots, tapped if isinstance(tapped, tuple) else (tapped,), strict=True):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, tree)


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: TapSpec, state: RoutingState, where: Any, *tensors: Any) -> Any:  # type: ignore[override]
        leaves, tree, slots = where
        outs, projected = tensors[:len(slots)], tensors[len(slots):]
        shapes = [x.shape if isinstance(x, Tensor) else None for x in projected]
        batch = {t.shape[0] if t.dim() else None for t in outs}
        wanted = [isinstance(x, Tensor) and x.requires_grad for x in projected]
        if spec.checked != (batch, shapes, wanted):  # checked once per shape
            if spec.pairs and (None in batch or len(batch) > 1):
                raise FxnxValueError(
                    "direct feedback alignment sends each sample's output error to the layers, "
                    "so every output tensor must have the batch as its first dimension; the "
                    f"model's outputs have shapes {', '.join(str(tuple(t.shape)) for t in outs)}. "
                    "Return a value of the whole batch (an auxiliary loss) apart from the outputs "
                    "routed, or route with another rule"
                )
            for (entry, k), x, want in zip(spec.pairs, projected, wanted, strict=True):
                if want and (x.dim() == 0 or batch != {x.shape[0]}):
                    raise FxnxValueError(
                        f"direct feedback alignment at node {entry.call.name!r}: its input {k} has "
                        f"shape {tuple(x.shape)}, whose first dimension is not the output's batch size "
                        f"({', '.join(map(str, sorted(b for b in batch if b is not None))) or 'none'}); "
                        f"route this node another way, e.g. rules={{{entry.call.name!r}: Exact()}}"
                    )
            if not spec.drawn:
                if any(not entry.rule.drawn(k) for entry, k in spec.pairs):  # before the first draws only
                    _check_feedback_bytes(spec.pairs, outs, projected)
                else:
                    spec.drawn = True
            spec.checked = (batch, shapes, wanted)
        ctx.spec, ctx.state, ctx.where = spec, state, (leaves, tree, slots)
        state._drawn = spec.drawn_now() if spec.pairs else None
        ctx.shapes = shapes
        ctx.dtypes = [x.dtype if isinstance(x, Tensor) else None for x in projected]
        return outs if len(outs) != 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        leaves, tree, slots = ctx.where
        credit: list[Any] = [None] * len(leaves)
        for i, g in zip(slots, grads, strict=True):
            credit[i] = g
        ctx.state.output_credit = pytree.tree_unflatten(credit, tree)
        sent: list[Tensor | None] = []
        spec = ctx.spec
        if spec.pairs:
            now = backward_pass()
            e = ctx.state._direct[now] = torch.cat([per_sample(g) for g in grads], 1)
            at_pass_end(functools.partial(ctx.state._direct.pop, now, None))  # (no N × D per pass kept)
            needs = ctx.needs_input_grad[3 + len(slots):]
            received = ctx.state._received
            for j, (shape, dtype, needed) in enumerate(zip(ctx.shapes, ctx.dtypes, needs, strict=True)):
                sent.append(spec.send(j, e, shape, dtype, ctx.state) if needed and j not in received else None)
        return (None, None, None, *grads, *sent)


def receive(spec: TapSpec, state: RoutingState, places: tuple[int, ...], value: Any, *inputs: Any) -> Any:
    """``value``, a direct-feedback node's output, through :class:`_Receive`: its inputs
    (the tap's ``places``) get their projection of the output credit when the backward pass
    reaches the node. Left to the tap where there is nothing to receive or no tensor to
    receive it by."""
    wanted = [isinstance(x, Tensor) and x.requires_grad for x in inputs]
    if not torch.is_grad_enabled() or not isinstance(value, Tensor) or not any(wanted):
        return value
    if spec.unreached and not spec.unreached.isdisjoint(places):
        return value
    state._received.update(j for j, want in zip(places, wanted, strict=True) if want)
    return _Receive.apply(spec, state, places, value, *inputs)


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: TapSpec, state: RoutingState, places: tuple[int, ...], value: Tensor, *inputs: Any) -> Tensor:  # type: ignore[override]
        ctx.spec, ctx.state, ctx.places = spec, state, places
        ctx.shapes = [x.shape if isinstance(x, Tensor) else None for x in inputs]
        ctx.dtypes = [x.dtype if isinstance(x, Tensor) else None for x in inputs]
        return value

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        e, spec = output_credit(ctx), ctx.spec
        needs = ctx.needs_input_grad[4:]
        sent = [
            spec.send(j, e, shape, dtype, ctx.state) if needed else None
            for j, shape, dtype, needed in zip(ctx.places, ctx.shapes, ctx.dtypes, needs, strict=True)
        ]
        return (None, None, None, credit, *sent)


def output_credit(ctx: Any) -> Tensor | None:
    """``e``, the output's credit in this backward pass, which the output's tap sets before
    the pass reaches any node (``ctx`` is a node's); None in a pass that never reached the
    output (its output credit is zero: routing is linear in the credit, so that pass's
    projections are nothing, and backward calls add up as one over their sum does)."""
    return ctx.state._direct.get(backward_pass())  # type: ignore[no-any-return]


def direct_linear(spec: TapSpec, state: RoutingState, place: int, layer: torch.nn.Linear, x: Any) -> Any:
    """``layer(x)``, an ``nn.Linear`` whose input gets its projection of the output credit
    (the tap's ``place``) when the backward pass reaches the layer: one autograd function
    (:class:`_DirectLinear`) where nothing hooks the layer and ``x`` is a plain floating-point
    tensor of two or more dimensions that takes credit, outside autocast; else the layer on
    ``x`` detached, then :func:`receive`. (Its output may be a view, ``F.linear``'s for a 3-D
    input: no later node writes into it, or the graft would have left its projection to the
    output.)"""
    params = linear_parameters(layer)
    if params is None:
        return receive(spec, state, (place,), layer(detached(x)), x)
    return direct_f_linear(spec, state, place, x, *params)


def direct_f_linear(spec: TapSpec, state: RoutingState, place: int, x: Any, W: Tensor, b: Tensor | None = None) -> Any:
    """``F.linear(x, W, b)`` as :func:`direct_linear` runs a layer: one autograd function
    where it can be, else on ``x`` detached, then :func:`receive`."""
    if takes_direct_credit(x) and x.dim() >= 2 and place not in spec.unreached:
        state._received.add(place)
        return _DirectLinear.apply(x, W, b, spec, state, place)
    return receive(spec, state, (place,), torch.nn.functional.linear(detached(x), W, b), x)


def takes_direct_credit(x: Any) -> bool:
    """Whether a layer's input ``x`` can take its projection from an autograd function that
    also runs the layer (:class:`_DirectLinear`, a fused run): a plain real tensor that takes
    credit, with gradients on and no autocast."""
    return (type(x) in PLAIN_TENSORS and x.requires_grad and x.is_floating_point()
            and torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type))


class _DirectLinear(torch.autograd.Function):
    """``F.linear(x, W, b)`` whose backward sends ``x`` its projection ``e·B`` of the output
    credit and ``W`` and ``b`` their exact credit (``creditᵀ·x`` and the credit summed, over
    every dimension but the last), as :class:`_Receive` after the layer on ``x`` detached
    would. ``x`` is saved as autograd saves it (through the caller's saved-tensor hooks) and
    checked for writes in place when read, the error naming the node."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, b: Tensor | None, spec: TapSpec, state: RoutingState, place: int) -> Tensor:  # type: ignore[override]
        ctx.spec, ctx.state, ctx.places = spec, state, (place,)  # places: found by _unreached
        ctx.shape, ctx.dtype = x.shape, x.dtype
        if ctx.needs_input_grad[1]:  # only W's credit reads x
            ctx.save_for_backward(x)
        return torch.nn.functional.linear(x, W, b)

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        e = output_credit(ctx)
        needs = ctx.needs_input_grad
        sent = ctx.spec.send(ctx.places[0], e, ctx.shape, ctx.dtype, ctx.state) if needs[0] else None
        rows = credit.reshape(-1, credit.shape[-1])  # every dimension but the last, as one
        weight = None
        if needs[1]:
            try:
                x, = ctx.saved_tensors
            except RuntimeError as error:  # autograd's own check, on what the forward pass saved
                entry, _ = ctx.spec.pairs[ctx.places[0]]
                raise RuntimeError(f"node {entry.call.name!r}: {error}") from None
            # x detached, as the layer ran on x detached: a graph recorded by this backward
            # (create_graph=True) reaches no layer below through W's credit
            weight = rows.T @ x.detach().reshape(-1, x.shape[-1])
        bias = rows.sum(0) if needs[2] else None
        return sent, weight, bias, None, None, None


def _unreached(spec: TapSpec, outs: list[Tensor], projected: Sequence[Any], received: set[int]) -> set[int]:
    """The places in ``received`` whose :class:`_Receive` the backward pass does not reach: a
    node read only through what carries no credit (``argmax``, ``detach``, a ``zeros_like``)
    by every path to the output. They get their projection at the output, as direct feedback
    defines, and later forwards leave them to the output (``spec.unreached``).

    The backward pass starts at ``outs``, and every input the tap projects onto gets credit:
    from the tap, or from its node's receiver, or (a node not reached) from the tap again. So
    autograd's graph is walked from all of them, once per kind of forward (what a captured
    graph records the same way each time); :func:`.graft._credited` has already left out what
    could differ from call to call. (Walking from the outputs alone, and from an unreached
    node's inputs only once it was found unreached, took a node reached only through such an
    input for unreached too, and its input got ``e·B`` twice.)
    """
    seen: set[Any] = set()
    reached: set[int] = set()
    stack = [t.grad_fn for t in (*outs, *projected) if isinstance(t, Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if getattr(fn, "spec", None) is spec and hasattr(fn, "places"):  # a _Receive of this tap
            reached.update(fn.places)
        stack.extend(f for f, _ in fn.next_functions if f is not None and f not in seen)
    missed = received - reached
    spec.unreached |= missed
    return missed


def _check_feedback_bytes(spec: list[tuple[Entry, int]], outs: Sequence[Tensor], projected: Sequence[Any]) -> None:
    """Refuse, before drawing any, direct feedback whose weights would take more than the
    rule allows (``max_bytes``), naming the largest."""
    d = sum(math.prod(t.shape[1:]) for t in outs)
    sizes = []
    for (entry, k), x in zip(spec, projected, strict=True):
        if isinstance(x, Tensor) and x.requires_grad:
            shape = entry.rule.feedback_shape(k, d, x.shape)
            sizes.append((math.prod(shape) * x.element_size(), entry, k, shape))
    limits = [entry.rule.max_bytes for entry, _ in spec if entry.rule.max_bytes is not None]
    total = sum(size for size, *_ in sizes)
    if limits and total > min(limits):
        size, entry, k, shape = max(sizes, key=operator.itemgetter(0))
        check_bytes(
            total, min(limits),
            f"direct feedback alignment at {len(sizes)} inputs (the largest: node "
            f"{entry.call.name!r}, input {k}, shape {tuple(shape)}, {readable(size)})",
        )
