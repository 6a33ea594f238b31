"""One-shot credit routing: the credit at every node, with no trace left on the model.

Nodes are visited in reverse topological order of ``G`` (ties broken by fx
``order``, so sums are bit-stable). The credit of a node is the sum over its
outgoing edges of what each consumer sent back along that edge; the node's
rule then splits it over the node's incoming edges. Edits to ``G`` are honoured:
an edge removed from ``G`` carries no credit. :class:`~fxnx.CreditRouter` runs
the same plan every training step; :func:`route_credit` runs it once, for
analysis, restoring buffers and leaving ``.grad`` alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import networkx as nx
from torch import Tensor, nn

from .._capture import TRACING_LOCK
from .._capture.options import LeafSpec
from .._capture.reuse import kept_on
from .._compat import own_parameters, pytree
from .._state import preserved
from .accumulated import routed, watched
from .nodecall import fresh_leaf
from .presets import PRESETS
from .result import CreditResult, credit_norms, owned
from .router import (
    CreditRouter,
    graph_credit,
    output_credit_like,
    own,
    rules_used,
    run_checked,
)
from .rules import Rule

__all__ = ["route_credit"]


def route_credit(
    G: nx.MultiDiGraph,
    model: nn.Module | Callable[..., Any],
    *inputs: Any,
    output_credit: Any = None,
    rule: str | Rule | Mapping[Any, Any] = "exact",
    rules: Mapping[Any, Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    feedback: Mapping[str, Any] | None = None,
    leaf_modules: Iterable[LeafSpec] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> CreditResult:
    """Route credit from the model's output backward over the graph ``G``, once.

    Side-effect free: buffers (BatchNorm's running statistics) and the random
    state are restored, and no parameter's ``.grad`` changes. To train with
    routed credit, use :class:`~fxnx.CreditRouter`.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        The graph from :func:`fxnx.convert` of this model, possibly edited
        (edges removed to cut credit paths). Each node gets a ``credit_norm``
        attribute, and ``G.graph["credit_rule"]`` names the rule.
    model : nn.Module or callable
        The model ``G`` was converted from.
    *inputs, kwargs : the model's inputs for the forward pass.
    output_credit : tensor or structure like the output, optional
        Credit arriving at the output; None means ones (the gradient of ``output.sum()``).
    rule : str, Rule, Preset or mapping
        A preset name: ``"exact"`` (equals autograd), ``"feedback_alignment"``,
        ``"usf"``, ``"brsf"``, ``"frsf"``, ``"direct_feedback_alignment"``, ``"kolen_pollack"``,
        ``"weight_mirror"`` (see ``fxnx.credit.PRESETS``); a rule object, at every weighted
        layer as a preset puts its own; a :class:`~fxnx.credit.Preset`; or a mapping of node
        kinds to rules.
    rules : mapping, optional
        Rules that override the preset: keys are node names (str), module
        classes, functions, or ``method("name")``; values rule objects or
        functions ``rule(call, credit, state)``.
    seed : int
        Seed of the random feedback weights.
    feedback : mapping, optional
        Node name to feedback weights, to reuse or set them (``CreditResult.feedback``,
        ``CreditRouter.feedback``).
    leaf_modules : optional
        Rarely needed: ``G`` carries the options it was captured with
        (``G.graph["capture_options"]``); these replace the stored ones.
    concrete_args : mapping, optional
        The ``concrete_args`` ``G`` was converted with, if any: they change what the model
        computes, so the ones ``G`` stores are checked against these, never applied.

    Returns
    -------
    CreditResult

    Raises
    ------
    FxnxValueError
        Unknown rule; ``G`` has a cycle, lacks a node the model needs, or has an
        edge the model does not; ``output_credit`` does not match the output. The
        model's forward is not one graph (a random choice made in Python while it was
        captured, a captured graph whose output is not the model's); a node writes in
        place into a value later nodes read, and its rule runs it apart from the graph
        or ``G`` lacks the edge into what it writes.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()).double()
    >>> x = torch.randn(4, 3, dtype=torch.float64)
    >>> G = fxnx.convert(model, x)
    >>> res = route_credit(G, model, x)
    >>> x_ = x.clone().requires_grad_()
    >>> torch.allclose(res.node_credit["input_1"], torch.autograd.grad(model(x_).sum(), x_)[0])
    True
    """
    modules = list(model.modules()) if isinstance(model, nn.Module) else []
    router = _router(G, model, modules, rule, rules, seed, feedback, leaf_modules, concrete_args)
    # Every floating input is a leaf of its own: credit is reported at the inputs too.
    inputs, kwargs = fresh_leaf((tuple(inputs), dict(kwargs or {})))
    # Buffers are restored only after the backward: eval-mode BatchNorm's backward reads them.
    with TRACING_LOCK, preserved(model, modules):
        run, values = router.grafted(inputs, kwargs, collect=True)
        result, output, nodes = run_checked(run, model, values)
        # each node's value above accumulated._HELD elements goes once its edge is taken: it is
        # then freed as autograd frees it, not held to the end of the backward pass (nor its
        # memory faulted in again at the next call, where the allocator gave it back)
        places, edges = watched(run.names, nodes)
        del nodes
        flat = output_credit_like(result, output_credit)
        pairs = [(t, g) for t, g in zip(pytree.tree_leaves(result), flat, strict=True)
                 if isinstance(t, Tensor) and isinstance(g, Tensor) and t.requires_grad]
        params = {n: p for n, p in run.plan.params.items() if p.requires_grad}
        node_credit, param_credit = routed(places, edges, [t for t, _ in pairs], [g for _, g in pairs], params)
    node_credit[run.plan.entries[-1].call.name] = graph_credit(result, output, flat)
    # a parameter whose credit is the output credit itself (one added to the output, or
    # returned by the model) gets the caller's tensor back from autograd: copied, as nodes' are
    node_credit, param_credit = owned(node_credit, output_credit), owned(param_credit, output_credit)
    norms = credit_norms(node_credit)
    result_ = CreditResult(
        node_credit=node_credit,
        param_credit=param_credit,
        rules=rules_used(run.plan, node_credit),
        rule=router.preset.name,
        feedback=own(router.feedback),
        output=own(result),
    )
    nx.set_node_attributes(G, norms, "credit_norm")
    G.graph["credit_rule"] = result_.rule
    return result_


#: Where route_credit keeps its routers on ``G`` (outside ``G``'s data, like the captures).
_SLOT = "_fxnx_routers"


def _recorded(G: nx.MultiDiGraph) -> list[Any]:
    """What ``G`` records of how it was captured, which routing reads."""
    return [G.graph.get(key) for key in ("capture", "capture_options", "level")]


def _router(
    G: nx.MultiDiGraph, model: Any, modules: list[nn.Module], rule: Any, rules: Any, seed: int, feedback: Any,
    leaf_modules: Any, concrete_args: Any,
) -> CreditRouter:
    """A router for one run, kept on ``G`` for the next call with the same model and rule.

    Its plan (the rule bound to each node, the edge matching) is then compiled once;
    an edit of ``G``'s edges or of its capture record, other rules or feedback, a parameter
    replaced, or a rule that changes between runs (brSF) make a new one, as does a model whose
    structure changed (the capture does). ``modules``: ``list(model.modules())``.
    """
    def fresh() -> CreditRouter:
        return CreditRouter(G, model, rule, rules=rules, seed=seed, feedback=feedback,
                            leaf_modules=leaf_modules, concrete_args=concrete_args)

    if (rules or feedback or leaf_modules or concrete_args or not isinstance(rule, str)
            or not isinstance(G, nx.MultiDiGraph)):
        return fresh()
    preset = PRESETS.get(rule)
    if preset is None or any(getattr(r, "stateful", True) for r in preset.values()):
        return fresh()
    # the parameters themselves: one replaced (layer.weight = nn.Parameter(...)) is another
    # plan's, whose credit the kept plan would not report
    params = tuple(map(id, itertools.chain.from_iterable(map(own_parameters, modules))))
    # (iter: tuple() of the view itself walks every edge once more for its length)
    key = (id(model), rule, seed, G.number_of_nodes(), hash(tuple(iter(G.edges(keys=True)))), params)
    kept = kept_on(G, _SLOT)
    router = kept.get(key)
    if router is None or router.model is not model or _recorded(router.G) != _recorded(G):  # (a copy of G)
        kept.clear()  # one router at a time: each holds its plan's tensors' metadata
        router = kept[key] = fresh()
    return router
