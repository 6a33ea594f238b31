"""Weight transport, natively: ``B`` swapped in for ``W`` in what the layer's backward saves.

Weight transport (feedback alignment, sign symmetry) on linear layers,
convolutions, attention and transformer layers runs the layer as it is, but
while it runs every tensor that the layer's backward saves from a weight ``W``
is swapped for the same view of the feedback weight ``B`` (a
``saved_tensors_hooks`` pair). Autograd's own backward then sends ``credit·B``
to the input and the exact credit to ``W`` and the bias (dropout inside the
layer replays its own mask). The other tensors the layer saves are kept as they
are; each saved tensor, ``B`` included, is checked for writes in place when
unpacked, as autograd checks what it saves. An ``nn.Linear`` that nothing hooks, on a 2-D
real input, runs as an ``autograd.Function`` of its own instead (:class:`_Linear`: no hooks, and none of the
module's frames).
Sign symmetry's ``sign(W)·M`` is made in the backward pass, one layer at a time,
and dropped after it. Under autocast, where the layer would save a cast copy of
``W``, and for a layer applied to its own weight (but a 2-D ``nn.Linear``, whose
:class:`_Linear` keeps its input and ``B`` apart), the node runs through its rule
instead (:mod:`.ruled`). A backward pass that records its own graph
(``create_graph=True``) through ``B`` is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.nn.utils import parametrize

from .._compat import (
    linear_parameters,
    pytree,
    saved_tensors_hooks_calls,
    version,
)
from .._errors import FxnxValueError
from .nodecall import NodeCall
from .plan import Entry, swapped_in
from .ruled import FunctionSpec, feedback_written, function_call, written_since
from .rules import RoutingState, SignSymmetry, _Later, signed
from .transport import feedback_weights


class NativeSpec:
    """A weight-transport node run natively, made once per node: what it calls, its weights,
    and a ``saved_tensors_hooks`` pair kept across calls whose pack function swaps each view
    of a weight ``W`` that the layer saves for the same view of ``B``.

    Fixed feedback (feedback alignment, Kolen–Pollack, weight mirrors) is swapped in as it
    is, each view made once.
    Sign symmetry's ``B = sign(W)·M`` is made in the backward pass, when the layer's backward
    unpacks it, and dropped once the layer's backward is done (:class:`_SignOf`): no copy of
    the weights lives from the forward pass to the backward pass.
    """

    def __init__(self, entry: Entry) -> None:
        call = entry.call
        self.entry, self.call, self.rule = entry, call, entry.rule
        self.fn = call.module if call.module is not None else call.target
        #: an nn.Linear, called as F.linear while nothing hooks it (_run)
        self.linear = call.module if isinstance(call.module, torch.nn.Linear) else None
        self.weights = feedback_weights(call)  # parameter name to W
        self.first = next(iter(self.weights))
        #: each weight of a module's node with the module holding it and its name there,
        #: checked at each call but :class:`_Linear`'s, which holds W itself (:func:`_check_owned`)
        self.owned: list[tuple[torch.nn.Module, str, Tensor]] = []
        for name, W in self.weights.items() if call.module is not None else ():
            prefix, _, leaf = name.rpartition(".")
            self.owned.append((self.fn.get_submodule(prefix), leaf, W))
        self.device = next(iter(self.weights.values())).device.type
        #: sign symmetry of its own kind: B made lazily from sign(W) and the magnitudes
        self.signs = isinstance(self.rule, SignSymmetry) and type(self.rule).feedback_for is SignSymmetry.feedback_for
        #: start, end, W, B or M, the given feedback, and its version where B is a copy of it
        self.spans: list[tuple[int, int, Tensor, Any, Any, int | None]] = []
        self.views: dict[tuple[Any, ...], Tensor] = {}
        self.hits = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        #: the node as a rule run on its own graph (under autocast, or applied to its weight)
        self.ruled = FunctionSpec.of(entry)

    def use(self) -> None:
        """Take this call's feedback: ``B`` for each weight (laid out like ``W``), or for sign
        symmetry the magnitudes ``M`` (drawn afresh at each call for brSF)."""
        if self.signs:
            magnitudes = self.rule.magnitudes(self.call)
            self.spans = [  # M read when unpacked (brSF draws it then)
                (W.data_ptr(), W.data_ptr() + W.numel() * W.element_size(), W, _Magnitudes(magnitudes, name), None, None)
                for name, W in self.weights.items()
            ]
            return
        feedback = self.rule.feedback_for(self.call)
        old = self.spans
        if len(old) == 1:  # one weight (a linear or convolution layer): no loop
            if _current(old[0], feedback[self.first]):
                return  # the same B (feedback alignment): its views are kept
        elif old and all(_current(span, feedback[name]) for span, name in zip(old, self.weights, strict=True)):
            return
        spans = []
        for name, W in self.weights.items():
            given = feedback[name]
            B, stamp = given.detach(), None
            if B.stride() != W.stride() or B.dtype != W.dtype or B.device != W.device:
                B = torch.empty_strided(W.shape, W.stride(), dtype=W.dtype, device=W.device).copy_(B)
                stamp = version(given)  # a copy: made again once the given B is written
            start = W.data_ptr()
            spans.append((start, start + W.numel() * W.element_size(), W, B, given, stamp))
        self.views = {}
        self.spans = spans

    def pack(self, t: Tensor) -> Any:
        """A view of a weight as the same view of ``B`` (or, for sign symmetry, what makes
        it); any other tensor as it is. Each with the write counter of what it reads, which
        :func:`_unpack` checks as autograd checks what it saves (hooks take that check over):
        the layer's backward reads its inputs and ``B`` as the forward pass left them."""
        ptr = t.data_ptr()
        for start, end, W, B, _, _ in self.spans:
            if start <= ptr < end and t.dtype == W.dtype:
                self.hits += 1
                if self.signs:
                    return _SignOf(W, B, t, self.call.name)
                key = (id(B), ptr, t.size(), t.stride())
                view = self.views.get(key)
                if view is None:
                    offset = t.storage_offset() - W.storage_offset() + B.storage_offset()
                    view = self.views[key] = B.as_strided(t.size(), t.stride(), offset)
                return (view, B, version(B), self.call.name)
        return (t, t, version(t), self.call.name)


def _current(span: tuple[int, int, Tensor, Any, Any, int | None], given: Any) -> bool:
    """Whether ``span`` holds ``given`` as it is now: the same tensor, ``W`` where it was, and
    a copy of ``given`` (another dtype or layout than ``W``'s) made since its last write
    (Kolen–Pollack and weight mirrors update ``B`` in place)."""
    start, _, W, _, held, stamp = span
    return held is given and W.data_ptr() == start and (stamp is None or stamp == version(given))


_HOOKS = saved_tensors_hooks_calls()
#: what an nn.Linear's input may be to run as one autograd function (:class:`_Linear`,
#: :class:`.taps._DirectLinear`): a subclass runs under hooks or as the module
PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


class _Magnitudes:
    """Sign symmetry's ``M`` for one weight, as one forward pass took it: a tensor of them
    (frSF's, or magnitudes given to route a step again) with its write counter then, which
    :meth:`signed` checks as :func:`_unpack` checks ``B``; a number (uSF) or a fresh draw
    (brSF) holds nothing a write could change."""

    __slots__ = ("magnitudes", "name", "held", "stamp")

    def __init__(self, magnitudes: Any, name: str) -> None:
        self.magnitudes, self.name = magnitudes, name
        held = None if isinstance(magnitudes, _Later) else magnitudes[name]
        self.held = held if isinstance(held, Tensor) else None
        self.stamp = None if self.held is None else version(self.held)

    def signed(self, W: Tensor, node: str) -> Tensor:
        """``sign(W)·M``, refusing an ``M`` written since the forward pass took it."""
        if self.held is not None and version(self.held) != self.stamp:
            raise RuntimeError(feedback_written(node))
        return signed(self.magnitudes, self.name, W)


class _SignOf:
    """A view of ``W`` saved by a layer under sign symmetry: on unpacking, the same view of
    ``sign(W)·M`` (``W`` as it was when saved: a write into it since is refused, as autograd
    refuses one into a tensor it saved)."""

    __slots__ = ("W", "M", "version", "size", "stride", "offset", "B", "node")

    def __init__(self, W: Tensor, M: _Magnitudes, t: Tensor, node: str) -> None:
        self.W, self.M, self.version, self.node = W, M, version(W), node
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - W.storage_offset()
        self.B: Tensor | None = None

    def unpack(self) -> Tensor:
        if self.B is None:
            W = self.W
            if version(W) != self.version:
                raise _sign_written(self.node)
            B = self.M.signed(W.detach(), self.node)
            self.B = B.as_strided(self.size, self.stride, B.storage_offset() + self.offset)
        return self.B


def _sign_written(node: str) -> FxnxValueError:
    return FxnxValueError(
        f"node {node!r}: a weight routed by sign symmetry was written in place (an optimizer "
        "step?) between the forward pass and its backward pass, which reads sign(W) as the "
        "forward pass saw it: call backward before changing the weights"
    )


def _unpack(packed: Any) -> Tensor:
    if type(packed) is not tuple:
        _first_order(packed.node)
        return packed.unpack()  # _SignOf
    t, read, saved, node = packed
    if version(read) != saved:
        if read is t:
            raise RuntimeError(written_since(t, saved, f"node {node!r} saved"))
        raise RuntimeError(feedback_written(node))
    if read is not t:  # B for W
        _first_order(node)
    return t


def _first_order(node: str) -> None:
    """Refuse a backward pass that records its own graph (``create_graph=True``) through ``B``:
    autograd would differentiate ``B`` as the ``W`` it stands in for, and send ``W`` the
    second-order credit of a matrix it never multiplied."""
    if torch.is_grad_enabled():
        raise FxnxValueError(
            f"create_graph=True through node {node!r}, whose backward sends credit through "
            "its feedback weights B in place of W: autograd would differentiate B as if it were "
            "W, so higher-order gradients would be wrong. Route this node with rule 'exact' "
            f"(rules={{{node!r}: fxnx.credit.Exact()}}) for higher-order gradients"
        )


def one_function(spec: NativeSpec, x: Any) -> tuple[Tensor, Tensor | None] | None:
    """The weight and bias of an ``nn.Linear`` node that can run on ``x`` as one autograd
    function (:class:`_Linear`): a layer :func:`linear_weights` takes, on a plain 2-D tensor
    (F.linear's output is then no view); None otherwise."""
    return linear_weights(spec) if type(x) in PLAIN_TENSORS and x.dim() == 2 else None


def linear_weights(spec: NativeSpec) -> tuple[Tensor, Tensor | None] | None:
    """The weight and bias of an ``nn.Linear`` node that nothing hooks, holding the weight the
    router bound its feedback to, a real one; None otherwise."""
    params = linear_parameters(spec.linear) if spec.linear is not None else None
    if params is None or params[0] is not spec.weights[spec.first] or not params[0].is_floating_point():
        return None
    return params


def input_feedback(feedback: Any, W: Tensor | None, stamp: int | None, node: str) -> Tensor:
    """What a layer's backward multiplies its output's credit by for its input's credit, refusing
    a backward that records its own graph: sign symmetry's ``sign(W)·M`` from the ``W`` the
    forward pass saved (``feedback`` its magnitudes), else ``feedback``, the ``B`` the forward pass
    took, refused where it was written since (its write counter then, ``stamp``)."""
    _first_order(node)
    if W is not None:
        return feedback.signed(W.detach(), node)  # type: ignore[no-any-return]
    if version(feedback) != stamp:
        raise RuntimeError(feedback_written(node))
    return feedback  # type: ignore[no-any-return]


def native_call(spec: NativeSpec, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # nothing is saved: the layer as it is
        return spec.fn(*args, **kwargs)
    if torch.is_autocast_enabled(spec.device):
        # The layer would save a cast copy of W, not W: route it through its rule instead.
        _check_owned(spec)
        return _on_its_own_graph(spec, args, kwargs)
    spec.use()
    params = one_function(spec, args[0]) if len(args) == 1 and not kwargs else None
    if params is not None:
        return _Linear.apply(args[0], *params, spec, spec.spans[0][3])
    _check_owned(spec)
    if spec.call.module is not None and _reads_its_weight(spec, args, kwargs):
        # A layer applied to its own weight (fc(fc.weight)) saves W as its input too, for
        # W's credit, which must not read B: route it through its rule instead.
        return _on_its_own_graph(spec, args, kwargs)
    hits = spec.hits
    if _HOOKS is None:
        with spec.hooks:
            out = _run(spec, params, args, kwargs)
    else:  # the same as the context manager, without its frames: once per layer and forward
        _HOOKS[0](spec.pack, _unpack)
        try:
            out = _run(spec, params, args, kwargs)
        finally:
            _HOOKS[1]()
    if spec.hits == hits and _needs_input_credit(args, kwargs, spec.call):
        call = spec.call
        refusal = _not_its_weights(spec) if call.module is not None else None
        raise refusal or FxnxValueError(
            f"node {call.name!r}: its backward did not read its weight where feedback weights "
            f"were to replace it, so {spec.entry.rule_name} cannot be applied natively; route it "
            f"with rules={{{call.name!r}: fxnx.credit.Exact()}} or report this model"
        )
    return out


def _check_owned(spec: NativeSpec) -> None:
    """Refuse a layer whose weights are no longer those the router bound its feedback to (a
    parametrization registered since, whose own backward would save the old weight's memory
    as its ``original`` and take ``B`` in its place; a parameter replaced or swapped in)."""
    for owner, leaf, W in spec.owned:
        if getattr(owner, leaf, None) is not W:
            raise _not_its_weights(spec) or FxnxValueError(
                f"node {spec.call.name!r}: its {leaf} is not the tensor the router's feedback "
                "weights stand in for: build a new router (fxnx.CreditRouter(G, model, ...))"
            )


def _not_its_weights(spec: NativeSpec) -> FxnxValueError | None:
    """Why a module's node does not hold the weights the router bound its feedback to; None
    where it does."""
    call = spec.call
    assert call.module is not None  # the caller's check
    now = dict(call.module.named_parameters())
    replaced = [name for name, W in spec.weights.items() if now.get(name) is not W]
    swapped = swapped_in(call.module)
    if swapped:
        return FxnxValueError(f"node {call.name!r}: its layer's parameters are not the model's own." + swapped)
    parametrized = [name for name in replaced if _parametrized(call.module, name)]
    if parametrized:
        return FxnxValueError(
            f"node {call.name!r}: its {', '.join(parametrized)} was parametrized "
            "(torch.nn.utils.parametrize) after G was converted, so the layer now multiplies by a "
            "weight computed from parameters, which G does not show and for which no feedback "
            "weight can stand in. Convert the model again with its parametrizations (a feedback "
            "rule then refuses that node, which can be routed exactly), or remove them"
        )
    held = {*now, *dict(call.module.named_buffers())}
    computed = [name for name in replaced if name not in held]
    if computed:
        return FxnxValueError(
            f"node {call.name!r}: its {', '.join(computed)} is not a parameter but a tensor "
            "set afresh at each call (as torch.nn.utils.weight_norm and spectral_norm, in "
            "their old form, set it in a forward pre-hook) or replaced by a plain tensor, so "
            "no feedback weight can stand in for it. Route it exactly, knowing its credit is backprop's "
            f"(rules={{{call.name!r}: fxnx.credit.Exact()}}), or make the weight a parameter"
        )
    if replaced:
        return FxnxValueError(
            f"node {call.name!r}: its {', '.join(replaced)} was replaced by another tensor "
            "since the router was built, and the router's feedback weights stand in for "
            "the one it had: build a new router (fxnx.CreditRouter(G, model, ...)) after "
            "replacing parameters"
        )
    return None


def _parametrized(module: torch.nn.Module, name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return parametrize.is_parametrized(module.get_submodule(prefix), leaf)


def _on_its_own_graph(spec: NativeSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return function_call(spec.ruled, RoutingState(), *_inputs_of(spec.entry, args, kwargs))


def _reads_its_weight(spec: NativeSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a tensor argument of a module's call lies in one of its weights."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            try:
                ptr = a.data_ptr()
            except RuntimeError:  # no storage (torch.func's wrappers): torch's own error follows
                return False
            if any(start <= ptr < end for start, end, *_ in spec.spans):
                return True
    return False


class _Linear(torch.autograd.Function):
    """``F.linear(x, W, b)`` for an ``nn.Linear`` that nothing hooks, on a 2-D real input,
    whose backward sends ``credit·B`` to ``x`` and the exact credit to ``W`` and ``b``, as
    autograd computes them (``creditᵀ·x``, the credit summed); forward-mode derivatives are
    ``F.linear``'s own. ``x`` (and, for sign symmetry where ``x`` takes credit, ``W``) is
    saved as autograd saves it: through the caller's saved-tensor hooks (a checkpoint's), and
    checked for writes in place when read, the error naming the node. ``B`` is held as it is,
    its write counter checked where the input's credit reads it; sign symmetry's ``sign(W)·M``
    is made in the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, b: Tensor | None, spec: NativeSpec, feedback: Any) -> Tensor:  # type: ignore[override]
        if spec.signs and x.requires_grad:
            ctx.save_for_backward(x, W)
            ctx.stamp = version(W)
        else:
            ctx.save_for_backward(x)
            ctx.stamp = None if spec.signs else version(feedback)
        ctx.spec, ctx.feedback = spec, feedback
        ctx.save_for_forward(x, W)
        return torch.nn.functional.linear(x, W, b)

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        spec = ctx.spec
        node = spec.call.name
        needs = ctx.needs_input_grad
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:  # autograd's own check, on what the forward pass saved
            if spec.signs and ctx.stamp is not None and version(spec.spans[0][2]) != ctx.stamp:
                raise _sign_written(node) from None
            raise RuntimeError(f"node {node!r}: {error}") from None
        x = saved[0]
        sent = None
        if needs[0]:
            sent = credit @ input_feedback(ctx.feedback, saved[1] if spec.signs else None, ctx.stamp, node)
        return sent, credit.T @ x if needs[1] else None, credit.sum(0) if needs[2] else None, None, None

    @staticmethod
    def jvp(ctx: Any, tx: Tensor | None, tW: Tensor | None, tb: Tensor | None, *_: Any) -> Tensor:
        x, W = ctx.saved_tensors  # what forward saved for forward mode
        terms = [torch.nn.functional.linear(t, w) for t, w in ((tx, W), (x, tW)) if t is not None and w is not None]
        if tb is not None:
            terms.append(tb.expand(x.shape[0], -1))
        out = terms[0]
        for term in terms[1:]:
            out = out + term
        return out


def _run(spec: NativeSpec, params: tuple[Tensor, Tensor | None] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The node's call; an ``nn.Linear`` that nothing hooks (``params``, its weight and bias)
    as ``F.linear``, which is all its call would do (small layers pay most for its frames)."""
    if params is not None:
        return torch.nn.functional.linear(args[0], *params)
    return spec.fn(*args, **kwargs)


def _inputs_of(entry: Entry, args: Any, kwargs: Any) -> list[Any]:
    """The values of ``entry``'s input occurrences among concrete ``args``/``kwargs``."""
    found: list[Any] = []

    def walk(template: Any, value: Any) -> None:
        if isinstance(template, fx.Node):
            found.append(value)
        elif isinstance(template, (list, tuple)):
            for t, v in zip(template, value, strict=True):
                walk(t, v)
        elif isinstance(template, dict):
            for key, t in template.items():
                walk(t, value[key])
        elif isinstance(template, slice):
            for part in ("start", "stop", "step"):
                walk(getattr(template, part), getattr(value, part))

    walk((tuple(entry.node.args), dict(entry.node.kwargs)), (tuple(args), dict(kwargs)))
    return found


def _needs_input_credit(args: Any, kwargs: Any, call: NodeCall) -> bool:
    """Whether an input other than the node's parameters (an ATen node's weight and bias are
    arguments) carries credit: only then must its backward have read the weight."""
    # A parameter, route_credit's alias of it, or a view of it that copies nothing (W.T)
    own = {(p.data_ptr(), p.numel()) for p in call.own_parameters()}
    return any(
        isinstance(t, Tensor) and t.requires_grad and (t.data_ptr(), t.numel()) not in own
        for t in pytree.tree_leaves((args, kwargs))
    )
