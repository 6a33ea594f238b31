"""Runs of linear layers routed by weight transport, as one autograd function.

In a deep, narrow MLP routed by feedback alignment (or sign symmetry, Kolen–Pollack, weight
mirrors) every ``nn.Linear`` is an autograd function of its own (:class:`.native._Linear`),
and at small widths the autograd node and the Python backward of each cost more than its
arithmetic. :func:`.fuse.fuse` replaces each run of two or more such layers in the router's graph,
one after another with nothing between them, joined directly or through one elementwise
activation (ReLU, tanh, sigmoid, GELU, SiLU, leaky ReLU) whose value nothing else reads, by
one node calling :func:`chain_call`: one autograd function whose backward walks the run from
its end, sending each layer's credit as :class:`.native._Linear` sends it (``credit·B`` to
the input, ``creditᵀ·x`` and the credit summed to the weight and bias) and each activation's
as autograd's own backward of it does (the same ATen derivative on the same saved tensor: the
same bits). Credit still flows along ``G``'s edges, node by node in reverse order; only the
autograd nodes between them are gone, so each parameter's credit reaches it (and its hooks,
and DDP's reduction) once the whole run's backward is done.

At each call the run checks that each layer could run as :class:`.native._Linear`
(:func:`.native.one_function`), that each activation runs torch's own forward and nothing
hooks it, and that gradients are on without autocast; where anything differs, the run's nodes
are called one by one, as the graph would have called them. Its backward records no graph
(``create_graph=True`` through it is refused).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import own_forward, runs_own_forward, version
from .._errors import FxnxValueError
from .native import (
    NativeSpec,
    _sign_written,
    input_feedback,
    linear_weights,
    native_call,
    one_function,
)

__all__ = ["Activation", "ActivationCall", "Chain", "Step", "activation_call", "activation_of", "chain_call"]

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Activation:
    """An elementwise activation: its forward, and autograd's own backward of it (the ATen
    derivative its ``grad_fn`` calls) reading the activation's input (``reads_input``) or output;
    ``tangent`` is torch's forward-mode derivative of it where that is another formula."""

    forward: Callable[[Tensor, Any], Tensor]
    backward: Callable[[Tensor, Tensor, Any], Tensor]
    reads_input: bool
    #: its constant read from its module (a slope, GELU's approximation), or None
    constant_of: Callable[[Any], Any] = lambda module: None
    tangent: Callable[[Tensor, Tensor, Any], Tensor] | None = None


def _silu_tangent(t: Tensor, z: Tensor, _: Any) -> Tensor:
    """SiLU's forward-mode derivative as torch computes it with gradients on
    (``infinitely_differentiable_silu_backward``), operation for operation."""
    sigmoid = z.sigmoid()
    return t * sigmoid * (1.0 + z * (1.0 - sigmoid))


_RELU = Activation(lambda z, _: torch.relu(z), lambda g, y, _: _aten.threshold_backward.default(g, y, 0), False)
_TANH = Activation(lambda z, _: torch.tanh(z), lambda g, y, _: _aten.tanh_backward.default(g, y), False)
_SIGMOID = Activation(lambda z, _: torch.sigmoid(z), lambda g, y, _: _aten.sigmoid_backward.default(g, y), False)
_GELU = Activation(lambda z, a: F.gelu(z, approximate=a), lambda g, z, a: _aten.gelu_backward.default(g, z, approximate=a),
                   True, lambda m: m.approximate)
_SILU = Activation(lambda z, _: F.silu(z), lambda g, z, _: _aten.silu_backward.default(g, z), True, tangent=_silu_tangent)
_LEAKY = Activation(lambda z, s: F.leaky_relu(z, s), lambda g, z, s: _aten.leaky_relu_backward.default(g, z, s, False),
                    True, lambda m: m.negative_slope)

#: Activation modules by exact class, with torch's own forward of each (None where patched)
_MODULES: dict[type, tuple[Activation, Any]] = {
    cls: (act, own_forward(cls))
    for cls, act in ((nn.ReLU, _RELU), (nn.Tanh, _TANH), (nn.Sigmoid, _SIGMOID), (nn.GELU, _GELU),
                     (nn.SiLU, _SILU), (nn.LeakyReLU, _LEAKY))
}
#: Activation functions called on the value alone (no argument but an out-of-place flag)
_FUNCTIONS: dict[Any, Activation] = {
    torch.relu: _RELU, F.relu: _RELU, torch.tanh: _TANH, F.tanh: _TANH, torch.sigmoid: _SIGMOID,
    F.sigmoid: _SIGMOID, F.silu: _SILU,
}
_METHODS = {"relu": _RELU, "tanh": _TANH, "sigmoid": _SIGMOID}


@dataclasses.dataclass
class ActivationCall:
    """An activation node of a run: what it computes, and how the graph calls it."""

    activation: Activation
    call: Callable[[Tensor], Tensor]  # as the graph calls it, on the layer's output
    module: nn.Module | None  # its module, checked at each call
    own: Any  # torch's own forward of that module's class
    setting: Any  # a function's constant (a module's is read at each call)

    def constant(self) -> Any:
        """Its constant for this call; raises :class:`Apart` where its module cannot run as
        part of the run now (a hook, a patched forward, made in place since)."""
        module = self.module
        if module is None:
            return self.setting
        if not runs_own_forward(module, self.own) or _in_place(self.activation, module):
            raise Apart
        return self.activation.constant_of(module)


@dataclasses.dataclass
class Step:
    """One layer of a run and the activation after it (None where the next layer reads the
    layer's output itself)."""

    spec: NativeSpec
    act: ActivationCall | None
    #: the captured nodes it computes: the layer's, then the activation's
    nodes: tuple[fx.Node, fx.Node | None]

    def calls(self) -> list[tuple[Callable[[Any], Any], fx.Node]]:
        """Its nodes as the graph calls them, each with the captured node it computes."""
        layer, act = self.nodes
        found: list[tuple[Callable[[Any], Any], fx.Node]] = [(functools.partial(native_call, self.spec), layer)]
        if self.act is not None:
            found.append((self.act.call, cast(fx.Node, act)))
        return found


def _in_place(act: Activation, module: Any) -> bool:
    """Whether ``module`` runs ``act`` in place where running it out of place would change
    what is computed: an in-place ReLU is taken (the layer's output it writes is read by
    nothing else; its backward reads the output either way), no other."""
    return act is not _RELU and bool(getattr(module, "inplace", False))


class Apart(Exception):
    """A node of a run cannot run as part of it at this call: the run's nodes run one by one."""


def taken_at_call(steps: Sequence[Any], weights_of: Callable[[Any], Sequence[Tensor | None] | None]) -> tuple[list[Tensor | None], list[Any]]:
    """What a run's steps take at this call: each layer's weight and bias (``weights_of(step)``,
    None where the layer cannot run as part of the run now), in order, and each activation's
    constant (None where a step has no activation). Raises :class:`Apart` where a layer or an
    activation cannot."""
    params: list[Tensor | None] = []
    constants = []
    for step in steps:
        weights = weights_of(step)
        if weights is None:
            raise Apart
        params += weights
        constants.append(step.act.constant() if step.act is not None else None)
    return params, constants


@dataclasses.dataclass
class Run:
    """A run of layers fused into one node: its steps, each with the captured nodes it
    computes (``step.nodes``: the layer's, then its activation's or None)."""

    steps: list[Any]

    @property
    def names(self) -> list[str]:
        """The names of the run's nodes, in order."""
        return [n.name for step in self.steps for n in step.nodes if n is not None]


@dataclasses.dataclass
class Chain(Run):
    """A run of layers that :func:`chain_call` routes as one autograd function."""

    steps: list[Step]

    def unfused(self, x: Any) -> Any:
        """The run's nodes called one by one, as the graph would call them."""
        for step in self.steps:
            for call, _ in step.calls():
                x = call(x)
        return x


def chain_call(chain: Chain, x: Any) -> Any:
    """The run on ``x``: as one autograd function where each of its layers and activations
    can run so at this call (:func:`.native.one_function`, :func:`.native.linear_weights`,
    :meth:`Step.constant`), with
    gradients on and no autocast; else its nodes one by one."""
    first = chain.steps[0].spec
    if (not torch.is_grad_enabled() or torch.is_autocast_enabled(first.device)
            or (isinstance(x, Tensor) and x.is_inference())):
        return chain.unfused(x)
    try:
        # the run computes each later layer's input: a plain 2-D tensor where the first's is
        params, constants = taken_at_call(
            chain.steps, lambda step: one_function(step.spec, x) if step.spec is first else linear_weights(step.spec))
    except Apart:
        return chain.unfused(x)
    feedback = []
    for step in chain.steps:
        step.spec.use()
        feedback.append(step.spec.spans[0][3])
    return _Chain.apply(chain, _Taken(tuple(feedback), tuple(constants)), x, *params)


@dataclasses.dataclass(frozen=True)
class _Taken:
    """What one call of a run took: each layer's feedback (``B``, or sign symmetry's
    magnitudes) and each activation's constant."""

    feedback: tuple[Any, ...]
    constants: tuple[Any, ...]


class _Chain(torch.autograd.Function):
    """A run of linear layers and activations (see the module's docstring). Saved as autograd
    saves: each layer's input, each activation's input or output, and for sign symmetry the
    weights whose ``sign(W)`` the backward reads, through the caller's saved-tensor hooks.
    Each parameter's credit reaches it when the whole run's backward is done (a hook on it runs
    then; DDP reduces it then), not layer by layer."""

    @staticmethod
    def forward(ctx: Any, chain: Chain, taken: _Taken, x: Tensor, *params: Tensor | None) -> Tensor:  # type: ignore[override]
        needs = ctx.needs_input_grad
        below = needs[2]  # whether the current layer's input takes credit
        saved: list[Tensor] = []
        #: each layer's places in saved: its input, its W (sign symmetry, where its input
        #: takes credit) and what its activation's backward reads
        places: list[list[int | None]] = []
        awaiting: int | None = None  # the layer whose activation reads its output: the next input
        sends, stamps = [], []
        stamp_input(ctx, x)
        for i, step in enumerate(chain.steps):
            W, b = cast(Tensor, params[2 * i]), params[2 * i + 1]
            if awaiting is not None:
                places[awaiting][2] = len(saved)
            place: list[int | None] = [len(saved), None, None]
            saved.append(x)
            sends.append(below)
            if step.spec.signs:
                stamps.append(version(W) if below else None)
                if below:
                    place[1] = len(saved)
                    saved.append(W)
            else:
                stamps.append(version(taken.feedback[i]))
            x = F.linear(x, W, b)
            act, awaiting = step.act.activation if step.act is not None else None, None
            if act is not None:
                if act.reads_input:
                    place[2] = len(saved)
                    saved.append(x)
                else:
                    awaiting = i
                x = act.forward(x, taken.constants[i])
            places.append(place)
            below = below or needs[3 + 2 * i] or needs[4 + 2 * i]
        inputs = [saved[cast(int, place[0])] for place in places]
        if awaiting is not None:  # the last activation reads its output: the run's output
            places[awaiting][2] = len(saved)
            saved.append(x)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*inputs, *params)
        ctx.chain, ctx.taken, ctx.sends, ctx.stamps, ctx.places = chain, taken, sends, stamps, places
        return x

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        chain: Chain = ctx.chain
        steps = chain.steps
        refuse_higher_order(chain.names)
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:  # autograd's own check, on what the forward pass saved
            for step, stamp in reversed(list(zip(steps, ctx.stamps, strict=True))):  # as the backward meets them
                if step.spec.signs and stamp is not None and version(step.spec.weights[step.spec.first]) != stamp:
                    raise _sign_written(step.spec.call.name) from None
            raise RuntimeError(f"node {written_node(ctx, chain.names)!r}: {error}") from None
        needs, taken = ctx.needs_input_grad, ctx.taken
        grads: list[Tensor | None] = [None] * (2 * len(steps))
        g = credit
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            place, at_W, at_act = ctx.places[i]
            if step.act is not None:
                g = step.act.activation.backward(g, saved[at_act], taken.constants[i])
            if needs[3 + 2 * i]:
                grads[2 * i] = g.T @ saved[place]
            if needs[4 + 2 * i]:
                grads[2 * i + 1] = g.sum(0)
            if not ctx.sends[i]:
                break
            W = saved[at_W] if at_W is not None else None
            g = g @ input_feedback(taken.feedback[i], W, ctx.stamps[i], step.spec.call.name)
        return (None, None, g if needs[2] else None, *grads)

    @staticmethod
    def jvp(ctx: Any, _chain: None, _taken: None, tx: Tensor | None, *tparams: Tensor | None) -> Tensor:
        steps, constants = ctx.chain.steps, ctx.taken.constants
        forward = ctx.saved_tensors  # what forward saved for forward mode: each layer's input, then the parameters
        params = forward[len(steps):]
        t = tx
        for i, step in enumerate(steps):
            x, W, b = forward[i], params[2 * i], params[2 * i + 1]
            tW, tb = tparams[2 * i], tparams[2 * i + 1]
            terms = [F.linear(a, w) for a, w in ((t, W), (x, tW)) if a is not None and w is not None]
            if tb is not None:
                terms.append(tb.expand(x.shape[0], -1))
            t = sum(terms[1:], terms[0]) if terms else None
            act = step.act.activation if step.act is not None else None
            if act is not None and t is not None:
                z = F.linear(x, W, b)
                read = z if act.reads_input else act.forward(z, constants[i])
                t = (act.tangent or act.backward)(t, read, constants[i])
        assert t is not None  # forward mode calls jvp where some input has a tangent
        return t


def stamp_input(ctx: Any, x: Tensor) -> None:
    """Keep, on a run's ``ctx``, its input and that input's write counter (for
    :func:`written_node`)."""
    ctx.first, ctx.start = weakref.ref(x), version(x)


def written_node(ctx: Any, names: list[str]) -> str:
    """The node a write that autograd's check of a run's saved tensors found belongs to: the
    run's first, where its input was written since (:func:`stamp_input`), else its last."""
    first = ctx.first()
    return names[0] if first is not None and version(first) != ctx.start else names[-1]


def refuse_higher_order(names: list[str]) -> None:
    """Refuse a backward pass that records its own graph (``create_graph=True``) through a
    run, whose backward computes from tensors its forward saved without a graph."""
    if torch.is_grad_enabled():
        raise FxnxValueError(
            f"create_graph=True through nodes {names[0]!r} to {names[-1]!r}, a run of layers "
            "routed as one autograd function, whose backward cannot be differentiated: build "
            "the router with CreditRouter(..., fuse=False), which routes each node as its own "
            "autograd function"
        )


def activation_of(node: fx.Node, value: fx.Node, root: dict[str, Any]) -> tuple[Activation, Any] | None:
    """The activation ``node`` applies to ``value`` alone, with its constant (a function's,
    fixed in the graph; a module's is read at each call), or None. An in-place ReLU is taken
    (the layer's output it writes is read by nothing else); other in-place activations are not."""
    args, kwargs = node.args, dict(node.kwargs)
    if not args or args[0] is not value:
        return None
    if node.op == "call_module":
        module = root.get(str(node.target))
        found = _MODULES.get(type(module))
        if found is None or found[1] is None or len(args) != 1 or kwargs:
            return None
        return None if _in_place(found[0], module) else (found[0], None)
    if node.op == "call_method":
        act = _METHODS.get(str(node.target))
        return (act, None) if act is not None and len(args) == 1 and not kwargs else None
    if node.op != "call_function":
        return None
    try:
        act = _FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable callable
        return None
    inplace = kwargs.pop("inplace", False)
    if act is not None:
        return (act, None) if len(args) == 1 and not kwargs and (inplace is False or act is _RELU) else None
    if node.target is F.gelu and len(args) == 1 and set(kwargs) <= {"approximate"}:
        return _GELU, kwargs.get("approximate", "none")
    if node.target is F.leaky_relu and inplace is False and not (set(kwargs) - {"negative_slope"}):
        rest = [*args[1:2], *kwargs.values()]
        slope = rest[0] if rest else 0.01
        return (_LEAKY, slope) if isinstance(slope, float | int) and len(args) <= 2 and len(rest) <= 1 else None
    return None


def activation_call(node: fx.Node | None, act: Activation | None, setting: Any, root: dict[str, Any]) -> ActivationCall | None:
    """The activation node of a run, with how the graph calls it on its one value."""
    if node is None or act is None:
        return None
    args, kwargs = node.args[1:], dict(node.kwargs)
    if node.op == "call_module":
        module = root[str(node.target)]
        return ActivationCall(act, module, module, _MODULES[type(module)][1], setting)
    if node.op == "call_method":
        name = str(node.target)
        return ActivationCall(act, lambda v: getattr(v, name)(), None, None, setting)
    target = node.target
    return ActivationCall(act, lambda v: target(v, *args, **kwargs), None, None, setting)  # type: ignore[operator]

