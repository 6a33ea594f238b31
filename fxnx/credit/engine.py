"""Training with credit routed over the graph: a router built once, used every step."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import Tensor, nn

from .._compat import pytree
from ..capturing import TRACING_LOCK
from ..capturing.options import LeafSpec
from ..capturing.reuse import recapture
from ..contract import validate
from ..errors import FxnxTypeError, FxnxValueError
from .plan import Plan, Tape, compile_plan
from .presets import PRESETS, Preset, lookup
from .record import NodeCall
from .result import CreditResult
from .rules import Exact, RoutingState, Rule, check_rule, rule_name

__all__ = ["CreditRouter"]

_EXACT = Exact()


class CreditRouter:
    """Train ``model`` with credit routed over its graph ``G`` by a learning rule.

    ``router(*inputs, **kwargs)`` is the model's forward: it returns the model's
    output (to feed any loss) and updates buffers (BatchNorm's running
    statistics) as ``model(...)`` does, in the model's current train/eval mode.
    ``router.backward(loss)`` then routes ``d(loss)/d(output)`` backward over
    ``G`` and adds each trainable parameter's credit into its ``.grad``, as
    ``loss.backward()`` would; frozen parameters are left alone. With
    ``rule="exact"`` this is backpropagation: training with the router is
    training with autograd, bit for bit.

    The capture of the model and the routing plan (visiting order, each node's
    bound rule, edge matching, the order of sums) are made on the first call and
    reused while the model's structure and the inputs' structure stay the same;
    ``G`` is validated once, here. Build a new router after editing ``G``.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        The graph :func:`fxnx.convert` made of ``model``, possibly with edges
        removed (an edge removed carries no credit).
    model : nn.Module or callable
    rule : str, Preset or mapping
        A preset name (``"exact"``, ``"feedback_alignment"``, ``"usf"``,
        ``"brsf"``, ``"frsf"``, ``"direct_feedback_alignment"``; see
        ``fxnx.PRESETS``), a :class:`Preset`, or a mapping of node kinds to
        rules (a preset over exact).
    rules : mapping, optional
        Rules that override the preset, keyed by node name (str), module
        class, function, or ``method("name")``.
    seed : int
        Seeds the rules' random feedback weights (each per node).
    feedback : mapping, optional
        Node name to feedback weights to use instead of drawing them (as in
        :attr:`feedback` of another router, or ``CreditResult.feedback``).
    leaf_modules, concrete_args
        Rarely needed: ``G`` carries the options it was captured with
        (``G.graph["capture_options"]``), and these replace the stored ones;
        give ``concrete_args`` again only where they were not plain data.

    Raises
    ------
    FxnxValueError, FxnxTypeError
        ``G`` is not a graph of a module-level capture; an unknown preset; a
        rule that is not a rule; a rule for a node ``G`` lacks.

    Examples
    --------
    >>> import torch, fxnx
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> x, y = torch.randn(8, 3), torch.randn(8, 2)
    >>> router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> for step in range(3):
    ...     opt.zero_grad()
    ...     loss = torch.nn.functional.mse_loss(router(x), y)
    ...     res = router.backward(loss)
    ...     opt.step()
    >>> sorted(router.feedback), res.rules["_0"]
    (['_0', '_2'], 'feedback_alignment')
    """

    def __init__(
        self,
        G: nx.MultiDiGraph,
        model: nn.Module | Callable[..., Any],
        rule: str | Mapping[Any, Any] = "exact",
        *,
        rules: Mapping[Any, Any] | None = None,
        seed: int = 0,
        feedback: Mapping[str, Any] | None = None,
        leaf_modules: Iterable[LeafSpec] = (),
        concrete_args: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(G, nx.MultiDiGraph):
            raise FxnxTypeError(
                f"G must be the networkx.MultiDiGraph from fxnx.convert, got {type(G).__qualname__}"
            )
        self.preset = _preset(rule)
        validate(G)  # the graph contract: acyclic, every attribute of the right type
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
        unknown = sorted(set(self._by_name) - set(G))
        unknown_fb = sorted(set(feedback or {}) - set(G))
        if unknown or unknown_fb:
            what = "rules" if unknown else "feedback"
            raise FxnxValueError(f"{what} name nodes that G does not have: {unknown or unknown_fb}")
        self.G = G
        self.model = model
        self.seed = seed
        self._given = dict(feedback or {})
        # G carries the options it was captured with; these, when given, replace them.
        self._capture = {"leaf_modules": leaf_modules, "concrete_args": concrete_args}
        self._plans: dict[tuple[int, bool], tuple[fx.GraphModule, Plan]] = {}
        self._bound: dict[tuple[str, int, int], Any] = {}
        self._plan: Plan | None = None
        self._tape: tuple[Plan, Tape] | None = None
        self._why_none = ""  # why there is no forward to route, where known

    @property
    def feedback(self) -> dict[str, Any]:
        """Node name to the feedback weights its rule holds (empty before the first call;
        direct feedback alignment draws its projections on first use)."""
        if self._plan is None:
            return {}
        return {
            name: rule.feedback for name, rule in self._plan.rules.items()
            if getattr(rule, "feedback", None) is not None
        }

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's forward on ``inputs``, recorded for :meth:`backward`; returns its output."""
        if not torch.is_grad_enabled():  # nothing to route afterwards: the plain forward
            self._tape = None
            self._why_none = (
                "the last router(...) call ran under torch.no_grad() (or inference mode), "
                "which records nothing: call it with gradients enabled"
            )
            return self.model(*inputs, **kwargs)
        plan, tape = self._record(inputs, kwargs, training=True)
        self._tape = (plan, tape)
        for leaf in pytree.tree_leaves(tape.result):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(_not_autograd)
        return tape.result

    def backward(
        self, loss: Tensor | None = None, *, output_credit: Any = None, node_credit: bool = False
    ) -> CreditResult:
        """Route the credit of the last forward's output; add parameter credit into ``.grad``.

        Parameters
        ----------
        loss : tensor, optional
            A scalar computed from the output the last call returned; the credit
            at the output is ``d(loss)/d(output)``.
        output_credit : tensor or structure like the output, optional
            The credit at the output itself, instead of ``loss``.
        node_credit : bool
            Keep every node's credit in the result (memory: about one more
            copy of the activations).

        Returns
        -------
        CreditResult

        Raises
        ------
        FxnxValueError
            No forward to route (call ``router(x)`` first, once per backward);
            both or neither of ``loss`` and ``output_credit``; a loss that is not
            a scalar or does not depend on the output.
        """
        if self._tape is None:
            raise FxnxValueError(
                "router.backward needs a forward to route: call output = router(x), compute "
                "the loss from that output, then router.backward(loss) (once per forward)"
                + (f"; {self._why_none}" if self._why_none else "")
            )
        if (loss is None) == (output_credit is None):
            raise FxnxValueError(
                "router.backward takes either loss or output_credit=…, exactly one of them"
            )
        plan, tape = self._tape
        flat = self._loss_credit(loss, tape.result) if loss is not None else output_credit_like(
            tape.result, output_credit
        )
        credit = tape.graph_credit(flat)
        self._tape = None
        self._why_none = "router.backward was already called on the last forward"
        state = RoutingState(seed=self.seed, output_credit=credit)
        nodes, params, used = plan.backward(tape, credit, state, keep=node_credit)
        self._accumulate(plan, params, aliased=node_credit)
        return CreditResult(
            node_credit=nodes, param_credit=params, rules=used, rule=self.preset.name,
            feedback=self.feedback, output=tape.result,
        )

    def _record(self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None, *, training: bool) -> tuple[Plan, Tape]:
        """Capture (or reuse the capture), compile (or reuse) the plan, run the forward."""
        cap = recapture(self.G, self.model, inputs, kwargs, **self._capture)
        key = (id(cap.gm), training)
        kept = self._plans.get(key)
        if kept is None:
            plan = compile_plan(self.G, cap.gm, self.model, self._choose, training=training)
            self._plans = {key: (cap.gm, plan)}  # the capture changed: the old plan is stale
            self._warn_if_unused(plan)
        else:
            plan = kept[1]
        self._plan = plan
        with TRACING_LOCK:  # other threads' tracing must not patch the modules this run calls
            tape = plan.forward(cap.inputs or [])
        return plan, tape

    def _choose(self, call: NodeCall) -> tuple[Any, str]:
        """The rule bound to ``call``'s node: the user's by name, by kind, the preset's, exact."""
        template = self._by_name.get(call.name) or lookup(call, self._by_kind)
        if template is None:
            template = self.preset.lookup(call) or _EXACT
        key = (call.name, id(template), id(call.module))
        bound = self._bound.get(key)
        if bound is None:
            given = self._given.get(call.name)
            if isinstance(template, Rule):
                bound = template.bind(call, self.seed, given)
            elif given is not None:
                raise FxnxValueError(
                    f"feedback was given for node {call.name!r}, but its rule "
                    f"{rule_name(template)!r} is a function, which takes no feedback weights"
                )
            else:
                bound = template
            self._bound[key] = bound
        return bound, rule_name(bound)

    def _warn_if_unused(self, plan: Plan) -> None:
        if not self.preset or self._by_name or self._by_kind:
            return
        if all(isinstance(rule, Exact) for rule in plan.rules.values()):
            warnings.warn(
                f"rule {self.preset.name!r} applies to no node of this model; every node is "
                "routed exactly",
                stacklevel=4,
            )

    @staticmethod
    def _loss_credit(loss: Any, output: Any) -> list[Any]:
        """``d(loss)/d(leaf)`` for each leaf of ``output`` (``tree_flatten`` order), None where
        the loss does not depend on it."""
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__qualname__
            raise FxnxValueError(
                f"loss must be a scalar tensor, got {what}; for credit of another shape, pass "
                "router.backward(output_credit=...)"
            )
        flat = pytree.tree_leaves(output)
        slots = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
        unrelated = FxnxValueError(
            "loss does not depend on the output the last router(...) call returned: compute it "
            "from that output (not from model(x), nor from an earlier call's output)"
        )
        if not loss.requires_grad or not slots:
            raise unrelated
        grads = torch.autograd.grad(loss, [flat[i] for i in slots], allow_unused=True)
        if all(g is None for g in grads):
            raise unrelated
        credit: list[Any] = [None] * len(flat)
        for i, g in zip(slots, grads, strict=True):
            credit[i] = g
        return credit

    @staticmethod
    def _accumulate(plan: Plan, params: dict[str, Tensor], *, aliased: bool) -> None:
        """Add each parameter's credit into its ``.grad``, as autograd's AccumulateGrad does:
        an empty ``.grad`` takes the credit itself (a copy where the tensor is shared or laid
        out unlike the parameter), an existing one is added to in place."""
        taken: set[int] = set()
        with torch.no_grad():
            for name, g in params.items():
                p = plan.params[name]
                if p.grad is None:
                    if aliased or id(g) in taken or g.stride() != p.stride() or g.dtype != p.dtype:
                        g = torch.empty_like(p).copy_(g)
                    taken.add(id(g))
                    p.grad = g
                else:
                    p.grad += g


def _not_autograd(_: Tensor) -> None:
    """Hooked on the router's output: ``loss.backward()`` would stop there, silently."""
    raise FxnxValueError(
        "loss.backward() cannot train through a CreditRouter: the output router(x) returns "
        "ends the autograd graph. Call router.backward(loss) instead"
    )


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
    raise FxnxTypeError(
        f"rule must be a preset name ({', '.join(PRESETS)}), a fxnx.Preset or a "
        f"mapping of node kinds to rules, got {type(rule).__qualname__}"
    )


def output_credit_like(output: Any, given: Any) -> list[Any]:
    """``given`` checked against the output's structure and shapes, as one credit per leaf of
    ``output`` (``tree_flatten`` order); None means ones."""
    if given is None:
        return [
            torch.ones_like(t) if isinstance(t, Tensor) and t.is_floating_point() else None
            for t in pytree.tree_leaves(output)
        ]
    out_flat, spec = pytree.tree_flatten(output)
    given_flat, given_spec = pytree.tree_flatten(given)
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
        if isinstance(out, Tensor) and isinstance(g, Tensor) and g.shape != out.shape:
            raise FxnxValueError(
                f"{where} has shape {tuple(g.shape)}, the output {tuple(out.shape)}"
            )
    return [g.to(out.dtype) if isinstance(g, Tensor) else g for out, g in zip(out_flat, given_flat, strict=True)]
