"""Credit rules: how one node sends the credit at its output back to its inputs.

A rule is an object (a :class:`Rule`) or a plain function, called as::

    rule(call: NodeCall, credit, state: RoutingState) -> tuple[list, dict]

It returns the credit for each input occurrence of the node (``call.inputs``)
and for each parameter the node owns (``call.params``). A rule object is
*bound* to each node it routes through: :meth:`Rule.bind` returns the node's
own copy, which keeps whatever that node needs across steps (the fixed random
feedback weights of :class:`FeedbackAlignment`, for instance).

The rules:

- :class:`Exact`: the node's vector-Jacobian product, what backpropagation sends.
- :class:`FeedbackAlignment` (Lillicrap et al., 2016, *Nat. Commun.* 7:13276): a
  fixed random ``B`` carries credit back to the input in place of ``W``.
- :class:`SignSymmetry` (Liao, Leibo & Poggio, 2016, AAAI; the variants as
  BioTorch names them, Sanfiz & Akrout, 2021): ``sign(W) ∘ M`` in place of ``W``,
  with ``M`` all ones (uSF), redrawn at random every step (brSF) or drawn once (frSF).
- :class:`DirectFeedbackAlignment` (Nøkland, 2016, NeurIPS): a fixed random
  projection of the credit at the *model's output* goes to the node's input.

Feedback weights are drawn as BioTorch draws them (:mod:`.feedback`);
feedback that learns (Kolen–Pollack, weight mirrors) is in :mod:`.learned`.

Under every one of them a layer's own parameters get their exact credit given
the credit that reached the layer's output.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, cast

import torch
from torch import Tensor

from .._compat import pytree
from .._errors import FxnxTypeError, FxnxValueError
from . import feedback as fb
from .nodecall import Credit, NodeCall
from .spatial import Geometry, conv_geometry
from .transport import exact_parameters, feedback_weights, has_weights, transported

__all__ = [
    "DirectFeedbackAlignment",
    "Exact",
    "FeedbackAlignment",
    "Routed",
    "RoutingState",
    "Rule",
    "SignSymmetry",
    "Transport",
]

#: What a rule returns: credit per input occurrence, and per qualified parameter name.
Routed = tuple[list[Credit], dict[str, Tensor]]


@dataclass
class RoutingState:
    """What every rule may read during one backward pass.

    Attributes
    ----------
    seed : int
        The run's seed (rules without a seed of their own draw from it).
    output_credit : Any
        The credit at the model's output, in the output's structure.
    """

    seed: int = 0
    output_credit: Any = None
    #: Direct feedback's flattened output credit, ``N × D``, for the nodes that receive it
    #: when the backward pass reaches them (fxnx's own; set before any of them runs), by
    #: backward pass (autograd's graph task): each pass projects its own ``e``, and a pass
    #: that never reached the output (a loss on a value inside the model, a second-order pass)
    #: has none, as its output credit is zero. Each is dropped when its pass ends.
    _direct: dict[Any, Tensor] = field(default_factory=dict, init=False, repr=False)
    #: The direct-feedback inputs (their places in the run's tap) that this forward's nodes
    #: receive themselves, rather than at the output.
    _received: set[int] = field(default_factory=set, init=False, repr=False)
    #: Direct feedback's ``B`` at each place of the tap as this forward left it (each with its
    #: write counter; None where not drawn yet), read again when the backward pass sends.
    _drawn: Any = field(default=None, init=False, repr=False)


class Rule:
    """Base class of rule objects. Subclasses set :attr:`name` and implement ``__call__``.

    Attributes
    ----------
    feedback : Any
        What the rule holds fixed at its node (feedback weights), or None;
        collected in :attr:`CreditRouter.feedback`.

    Examples
    --------
    A rule that halves the exact credit it sends on:

    >>> class Halve(Rule):
    ...     name = "halve"
    ...     def __call__(self, call, credit, state):
    ...         inputs, params = call.exact(credit)
    ...         return [None if c is None else c / 2 for c in inputs], params
    """

    name: ClassVar[str] = "rule"
    feedback: Any = None
    #: Whether the rule changes from one routing run to the next (brSF redraws its
    #: magnitudes): ``route_credit`` then builds its plan afresh on every call.
    stateful: ClassVar[bool] = False

    def bind(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        """This rule for one node (``call`` has no values yet), once, when a plan is compiled.

        ``feedback`` is the user's feedback for the node (``route_credit(..., feedback=)``),
        or None. The default returns the rule itself and refuses feedback.
        """
        if feedback is not None:
            raise FxnxValueError(
                f"feedback was given for node {call.name!r}, but its rule {self.name!r} "
                "takes no feedback weights"
            )
        return self

    def get_extra_state(self) -> dict[str, Any]:
        """What this rule keeps at its node besides :attr:`feedback`, for a router's
        ``state_dict`` (as ``nn.Module.get_extra_state``): tensors, numbers and strings in a
        dict. A router loaded with that state binds the rule with the saved feedback, then
        calls :meth:`set_extra_state` with this. The default keeps nothing."""
        return {}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`get_extra_state` kept (this rule was just bound with the
        saved feedback)."""

    def __call__(self, call: NodeCall, credit: Credit, state: RoutingState) -> Routed:
        raise NotImplementedError(
            f"{type(self).__qualname__} is a Rule without a __call__ of its own: define "
            "__call__(self, call, credit, state), returning (input_credits, param_credits) for "
            f"the node (node {call.name!r} needs it now)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Exact(Rule):
    """The node's exact vector-Jacobian product: what backpropagation sends."""

    name = "exact"

    def __call__(self, call: NodeCall, credit: Credit, state: RoutingState) -> Routed:
        return call.exact(credit)


class _Drawn(Rule):
    """A rule that draws random feedback weights (see :mod:`.feedback`): from its
    own seed or the run's, from law ``init``, none larger than ``max_bytes``."""

    laws: ClassVar[tuple[str, ...]] = fb.LAWS

    def __init__(
        self, seed: int | None = None, *, init: str = "xavier", max_bytes: float | None = fb.MAX_BYTES
    ) -> None:
        self.seed = fb.check_seed(seed, type(self).__name__, optional=True)
        self.init = fb.check_law(init, self.laws)
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed!r}, init={self.init!r})"

    def _draw(self, call: NodeCall, seed: int, key: str, shape: Any, like: Tensor) -> Tensor:
        return fb.draw(
            self.init, shape, seed=seed, key=key, like=like, max_bytes=self.max_bytes,
            where=f"{self.name} at node {call.name!r}",
        )


class Transport(Rule):
    """Weight transport: the layer sends credit back as if each weight ``W`` were ``B``.

    Subclasses implement :meth:`feedback_for`; the input's credit is then that of
    the layer computed with ``B`` in place of ``W``, and the layer's own
    parameters get their exact credit. On linear layers and convolutions the
    router does this inside autograd's own backward (the tensors the layer saves
    from ``W`` are swapped for the same views of ``B``), elsewhere by calling the
    rule with the node's recorded call.
    """

    def feedback_for(self, call: NodeCall) -> dict[str, Tensor]:
        """``B`` for each weight of ``call``'s layer (as :func:`feedback_weights` names them),
        for one backward pass."""
        raise NotImplementedError

    def feedback_now(self, call: NodeCall) -> dict[str, Tensor]:
        """The ``B`` the node's latest step used, drawing nothing (empty before any)."""
        return self.feedback_for(call)

    def __call__(self, call: NodeCall, credit: Credit, state: RoutingState) -> Routed:
        return transported(call, credit, self.feedback_for(call))


def _key(call: NodeCall, pname: str) -> str:
    return call.name if pname == "weight" else f"{call.name}.{pname}"


def _public(weights: dict[str, Tensor]) -> Tensor | dict[str, Tensor]:
    """One tensor for a layer with one weight, else parameter name to tensor."""
    return next(iter(weights.values())) if len(weights) == 1 else weights


def _given(call: NodeCall, weights: dict[str, Tensor], feedback: Any) -> dict[str, Tensor]:
    """The user's feedback for ``call`` as parameter name to tensor, shapes checked."""
    if isinstance(feedback, Tensor) and len(weights) == 1:
        feedback = dict.fromkeys(weights, feedback)
    if not isinstance(feedback, (Tensor, Mapping)):
        raise FxnxTypeError(
            f"feedback for node {call.name!r} must be a tensor shaped like its weight, or a "
            f"dict of parameter name to tensor, got {type(feedback).__qualname__}"
        )
    given = {"weight": feedback} if isinstance(feedback, Tensor) else dict(feedback)
    if set(given) != set(weights):
        raise FxnxValueError(
            f"feedback for node {call.name!r} must give {sorted(weights)}, got {sorted(given)}"
        )
    for pname, B in given.items():
        if not isinstance(B, Tensor):
            raise FxnxTypeError(
                f"feedback weight for node {call.name!r} ({pname}) must be a tensor, got "
                f"{type(B).__qualname__}"
            )
        if B.shape != weights[pname].shape:
            got = tuple(B.shape)
            raise FxnxValueError(
                f"feedback weight for node {call.name!r} ({pname}) has shape {got}, but its "
                f"weight has shape {tuple(weights[pname].shape)}"
            )
    return {pname: B.detach() for pname, B in given.items()}


class FeedbackAlignment(_Drawn, Transport):
    """Feedback alignment (Lillicrap et al., 2016): a fixed random ``B`` in place of ``W``.

    The credit sent to the layer's input is that of the layer with ``B`` as its
    weight (``credit @ B`` for ``nn.Linear``; the transposed convolution with
    ``B`` for convolutions; inside ``nn.MultiheadAttention``, ``B`` replaces each
    of its projection weights while the attention itself is differentiated
    exactly). The layer's own parameters get their exact credit.

    Layers written as functions (``F.linear(x, self.emb.weight)``, ``x @ self.W``,
    the ``aten.linear``/``aten.conv2d``/``aten.addmm`` nodes of an exported graph)
    and modules without a transport of their own (transformers' ``Conv1D``) are
    recomputed with ``B`` in place of each trainable parameter of two or more
    dimensions among their arguments (their module's parameters), and the input
    credit is that recomputation's VJP; a function node with no such parameter
    (``q @ k.transpose(-2, -1)``) is routed exactly. :attr:`feedback` is one
    tensor for a node with one weight, else parameter name to tensor.

    Parameters
    ----------
    seed : int, optional
        Seeds ``B``, per node. None: the seed of the router or ``route_credit`` call.
    init : {"xavier", "kaiming"}
        The law ``B`` is drawn from: ``"xavier"`` (Glorot uniform, BioTorch's default) or
        ``"kaiming"`` (the layer's own initialisation in PyTorch).
    max_bytes : int, optional
        Refuse any feedback weight larger than this (1 GiB), before making it.
    """

    name = "feedback_alignment"

    # set on the bound copy by bind
    _weights: dict[str, Tensor]

    def bind(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        if _weightless(call):
            return Exact().bind(call, seed, feedback)
        weights = feedback_weights(call)
        seed = seed if self.seed is None else self.seed
        bound = copy.copy(self)
        bound._weights = (
            _given(call, weights, feedback) if feedback is not None
            else {p: self._draw(call, seed, _key(call, p), W.shape, W) for p, W in weights.items()}
        )
        bound.feedback = _public(bound._weights)
        return bound

    def feedback_for(self, call: NodeCall) -> dict[str, Tensor]:
        return self._weights

    def feedback_now(self, call: NodeCall) -> dict[str, Tensor]:
        return self._weights  # not feedback_for, which learned feedback overrides to warn


_VARIANTS = {"uniform": "usf", "batch_random": "brsf", "fixed_random": "frsf"}


class SignSymmetry(_Drawn, Transport):
    """Sign symmetry (Liao et al., 2016): ``sign(W) ∘ M`` in place of ``W``.

    As BioTorch defines the variants (Sanfiz & Akrout, 2021): ``M`` is the
    standard deviation of the law ``init`` for ``W``'s shape (uSF), the absolute
    value of a fresh draw from that law at every step (brSF; 16 random bits a
    value, :func:`.feedback.magnitudes`), or of one draw kept for good (frSF).
    Scaling uSF this way keeps the credit at the scale of the forward weights
    (Xiao et al., 2018); ``init="unit"`` gives Liao et al.'s
    literal uSF, ``M = 1``, whose credit grows with each layer's fan-in and can
    make plain SGD diverge.

    Parameters
    ----------
    magnitude : {"uniform", "batch_random", "fixed_random"}
        uSF, brSF or frSF.
    seed : int, optional
        Seeds the draws, per node. None: the seed of the run.
    init : {"xavier", "kaiming", "unit"}
        The law of ``M``, as for :class:`FeedbackAlignment`; ``"unit"`` (magnitude one,
        Liao et al.'s literal form) for uSF only.
    max_bytes : int, optional
        Refuse any feedback weight larger than this (1 GiB), before making it.

    Notes
    -----
    ``sign(W)`` is read at every step, so it follows the weights as they learn.
    :attr:`feedback` holds ``M``: the fixed one (frSF) or the latest draw (brSF).
    Feedback given to brSF (``route_credit(..., feedback=router.feedback)``) is
    used for the first step routed, so one step can be routed again as it was.
    """

    laws = (*fb.LAWS, "unit")

    # set on the bound copy by bind
    _seed: int
    _draws: int
    _pending: dict[str, Tensor] | None
    _magnitudes: Mapping[str, Tensor | float] | None

    def __init__(
        self, magnitude: Literal["uniform", "batch_random", "fixed_random"] = "uniform",
        seed: int | None = None, *, init: str = "xavier", max_bytes: float | None = fb.MAX_BYTES,
    ) -> None:
        if magnitude not in _VARIANTS:
            raise FxnxValueError(
                f"magnitude must be one of {', '.join(map(repr, _VARIANTS))}, got {magnitude!r}"
            )
        if init == "unit" and magnitude != "uniform":
            raise FxnxValueError(f"init='unit' is uSF's literal form; {_VARIANTS[magnitude]} draws from 'xavier' or 'kaiming'")
        super().__init__(seed, init=init, max_bytes=max_bytes)
        self.magnitude = magnitude

    @property
    def name(self) -> str:  # type: ignore[override]
        return _VARIANTS[self.magnitude]

    @property
    def stateful(self) -> bool:  # type: ignore[override]
        return self.magnitude == "batch_random"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.magnitude!r}, seed={self.seed!r}, init={self.init!r})"

    def bind(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        if _weightless(call):
            return Exact().bind(call, seed, feedback)
        weights = feedback_weights(call)
        bound = copy.copy(self)
        bound._seed = seed if self.seed is None else self.seed
        bound._draws = 0
        bound._pending = None
        bound._magnitudes = None  # M per weight: a number (uSF) or a tensor like W
        if self.magnitude == "uniform":
            if feedback is not None:
                raise FxnxValueError(
                    f"feedback was given for node {call.name!r}, but {self.name} uses sign(W) alone"
                )
            bound._magnitudes = {p: 1.0 if self.init == "unit" else fb.std(self.init, W.shape) for p, W in weights.items()}
        elif self.magnitude == "fixed_random":
            fixed = (
                _magnitudes(call, self.name, _given(call, weights, feedback)) if feedback is not None
                else {p: bound._draw(call, bound._seed, _key(call, p), W.shape, W).abs_() for p, W in weights.items()}
            )
            bound._magnitudes = fixed
            bound.feedback = _public(fixed)
        elif feedback is not None:
            # The magnitudes of one step (CreditRouter.feedback after it), to route that step
            # again; later steps draw afresh.
            bound._pending = _magnitudes(call, self.name, _given(call, weights, feedback))
        return bound

    def get_extra_state(self) -> dict[str, Any]:
        # brSF draws afresh at each step: how far its draws got (its feedback is one step's)
        return {"draws": self._draws} if self.magnitude == "batch_random" else {}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if "draws" in state:
            self._draws = state["draws"]

    def feedback_for(self, call: NodeCall) -> dict[str, Tensor]:
        magnitudes = self.magnitudes(call)
        return {p: signed(magnitudes, p, W.detach()) for p, W in feedback_weights(call).items()}

    def magnitudes(self, call: NodeCall) -> Mapping[str, Tensor | float]:
        """``M`` for each weight, for one backward pass: brSF draws afresh at each call.

        The router makes ``sign(W)·M`` from them only in the backward pass, as each layer's
        backward needs it (so no ``B`` is kept from the forward pass to the backward pass).
        """
        if self.magnitude == "batch_random":
            self._draws += 1
            if self._pending:
                drawn: Mapping[str, Tensor] = self._pending
            else:
                draws = self._draws
                drawn = _Later({
                    p: functools.partial(
                        fb.magnitudes, self.init, W.shape, seed=self._seed, key=f"{_key(call, p)}@{draws}", like=W,
                        max_bytes=self.max_bytes, where=f"{self.name} at node {call.name!r}",
                    )
                    for p, W in feedback_weights(call).items()
                })
            self._magnitudes = drawn
            self._pending = None
            self.feedback = drawn
        assert self._magnitudes is not None  # set by bind (uSF, frSF) or just above (brSF)
        return self._magnitudes

    @property  # type: ignore[override]
    def feedback(self) -> Any:
        """``M`` (brSF: the last step's, drawn now if its backward pass has not drawn it) or
        None (uSF)."""
        held = self.__dict__.get("_feedback")
        return _public(dict(held)) if isinstance(held, _Later) else held

    @feedback.setter
    def feedback(self, value: Any) -> None:
        self.__dict__["_feedback"] = value

    def feedback_now(self, call: NodeCall) -> dict[str, Tensor]:
        if self._magnitudes is None:  # brSF before its first draw
            return {}
        return {p: signed(self._magnitudes, p, W.detach()) for p, W in feedback_weights(call).items()}


def _check_direct(call: NodeCall, given: Sequence[Any]) -> None:
    """Refuse direct feedback given for ``call`` that is not one tensor (or None) per input
    of the node, in order (what ``CreditRouter.feedback`` holds for it)."""
    if len(given) > len(call.sources):
        raise FxnxValueError(
            f"feedback for node {call.name!r} gives {len(given)} tensors, but the node has "
            f"{len(call.sources)} input{'s' * (len(call.sources) != 1)}: give one B per input, in "
            "order, as CreditRouter.feedback holds them"
        )
    for i, B in enumerate(given):
        if B is not None and not (isinstance(B, Tensor) and B.is_floating_point()):
            raise FxnxTypeError(
                f"feedback for node {call.name!r} (input {i}) must be a floating-point tensor, got "
                f"{type(B).__qualname__ if not isinstance(B, Tensor) else B.dtype}"
            )


def _magnitudes(call: NodeCall, rule: str, given: dict[str, Tensor]) -> dict[str, Tensor]:
    """Given magnitudes ``M``, refused where one is negative (``sign(W)·M`` would then send
    credit against the sign of ``W``: not sign symmetry)."""
    for p, M in given.items():
        if isinstance(M, Tensor) and bool((M < 0).any()):
            raise FxnxValueError(
                f"feedback for node {call.name!r} ({p}): {rule} takes magnitudes M >= 0 (B = "
                f"sign(W)·M), and {int((M < 0).sum())} are negative; pass M.abs() for the same "
                "magnitudes"
            )
    return given


class _Later(Mapping[str, Tensor]):
    """brSF's magnitudes for one step, drawn (from their key: the same values whenever) each
    time they are read, and never kept: the router reads them in the backward pass, as each
    layer's backward needs its ``B`` (:func:`signed`), so that no ``M`` is held from the
    forward pass to the backward pass, nor from one step to the next."""

    def __init__(self, draws: dict[str, Callable[[], Tensor]]) -> None:
        self._draws = draws

    def __getitem__(self, name: str) -> Tensor:
        return self._draws[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._draws)

    def __len__(self) -> int:
        return len(self._draws)


#: A brSF draw of at most this many values is multiplied by ``sign(W)`` (see :func:`signed`).
_SMALL_DRAW = 1 << 16


def signed(magnitudes: Mapping[str, Tensor | float], name: str, W: Tensor) -> Tensor:
    """Sign symmetry's ``B = sign(W)·M`` for the weight ``name`` (``W`` detached), laid out
    like ``W``. A fresh brSF draw of a large weight is made into ``B`` where it lies:
    ``copysign`` is ``sign(W)·M`` wherever ``W`` is neither zero nor NaN, which two reductions
    check (each cheaper than the allocation it saves; for a small weight, dearer than it)."""
    M = magnitudes[name]
    if isinstance(magnitudes, _Later) and W.numel() > _SMALL_DRAW:
        B = fb.laid_out_like(cast(Tensor, M), W).copysign_(W)
        if int(torch.count_nonzero(W)) == W.numel() and not math.isnan(float(W.sum())):
            return B
        return B.abs_().mul_(torch.sign(W))  # torch.sign is 0 at a zero weight and at a NaN
    if W.is_contiguous():  # sign keeps a dense layout: one allocation, two ops
        return torch.sign(W).mul_(M)
    B = torch.empty_strided(W.shape, W.stride(), dtype=W.dtype, device=W.device)
    return torch.sign(W, out=B).mul_(M)



class DirectFeedbackAlignment(_Drawn):
    """Direct feedback alignment (Nøkland, 2016): the node's input gets ``e`` through ``B``.

    ``e`` is the credit at the model's output, flattened per sample to shape
    ``(N, D)`` (several output tensors are concatenated), and ``B`` a fixed
    random projection for each input ``x`` of the node:

    - for a convolution's input (``nn.Conv1d/2d/3d``, ``F.conv*d``, their ATen
      forms), by default **shared over space**, as BioTorch does: ``B`` has the
      shape ``(D, C_in, *kernel)``, and the input's credit is what a convolution
      with weight ``B`` and the layer's stride, padding and dilation sends back
      when ``e`` is broadcast over its whole output grid. Its size does not
      depend on the image's; a grouped convolution's feedback is ungrouped;
      padding is zero padding;
    - otherwise (and with ``spatial=False``) dense: ``B`` has the shape
      ``(D, *x.shape[1:])`` and the input's credit is
      ``(e @ B.reshape(D, -1)).reshape(x.shape)``.

    Routed over the graph, this is Nøkland's rule: the credit at a hidden
    layer's output is what the nodes after it made of their projections (the
    exact VJP of the activation after it, the sum at a fan-out). So besides its
    own projection, a layer whose output feeds an identity skip also receives
    the projections of the layers after the merge, carried back along the
    skip (as in BioTorch); the layer's own parameters get the exact local
    credit given it. The last layer's parameters get the output credit
    itself, as in the paper. A function node's parameter arguments (the weight
    and bias of an exported ``aten.linear``) get their exact credit; only its
    other inputs get projections, and a function node with no weight of two or
    more dimensions that the rule reaches by kind is routed exactly (given by the
    node's name, the rule runs there, as at a module without weights).

    Parameters
    ----------
    seed : int, optional
        Seeds each ``B``, per node and input, drawn on first use when the
        output's size is known. None: the seed of the run.
    init : {"xavier", "kaiming"}
        The law of ``B``, as for :class:`FeedbackAlignment` (fans of the dense form are
        those of the ``(D, prod(x.shape[1:]))`` matrix).
    spatial : bool
        Share a convolution's feedback over space (default) or use the dense form.
    max_bytes : int, optional
        The most the feedback weights of all of one router's nodes under this
        rule may take together (1 GiB); the router refuses, before drawing
        any, when they would take more.

    Notes
    -----
    :attr:`feedback` holds ``B`` (a tuple for several inputs).
    """

    name = "direct_feedback_alignment"

    # set on the bound copy by bind
    _seed: int
    _B: list[Tensor | None]
    _geometry: Geometry | None

    def __init__(
        self, seed: int | None = None, *, init: str = "xavier", spatial: bool = True,
        max_bytes: float | None = fb.MAX_BYTES,
    ) -> None:
        super().__init__(seed, init=init, max_bytes=max_bytes)
        self.spatial = spatial

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed!r}, init={self.init!r}, spatial={self.spatial!r})"

    def bind(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        if _weightless(call):
            return Exact().bind(call, seed, feedback)
        return self.bind_at(call, seed, feedback)

    def bind_at(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        """This rule at ``call``'s node whatever its weights: the rule needs none of the
        node's own, so given for a node by name it runs at a function node with no weight
        (``torch.tanh``) as at a module with none (``nn.Tanh``)."""
        _weightless(call)  # a weight computed from parameters is still refused
        bound = copy.copy(self)
        bound._seed = seed if self.seed is None else self.seed
        given = feedback if isinstance(feedback, (tuple, list)) else [feedback]
        if feedback is not None:
            _check_direct(call, given)
        bound._B = [B.detach() if isinstance(B, Tensor) else B for B in given] if feedback is not None else []
        bound.feedback = feedback
        bound._geometry = conv_geometry(call) if self.spatial else None
        return bound

    def __call__(self, call: NodeCall, credit: Credit, state: RoutingState) -> Routed:
        inputs, params = exact_parameters(call, credit)
        e = _flat_output_credit(state.output_credit)
        if e is None:
            return inputs, params
        for i, x in enumerate(call.inputs):
            if not call.wants(i) or i in call.param_inputs:
                continue
            if x.dim() == 0 or x.shape[0] != e.shape[0]:
                raise FxnxValueError(
                    f"direct feedback alignment at node {call.name!r}: its input {i} has shape "
                    f"{tuple(x.shape)}, whose first dimension is not the output's batch size "
                    f"{e.shape[0]}; route this node another way, e.g. "
                    f"rules={{{call.name!r}: Exact()}}"
                )
            inputs[i] = self.sent(call, i, e, x.shape, x.dtype)
        return inputs, params

    def _spatial(self, i: int) -> bool:
        """Whether input ``i`` gets feedback shared over space (a convolution's data input)."""
        return i == 0 and self._geometry is not None

    def drawn(self, i: int) -> bool:
        """Whether input ``i``'s ``B`` exists (given, or drawn on an earlier step)."""
        return i < len(self._B) and self._B[i] is not None

    def feedback_shape(self, i: int, d: int, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of ``B`` for input ``i`` of shape ``shape``, with ``d`` output features."""
        if self._spatial(i):
            assert self._geometry is not None  # _spatial(i) holds only with a geometry
            return (d, shape[1], *self._geometry.kernel)
        return (d, *shape[1:])

    def sent(self, call: NodeCall, i: int, e: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """The credit input ``i`` (of ``shape``) gets for output credit ``e`` of shape ``(N, D)``."""
        return self.sender(call, i, e, shape, dtype)(e)

    def sender(
        self, call: NodeCall, i: int, e: Tensor, shape: torch.Size, dtype: torch.dtype
    ) -> Callable[[Tensor], Tensor]:
        """What :meth:`sent` computes, as a function of ``e`` alone: valid for every output
        credit of ``e``'s dtype and width, and inputs of ``shape`` and ``dtype`` (``B``,
        drawn here on first use, never changes)."""
        B = self.projection(call, i, e, shape, dtype)
        # B's dtype or the credit's, the wider: B drawn in float32, then the model made float64
        # (model.double()), projects in float64, as the layer's own credit is computed
        work = torch.promote_types(B.dtype, e.dtype)
        if self._spatial(i):
            geometry = self._geometry
            assert geometry is not None  # _spatial(i) holds only with a geometry
            return lambda e: geometry.credit(e.to(work), B.to(work), shape).to(dtype)
        matrix = B.reshape(e.shape[1], -1)
        if B.dtype == e.dtype == dtype:
            return lambda e: (e @ matrix).reshape(shape)
        return lambda e: (e.to(work) @ matrix.to(work)).reshape(shape).to(dtype)

    def projection(self, call: NodeCall, i: int, e: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """``B`` for input ``i`` of ``call``'s node (see :meth:`feedback_shape`), for output
        credit ``e`` of shape ``(N, D)``: drawn on first use, then the same every step."""
        want = self.feedback_shape(i, e.shape[1], shape)
        while len(self._B) <= i:
            self._B.append(None)
        B = self._B[i]
        if B is None:
            # In the layer's own dtype where it has a weight: not the credit's or the input's
            # under autocast, which would keep B in bfloat16 for every later step.
            weights = call.own_parameters()
            if weights and weights[0].is_floating_point():
                dtype = weights[0].dtype
            like = torch.empty((), dtype=dtype, device=e.device)
            # the dense form's law sees the (D, input size) matrix it is
            drawn = want if self._spatial(i) else (want[0], math.prod(want[1:]))
            B = self._draw(call, self._seed, f"{call.name}.dfa{i}", drawn, like).reshape(want)
            self._B[i] = B
            self.feedback = B if len(self._B) == 1 else tuple(self._B)
        elif tuple(B.shape) != want:
            layout = (
                "output features, input channels, then the kernel's size: feedback shared over space; "
                "DirectFeedbackAlignment(spatial=False) takes the dense form"
                if self._spatial(i)
                else "output features, then the input's shape without its batch dimension"
            )
            raise FxnxValueError(
                f"direct feedback alignment at node {call.name!r}: feedback for input {i} has "
                f"shape {tuple(B.shape)}, expected {want} ({layout})"
            )
        return B


def _weightless(call: NodeCall) -> bool:
    """A function node with no weight (``x @ y`` of two activations, as in attention): a
    feedback rule's preset matches its kind, but it is routed exactly. One whose weight is
    computed from parameters in a way no feedback weight stands for (``weight_norm``) is
    refused: routed exactly, it would have been backprop where a feedback rule was asked."""
    if call.module is not None or has_weights(call):
        return False
    if call.computed_weights:
        raise FxnxValueError(
            f"node {call.name!r} multiplies by a weight computed from parameters "
            f"({'; '.join(call.computed_weights.values())}), not by a parameter or a view, "
            "reshape, cast or scale of one, so no feedback weight can stand in for it (as under "
            "weight_norm or spectral_norm). Route it exactly, knowing its credit is backprop's "
            f"(rules={{{call.name!r}: fxnx.credit.Exact()}}), or make the weight a parameter"
        )
    return True


def _flat_output_credit(output_credit: Any) -> Tensor | None:
    """The output credit as one ``(N, D)`` matrix, output tensors side by side."""
    parts = [t for t in pytree.tree_flatten(output_credit)[0] if isinstance(t, Tensor)]
    if not parts:
        return None
    if any(t.dim() == 0 or t.shape[0] != parts[0].shape[0] for t in parts):
        raise FxnxValueError(
            "direct feedback alignment needs every output tensor to share a leading batch "
            f"dimension; the output credit has shapes {[tuple(t.shape) for t in parts]}"
        )
    return torch.cat([per_sample(t) for t in parts], 1)


def per_sample(t: Tensor) -> Tensor:
    """``t`` as an ``(N, D)`` matrix, one row per sample (``-1`` would not do for ``N = 0``)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


RuleLike = Rule | Callable[[NodeCall, Credit, RoutingState], Routed]


def rule_name(rule: Any) -> str:
    """The name a rule is reported by."""
    return str(getattr(rule, "name", None) or getattr(rule, "__name__", None) or repr(rule))


def check_rule(rule: Any, where: str) -> None:
    """Refuse what cannot be a rule, naming where it was given."""
    if not callable(rule):
        raise FxnxTypeError(
            f"{where} must be a rule object (fxnx.credit.Exact(), fxnx.credit.FeedbackAlignment(), …) or a "
            f"function rule(call, credit, state), got {type(rule).__qualname__} {rule!r:.60}"
        )
    if isinstance(rule, type):
        raise FxnxTypeError(f"{where} is the class {rule.__qualname__}; pass an instance: {rule.__qualname__}()")
