"""Paths through residual branches: how many there are of each length, and the credit each
length carries back to the input.

Veit, Wilber and Belongie (2016), "Residual networks behave like ensembles of relatively
shallow networks", unravel a network of ``n`` residual blocks into ``2**n`` paths, each
block taken either through its residual branch or along its skip, and measure the
gradient each path length carries by sampling paths. Over ``G``, with the skip
connections that :func:`~fxnx.skip_connections` finds, both are computed exactly.

A path is a sequence of nodes from the input to the output along ``G``'s data edges
(edges that carry a tensor; parallel edges, as in ``x * x`` or attention reading ``x``
three times, are one step). Its **length** is the number of residual branches it goes
through: the number of its edges that enter a skip connection's merge from one of its
residual branches (every branch but the shortest, which is the skip: empty for an
identity skip, the 1×1 projection of a downsampling block). Each merge is entered once
per path, so lengths run from 0 to the number of skip connections.

Only :func:`path_length_credit` needs torch, and imports it when called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import networkx as nx

from ._analysis import SkipConnection, skip_connections, topological_order
from ._contract import explained
from ._errors import FxnxTypeError, FxnxValueError

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["path_length_counts", "path_length_credit"]


@explained
def path_length_counts(G: nx.MultiDiGraph, *, input: str | None = None) -> dict[int, int]:
    """How many input-to-output paths of ``G`` go through exactly ``k`` residual branches.

    One pass over ``G`` in topological order: each node holds the number of
    paths reaching it by length, and an edge entering a merge from a residual
    branch shifts its counts one length up. No path is enumerated, so a
    network of ``n`` blocks costs ``n + 1`` numbers per node, not ``2**n`` paths.

    Parameters
    ----------
    G : networkx.MultiDiGraph
    input : str, optional
        The input node paths start from; default the first input (placeholder).

    Returns
    -------
    dict
        ``k`` to the number of paths of length ``k``, for ``k`` from 0 to the number
        of skip connections. For a ResNet of ``n`` blocks, the binomial coefficients ``C(n, k)``.

    Raises
    ------
    FxnxValueError
        ``G`` has no such input.

    Examples
    --------
    Two identity skips around learned layers ``f`` and ``g``, and a layer ``h``:

    >>> G = nx.MultiDiGraph([("x", "f"), ("f", "add"), ("x", "add"), ("add", "g"),
    ...                      ("g", "add_1"), ("add", "add_1"), ("add_1", "h"), ("h", "out")])
    >>> nx.set_node_attributes(G, "call_module", "op")
    >>> nx.set_node_attributes(G, {"f": 64, "g": 64, "h": 64}, "num_params")
    >>> G.nodes["x"]["op"], G.nodes["out"]["op"] = "placeholder", "output"
    >>> for merge in ("add", "add_1"):
    ...     G.nodes[merge].update(op="call_function", target="operator.add")
    >>> path_length_counts(G)
    {0: 1, 1: 2, 2: 1}
    """
    source = _input_node(G, input, "path_length_counts")
    skips = skip_connections(G, annotate=False)
    entries = {(u, s.merge) for s in skips for u in _residual_inputs(s)}
    n = len(skips)
    flow = _data_edges(G)
    counts: dict[str, list[int]] = {source: [1] + [0] * n}
    for v in topological_order(G):
        if v == source or v not in flow:
            continue
        reached = [
            [0, *counts[u][:-1]] if (u, v) in entries else counts[u]
            for u in flow.predecessors(v) if u in counts
        ]
        if reached:
            counts[v] = [sum(c) for c in zip(*reached, strict=True)]
    outputs = [v for v in G if G.nodes[v].get("op") == "output" and v in counts]
    return {k: sum(counts[v][k] for v in outputs) for k in range(n + 1)}


def path_length_credit(
    G: nx.MultiDiGraph, model: nn.Module, x: Tensor, *, output_credit: Any = None
) -> dict[int, Tensor]:
    """The credit at the model's input carried by the paths through exactly ``k`` residual branches.

    The terms add up to the exact input credit (:func:`~fxnx.route_credit`'s,
    autograd's): ``sum(path_length_credit(G, model, x).values())``. The forward pass
    is the model's; only which branches carry credit back differs between terms:
    term ``k`` is the credit of the paths that pass exactly ``k`` residual branches.
    Where the skip connections follow one another (none inside another's branch), that
    is the sum, over every set ``S`` of ``k`` skip connections, of the credit routed
    back with, at each skip connection, its skip cut if it is in ``S`` and its residual
    branches cut if it is not. (Where one lies inside another's residual branch, a path
    along the outer skip passes neither of the inner one's branches, and that sum would
    count it once for each way of cutting the inner one.)

    The terms are found in one routing run, exactly: credit is linear, so it is
    routed for ``n + 1`` copies of the batch at once (``n`` skip connections), copy
    ``k`` holding the credit that has gone through ``k`` residual branches so far.
    Each merge sends its skip branch each copy's credit as it is and its residual
    branches copy ``k``'s credit as copy ``k + 1``'s. (Sampling paths, as Veit et al.
    did, or evaluating a polynomial in the branch weight at ``n + 1`` points, would
    be approximate or ill-conditioned at ResNet-50's 16 blocks.)

    Parameters
    ----------
    G : networkx.MultiDiGraph
        The graph of ``model`` (edits honoured, as in :func:`~fxnx.route_credit`).
    model : nn.Module
        In eval mode: the batch is copied ``n + 1`` times, which training-mode
        BatchNorm would mix and dropout would make differ.
    x : Tensor
        The model's one input, batch first; the model must treat batch elements
        independently and return outputs batch first.
    output_credit : tensor or structure like the output, optional
        Credit at the output; None means ones (the gradient of ``output.sum()``).

    Returns
    -------
    dict
        ``k`` to the credit at ``x`` of the paths of length ``k`` (a tensor shaped
        like ``x``), for ``k`` from 0 to the number of skip connections.

    Raises
    ------
    FxnxValueError
        A module is in training mode; an output's credit, or a residual branch's,
        is not batch first.
    FxnxTypeError
        ``x`` is not a tensor with a batch dimension.

    Examples
    --------
    >>> import torch, fxnx
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.f = torch.nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         return x + self.f(x)
    >>> model = torch.nn.Sequential(Block(), Block()).double().eval()
    >>> x = torch.randn(2, 3, dtype=torch.float64)
    >>> G = fxnx.convert(model, x)
    >>> terms = path_length_credit(G, model, x)
    >>> sorted(terms)
    [0, 1, 2]
    >>> torch.equal(terms[0], torch.ones_like(x))   # the path along both skips
    True
    >>> x_ = x.clone().requires_grad_()
    >>> exact, = torch.autograd.grad(model(x_).sum(), x_)
    >>> torch.allclose(sum(terms.values()), exact)
    True
    """
    import torch

    from ._compat import pytree
    from ._credit import route_credit

    training = next((name or "the model" for name, m in model.named_modules() if m.training), None)
    if training is not None:
        raise FxnxValueError(
            f"path_length_credit: {training} is in training mode; call model.eval() first "
            "(the batch is copied once per path length, which batch statistics would mix "
            "and dropout would make differ)"
        )
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise FxnxTypeError(
            f"path_length_credit: x must be a tensor with a batch dimension, got {x!r:.60}")
    source = _input_node(G, None, "path_length_credit")
    skips = skip_connections(G, annotate=False)
    copies = len(skips) + 1
    if output_credit is None:  # ones, as route_credit gives, for the first copy only
        with torch.no_grad():
            output = model(x)
        output_credit = pytree.tree_map(
            lambda t: torch.ones_like(t)
            if isinstance(t, torch.Tensor) and t.is_floating_point() else None,
            output)

    def first_copy(g: Any) -> Any:
        if not isinstance(g, torch.Tensor):
            return g
        if g.dim() == 0 or g.shape[0] != x.shape[0]:
            raise FxnxValueError(
                f"path_length_credit: an output's credit has shape {tuple(g.shape)}, whose first "
                f"dimension is not the batch ({x.shape[0]}): outputs must be batch first"
            )
        return torch.cat([g, g.new_zeros((copies - 1) * g.shape[0], *g.shape[1:])])

    rules = {s.merge: _shift_rule(frozenset(_residual_inputs(s)), copies) for s in skips}
    xs = x.detach().repeat(copies, *([1] * (x.dim() - 1)))
    with _credit_attributes_kept(G):  # the copies' norms would mean nothing on G
        stacked = pytree.tree_map(first_copy, output_credit)
        res = route_credit(G, model, xs, output_credit=stacked, rules=rules)
    credit = res.node_credit[source].unflatten(0, (copies, x.shape[0]))
    return {k: credit[k] for k in range(copies)}


def _shift_rule(residual: frozenset[str], copies: int) -> Callable[..., Any]:
    """A merge's rule: exact, with its residual inputs' credit moved one path length up."""

    def shift_residual(call: Any, credit: Any, state: Any) -> Any:
        inputs, params = call.exact(credit)
        for i, source in enumerate(call.sources):
            if source in residual and inputs[i] is not None:
                g = inputs[i]
                if g.dim() == 0 or g.shape[0] % copies:
                    raise FxnxValueError(
                        f"path_length_credit: merge {call.name!r} sends {source!r} credit of shape "
                        f"{tuple(g.shape)}, whose first dimension is not the batch times {copies}"
                    )
                g = g.unflatten(0, (copies, -1))
                shifted = g.new_zeros(g.shape)
                shifted[1:] = g[:-1]  # nothing leaves past the last copy: no path has more
                inputs[i] = shifted.flatten(0, 1)
        return inputs, params

    return shift_residual


@contextmanager
def _credit_attributes_kept(G: nx.MultiDiGraph) -> Iterator[None]:
    """Put back the ``credit_norm`` and ``credit_rule`` attributes that a routing run writes."""
    norms, rule = dict(G.nodes(data="credit_norm")), G.graph.get("credit_rule")
    try:
        yield
    finally:
        for node, norm in norms.items():
            if norm is None:
                G.nodes[node].pop("credit_norm", None)
            else:
                G.nodes[node]["credit_norm"] = norm
        if rule is None:
            G.graph.pop("credit_rule", None)
        else:
            G.graph["credit_rule"] = rule


def _residual_inputs(skip: SkipConnection) -> list[str]:
    """The merge's inputs at the end of its residual branches (every branch but the skip)."""
    return [branch[-1] for branch in skip.branches[1:] if branch]


def _data_edges(G: nx.MultiDiGraph) -> nx.DiGraph:
    """``G``'s edges that carry a tensor, one per pair of nodes.

    An edge without a dtype carries a plain value (``x.shape``) on a graph with
    shapes; on a graph without them, every edge from a node that is not a
    parameter counts.
    """
    return nx.DiGraph(
        (u, v) for u, v, dtype in G.edges(data="dtype")
        if dtype is not None
        or (G.nodes[u].get("out_type") is None and G.nodes[u].get("op") != "get_attr")
    )


def _input_node(G: nx.MultiDiGraph, name: str | None, caller: str) -> str:
    primals = G.graph.get("primals", {})
    inputs = [
        n for n in topological_order(G)
        if G.nodes[n].get("op") == "placeholder"
        and primals.get(n, {}).get("kind", "input") == "input"
    ]
    if not inputs:
        raise FxnxValueError(f"{caller}: G has no input (placeholder) node for paths to start from")
    if name is None:
        return inputs[0]
    if name not in inputs:
        raise FxnxValueError(
            f"{caller}: input={name!r} is not an input of G; its inputs are {inputs}")
    return name
