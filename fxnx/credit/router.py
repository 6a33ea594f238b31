"""Routing credit backward over the graph ``G``, one node at a time.

Nodes are visited in reverse topological order of ``G`` (ties broken by fx
``order``, so sums are bit-stable). The credit of a node is the sum over its
outgoing edges of what each consumer sent back along that edge; the node's
rule then splits it over the node's incoming edges. Edits to ``G`` are honoured:
an edge removed from ``G`` carries no credit.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import Tensor, nn

from .._compat import pytree
from .._state import preserved
from ..analysis import topological_order
from ..capturing import TRACING_LOCK
from ..capturing.options import LeafSpec
from ..capturing.reuse import recapture
from ..contract import validate
from ..errors import FxnxTypeError, FxnxValueError
from .record import Credit, NodeCall, record
from .rules import PRESETS, RoutingState, Rule, exact, lookup

__all__ = ["CreditResult", "route_credit"]


@dataclass
class CreditResult:
    """The credit every node and parameter received in one routing run.

    Attributes
    ----------
    node_credit : dict
        Node name to the credit with respect to that node's output: a tensor of
        the output's shape, a tuple for multi-output nodes, or None (no credit,
        or a node that produces no tensor).
    param_credit : dict
        Qualified parameter name (as in ``model.named_parameters()``) to its credit.
    rules : dict
        Node name to the name of the rule that routed through it.
    rule : str
        The preset the run used.
    feedback : dict
        Node name to the feedback weight used there (feedback alignment).
    output : Any
        The model's output in the recorded forward pass.
    """

    node_credit: dict[str, Credit]
    param_credit: dict[str, Tensor]
    rules: dict[str, str]
    rule: str
    feedback: dict[str, Tensor] = field(default_factory=dict)
    output: Any = None

    def norms(self) -> dict[str, float | None]:
        """The Euclidean norm of each node's credit (None where it has none)."""
        return {name: credit_norm(c) for name, c in self.node_credit.items()}

    def describe(self) -> str:
        """Which rule routed through how many nodes: say where a preset fell back to exact."""
        counts = Counter(self.rules.values())
        return ", ".join(f"{rule} on {n} node{'s' * (n != 1)}" for rule, n in counts.most_common())


def credit_norm(credit: Credit) -> float | None:
    """The Euclidean norm of a credit, over all its tensors; None if it has none."""
    norms = [torch.linalg.vector_norm(t.detach()) for t in pytree.tree_flatten(credit)[0] if isinstance(t, Tensor)]
    if not norms:
        return None
    return float(torch.linalg.vector_norm(torch.stack(norms).double()))


def route_credit(
    G: nx.MultiDiGraph,
    model: nn.Module | Callable[..., Any],
    *inputs: Any,
    output_credit: Any = None,
    rule: str = "exact",
    rules: Mapping[Any, Rule] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    feedback: Mapping[str, Tensor] | None = None,
    leaf_modules: Iterable[LeafSpec] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> CreditResult:
    """Route credit from the model's output backward over the graph ``G``.

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
    rule : str
        A preset: ``"exact"`` (equals autograd), ``"feedback_alignment"``,
        ``"sign_symmetry"``, or one made with :func:`register_rule`.
    rules : mapping, optional
        Rules that override the preset: keys are node names (str), module
        classes, functions, or ``method("name")``.
    seed : int
        Seed of the random feedback weights.
    feedback : mapping, optional
        Node name to feedback weight, to reuse or set them (``CreditResult.feedback``).
    leaf_modules, concrete_args
        The tracing options ``G`` was converted with.

    Returns
    -------
    CreditResult

    Raises
    ------
    FxnxValueError
        Unknown rule; ``G`` has a cycle, lacks a node the model needs, or has an
        edge the model does not; ``output_credit`` does not match the output.

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
    if not isinstance(G, nx.MultiDiGraph):
        raise FxnxTypeError(
            f"G must be the networkx.MultiDiGraph from fxnx.convert, got {type(G).__qualname__}"
        )
    if rule not in PRESETS:
        raise FxnxValueError(f"unknown rule {rule!r}; known rules: {', '.join(sorted(PRESETS))}")
    validate(G)  # the graph contract: acyclic, every attribute of the right type

    route = G.graph.get("capture", "auto")
    if route == "make_fx" or G.graph.get("level") == "joint":
        raise FxnxValueError(
            f"G was captured with make_fx (level={G.graph.get('level')!r}), whose inputs are the "
            "parameters themselves; route credit over a graph from convert(model, x) at "
            "level='module' (symbolic_trace, export or draft_export)"
        )
    # The capture behind G, with the options stored in G (those given here replace them),
    # reused while model and inputs keep their structure.
    cap = recapture(G, model, inputs, kwargs, leaf_modules=leaf_modules, concrete_args=concrete_args)
    _check_nodes(G, [node.name for node in cap.gm.graph.nodes])
    named = model.named_parameters() if isinstance(model, nn.Module) else ()
    param_names = {id(p): name for name, p in named}
    overrides = dict(rules or {})
    by_name = {k: v for k, v in overrides.items() if isinstance(k, str)}
    by_kind = {k: v for k, v in overrides.items() if not isinstance(k, str)}
    unknown = sorted(set(by_name) - set(G))
    if unknown:
        raise FxnxValueError(f"rules name nodes that G does not have: {unknown}")
    state = RoutingState(seed=seed, feedback=dict(feedback or {}))
    # Buffers are restored only after the backward: eval-mode BatchNorm's backward reads them.
    # The lock keeps other threads' tracing from patching the modules this run calls.
    with TRACING_LOCK, preserved(model):
        calls, values, output = record(cap.gm, cap.inputs or [], param_names)
        credit_at_output = _output_credit(output, output_credit)
        node_credit, param_credit, used = _backward(
            G, calls, values, credit_at_output, param_names, by_name, by_kind, rule, state
        )

    if rule != "exact" and PRESETS[rule] and rule not in used.values():
        warnings.warn(
            f"rule {rule!r} applies to no node of this model; every node was routed exactly",
            stacklevel=2,
        )
    result = CreditResult(
        node_credit=node_credit,
        param_credit=param_credit,
        rules=used,
        rule=rule,
        feedback=state.feedback,
        output=output,
    )
    nx.set_node_attributes(G, result.norms(), "credit_norm")
    G.graph["credit_rule"] = rule
    return result


def _backward(
    G: nx.MultiDiGraph,
    calls: dict[str, NodeCall],
    values: dict[str, Any],
    credit_at_output: Credit,
    param_names: dict[int, str],
    by_name: dict[str, Rule],
    by_kind: dict[Any, Rule],
    rule: str,
    state: RoutingState,
) -> tuple[dict[str, Credit], dict[str, Tensor], dict[str, str]]:
    """Visit G's nodes in reverse topological order, each node's rule splitting its credit."""
    node_credit: dict[str, Credit] = {}
    param_credit: dict[str, Tensor] = {}
    used: dict[str, str] = {}
    edge_credit: dict[tuple[str, str, int], Credit] = {}
    order = {n: i for i, n in enumerate(topological_order(G))}
    for name in reversed(order):
        credit = None
        # Sum as autograd accumulates: the latest consumer first, its arguments in order.
        # The order is fixed, so sums are bit-stable; matching autograd's keeps them bit-equal.
        out_edges = sorted(G.out_edges(name, keys=True), key=lambda e: (-order[e[1]], e[2]))
        for _, v, key in out_edges:
            credit = _tree_add(credit, edge_credit.pop((name, v, key), None))
        call = calls.get(name)
        if call is not None and call.op == "output":
            credit = credit_at_output
        node_credit[name] = credit
        value = values.get(name)
        if call is None:  # placeholder or get_attr: credit ends here
            if isinstance(value, nn.Parameter) and id(value) in param_names and credit is not None:
                key_ = param_names[id(value)]
                param_credit[key_] = _tree_add(param_credit.get(key_), credit)
            continue
        in_edges = _match_edges(G, call)
        call.wanted = [False] * len(call.inputs)
        for i in in_edges.values():
            call.wanted[i] = True
        if credit is None:
            continue
        fn, used[name] = _choose(call, by_name, by_kind, rule)
        input_credit, params = fn(call, credit, state)
        for edge, i in in_edges.items():
            if input_credit[i] is not None:
                edge_credit[edge] = input_credit[i]
        for pname, g in params.items():
            param_credit[pname] = _tree_add(param_credit.get(pname), g)
        call.output = call.inputs = None  # free the node's graph and activations
    return node_credit, param_credit, used


def _choose(
    call: NodeCall, by_name: dict[str, Rule], by_kind: dict[Any, Rule], preset: str
) -> tuple[Rule, str]:
    """The rule for ``call`` and its name: the user's by node name, then by kind, then the
    preset's, then exact."""
    fn = by_name.get(call.name) or lookup(call, by_kind)
    if fn is not None:
        return fn, getattr(fn, "__name__", repr(fn))
    fn = lookup(call, PRESETS[preset])
    return (fn, preset) if fn is not None else (exact, "exact")


def _check_nodes(G: nx.MultiDiGraph, model_nodes: list[str]) -> None:
    missing = [n for n in model_nodes if n not in G]
    extra = sorted(set(G) - set(model_nodes))
    if missing:
        raise FxnxValueError(
            f"G lacks nodes the model computes: {missing[:8]}{' …' if len(missing) > 8 else ''}. "
            "Route over the graph fxnx.convert made from this model (with the same "
            "leaf_modules and concrete_args); to cut credit paths, remove edges, not nodes."
        )
    if extra:
        raise FxnxValueError(
            f"G has nodes the model does not compute: {extra[:8]}; was G converted from "
            "another model, or with other leaf_modules or concrete_args?"
        )


def _match_edges(G: nx.MultiDiGraph, call: NodeCall) -> dict[tuple[str, str, int], int]:
    """Each in-edge of the node in G, mapped to the input occurrence it stands for."""
    index = {(src, label): i for i, (src, label) in enumerate(zip(call.sources, call.labels, strict=True))}
    matched = {}
    for u, v, key, arg in G.in_edges(call.name, keys=True, data="arg"):
        i = index.get((u, arg))
        if i is None:
            raise FxnxValueError(
                f"G has an edge {u} -> {v} (arg {arg!r}) that is not an input of node {v!r} in "
                "the model; credit can only be routed along the model's own dataflow"
            )
        matched[(u, v, key)] = i
    return matched


def _output_credit(output: Any, given: Any) -> Any:
    if given is None:
        return pytree.tree_map(
            lambda t: torch.ones_like(t) if isinstance(t, Tensor) and t.is_floating_point() else None,
            output,
        )
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
    return pytree.tree_unflatten(
        [g.to(out.dtype) if isinstance(g, Tensor) else g for out, g in zip(out_flat, given_flat, strict=True)],
        spec,
    )


def _tree_add(a: Credit, b: Credit) -> Credit:
    """Sum two credits of the same structure; None is zero."""
    if a is None:
        return b
    if b is None:
        return a
    return pytree.tree_map(lambda x, y: y if x is None else x if y is None else x + y, a, b)
