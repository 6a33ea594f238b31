"""Training with credit routed over the graph: a module whose backward is the routing.

(This module was ``fxnx/credit/engine.py``; the old ``credit/router.py``, which held
:func:`~fxnx.route_credit`, is now :mod:`.collected`.)
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import networkx as nx
import torch
from torch import Tensor, nn

from .._capture import TRACING_LOCK
from .._capture.agree import detached, saves_nothing
from .._capture.fingerprint import Fingerprints, structure
from .._capture.inputs import bind_inputs, qualname
from .._capture.ladder import Capture
from .._capture.options import LeafSpec
from .._capture.reuse import (
    inputs_key,
    kept_on,
    placeholders_for,
    recapture,
    snapshot,
    traced_through,
)
from .._compat import in_backward, in_transform, pytree
from .._contract import validate
from .._errors import FxnxError, FxnxTypeError, FxnxValueError, warn_user
from .._state import attributes_kept, preserved
from . import feedback as fb
from .accumulated import accumulated, reaches
from .compare import cosine_angle, flat
from .faithful import (
    Probe,
    TensorHooks,
    backward_differs,
    check_hooks,
    differs,
    probe,
    warn_traced_hooks,
)
from .graft import Graft, graft
from .learned import check_learning
from .nodecall import NodeCall
from .plan import Plan, check_arguments, compile_plan, swapped_names
from .presets import (
    PRESETS,
    Preset,
    check_kinds,
    check_named,
    lookup,
    preset_of,
    warn_exact_layers,
    warn_unused_kinds,
)
from .result import CreditResult, owned
from .rules import DirectFeedbackAlignment, Exact, Rule, Transport, check_rule, rule_name
from .saved import check_rule_name, decoded, encoded, loaded_state, on_device, router_state
from .transport import feedback_weights

__all__ = ["CreditRouter"]

_EXACT = Exact()
#: A parameter's trainability, read in C for each of a model's parameters at every call.
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_RESULT = "\0result"  # the model's output among the values whose credit backward() reports
#: Where on G the captures checked against the model are noted (capture id -> weak reference).
_CHECKED = "_fxnx_checked"
_SAME_BACKWARD = "_fxnx_same_backward"  # captures whose autograd was found the model's
#: captures to what a run of their model showed: the refusal of the tensor hooks its forward
#: registers (or None), and the type of its output where the graph's is a plain dict
_EAGER = "_fxnx_eager"
#: How many captures' plans (and grafts) a router keeps.
_PLANS_KEPT = 4
_NOT_RUN = object()


class CreditRouter(nn.Module):
    """The model, trained by a learning rule: credit routed over ``G`` inside autograd.

    ``router(*inputs, **kwargs)`` is the model's forward over its captured graph:
    the same output (to feed any loss), buffers (BatchNorm's running statistics)
    updated as ``model(...)`` updates them. Its backward is routing over ``G``:
    ``loss.backward()`` sends credit backward in ``G``'s reverse topological
    order along ``G``'s edges, each node's backward being torch's own for that
    node or its rule's, and adds each trainable parameter's credit into its
    ``.grad``. Everything PyTorch training relies on therefore holds: terms of
    the loss that do not pass through the output (weight decay, regularisers)
    get their exact gradient, several forwards before one backward add up, each
    forward's backward routes that forward (threads included), ``.grad``
    accumulates across backward calls, frozen parameters are left alone, and
    ``DistributedDataParallel(router)``, ``torch.autocast``,
    ``torch.utils.checkpoint`` and optimizers work unchanged. With
    ``rule="exact"`` the router is the model, bit for bit.

    The router is an ``nn.Module`` holding ``model``: ``router.parameters()`` and
    buffers are the model's, and ``router.state_dict()`` holds the model's state and
    the router's own (the seed, each node's rule and feedback weights), which
    ``load_state_dict`` loads into a new router to resume training as it was. The capture of the model and the routing plan are
    made on the first call and reused while the model's structure and the
    inputs' structure stay the same; ``G`` is validated once, here. Where every
    node is routed exactly and no edge of ``G`` is removed, routing *is* autograd's:
    after the first call (which checks that the captured graph computes what the
    model computes), the router's forward is then the model's own, at the cost
    of checking that the model's structure is still the one ``G`` describes.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        The graph :func:`fxnx.convert` made of ``model``, possibly with edges
        removed (an edge removed carries no credit; its value still flows forward).
        The router routes over ``G`` as it is here (``router.G`` is a copy): an edit
        of ``G`` afterwards is not seen; build a new router to route over it.
    model : nn.Module or callable
    rule : str, Rule, Preset or mapping
        A preset name (``"exact"``, ``"feedback_alignment"``, ``"usf"``,
        ``"brsf"``, ``"frsf"``, ``"direct_feedback_alignment"``, ``"kolen_pollack"``,
        ``"weight_mirror"``; see
        ``fxnx.credit.PRESETS``); a rule object, at every weighted layer as a preset puts
        its own (``rule=fxnx.credit.FeedbackAlignment(init="kaiming")``); a :class:`Preset`;
        or a mapping of node kinds to rules (a preset over exact).
    rules : mapping, optional
        Rules that override the preset, keyed by node name (str), module
        class, function, or ``method("name")``.
    seed : int
        Seeds the rules' random feedback weights (each per node).
    feedback : mapping, optional
        Node name to feedback weights to use instead of drawing them (as in
        :attr:`feedback` of another router, or ``CreditResult.feedback``).
    node_credit : bool
        Keep every node's value from the forward, so that
        ``router.backward(..., node_credit=True)`` reports the credit at every
        node (memory: every activation is kept until that backward).
    leaf_modules : optional
        Rarely needed: ``G`` carries the options it was captured with
        (``G.graph["capture_options"]``); these replace the stored ones.
    concrete_args : mapping, optional
        The ``concrete_args`` ``G`` was converted with, if any: they change what the model
        computes, so the ones ``G`` stores are checked against these, never applied.
    fuse : bool
        Route each run of ``nn.Linear`` layers (an MLP's) under a built-in weight-transport
        rule (feedback alignment, sign symmetry, Kolen–Pollack, weight mirrors) or direct
        feedback alignment as one autograd function, which is faster on small, deep models:
        the same credit bit for bit, each parameter's reaching it when the whole run's
        backward is done (its hooks, and DDP's reduction, run then). False keeps one
        autograd function per node of ``G``, as a backward pass that records its own graph
        (``create_graph=True``) through such a run needs. A router with ``node_credit=True``
        never fuses: ``router.backward`` reports every node's credit. Fixed when the router
        is built.

    Raises
    ------
    FxnxValueError, FxnxTypeError
        ``G`` is not a graph of a module-level capture; an unknown preset; a
        preset key that is not a node kind; a rule that is not a rule; a rule
        for a node ``G`` lacks. At the first call: the model's forward is not one
        graph, or a write in place that later nodes read would be lost (see
        :func:`fxnx.route_credit`).

    Examples
    --------
    >>> import torch, fxnx
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> x, y = torch.randn(8, 3), torch.randn(8, 2)
    >>> router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    >>> opt = torch.optim.SGD(router.parameters(), lr=0.1, weight_decay=1e-4)
    >>> for step in range(3):
    ...     opt.zero_grad()
    ...     loss = torch.nn.functional.mse_loss(router(x), y)
    ...     loss.backward()
    ...     opt.step()
    >>> sorted(router.feedback)
    ['_0', '_2']
    """

    def __init__(
        self,
        G: nx.MultiDiGraph,
        model: nn.Module | Callable[..., Any],
        rule: str | Rule | Mapping[Any, Any] = "exact",
        *,
        rules: Mapping[Any, Any] | None = None,
        seed: int = 0,
        feedback: Mapping[str, Any] | None = None,
        node_credit: bool = False,
        leaf_modules: Iterable[LeafSpec] = (),
        concrete_args: Mapping[str, Any] | None = None,
        fuse: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(G, nx.MultiDiGraph):
            raise FxnxTypeError(
                f"G must be the networkx.MultiDiGraph from fxnx.convert, got {type(G).__qualname__}"
            )
        self.preset = _preset(rule)
        validate(G)  # the graph contract: acyclic, every attribute of the right type
        check_arguments(G)  # and one edge per argument
        route = G.graph.get("capture", "auto")
        if route == "make_fx" or G.graph.get("level") == "joint":
            raise FxnxValueError(
                f"G was captured with make_fx (level={G.graph.get('level')!r}), whose inputs are "
                "the parameters themselves; route credit over a graph from convert(model, x) at "
                "level='module' (symbolic_trace, export or draft_export)"
            )
        overrides = dict(rules or {})
        for key, value in overrides.items():
            check_rule(value, f"rules[{key!r}]")
        for kind, value in self.preset.items():
            check_rule(value, f"the rule for {kind!r}")
        self._by_name = {k: v for k, v in overrides.items() if isinstance(k, str)}
        self._by_kind = {k: v for k, v in overrides.items() if not isinstance(k, str)}
        check_kinds(self._by_kind, "rules")
        seed = fb.check_seed(seed, "CreditRouter")
        if feedback is not None and not isinstance(feedback, Mapping):
            raise FxnxTypeError(
                f"feedback must map node names to feedback weights (router.feedback, "
                f"CreditResult.feedback), got {type(feedback).__qualname__}"
            )
        unknown = sorted(set(self._by_name) - set(G))
        unknown_fb = sorted(set(feedback or {}) - set(G))
        if unknown or unknown_fb:
            what = "rules" if unknown else "feedback"
            raise FxnxValueError(f"{what} name nodes that G does not have: {unknown or unknown_fb}")
        if isinstance(model, nn.Module):
            self.model = model
        else:  # a plain callable: not a submodule
            object.__setattr__(self, "model", model)
        self.G = snapshot(G, _CHECKED, _SAME_BACKWARD, _EAGER)
        self.seed = seed
        self.node_credit = bool(node_credit)
        self._fuse = bool(fuse)
        self._given = dict(feedback or {})
        #: node name to its state loaded by load_state_dict, bound at the next call (.saved)
        self._loaded: dict[str, dict[str, Any]] = {}
        # G carries the options it was captured with; these, when given, replace them.
        self._capture: dict[str, Any] = {"leaf_modules": leaf_modules, "concrete_args": concrete_args}
        self._plans: dict[int, Plan] = {}
        self._grafts: dict[tuple[int, bool], Graft] = {}
        self._bound: dict[tuple[str, int, int], Any] = {}
        self._plan: Plan | None = None
        self._fast: dict[bool, tuple[Any, Graft, Capture]] = {}
        self._tail: list[Any] | None = None  # placeholders past the positional inputs
        #: Number of positional inputs to the keywords the model's own forward is called
        #: with besides them (what convert fixes), where binding leaves the inputs as given.
        self._fixed: dict[int, dict[str, Any]] = {}
        self._watched: dict[int, list[nn.Module]] = {}
        self._fingerprints = Fingerprints()  # of the watched modules, walked where they changed
        self._last = threading.local()  # this thread's last forward, for backward()

    @property
    def feedback(self) -> dict[str, Any]:
        """Node name to the feedback weights its rule holds (empty before the first call;
        direct feedback alignment draws its projections on first use; after
        ``load_state_dict``, until the next call, those loaded)."""
        if self._plan is None:
            return {name: kept["feedback"] for name, kept in self._loaded.items() if "feedback" in kept}
        return {
            name: rule.feedback for name, rule in self._plan.rules.items()
            if getattr(rule, "feedback", None) is not None
        }

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's forward on ``inputs``, with the rules in its backward."""
        if not torch.is_grad_enabled():  # nothing to route afterwards: the plain forward
            self._last.run = None
            self._last.why = (
                "the last router(...) call ran under torch.no_grad() (or inference mode), "
                "which records nothing: call it with gradients enabled"
            )
            return self.model(*inputs, **kwargs)
        compiling = torch.compiler.is_compiling()
        if not compiling and in_transform():
            self._refuse_transform()
        grafted = torch.compiler.disable(self.grafted, recursive=True) if compiling else self.grafted
        run, values = grafted(inputs, kwargs, collect=self.node_credit)
        if in_backward() and getattr(self._last, "run", None) is not None:
            self._refuse_redraw(run)
        with TRACING_LOCK:  # other threads' tracing must not patch the modules this run calls
            if run.plain:  # routing is autograd's own: the model's forward, bit for bit
                result = output = self._eager(inputs, kwargs)
                nodes = None
            else:
                if run.collect and run.writes_inputs:
                    _refuse_input_writes(run.writes_inputs)
                first = run.expect is not None
                try:
                    result, output, nodes = (_run_checked_eagerly if compiling else run_checked)(run, self.model, values)
                except BaseException:
                    if first:  # its check against the capture is not done: made again next call
                        self._forget(run)
                    raise
        self._last.run = (run, result, output, nodes)
        return result

    def _refuse_transform(self) -> None:
        """Refuse a forward pass under a ``torch.func`` transform, but the model's own (a
        router whose every node is exact, called once outside the transform): the transforms
        do not carry the rules' autograd functions and saved-tensor hooks, and under ``vmap``
        direct feedback alignment's credit was lost silently."""
        fast = self._fast.get(self.node_credit)
        if fast is not None and fast[1].plain:
            return
        routed = [f"node {name!r} is routed by {rule_name(rule)!r}" for name, rule in (
            self._plan.rules.items() if self._plan else ()) if not isinstance(rule, Exact)]
        why = routed[0] if routed else "its first call (which checks the capture) runs under it"
        raise FxnxValueError(
            f"CreditRouter under a torch.func transform (vmap, grad, jvp, jacrev, jacfwd), and "
            f"{why}: torch.func does not carry a rule's autograd functions and hooks, so its "
            "credit would be lost or exact. For per-sample credit under a rule, route each "
            "sample alone (a batch of one); a router with rule='exact' and no edge removed runs "
            "the model itself and works under torch.func once called outside it (router(x))"
        )

    def _refuse_redraw(self, run: Graft) -> None:
        """Refuse a forward pass run again inside a backward pass (a checkpoint around the
        router that recomputes it there: its first forward ran with gradients, so this one
        replays it) where a rule draws at each forward (brSF): it would route with other
        magnitudes than the first forward drew, and ``feedback`` reports. A reentrant
        checkpoint's first forward runs without gradients and draws nothing: its replay draws."""
        drawing = [e.call.name for e in run.plan.entries if getattr(e.rule, "magnitude", None) == "batch_random"]
        if drawing:
            raise FxnxValueError(
                f"node {drawing[0]!r}: brsf draws fresh magnitudes at each forward pass, and this "
                "forward pass is run again inside the backward pass (torch.utils.checkpoint around "
                "the router, use_reentrant=False), where it would draw them again and route with "
                "others than the forward pass used. Put the checkpoint inside the model (fxnx "
                "traces through it, and the rule reaches the layers in it), use use_reentrant=True, "
                "or use rule 'frsf' or 'usf'"
            )

    def _eager(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The model called on ``inputs`` as its capture was (the keyword arguments convert
        fixes, such as ``use_cache=False``, and the ``concrete_args`` given)."""
        concrete = dict(self._capture["concrete_args"] or {})
        fixed = None if kwargs else self._fixed.get(len(inputs))
        if fixed is not None:  # positional inputs bound as they come: no binding again
            return self.model(*inputs, **fixed, **concrete)
        bound = bind_inputs(self.model, inputs, kwargs, concrete, copy=False)
        if bound is None:
            return self.model(*inputs, **kwargs)
        if not kwargs and len(bound.args) == len(inputs) and all(
            a is b for a, b in zip(bound.args, inputs, strict=True)
        ) and not any(isinstance(v, Tensor) for v in pytree.tree_leaves(bound.kwargs)):
            self._fixed[len(inputs)] = dict(bound.kwargs)  # only what fxnx fixes: use_cache=False
        return self.model(*bound.args, **bound.kwargs, **concrete)

    def backward(  # type: ignore[override]
        self, loss: Tensor | None = None, *, output_credit: Any = None, node_credit: bool = False
    ) -> CreditResult:
        """Route the credit of this thread's last forward, as ``loss.backward()`` would, and
        report it.

        ``loss.backward()`` does the same and is the primary path; this call runs it (every
        leaf the loss reaches gets its ``.grad``, hooks and DDP's reducer fire), and also
        returns what was routed, and takes the credit at the output itself.

        Parameters
        ----------
        loss : tensor, optional
            A scalar; every parameter's credit is ``d(loss)/d(parameter)`` as the
            rules route it (terms that do not pass through the output are exact).
        output_credit : tensor or structure like the output, optional
            The credit at the output itself, instead of ``loss``.
        node_credit : bool
            Report every node's credit too (the router must have been built
            with ``node_credit=True``).

        Returns
        -------
        CreditResult
            Its tensors are its own: what was added to each ``.grad``, not ``.grad``.

        Raises
        ------
        FxnxValueError
            No forward to route (call ``router(x)`` first, once per backward);
            both or neither of ``loss`` and ``output_credit``; a loss that is not
            a scalar or does not depend on the output.
        """
        last = getattr(self._last, "run", None)
        if last is None:
            why = getattr(self._last, "why", "")
            raise FxnxValueError(
                "router.backward needs a forward to route: call output = router(x), compute "
                "the loss from that output, then router.backward(loss) (once per forward)"
                + (f"; {why}" if why else "")
            )
        if (loss is None) == (output_credit is None):
            raise FxnxValueError(
                "router.backward takes either loss or output_credit=…, exactly one of them"
            )
        run, result, output, nodes = last
        if node_credit and nodes is None:
            raise FxnxValueError(
                "router.backward(node_credit=True) needs every node's value from the forward: "
                "build the router with CreditRouter(G, model, ..., node_credit=True)"
            )
        if loss is not None:
            _check_loss(loss)
            roots, grads = [loss], None
        else:
            flat = output_credit_like(result, output_credit)
            pairs = [(t, g) for t, g in zip(pytree.tree_leaves(result), flat, strict=True)
                     if isinstance(t, Tensor) and isinstance(g, Tensor) and t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        params = run.plan.params
        if isinstance(self.model, nn.Module):  # the model as it is now
            live = dict(self.model.named_parameters())
            # A layer the graph calls whole reads its parameters as they are now (one replaced
            # since the plan was made included); the rest are the capture's own.
            params = live if run.plain else {n: live.get(n, p) for n, p in params.items()}
        params = {n: p for n, p in params.items() if p.requires_grad}
        names = [*run.names, _RESULT] if node_credit else [_RESULT]
        outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, Tensor) and t.requires_grad]
        if loss is not None and not reaches(roots, outputs):
            raise FxnxValueError(
                "loss does not depend on the output the last router(...) call returned: compute "
                "it from that output (not from model(x), nor from an earlier call's output)"
            )
        try:  # as loss.backward() runs: every leaf it reaches, hooks and DDP's reducer too
            nodes_got, params_got = accumulated(names, (*nodes, result) if node_credit else (result,), roots, grads, params)
        except RuntimeError as err:
            if "second time" not in str(err):
                raise
            raise FxnxValueError(
                "this forward was already routed: call router(x) again before each "
                "router.backward (once per forward)"
            ) from err
        at_result = nodes_got.pop(_RESULT)
        self._last.run = None
        self._last.why = "router.backward was already called on the last forward"
        if node_credit:
            flat = pytree.tree_leaves(at_result) if at_result is not None else [None] * len(pytree.tree_leaves(result))
            nodes_got[run.plan.entries[-1].call.name] = graph_credit(result, output, flat)
            nodes_got = owned(nodes_got, output_credit)
        used = rules_used(run.plan, nodes_got)
        return CreditResult(
            node_credit=nodes_got, param_credit=params_got, rules=used, rule=self.preset.name,
            feedback=own(self.feedback), output=own(result),
        )

    def alignment(self) -> dict[str, dict[str, float]]:
        """How close each weight-transport node's feedback weights are to its weights.

        For every node whose rule sends credit back through ``B`` in place of ``W``
        (feedback alignment, sign symmetry, Kolen–Pollack, weight mirrors), the angle
        between ``B`` and ``W`` in degrees (all of the node's weights as one vector) and
        the ratio of their norms ``‖B‖ / ‖W‖``: the two measures BioTorch records.
        Cheap (no forward pass); empty before the first call.
        """
        out = {}
        for entry in self._plan.entries if self._plan else []:
            rule = entry.rule
            B = rule.feedback_now(entry.call) if isinstance(rule, Transport) else None
            if not B:
                continue
            W = feedback_weights(entry.call)
            w, b = flat([W[p] for p in B]), flat(list(B.values()))
            assert w is not None and b is not None  # B is not empty: both hold tensors
            _, angle = cosine_angle(w, b)
            out[entry.call.name] = {"angle": angle, "norm_ratio": float(b.norm() / w.norm())}
        return out

    def update_feedback(self, lr: float | None = None, weight_decay: float = 0.0) -> None:
        """Let learned feedback weights learn one step (:class:`~fxnx.credit.KolenPollack`,
        :class:`~fxnx.credit.WeightMirror`); call it once per step, after the optimizer's step (a
        mirror then reflects the ``W`` the next forward runs with; Kolen–Pollack's step reads
        ``W.grad``, which plain SGD's step leaves as it was).

        Parameters
        ----------
        lr, weight_decay : float
            The optimizer's learning rate and weight decay: Kolen–Pollack gives each
            ``B`` the step plain SGD gives ``W`` (weight mirrors use their own rate).

        Raises
        ------
        FxnxValueError
            No node's rule learns its feedback (or none has run yet), or Kolen–Pollack
            without ``lr`` or without any ``W.grad`` (called after ``opt.zero_grad()``).
        """
        learners = {id(rule): rule for rule in self._bound.values() if callable(getattr(rule, "learn", None))}
        if not learners:
            raise FxnxValueError(
                "update_feedback: no node of this router has feedback that learns (rules "
                "'kolen_pollack' and 'weight_mirror' do), or none has run since the router was "
                "built or loaded (load_state_dict): call router(x) first"
            )
        check_learning(learners.values(), lr)
        for rule in learners.values():
            rule.learn(lr, weight_decay)

    def get_extra_state(self) -> Tensor:
        """What ``state_dict()`` holds beside the model's: the seed and each node's rule and
        feedback (:mod:`.saved`, as one ``uint8`` tensor), so that a router loaded with it
        trains on as this one would."""
        return encoded(router_state(self._plan, self._given, self._loaded, self.seed))

    def set_extra_state(self, state: Any) -> None:
        """Take what :meth:`get_extra_state` gave (``load_state_dict``): checked first, then
        every rule bound again with it at the next call."""
        self.seed, self._loaded = loaded_state(decoded(state), self.G, self._plan)
        # every capture, plan and bound rule made so far is dropped: the next call makes them
        # again, binding each node's rule with what was loaded (then dropped: a layer replaced
        # later is bound afresh, as in the router saved)
        self._bound, self._plans, self._grafts, self._fast = {}, {}, {}, {}
        self._plan, self._tail, self._fixed = None, None, {}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, whose error for a state without the router's own
        (a model's ``state_dict``) says also what it lacks and what loads it."""
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as error:
            if not strict or "_extra_state" in state_dict:
                raise
            raise RuntimeError(
                f"{error}\n\tThe state has no router state ('_extra_state': the seed and each node's "
                "rule and feedback weights), as a model's own state_dict has none: load a model's "
                "state_dict into router.model, or this one with strict=False, which keeps the "
                "router's own feedback"
            ) from None

    def grafted(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None, *, collect: bool) -> tuple[Graft, list[Any]]:
        """The router's forward for these inputs (capture and graft reused or made) and the
        values to call it with.

        The last capture is reused at once while a cheap guard holds: the inputs' structure,
        which parameters are trainable, and the fingerprint of every module the capture
        traced through (every attribute by value; modules the graph calls run their own code
        live). Otherwise the model's whole structure is keyed again
        (:func:`~fxnx._capture.reuse.recapture`), capturing again where it changed.
        """
        run: Graft | None
        fast = self._fast.get(collect)
        if fast is not None:
            guard, run, cap = fast
            if guard == self._guard(cap, inputs, kwargs, plain=run.plain):
                if run.plain:
                    return run, []
                if not collect and not kwargs and self._tail is not None:
                    return run, [*inputs, *self._tail]
                # not None: the guard holds, so these inputs bind as the last ones did
                return run, cast(list[Any], placeholders_for(cap, self.model, inputs, kwargs, copy=collect))
        cap = recapture(self.G, self.model, inputs, kwargs, **self._capture)
        if cap.varies:
            raise FxnxValueError(
                f"credit cannot be routed over {qualname(self.model)}: {cap.varies}. Credit "
                "over one such graph would be credit for another forward than the one that "
                "runs. Call model.eval() (layer drop and stochastic depth are off in eval "
                "mode), or make the choice with tensor operations (as torchvision's "
                "StochasticDepth does), and convert it again"
            )
        key = (id(cap.gm), collect)
        run = self._grafts.get(key)
        if run is None:
            plan = self._plans.get(id(cap.gm))
            if plan is None:
                before = set(self._bound)
                plan = compile_plan(self.G, cap.gm, self.model, self._choose)
                self._refuse_swapped(plan, before)
                self._loaded = {}  # bound into the plan's rules (_choose)
                # a few captures' plans are kept (inputs may alternate between captures, as
                # with and without requires_grad for a graph specialised to its inputs); each
                # holds its capture's graph, so no id is reused while it is kept
                self._plans[id(cap.gm)] = plan
                while len(self._plans) > _PLANS_KEPT:
                    del self._plans[next(iter(self._plans))]
                self._grafts = {k: kept for k, kept in self._grafts.items() if k[0] in self._plans}
                self._warn_if_unused(plan)
            # (a graph that follows the example's values is compared at every call, below)
            seen = self._probe(plan, cap, inputs, kwargs, compare=not cap.reads_values)
            run = graft(plan, seed=self.seed, collect=collect, fused=self._fuse, probe=seen)
            run.expect = seen  # its first run is checked against the captured graph's output
            self._grafts[key] = run
        if cap.reads_values and not run.plain:  # its branches may not be these inputs'
            self._probe(run.plan, cap, inputs, kwargs, every_call=True)
        if not run.plain:  # (the fast path, set below, skips this: a refusal comes back here)
            self._as_the_model_ran(run, cap)
        if cap.unroutable and not run.plain:
            self._check_backward(run.plan, cap, inputs, kwargs)
        self._plan = run.plan
        self._fixed = {}  # bound afresh for this capture
        if isinstance(self.model, nn.Module):
            cap_ = dataclasses.replace(cap, model=None, inputs=None)
            self._watched[id(cap.gm)] = traced_through(cap.gm, self.model)
            if not run.plain:  # the guard holds the hook tables: a hook added comes back here
                check_hooks(self.model, self._watched[id(cap.gm)])
                warn_traced_hooks(self.model, self._watched[id(cap.gm)])
            if run.plain or not cap.reads_values:  # else every call is checked, above
                self._fast[collect] = (self._guard(cap_, inputs, kwargs, plain=run.plain), run, cap_)
            if not collect:
                # Inputs of this structure bind to the first placeholders one by one, in order,
                # and the rest take no tensor (defaults, fixed keywords): later calls pass the
                # inputs on, followed by the same rest, without binding them (the guard keeps
                # the structure).
                bound = placeholders_for(cap_, self.model, inputs, kwargs, copy=False)
                n = len(inputs)
                self._tail = bound[n:] if (
                    not kwargs and bound is not None and len(bound) >= n
                    and all(a is b for a, b in zip(bound[:n], inputs, strict=True))
                    and not any(isinstance(v, Tensor) for v in pytree.tree_leaves(bound[n:]))
                ) else None
        # The model's own inputs, as later calls pass them (the capture's are copies: a model
        # that writes into its input must write into the caller's, as model(x) does)
        values = placeholders_for(cap, self.model, inputs, kwargs, copy=collect)
        return run, values if values is not None else (cap.inputs or [])

    def _refuse_swapped(self, plan: Plan, bound: set[Any]) -> None:
        """Refuse a plan compiled while the model's parameters are tensors swapped in for
        this call (``torch.func.functional_call``) where a rule other than exact routes a node,
        dropping the rules it bound (``bound``: the keys bound before): a rule binds to its
        node's parameters, and these are the caller's for one call. The router is left as it
        was, to be called on the model's own parameters."""
        swapped = swapped_names(self.model)
        routed = next((name for name, rule in plan.rules.items() if not isinstance(rule, Exact)), None)
        if not swapped or routed is None:
            return
        for key in set(self._bound) - bound:
            del self._bound[key]
        raise FxnxValueError(
            f"node {routed!r} is routed by {rule_name(plan.rules[routed])!r}, and this first call "
            f"of the router for these inputs runs on tensors swapped in for the parameters "
            f"{swapped[:4]}{' …' if len(swapped) > 4 else ''} (torch.func.functional_call does "
            "this), where the router binds its rules to the model's own parameters. Call "
            "router(...) once on the model's own parameters first (rules that put feedback "
            "weights in place of a layer's weights then still need them)"
        )

    def _as_the_model_ran(self, run: Graft, cap: Capture) -> None:
        """What the model's own run showed (:meth:`_probe`): refuse a tensor hook its forward
        registers, warn of attributes it sets on the model (which the graph's run does not),
        and return the model's output type where the graph's is a plain dict."""
        eager = _noted(self.G, _EAGER, cap.gm)
        if eager is None:
            return
        refusal, run.rebuild, changed = eager
        if refusal is not None:
            raise FxnxValueError(refusal)
        if changed:
            warn_user(
                f"{qualname(self.model)}'s forward sets {', '.join(map(repr, changed[:4]))}"
                f"{' …' if len(changed) > 4 else ''} on the model, which a run of its captured "
                "graph does not: where this router runs the graph, they keep the values they had "
                "before the call (a value kept for a loss term, such as an auxiliary loss, would "
                "be stale). Return such values from forward, or train with rule='exact' and "
                "node_credit=False, which runs the model's own forward"
            )

    def _forget(self, run: Graft) -> None:
        """Drop ``run``, whose first run failed: the next call makes and checks it again."""
        self._grafts = {key: kept for key, kept in self._grafts.items() if kept is not run}
        self._fast = {key: kept for key, kept in self._fast.items() if kept[1] is not run}

    def _probe(self, plan: Plan, cap: Capture, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None,
               *, compare: bool = True, every_call: bool = False) -> Probe:
        """One run of the captured graph without gradients (:func:`.faithful.probe`: what it
        writes where, and its output), checked against ``model(...)`` (where ``compare``)
        once per capture, or at ``every_call`` for a graph whose branches followed the
        example's tensor values (``draft_export``'s): those of other inputs may differ.

        Nothing changes: buffers and the random state are restored after each run, and both
        run on copies of the inputs, so the run that follows draws the same random numbers.
        """
        model = self.model
        values = placeholders_for(cap, model, inputs, kwargs, copy=True)
        with torch.no_grad(), preserved(model), attributes_kept(model) as graph_sets, TRACING_LOCK:
            seen = probe(plan.gm, values or [])
        if not compare or (not every_call and _noted(self.G, _CHECKED, cap.gm)):
            return seen
        run_model = self._on_copies(inputs, kwargs)
        if run_model is None:
            return seen
        spy, changed = TensorHooks(), list[str]()
        try:  # with gradients, as the model runs when called (if h.requires_grad: h.register_hook),
            # saving nothing for a backward that never comes (nor into a checkpoint around us)
            with torch.enable_grad(), saves_nothing(), spy:
                eager = detached(run_model(changed))
        except Exception:  # the graph runs where the model does not: nothing to compare
            eager = _NOT_RUN
        rebuild = None if eager is _NOT_RUN else rebuilt_as(seen.output, eager)
        _note(self.G, _EAGER, cap.gm, (spy.refusal(qualname(model)), rebuild, [name for name in changed if name not in graph_sets]))
        if eager is _NOT_RUN:
            return seen
        problem = differs(seen.output, eager)
        if problem is not None and cap.reads_values:
            raise FxnxValueError(
                f"the graph {cap.method} captured from {qualname(model)} does not compute what "
                f"the model computes on these inputs ({problem}): its control flow read tensor "
                f"values ({cap.reads_values}), and the graph follows the branches the example "
                "input took, not those of these inputs, so credit over it would be credit for "
                "another forward. Make the branch a tensor operation (torch.where, torch.cond), "
                "convert the model with an input that takes this branch, or train with "
                "rule='exact' and node_credit=False, which runs the model's own forward"
            )
        if problem is not None:
            raise FxnxValueError(
                f"the graph captured from {qualname(model)} does not compute what the model "
                f"computes on these inputs ({problem}), so credit over it would be credit for "
                "another forward. The model's forward is not one graph: it changes from call "
                "to call (a random choice in Python, such as skipping layers at random in "
                "training mode), or the model changes itself as it runs. Call model.eval() "
                "(layer drop and stochastic depth are off in eval mode), or call the model "
                "once before converting it (a warm-up call), and convert it again"
            )
        _note(self.G, _CHECKED, cap.gm)
        return seen

    def _on_copies(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> Callable[..., Any] | None:
        """The model's forward on copies of ``inputs``, bound as its capture was, changing
        nothing (buffers, attributes and the random state restored): for comparing the graph
        with the model; None where the inputs do not bind. Given a list, the run adds the names
        of the attributes the forward set (:func:`~fxnx._state.attributes_kept`)."""
        model, concrete = self.model, dict(self._capture["concrete_args"] or {})
        bound = bind_inputs(model, inputs, kwargs, concrete)
        if bound is None:
            return None

        def run(changed: list[str] | None = None) -> Any:
            set_: list[str] = []
            try:
                with preserved(model), attributes_kept(model) as set_, TRACING_LOCK:
                    return model(*bound.args, **bound.kwargs, **concrete)
            finally:  # once attributes_kept has named what the forward set
                if changed is not None:
                    changed.extend(set_)

        return run

    def _check_backward(self, plan: Plan, cap: Capture, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
        """Refuse a graph whose autograd is not the model's (:attr:`Capture.unroutable`: a
        custom autograd Function ``torch.export`` inlined without its backward) where the
        parameters' gradients differ (:func:`.faithful.backward_differs`), once per capture.
        A Function whose backward is its forward's derivative (a memory-efficient GELU)
        agrees to rounding, and its graph is routed."""
        if _noted(self.G, _SAME_BACKWARD, cap.gm):
            return
        model = self.model
        run_model = self._on_copies(inputs, kwargs)
        values = placeholders_for(cap, model, inputs, kwargs, copy=True)

        def graph() -> Any:
            with preserved(model), TRACING_LOCK:
                return torch.fx.Interpreter(plan.gm).run(*values)  # type: ignore[misc]

        problem = (
            "the model cannot be run on these inputs to compare" if run_model is None or values is None
            else backward_differs(graph, run_model, plan.params)
        )
        if problem is not None:
            raise FxnxValueError(
                f"credit cannot be routed over the graph {cap.method} captured of "
                f"{qualname(model)}: {cap.unroutable}, and autograd over the graph is not the "
                f"model's ({problem}). Convert with routes='symbolic_trace' where it traces "
                "the model (it keeps a custom autograd Function whole), or train with "
                "rule='exact' and node_credit=False, which runs the model's own forward"
            )
        _note(self.G, _SAME_BACKWARD, cap.gm)

    def _guard(self, cap: Capture, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None,
               *, plain: bool = False) -> Any:
        """What must stay the same for the last capture to be reused. A ``plain`` run is the
        model's own forward under autograd: an attribute's value cannot make it differ from
        autograd, so only what the modules register is compared (a module added, replaced
        or hooked still makes ``G`` another model's), not every value they hold."""
        watched = self._watched.get(id(cap.gm))
        if watched is None:
            return object()  # never equal: key the whole structure again
        params = tuple(map(_REQUIRES_GRAD, self._plan.params.values())) if self._plan else ()
        modules = structure(watched) if plain else self._fingerprints(watched)
        return (inputs_key(inputs, kwargs, shapes=cap.shape_specialised), params, modules)

    def _choose(self, call: NodeCall) -> tuple[Any, str]:
        """The rule bound to ``call``'s node: the user's by name, by kind, the preset's, exact."""
        template = self._by_name.get(call.name)
        named = template is not None
        if named:
            check_named(call, template)  # a feedback rule by name: the node must have weights
        else:
            template = lookup(call, self._by_kind) or self.preset.lookup(call) or _EXACT
        key = (call.name, id(template), id(call.module))
        bound = self._bound.get(key)
        if bound is None:
            loaded = self._loaded.get(call.name)
            given = self._given.get(call.name) if loaded is None else loaded.get("feedback")
            if loaded is not None and given is not None:
                given = on_device(given, self._device_of(call))
            try:
                bound = self._bind(template, call, named, given)
            except FxnxError:
                if loaded is not None:  # a state saved under another rule: that is the cause
                    check_rule_name(call.name, loaded, template)
                raise
            if loaded is not None:
                check_rule_name(call.name, loaded, bound)
                if isinstance(bound, Rule):
                    bound.set_extra_state(dict(loaded.get("extra", {})))
            self._bound[key] = bound
        return bound, rule_name(bound)

    def _bind(self, template: Any, call: NodeCall, named: bool, given: Any) -> Any:
        """``template`` bound to ``call``'s node with the feedback ``given`` (or None)."""
        if isinstance(template, DirectFeedbackAlignment) and named:
            return template.bind_at(call, self.seed, given)  # as at nn.Tanh, not exact
        if isinstance(template, Rule):
            return template.bind(call, self.seed, given)
        if given is not None:
            raise FxnxValueError(
                f"feedback was given for node {call.name!r}, but its rule "
                f"{rule_name(template)!r} is a function, which takes no feedback weights"
            )
        return template

    def _device_of(self, call: NodeCall) -> torch.device:
        """Where ``call``'s node keeps its feedback: on its weights' device (else the model's)."""
        own = call.own_parameters()
        return own[0].device if own else next((p.device for p in self.parameters()), torch.device("cpu"))

    def _warn_if_unused(self, plan: Plan) -> None:
        last = plan.entries[-1]
        if plan.params and last.call.sources and len(last.cut) == len(last.call.sources):
            warn_user(
                f"every edge into the output node {last.call.name!r} was removed from G, and an "
                "edge removed carries no credit, so no parameter gets credit from the output: "
                "loss.backward() on it alone fails as on a detached tensor. Keep an edge into "
                "the output"
            )
        calls = [entry.call for entry in plan.entries]
        warn_unused_kinds(self._by_kind, calls, "rules")
        warn_unused_kinds(self.preset.added, calls, f"rule {self.preset.name!r}")
        credited = {
            call.name: any(str(d.get("dtype", "")).startswith(("torch.float", "torch.bfloat", "torch.complex"))
                           for *_, d in self.G.in_edges(call.name, data=True))
            for call in calls if call.name in self.G
        }
        warn_exact_layers(self.preset, calls, plan.rules, credited, self._by_kind, self._by_name)
        if not self.preset or self._by_name or self._by_kind:
            return
        if all(isinstance(rule, Exact) for rule in plan.rules.values()):
            warn_user(
                f"rule {self.preset.name!r} applies to no node of this model; every node is "
                "routed exactly"
            )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise FxnxTypeError(
            "a CreditRouter cannot be pickled or copied (it holds its capture and this "
            "thread's last forward): save router.state_dict() (the model's and each node's "
            "feedback weights), and load it into a new CreditRouter(G, model, rule)"
        )


def _noted(G: nx.MultiDiGraph, slot: str, gm: Any) -> Any:
    """What was noted for the capture ``gm`` on ``G`` under ``slot`` (True: checked once
    already), or None."""
    entry = kept_on(G, slot).get(id(gm))
    return entry[1] if entry is not None and entry[0]() is gm else None


def _note(G: nx.MultiDiGraph, slot: str, gm: Any, value: Any = True) -> None:
    """Note ``value`` for the capture ``gm`` on ``G`` under ``slot``, forgetting captures
    since dropped."""
    noted = kept_on(G, slot)
    for key in [k for k, (ref, _) in noted.items() if ref() is None]:
        del noted[key]
    noted[id(gm)] = (weakref.ref(gm), value)


def own(value: Any) -> Any:
    """``value`` with a copy of each tensor in it, for a result to hold: the feedback weights
    (learned ones change in place as training goes), the output (a view of the inputs or a
    parameter, where the model returns one, and the caller's own output tensor)."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, value)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__qualname__
        raise FxnxValueError(
            f"loss must be a scalar tensor, got {what}; for credit of another shape, pass "
            "router.backward(output_credit=...)"
        )
    if not loss.requires_grad:
        raise FxnxValueError(
            "loss does not depend on the output the last router(...) call returned: compute it "
            "from that output (not from model(x), nor from an earlier call's output)"
        )


def rules_used(plan: Plan, node_credit: Mapping[str, Any] | None) -> dict[str, str]:
    """The rule of each computing node (that received credit, where that is known)."""
    return {
        e.call.name: e.rule_name for e in plan.entries
        if (e.rule is not None or e.call.op == "output")
        and (not node_credit or node_credit.get(e.call.name) is not None)
    }


def rebuilt_as(output: Any, eager: Any) -> type | None:
    """The type of the model's own output ``eager`` where the graph's ``output`` is a plain
    dict of the same keys, in order, and ``eager`` a dict of another type (a Hugging Face
    ``ModelOutput`` a symbolic trace records as a dict): the router returns that type, as
    the model does. None where the graph's output is the model's structure."""
    if type(output) is not dict or not isinstance(eager, dict) or type(eager) is dict:
        return None
    if list(output) != list(eager) or not all(isinstance(k, str) for k in output):
        return None
    return type(eager)


def graph_credit(result: Any, output: Any, flat: list[Any]) -> Any:
    """Credit for each leaf of ``result`` (``tree_flatten`` order) in the structure of
    ``output``, what the graph's output node took (a flat tuple for ``torch.export``
    graphs, whose codegen rebuilds the model's structure from the same tensors)."""
    leaves, spec = pytree.tree_flatten(result)
    if result is output:
        return pytree.tree_unflatten(list(flat), spec)
    where = {id(t): k for k, t in enumerate(leaves) if isinstance(t, Tensor)}
    out_leaves, out_spec = pytree.tree_flatten(output)
    return pytree.tree_unflatten(
        [flat[where[id(t)]] if isinstance(t, Tensor) and id(t) in where else None for t in out_leaves],
        out_spec,
    )


def run_checked(run: Graft, model: Any, values: list[Any]) -> tuple[Any, Any, Any]:
    """``run(values)``; where it fails, the node that fails is found (by a run without
    gradients, which changes nothing) and named in the error."""
    try:
        return run(values)
    except FxnxError:
        raise
    except Exception as err:
        with torch.no_grad(), preserved(model):
            run.probe(values)  # raises the error naming the node, where a node fails
        raise err


def _refuse_input_writes(writes: tuple[tuple[str, str], ...]) -> None:
    """Refuse a router with ``node_credit=True`` whose model writes into its input: it runs
    on copies of the inputs (each input's credit a leaf of its own), so the caller's tensor
    would not be written as ``model(x)`` writes it."""
    node, placeholder = writes[0]
    raise FxnxValueError(
        f"node {node!r} writes in place into the model's input {placeholder!r}: a router built with "
        "node_credit=True runs on copies of its inputs (to report each input's credit), so your "
        "tensor would not be written as model(x) writes it. Build the router with "
        "node_credit=False, or write out of place in the model (nn.ReLU(inplace=False)); "
        "fxnx.route_credit reports every node's credit and never writes into your tensors"
    )


# Under torch.compile (the router compiled, or a model holding it): the capture, its guard
# and a routed run go eagerly, a graph break each. Traced, the write counters the routed
# nodes check (of B, W and what they save) would be read at trace time, not when they run,
# and every step refused; the rules' Python state (a tap's places reached, brSF's draws)
# would be replayed, not run. A plain run (every node exact) is the model's forward, compiled.
_run_checked_eagerly = torch.compiler.disable(run_checked, recursive=True)


def _preset(rule: Any) -> Preset:
    if isinstance(rule, str):
        if rule not in PRESETS:
            raise FxnxValueError(
                f"unknown rule {rule!r}; known rules: {', '.join(PRESETS)}"
            )
        return PRESETS[rule]
    if isinstance(rule, Preset):
        return rule
    if isinstance(rule, Mapping):
        return Preset("custom", rule)
    if isinstance(rule, Rule):
        return preset_of(rule)
    raise FxnxTypeError(
        f"rule must be a preset name ({', '.join(PRESETS)}), a rule object (a fxnx.credit.Rule, "
        f"for every weighted layer), a fxnx.credit.Preset or a mapping of node kinds to rules, "
        f"got {type(rule).__qualname__}"
    )


def _by_key(output: Any, given: Any, where: str) -> Any:
    """``given`` with each mapping's entries in the order of the output's keys (pytree flattens
    a dict in its own order, so ``{"aux": ..., "logits": ...}`` would pair with the outputs by
    position, each credit on the other's output); a tuple or list for a mapping output pairs
    with its values in order (a Hugging Face ``ModelOutput`` is indexed so)."""
    if isinstance(output, Mapping) and isinstance(given, Mapping):
        if set(given) != set(output):
            raise FxnxValueError(
                f"{where} has keys {', '.join(sorted(map(repr, given)))}, the output "
                f"{', '.join(sorted(map(repr, output)))}: "
                "give one credit per output, by its key (None for no credit)"
            )
        return {k: _by_key(v, given[k], f"{where}[{k!r}]") for k, v in output.items()}
    if isinstance(output, (list, tuple)) and isinstance(given, (list, tuple)) and len(output) == len(given):
        return [_by_key(o, g, f"{where}[{i}]") for i, (o, g) in enumerate(zip(output, given, strict=True))]
    return given


def output_credit_like(output: Any, given: Any) -> list[Any]:
    """``given`` checked against the output's structure and shapes, as one credit per leaf of
    ``output`` (``tree_flatten`` order); None means ones."""
    if given is None:
        complex_ = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor) and t.is_complex()]
        if complex_:
            raise FxnxValueError(
                f"the model's output is complex ({complex_[0].dtype}), and autograd takes no "
                "implicit credit for a complex output (output.sum() is not real): pass "
                "output_credit= a complex tensor like the output (or route a real function "
                "of it, such as torch.view_as_real)"
            )
        return [
            torch.ones_like(t) if isinstance(t, Tensor) and t.is_floating_point() else None
            for t in pytree.tree_leaves(output)
        ]
    out_flat, spec = pytree.tree_flatten(output)
    given_flat, given_spec = pytree.tree_flatten(_by_key(output, given, "output_credit"))
    if len(out_flat) != len(given_flat):
        raise FxnxValueError(
            f"output_credit must have the structure of the model's output ({spec}), "
            f"got {given_spec}"
        )
    for i, (out, g) in enumerate(zip(out_flat, given_flat, strict=True)):
        where = "output_credit" if len(out_flat) == 1 else f"output_credit[{i}]"
        if g is not None and not isinstance(g, Tensor):
            want = (
                f"a tensor of shape {tuple(out.shape)} like the output, or None for no credit"
                if isinstance(out, Tensor) else "None (that output is not a tensor)"
            )
            raise FxnxTypeError(
                f"{where} must be {want}, got {type(g).__qualname__} {g!r:.60}; for a constant, "
                "pass torch.full_like(output, value)"
            )
        if isinstance(g, Tensor) and not isinstance(out, Tensor):
            raise FxnxTypeError(f"{where} is a tensor, but that output is {type(out).__qualname__}")
        if not (isinstance(out, Tensor) and isinstance(g, Tensor)):
            continue
        if g.shape != out.shape:
            raise FxnxValueError(
                f"{where} has shape {tuple(g.shape)}, the output {tuple(out.shape)}"
            )
        if g.is_complex() != out.is_complex() or not (g.is_floating_point() or g.is_complex()):
            raise FxnxTypeError(
                f"{where} has dtype {g.dtype}, the output {out.dtype}: credit must be "
                "complex for a complex output and real floating point for a real one"
            )
        if g.device != out.device:
            raise FxnxValueError(
                f"{where} is on {g.device}, the output on {out.device}: move it with "
                f"output_credit.to({str(out.device)!r})"
            )
    return [g.to(out.dtype) if isinstance(g, Tensor) else g for out, g in zip(out_flat, given_flat, strict=True)]
