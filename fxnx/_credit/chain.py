"""Runs of linear layers routed by weight transport, as one autograd function.

In a deep, narrow MLP routed by feedback alignment (or sign symmetry, Kolen–Pollack, weight
mirrors) every ``nn.Linear`` is an autograd function of its own (:class:`.native._Linear`),
and at small widths the autograd node and the Python backward of each cost more than its
arithmetic. :func:`fuse` replaces each run of two or more such layers in the router's graph,
joined directly or through one elementwise activation (ReLU, tanh, sigmoid, GELU, SiLU,
leaky ReLU) whose value nothing else reads, by one node calling :func:`chain_call`: one
autograd function whose backward walks the run from its end, sending each layer's credit as
:class:`.native._Linear` sends it (``credit·B`` to the input, ``creditᵀ·x`` and the credit
summed to the weight and bias) and each activation's as autograd's own backward of it does
(the same ATen derivative on the same saved tensor: the same bits). Credit still flows
along ``G``'s edges, node by node in reverse order; only the autograd nodes between them are
gone.

At each call the run checks what :func:`.native.native_call` checks of each layer (an
``nn.Linear`` that nothing hooks, holding the weights the router bound its feedback to, on a
2-D real input, gradients on, no autocast), and that each activation runs torch's own
forward and nothing hooks it; where anything differs, the run's nodes are called one by one,
as the graph would have called them.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import linear_parameters, own_forward, runs_own_forward, version
from .native import (
    PLAIN_TENSORS,
    NativeSpec,
    _first_order,
    _sign_written,
    feedback_written,
    native_call,
)

__all__ = ["Chain", "chain_call", "fuse"]

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Activation:
    """An elementwise activation: its forward, and autograd's own backward of it (the ATen
    derivative its ``grad_fn`` calls, which for an elementwise function is also its
    forward-mode derivative), reading the activation's input (``reads_input``) or output."""

    forward: Callable[[Tensor, Any], Tensor]
    backward: Callable[[Tensor, Tensor, Any], Tensor]
    reads_input: bool
    #: the activation's constant from its module (a slope, GELU's approximation), or None
    setting: Callable[[Any], Any] = lambda module: None


_RELU = Activation(lambda z, _: torch.relu(z), lambda g, y, _: _aten.threshold_backward.default(g, y, 0), False)
_TANH = Activation(lambda z, _: torch.tanh(z), lambda g, y, _: _aten.tanh_backward.default(g, y), False)
_SIGMOID = Activation(lambda z, _: torch.sigmoid(z), lambda g, y, _: _aten.sigmoid_backward.default(g, y), False)
_GELU = Activation(lambda z, a: F.gelu(z, approximate=a), lambda g, z, a: _aten.gelu_backward.default(g, z, approximate=a),
                   True, lambda m: m.approximate)
_SILU = Activation(lambda z, _: F.silu(z), lambda g, z, _: _aten.silu_backward.default(g, z), True)
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
class Step:
    """One layer of a run and the activation after it (None where the next layer reads the
    layer's output itself)."""

    spec: NativeSpec
    W: Tensor  # the weight the router bound the layer's feedback to
    act: Activation | None
    #: the activation as the graph calls it, on the layer's output
    call_act: Callable[[Tensor], Tensor] | None
    module: nn.Module | None  # the activation's module, checked at each call
    own: Any  # torch's own forward of that module's class
    setting: Any  # a function's constant (a module's is read at each call)
    #: the captured nodes it computes: the layer's, then the activation's
    nodes: tuple[fx.Node, fx.Node | None]


@dataclasses.dataclass
class Chain:
    """A run of layers that :func:`chain_call` routes as one autograd function."""

    steps: list[Step]

    @property
    def names(self) -> list[str]:
        """The names of the run's nodes, in order."""
        return [n.name for step in self.steps for n in step.nodes if n is not None]

    def calls(self) -> list[tuple[Callable[[Any], Any], fx.Node]]:
        """The run's nodes as the graph would call them, one by one, each with the captured
        node it computes."""
        found: list[tuple[Callable[[Any], Any], fx.Node]] = []
        for step in self.steps:
            layer, act = step.nodes
            found.append((functools.partial(native_call, step.spec), layer))
            if step.call_act is not None and act is not None:
                found.append((step.call_act, act))
        return found

    def unfused(self, x: Any) -> Any:
        """The run's nodes called one by one, as the graph would call them."""
        for step in self.steps:
            x = native_call(step.spec, x)
            if step.call_act is not None:
                x = step.call_act(x)
        return x


def chain_call(chain: Chain, x: Any) -> Any:
    """The run on ``x``: as one autograd function where each of its layers and activations
    can run so at this call, else its nodes one by one."""
    if (not torch.is_grad_enabled() or type(x) not in PLAIN_TENSORS or x.dim() != 2
            or not x.is_floating_point() or torch.is_autocast_enabled(x.device.type)):
        return chain.unfused(x)
    params: list[Tensor | None] = []
    settings = []
    for step in chain.steps:
        held = linear_parameters(step.spec.linear)
        if held is None or held[0] is not step.W or (step.module is not None and not runs_own_forward(step.module, step.own)):
            return chain.unfused(x)
        params += held
        act = step.act
        settings.append(step.setting if act is None or step.module is None else act.setting(step.module))
    feedback = []
    for step in chain.steps:
        spec = step.spec
        spec.use()
        feedback.append(spec.spans[0][3])
    return _Chain.apply(chain, (tuple(feedback), tuple(settings)), x, *params)


class _Chain(torch.autograd.Function):
    """A run of linear layers and activations (see the module's docstring). Saved as autograd
    saves: each layer's input, each activation's input or output, and for sign symmetry the
    weights whose ``sign(W)`` the backward reads, through the caller's saved-tensor hooks."""

    @staticmethod
    def forward(ctx: Any, chain: Chain, held: tuple[tuple[Any, ...], tuple[Any, ...]], x: Tensor, *params: Tensor | None) -> Tensor:  # type: ignore[override]
        feedback, settings = held
        needs = ctx.needs_input_grad
        below = needs[2]  # whether the current layer's input takes credit
        saved: list[Tensor] = []
        #: each layer's places in saved: its input, its W (sign symmetry), its activation's
        #: input or output (-1: the next layer's input)
        index: list[tuple[int, int | None, int | None]] = []
        sends, stamps = [], []
        ctx.first, ctx.start = weakref.ref(x), version(x)
        for i, step in enumerate(chain.steps):
            W, b = cast(Tensor, params[2 * i]), params[2 * i + 1]
            place, at_W, at_act = len(saved), None, None
            saved.append(x)
            sends.append(below)
            if step.spec.signs:
                stamps.append(version(W) if below else None)
                if below:
                    at_W = len(saved)
                    saved.append(W)
            else:
                stamps.append(version(feedback[i]))
            x = F.linear(x, W, b)
            act = step.act
            if act is not None:
                if act.reads_input:
                    at_act = len(saved)
                    saved.append(x)
                else:
                    at_act = -1
                x = act.forward(x, settings[i])
            index.append((place, at_W, at_act))
            below = below or needs[3 + 2 * i] or needs[4 + 2 * i]
        inputs = [saved[place] for place, _, _ in index]
        place, at_W, at_act = index[-1]
        if at_act == -1:  # the last activation reads its output: the run's output
            index[-1] = (place, at_W, len(saved))
            saved.append(x)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*inputs, *params)
        ctx.chain, ctx.feedback, ctx.settings, ctx.sends, ctx.stamps, ctx.index = chain, feedback, settings, sends, stamps, index
        return x

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        chain: Chain = ctx.chain
        steps = chain.steps
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:  # autograd's own check, on what the forward pass saved
            for step, stamp in zip(steps, ctx.stamps, strict=True):
                if step.spec.signs and stamp is not None and version(step.W) != stamp:
                    raise _sign_written(step.spec.call.name) from None
            first = ctx.first()
            node = chain.names[0] if first is not None and version(first) != ctx.start else chain.names[-1]
            raise RuntimeError(f"node {node!r}: {error}") from None
        needs, index = ctx.needs_input_grad, ctx.index
        grads: list[Tensor | None] = [None] * (2 * len(steps))
        g = credit
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            place, at_W, at_act = index[i]
            act = step.act
            if act is not None:
                g = act.backward(g, saved[index[i + 1][0] if at_act == -1 else at_act], ctx.settings[i])
            if needs[3 + 2 * i]:
                grads[2 * i] = g.T @ saved[place]
            if needs[4 + 2 * i]:
                grads[2 * i + 1] = g.sum(0)
            if not ctx.sends[i]:
                break
            node = step.spec.call.name
            _first_order(node)
            if at_W is not None:
                B = ctx.feedback[i].signed(saved[at_W].detach(), node)
            else:
                B = ctx.feedback[i]
                if version(B) != ctx.stamps[i]:
                    raise RuntimeError(feedback_written(node))
            g = g @ B
        return (None, None, g if needs[2] else None, *grads)

    @staticmethod
    def jvp(ctx: Any, _chain: None, _held: None, tx: Tensor | None, *tparams: Tensor | None) -> Tensor:
        steps = ctx.chain.steps
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
            act = step.act
            if act is not None and t is not None:
                z = F.linear(x, W, b)
                t = act.backward(t, z if act.reads_input else act.forward(z, ctx.settings[i]), ctx.settings[i])
        assert t is not None  # forward mode calls jvp where some input has a tangent
        return t


def fuse(graph: fx.Graph, root: dict[str, Any], origin: dict[str, fx.Node]) -> None:
    """Replace each run of two or more weight-transport ``nn.Linear`` layers in ``graph`` (the
    router's, calling :func:`.native.native_call`), each layer's value read by the next layer
    alone, directly or through an activation that nothing else reads, by one
    :func:`chain_call` node. ``root`` holds what ``graph``'s attributes name (the chain is
    added to it); ``origin`` maps a node of ``graph`` to the captured node it computes (the
    new node computes the run's first)."""
    taken: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node in taken or _layer(node, root) is None:
            continue
        run: list[tuple[fx.Node, fx.Node | None, Activation | None, Any]] = []
        current: fx.Node | None = node
        while current is not None:
            act_node, act, setting = None, None, None
            users = list(current.users)
            end = current
            if len(users) == 1:
                found = _activation(users[0], current, root)
                if found is not None:
                    act_node, (act, setting) = users[0], found
                    end = act_node
            run.append((current, act_node, act, setting))
            following = list(end.users)
            current = None
            if len(following) == 1 and _layer(following[0], root) is not None and following[0].args[1] is end:
                current = following[0]
        if len(run) < 2:
            continue
        steps = []
        for layer, act_node, act, setting in run:
            spec = _layer(layer, root)
            assert spec is not None  # found above
            module = root[str(act_node.target)] if act_node is not None and act_node.op == "call_module" else None
            nodes = (origin[layer.name], origin[act_node.name] if act_node is not None else None)
            steps.append(Step(spec, spec.weights[spec.first], act, _as_called(act_node, root), module,
                              _MODULES[type(module)][1] if module is not None else None, setting, nodes))
        chain = Chain(steps)
        first, last = run[0][0], run[-1][1] or run[-1][0]
        key = f"_fxnx_chain{len(root)}"
        root[key] = chain
        with graph.inserting_before(first):
            value = graph.call_function(chain_call, (graph.get_attr(key), first.args[1]))
        last.replace_all_uses_with(value)
        origin[value.name] = origin[first.name]
        for layer, act_node, _, _ in reversed(run):
            for n in (act_node, layer):
                if n is not None:
                    taken.add(n)
                    held = n.args[0] if n is layer else None
                    graph.erase_node(n)
                    if isinstance(held, fx.Node) and not held.users:
                        graph.erase_node(held)


def _layer(node: fx.Node, root: dict[str, Any]) -> NativeSpec | None:
    """The spec of a node calling :func:`.native.native_call` for an ``nn.Linear`` on one
    input; None for any other node."""
    if node.op != "call_function" or node.target is not native_call or len(node.args) != 2 or node.kwargs:
        return None
    held = node.args[0]
    spec = root.get(str(held.target)) if isinstance(held, fx.Node) and held.op == "get_attr" else None
    return spec if isinstance(spec, NativeSpec) and spec.linear is not None and len(spec.weights) >= 1 else None


def _activation(node: fx.Node, value: fx.Node, root: dict[str, Any]) -> tuple[Activation, Any] | None:
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
        if found[0] is not _RELU and getattr(module, "inplace", False):
            return None
        return found[0], None
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


def _as_called(node: fx.Node | None, root: dict[str, Any]) -> Callable[[Tensor], Tensor] | None:
    """The activation node as the graph calls it, on its one value."""
    if node is None:
        return None
    args, kwargs = node.args[1:], dict(node.kwargs)
    if node.op == "call_module":
        return root[str(node.target)]  # type: ignore[no-any-return]
    if node.op == "call_method":
        name = str(node.target)
        return lambda v: getattr(v, name)()
    target = node.target
    return lambda v: target(v, *args, **kwargs)  # type: ignore[operator]
