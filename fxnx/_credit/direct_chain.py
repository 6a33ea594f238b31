"""Runs of linear layers routed by direct feedback alignment, as one autograd function.

Direct feedback alignment sends each layer's input its projection ``e·B`` of the output's
credit, and each layer's weight and bias their exact credit from the layer's output
(:class:`.taps._DirectLinear`, one autograd function per layer). In a deep, narrow MLP the
autograd node and Python backward of each cost more than its arithmetic, as under weight
transport (:mod:`.chain`), and :func:`.fuse.fuse` fuses a run of such layers the same way:
one autograd function whose backward walks the run from its end, each activation's credit as
autograd's own backward of it computes it, each layer's weight and bias credit as
:class:`.taps._DirectLinear` computes it, and each layer's input its projection, sent as the
tap sends it (:meth:`.taps.TapSpec.send`). The output's tap reads each layer's input (its batch
check, and the projection it sends at the output to what the backward pass does not reach), so
the run returns its later layers' inputs beside its output; the tap sends them nothing, as
they are received here. At a call where a layer or activation could not run so, the run's
nodes run one by one. Each parameter's credit reaches it when the whole run's backward is done
(a hook on it runs then; DDP reduces it then), not layer by layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import linear_parameters
from .chain import (
    ActivationCall,
    Apart,
    Run,
    refuse_higher_order,
    stamp_input,
    taken_at_call,
    written_node,
)
from .native import PLAIN_TENSORS
from .rules import RoutingState
from .taps import TapSpec, direct_linear, output_credit, takes_direct_credit

__all__ = ["DirectChain", "DirectStep", "direct_chain_call"]


@dataclasses.dataclass
class DirectStep:
    """One layer of a run (an ``nn.Linear`` whose input is the tap's ``place``) and the
    activation after it."""

    layer: nn.Linear
    place: int
    act: ActivationCall | None
    #: the captured nodes it computes: the layer's, then the activation's
    nodes: tuple[fx.Node, fx.Node | None]

    def calls(self, spec: TapSpec, state: RoutingState) -> list[tuple[Callable[[Any], Any], fx.Node]]:
        """Its nodes as the graph calls them, each with the captured node it computes."""
        layer, act = self.nodes
        found: list[tuple[Callable[[Any], Any], fx.Node]] = [
            (functools.partial(direct_linear, spec, state, self.place, self.layer), layer)]
        if self.act is not None:
            found.append((self.act.call, cast(fx.Node, act)))
        return found

    def run(self, spec: TapSpec, state: RoutingState, x: Any) -> Any:
        for call, _ in self.calls(spec, state):
            x = call(x)
        return x


@dataclasses.dataclass
class DirectChain(Run):
    """A run of layers that :func:`direct_chain_call` routes as one autograd function."""

    steps: list[DirectStep]


def direct_chain_call(chain: DirectChain, spec: TapSpec, state: RoutingState, x: Any) -> tuple[Any, ...]:
    """The run on ``x``: its output, then each later layer's input (the run's own values the
    tap reads). As one autograd function where each layer could run as
    :class:`.taps._DirectLinear` (nothing hooks it; its input, a plain 2-D real tensor, takes
    credit; the backward pass reaches it) and each activation can run as part of the run, with
    gradients on and no autocast; else its nodes one by one. In a run of three or more layers,
    a first layer whose input takes no credit (the model's input) runs on its own first, as the
    graph runs it, and the rest as one function (a run of two whose input takes none runs as
    its nodes)."""
    steps, inputs = chain.steps, []
    if (torch.is_grad_enabled() and type(x) in PLAIN_TENSORS and not x.requires_grad and len(steps) > 2
            and not torch.is_autocast_enabled(x.device.type)):
        x = steps[0].run(spec, state, x)
        inputs.append(x)
        steps = steps[1:]
    if takes_direct_credit(x) and x.dim() == 2 and not any(step.place in spec.unreached for step in steps):
        try:
            params, constants = taken_at_call(steps, _real_weights)
            tensors = [p for p in params if p is not None]
            if len(set(map(id, tensors))) != len(tensors):  # a weight tied since: summed as apart
                raise Apart
        except Apart:
            pass
        else:
            state._received.update(step.place for step in steps)
            fused = _DirectChain.apply(DirectChain(steps), (spec, state, tuple(constants)), x, *params)
            return (fused[0], *inputs, *fused[1:])
    for step in steps:  # the run's nodes one by one
        x = step.run(spec, state, x)
        inputs.append(x)
    return (inputs.pop(), *inputs)


def _real_weights(step: DirectStep) -> tuple[Tensor, Tensor | None] | None:
    """A step's layer's weight and bias where calling it would run ``F.linear`` on them alone
    and its weight is real; None otherwise."""
    weights = linear_parameters(step.layer)
    return weights if weights is not None and weights[0].is_floating_point() else None


class _DirectChain(torch.autograd.Function):
    """A run of linear layers and activations under direct feedback alignment (see the
    module's docstring): its output, then each later layer's input. Each layer's input is
    saved as autograd saves it (through the caller's saved-tensor hooks) where its weight takes
    credit, and what each activation's backward reads. ``spec`` and ``places`` name it as a
    receiver of the tap's (found by :func:`.taps._unreached`, as :class:`.taps._DirectLinear`
    is)."""

    @staticmethod
    def forward(ctx: Any, chain: DirectChain, taken: tuple[TapSpec, RoutingState, tuple[Any, ...]], x: Tensor,  # type: ignore[override]
                *params: Tensor | None) -> tuple[Tensor, ...]:
        spec, state, constants = taken
        needs = ctx.needs_input_grad
        saved: list[Tensor] = []
        slots: list[tuple[int | None, int | None]] = []  # each layer's: its input (where W takes credit), its activation's
        shapes, inputs = [], []
        stamp_input(ctx, x)
        for i, step in enumerate(chain.steps):
            W, b = cast(Tensor, params[2 * i]), params[2 * i + 1]
            if i:
                inputs.append(x)
            at_x = at_act = None
            if needs[3 + 2 * i]:  # only W's credit reads x
                at_x = len(saved)
                saved.append(x)
            shapes.append((x.shape, x.dtype))
            x = F.linear(x, W, b)
            if step.act is not None:
                act, z = step.act.activation, x
                x = act.forward(z, constants[i])
                at_act = len(saved)
                saved.append(z if act.reads_input else x)
            slots.append((at_x, at_act))
        ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)
        ctx.chain, ctx.spec, ctx.state, ctx.constants, ctx.slots, ctx.shapes = chain, spec, state, constants, slots, shapes
        ctx.places = tuple(step.place for step in chain.steps)  # the tap's: see _unreached
        return (x, *inputs)

    @staticmethod
    def backward(ctx: Any, credit: Tensor | None, *received: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        chain: DirectChain = ctx.chain
        refuse_higher_order(chain.names)
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:  # autograd's own check, on what the forward pass saved
            raise RuntimeError(f"node {written_node(ctx, chain.names)!r}: {error}") from None
        e = output_credit(ctx)
        needs = ctx.needs_input_grad
        g: Tensor | None
        steps = chain.steps
        grads: list[Tensor | None] = [None] * (2 * len(steps))
        g = credit
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            at_x, at_act = ctx.slots[i]
            if g is not None:  # (the run's output may take none: its weight and bias get none)
                if step.act is not None:
                    g = step.act.activation.backward(g, saved[cast(int, at_act)], ctx.constants[i])
                if needs[3 + 2 * i]:
                    grads[2 * i] = g.T @ saved[cast(int, at_x)].detach()
                if needs[4 + 2 * i]:
                    grads[2 * i + 1] = g.sum(0)
            # the layer's input's credit (the run's input's where it takes any), whatever
            # reached its output: the tap sends its input nothing, and direct feedback every
            # layer's input its projection
            shape, dtype = ctx.shapes[i]
            g = ctx.spec.send(step.place, e, shape, dtype, ctx.state) if i or needs[2] else None
            tapped = received[i - 1] if i else None  # (the tap sends an input received here none)
            if tapped is not None:
                g = tapped if g is None else g + tapped
        return (None, None, g if needs[2] else None, *grads)

