"""Graph analysis: census, skip connections, summaries.

Pure graph logic over a converted ``MultiDiGraph``; nothing here imports torch,
so it works on a graph loaded from a file in an environment without torch.
"""

from __future__ import annotations

import re
import reprlib
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx

from ._contract import explained
from ._errors import FxnxValueError, GraphContractError

__all__ = [
    "MERGE_TARGETS",
    "SkipConnection",
    "census",
    "format_summary",
    "node_depths",
    "scope_subgraph",
    "short_name",
    "skip_connections",
    "summary",
    "topological_order",
]

#: Short reprs of node names in messages: a stranger's graph may have huge ones.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60

#: Node targets that merge branches: ``(op, target)`` pairs. Additions and concatenations.
MERGE_TARGETS = frozenset(
    {
        ("call_function", "operator.add"),
        ("call_function", "operator.iadd"),
        ("call_function", "torch.add"),
        ("call_method", "add"),
        ("call_method", "add_"),
        ("call_method", "__add__"),
        ("call_method", "__iadd__"),
        ("call_function", "torch.cat"),
        ("call_function", "torch.concat"),
        ("call_function", "torch.concatenate"),
        # ATen-level graphs (level="aten", or a torch.export / make_fx capture)
        ("call_function", "torch.ops.aten.add.Tensor"),
        ("call_function", "torch.ops.aten.add_.Tensor"),
        ("call_function", "torch.ops.aten.cat.default"),
    }
)


#: What a fork and merge is (:attr:`SkipConnection.kind`). A residual adds a learned branch (one
#: that holds parameters) to the fork's value, carried unchanged (``"identity"``) or through a
#: projection: a short branch of convolutions, linear layers, pooling and normalisation only
#: (``"projection"``, ResNet's downsample). Every other fork and merge is ``"parallel"``:
#: concatenations (DenseNet, Inception), rotary embeddings (``q*cos + rotate_half(q)*sin``),
#: sums of attention scores, activations written out (``x + 0.044715*x**3``), a state space
#: model's scan, branches that both transform the fork (GPT-NeoX's ``attn + mlp``).
SKIP_KINDS = ("identity", "projection", "parallel")
#: The kinds :func:`skip_connections` returns by default: the residuals users name.
RESIDUALS = ("identity", "projection")

#: Operators that carry a value unchanged (its dtype, layout or view at most): a skip branch of
#: these alone is an identity (Mamba's ``residual.to(torch.float32)``, timm's ``nn.Identity``).
_CARRIES = re.compile(
    r"(?i)identity|dropout\w*|droppath|stochasticdepth|to|_?to_copy|type|float|contiguous|clone"
    r"|alias|detach|lift_fresh_copy|view|_unsafe_view|reshape|flatten|unflatten|permute"
    r"|transpose|t|expand|unsqueeze|squeeze"
)
#: Operators a projection is made of: layers that map the fork's value to the merge's shape,
#: with normalisation, a tuple's item (ATen's pooling) and what carries a value.
_PROJECTION_LAYERS = re.compile(r"(?i)\w*conv(\d\w*|olution\w*|_?transpose\w*)?|linear|addmm|mm|\w*pool\w*")
_PROJECTION_EXTRAS = re.compile(r"(?i)\w*norm\w*|getitem")


@dataclass(frozen=True)
class SkipConnection:
    """Where branches that split at ``fork`` rejoin at ``merge``.

    Attributes
    ----------
    merge : str
        The node that adds or concatenates the branches.
    fork : str
        The nearest node every branch starts from (the merge's immediate dominator).
    skip : tuple of str
        The shortest branch: the nodes strictly between fork and merge on it,
        in graph order. Empty for an identity skip; else a projection or downsample.
    residual : tuple of str
        The nodes on every other branch, in graph order.
    branches : tuple of tuple of str
        Every branch's nodes, shortest first (``branches[0] == skip``).
    kind : str
        ``"identity"`` or ``"projection"`` for a residual, else ``"parallel"``
        (:data:`SKIP_KINDS` says what each means).
    """

    merge: str
    fork: str
    skip: tuple[str, ...]
    residual: tuple[str, ...]
    branches: tuple[tuple[str, ...], ...]
    kind: str = "parallel"

    @property
    def identity(self) -> bool:
        """Whether this is a residual whose skip branch carries the fork's output unchanged."""
        return self.kind == "identity"


def topological_order(G: nx.MultiDiGraph) -> list[str]:
    """Nodes in topological order, ties broken by fx ``order``: stable from run to run.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "b"), ("x", "a"), ("a", "out"), ("b", "out")])
    >>> nx.set_node_attributes(G, {"x": 0, "a": 1, "b": 2, "out": 3}, "order")
    >>> topological_order(G)
    ['x', 'a', 'b', 'out']
    """
    try:
        return list(nx.lexicographical_topological_sort(G, key=lambda n: G.nodes[n].get("order", 0)))
    except nx.NetworkXUnfeasible as err:
        raise cycle_error(G) from err


def cycle_error(G: nx.MultiDiGraph) -> GraphContractError:
    """The error for a graph that has a cycle, naming the first few nodes of one.

    Examples
    --------
    >>> print(cycle_error(nx.MultiDiGraph([("x", "a"), ("a", "b"), ("b", "a")])))
    G has a cycle through 'a' -> 'b' -> 'a': an fxnx graph is acyclic; fxnx.validate(G) checks a graph built or edited by hand
    """
    cycle = [u for u, *_ in nx.find_cycle(G)]
    shown = [_SHORT.repr(u) for u in cycle[:5]]
    shown.append(_SHORT.repr(cycle[0]) if len(cycle) <= 5 else f"... ({len(cycle)} nodes)")
    return GraphContractError(
        f"G has a cycle through {' -> '.join(shown)}: an fxnx graph is acyclic; "
        "fxnx.validate(G) checks a graph built or edited by hand"
    )


def node_depths(G: nx.MultiDiGraph) -> dict[str, int]:
    """Each node's depth: the most edges on any path to it from an input.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "a"), ("a", "b"), ("x", "b")])
    >>> node_depths(G)
    {'x': 0, 'a': 1, 'b': 2}
    """
    depth: dict[str, int] = {}
    for node in topological_order(G):
        depth[node] = max((depth[u] + 1 for u in G.predecessors(node)), default=0)
    return depth


def census(G: nx.MultiDiGraph, by: str = "op") -> dict[Any, int]:
    """How many nodes have each value of the node attribute ``by``, most common first;
    ``by="kind"`` counts each node's kind (:func:`node_kind`: ``Conv2d``, ``add``, ``input``).

    Examples
    --------
    >>> G = nx.MultiDiGraph()
    >>> G.add_nodes_from([("a", {"op": "call_module"}), ("b", {"op": "call_module"}),
    ...                   ("c", {"op": "output"})])
    >>> census(G)
    {'call_module': 2, 'output': 1}
    """
    value = node_kind if by == "kind" else lambda data: data.get(by)
    counts = Counter(value(data) for _, data in G.nodes(data=True))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def _carries_tensor(G: nx.MultiDiGraph, source: str) -> bool:
    out_type = G.nodes[source].get("out_type")
    if out_type is not None:
        return out_type == "torch.Tensor" or out_type.endswith(".Parameter")
    return G.nodes[source].get("op") != "get_attr"


#: Embedding calls, and the argument that takes the indices: where token ids become data.
_EMBEDDINGS = {
    ("call_function", "torch.ops.aten.embedding.default"): ("indices", 1),
    ("call_function", "torch.nn.functional.embedding"): ("input", 0),
    ("call_module", "torch.nn.modules.sparse.Embedding"): ("input", 0),
}


def _integer(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype.startswith(("torch.int", "torch.uint", "torch.bool"))


def _data_sources(G: nx.MultiDiGraph, starts: list[str]) -> list[str]:
    """Which nodes without inputs carry data, rather than build indices or masks.

    The model's inputs (placeholders) do; ``arange``, ``zeros``, ``scalar_tensor``
    and other nodes that make a tensor from nothing do not. An integer or bool
    input counts only where it (or integers computed from it) indexes an
    embedding: ``input_ids`` is data, ``attention_mask`` and position ids are
    not. Were a merge's branches traced back to a mask as well, their only
    common ancestor would be the virtual root, and the residual would be lost.
    Without any such input, every node without inputs counts, as before.
    """
    inputs = [n for n in starts if G.nodes[n].get("op") == "placeholder"]
    data = [n for n in inputs if not _integer(G.nodes[n].get("out_dtype")) or _indexes(G, n)]
    return data or inputs or starts


def _indexes(G: nx.MultiDiGraph, start: str) -> bool:
    """Whether ``start``'s integers reach the indices argument of an embedding."""
    todo, seen = [start], {start}
    while todo:
        u = todo.pop()
        for _, v, arg in G.out_edges(u, data="arg"):
            data = G.nodes[v]
            kind = data.get("module_type") if data.get("op") == "call_module" else data.get("target")
            if arg in _EMBEDDINGS.get((data.get("op"), kind), ()):
                return True
            if v not in seen and _integer(data.get("out_dtype")):
                seen.add(v)
                todo.append(v)
    return False


#: The node that feeds every source of the data flow, for the dominator tree; no fx name equals it.
_ROOT = ("fxnx", "root")


def _data_flow(G: nx.MultiDiGraph) -> nx.DiGraph:
    """The part of ``G`` that data flows through: the tensors downstream of an input,
    all fed from :data:`_ROOT`.

    Parameters and buffers (``get_attr`` nodes, and the ``primals_*`` inputs
    standing for them in ATen-level graphs) are not sources: a path through a
    layer's weight is no second path for the data. Nor is a path through a
    tensor's shape (``x.shape[0]`` sizing a learned token): only edges that
    carry tensors count.
    """
    weights = {
        name for name, primal in G.graph.get("primals", {}).items() if primal["kind"] != "input"
    }
    starts = [
        n for n in G
        if G.in_degree(n) == 0 and G.nodes[n].get("op") != "get_attr" and n not in weights
    ]
    sources = _data_sources(G, starts)
    tensors = nx.DiGraph(
        (u, v) for u, v, dtype in G.edges(data="dtype")
        # dtype None on a propagated graph: a shape or other plain value, not a tensor
        if dtype is not None or (G.nodes[u].get("out_type") is None and _carries_tensor(G, u))
    )
    tensors.add_node(_ROOT)  # a model without inputs has no sources
    tensors.add_edges_from((_ROOT, s) for s in sources)
    reach = nx.descendants(tensors, _ROOT) | {_ROOT}
    flow = nx.DiGraph(tensors.subgraph(reach).edges())
    flow.add_node(_ROOT)
    return flow


@explained
def skip_connections(
    G: nx.MultiDiGraph, kinds: str | Collection[str] = RESIDUALS, *, annotate: bool = True
) -> list[SkipConnection]:
    """Find the residual connections, or every place where branches split and rejoin.

    A merge is an addition or concatenation (:data:`MERGE_TARGETS`) of two or
    more distinct tensor-producing inputs; its fork is the merge's immediate
    dominator (every path from the inputs to the merge passes through it). Where
    a branch also reads a side input, so that no node dominates the merge (the
    cross-attention of an encoder-decoder reads the encoder's output), the fork
    is the merge input that every other input descends from. Index and mask
    tensors (``arange``, an ``attention_mask`` input) are not data: paths from
    them do not count.
    Merges whose inputs share no fork, such as adding a learned position
    embedding, are not skip connections, nor are merges of integers or booleans
    (position ids, masks): no data and no credit flows through them.

    Each fork and merge has a ``kind`` (:data:`SKIP_KINDS`): an ``"identity"`` or
    ``"projection"`` residual, or ``"parallel"`` branches (concatenations, rotary
    embeddings, sums of attention scores...). By default only the residuals are
    returned, the skip connections a reader of the paper would count.

    Parameters
    ----------
    G : networkx.MultiDiGraph
    kinds : str or collection of str
        The kinds to return: any of :data:`SKIP_KINDS`, or ``"all"``. Default
        :data:`RESIDUALS`.
    annotate : bool
        Also write the result onto ``G`` as plain data (see Notes). A view of another graph
        (``G.subgraph(...)``, or any frozen graph) shares that graph's attributes, so it is
        refused: annotate a copy (``.copy()``), or pass ``annotate=False``.

    Returns
    -------
    list of SkipConnection
        In graph order of the merge nodes.

    Notes
    -----
    With ``annotate``, ``G.graph["skip_connections"]`` holds one dict per fork
    and merge returned (``merge``, ``fork``, ``skip``, ``residual``, ``kind``), and
    nodes and edges on a branch get ``branch_role`` (``"fork"``, ``"merge"``,
    ``"skip"`` or ``"residual"``; ``"branch"`` on the branches of a parallel one)
    and ``branch_merge`` (the merge node's name). Where they nest, the innermost
    one names a node's or edge's role. Old annotations are cleared first, so an
    edited graph is annotated afresh.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "conv"), ("conv", "add"), ("x", "add"), ("add", "output")])
    >>> nx.set_node_attributes(G, "call_module", "op")
    >>> G.nodes["add"].update(op="call_function", target="operator.add")
    >>> G.nodes["conv"]["num_params"] = 9
    >>> [(s.fork, s.merge, s.skip, s.residual, s.kind) for s in skip_connections(G)]
    [('x', 'add', (), ('conv',), 'identity')]

    Without parameters, ``conv`` would be no learned branch, and the merge no residual:

    >>> G.nodes["conv"]["num_params"] = 0
    >>> skip_connections(G), [s.kind for s in skip_connections(G, "all")]
    ([], ['parallel'])
    """
    wanted = _kinds(kinds)
    if annotate and nx.is_frozen(G):
        raise FxnxValueError(
            "G is a view of another graph (G.subgraph(...), or a frozen graph), whose node "
            "and graph attributes it shares: annotating it would write into that graph. "
            "Annotate a copy (G.subgraph(...).copy()), or pass annotate=False"
        )
    order = {n: i for i, n in enumerate(topological_order(G))}
    flow = _data_flow(G)
    merges = [
        n
        for n in order
        if (G.nodes[n].get("op"), G.nodes[n].get("target")) in MERGE_TARGETS
        and not _integer(G.nodes[n].get("out_dtype"))
        and len({u for u in G.predecessors(n) if u in flow and _carries_tensor(G, u)}) >= 2
    ]
    if not merges:
        if annotate:
            _annotate(G, [])
        return []
    idom = nx.immediate_dominators(flow, _ROOT)
    found = []
    for merge in merges:
        fork = idom[merge]
        inputs = sorted(
            {u for u in G.predecessors(merge) if u in flow and _carries_tensor(G, u)}, key=order.__getitem__
        )
        if fork == _ROOT:
            # No common fork because a branch also reads a side input (cross-attention reads
            # the encoder's output): an input that every other input descends from is the fork.
            fork = next((u for u in inputs if all(
                v == u or v in _between(flow, u, v, order) for v in inputs)), _ROOT)
            if fork == _ROOT:
                continue
        # One that carries the fork's value unchanged first (an nn.Identity, x.float(), a
        # reshape: the skip however the sum is written); then the shortest, and of equal
        # lengths one that projects the fork.
        branches = sorted((_between(flow, fork, u, order) for u in inputs),
                          key=lambda b: (not _carries(G, b), len(b), not _projection(G, b)))
        kind = _kind(G, flow, merge, branches)
        if kind not in wanted:
            continue
        residual = sorted({n for branch in branches[1:] for n in branch}, key=order.__getitem__)
        found.append(
            SkipConnection(
                merge=merge,
                fork=fork,
                skip=branches[0],
                residual=tuple(residual),
                branches=tuple(branches),
                kind=kind,
            )
        )
    if annotate:
        _annotate(G, found)
    return found


def marked(G: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """A copy of ``G`` with its skip connections marked afresh (:func:`skip_connections`), of
    the kinds ``G``'s own marks name (the residuals where it has none): marks written before
    ``G`` was edited (an edge removed) would no longer be its skip connections.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "conv"), ("conv", "add"), ("x", "add"), ("add", "output")])
    >>> nx.set_node_attributes(G, "call_module", "op")
    >>> G.nodes["add"].update(op="call_function", target="operator.add")
    >>> G.nodes["conv"]["num_params"] = 9
    >>> _ = skip_connections(G)
    >>> G.remove_edge("x", "add")
    >>> G.nodes["add"]["branch_role"], marked(G).nodes["add"]["branch_role"]
    ('merge', None)
    """
    H = G.copy()
    named = G.graph.get("skip_connections")
    kinds = {s.get("kind") for s in named if isinstance(s, dict)} if isinstance(named, list) else set()
    skip_connections(H, [k for k in SKIP_KINDS if k in kinds] or RESIDUALS)
    return H


def _kinds(kinds: str | Collection[str]) -> frozenset[str]:
    wanted = frozenset(SKIP_KINDS if kinds == "all" else [kinds] if isinstance(kinds, str) else kinds)
    unknown = sorted(wanted - set(SKIP_KINDS), key=str)
    if unknown or not wanted:
        raise FxnxValueError(
            f"skip_connections: kinds must name some of {', '.join(SKIP_KINDS)} or be 'all', "
            f"got {kinds!r}"
        )
    return wanted


def _kind(G: nx.MultiDiGraph, flow: nx.DiGraph, merge: str,
          branches: list[tuple[str, ...]]) -> str:
    """What the fork and merge is (:data:`SKIP_KINDS`), from its branches, shortest first."""
    skip, others = branches[0], branches[1:]
    if not _adds(G.nodes[merge]) or not all(_learned(G, flow, b) for b in others):
        return "parallel"
    if _carries(G, skip):
        return "identity"
    if _projection(G, skip) and not any(_projection(G, b) for b in others):
        return "projection"
    return "parallel"


def _adds(data: dict[str, Any]) -> bool:
    return "add" in str(data.get("target"))


def _learned(G: nx.MultiDiGraph, flow: nx.DiGraph, branch: tuple[str, ...]) -> bool:
    """Whether a node on ``branch`` holds parameters or reads a parameter from outside the data."""
    return any(
        G.nodes[n].get("num_params") or any(
            G.nodes[p].get("num_params") for p in G.predecessors(n) if p not in flow)
        for n in branch
    )


def _carries(G: nx.MultiDiGraph, branch: tuple[str, ...]) -> bool:
    """Whether ``branch`` carries the fork's value unchanged (empty, or views and casts only)."""
    return all(_CARRIES.fullmatch(node_kind(G.nodes[n])) for n in branch)


def _projection(G: nx.MultiDiGraph, branch: tuple[str, ...]) -> bool:
    """Whether ``branch`` only projects: at least one layer, and nothing but layers, norms, views."""
    names = [node_kind(G.nodes[n]) for n in branch]
    return any(_PROJECTION_LAYERS.fullmatch(n) for n in names) and all(
        _PROJECTION_LAYERS.fullmatch(n) or _PROJECTION_EXTRAS.fullmatch(n) or _CARRIES.fullmatch(n)
        for n in names)


def _between(flow: nx.DiGraph, fork: Any, node: Any, order: dict[Any, int]) -> tuple[Any, ...]:
    """The nodes on the paths from ``fork`` to ``node``, ``node`` included, in graph order:
    ``node``'s ancestors that descend from ``fork`` (none where ``node`` is ``fork``).

    The search goes up from ``node`` no further back than ``fork``'s place in the
    topological ``order``: where ``fork`` dominates ``node``, every node it meets is on
    such a path, so finding a merge's branches costs what they hold, not the graph's size.
    """
    if node == fork:
        return ()

    def later(w: Any) -> Iterator[Any]:  # w's inputs that come after fork
        return (u for u in flow.predecessors(w) if order.get(u, -1) > order[fork])

    up = sorted({node, *(v for _, v in nx.generic_bfs_edges(flow, node, neighbors=later))},
                key=order.__getitem__)
    below = {fork}  # of those, the ones that descend from fork: all of them, under a dominator
    for w in up:
        if any(u in below for u in flow.predecessors(w)):
            below.add(w)
    return tuple(w for w in up if w in below)


def _annotate(G: nx.MultiDiGraph, skips: list[SkipConnection]) -> None:
    # Every node and edge gets both attributes, None off every branch: tools that want one set
    # of attribute names on all nodes (torch_geometric's from_networkx) read every graph.
    for _, data in G.nodes(data=True):
        data["branch_role"] = data["branch_merge"] = None
    for *_, data in G.edges(data=True):
        data["branch_role"] = data["branch_merge"] = None
    G.graph.pop("skip_connections", None)
    if skips:  # an empty list breaks torch_geometric's from_networkx: written only when found
        G.graph["skip_connections"] = [
            {"merge": s.merge, "fork": s.fork, "skip": list(s.skip), "residual": list(s.residual),
             "kind": s.kind}
            for s in skips
        ]
    # Innermost first (fewest nodes between fork and merge); an annotation is never overwritten.
    for s in sorted(skips, key=lambda s: len(s.skip) + len(s.residual)):
        roles = ("branch", "branch") if s.kind == "parallel" else ("skip", "residual")
        for role, branch, shortest in zip(roles, (s.skip, s.residual), (True, False), strict=True):
            members = set(branch)
            for node in branch:
                _claim(G.nodes[node], "branch_role", role)
                _claim(G.nodes[node], "branch_merge", s.merge)
            # Only edges into a branch node or the merge can lie on the branch (a fork's
            # out-edges can be many: one input read by every block).
            for u, v, data in G.in_edges([*branch, s.merge], data=True):
                if (u == s.fork or u in members) and (shortest or (u, v) != (s.fork, s.merge)):
                    _claim(data, "branch_role", role)
                    _claim(data, "branch_merge", s.merge)
        _claim(G.nodes[s.fork], "branch_role", "fork")
        G.nodes[s.merge]["branch_role"] = "merge"
        G.nodes[s.merge]["branch_merge"] = s.merge


def _claim(data: dict[str, Any], key: str, value: str) -> None:
    """Set ``data[key]`` unless an inner skip connection already has."""
    if data[key] is None:
        data[key] = value


@explained
def scope_subgraph(G: nx.MultiDiGraph, scope: str, *, inputs: bool = True) -> nx.MultiDiGraph:
    """The part of ``G`` computed inside module ``scope``: a copy with every attribute.

    Skip connections are marked afresh on the whole of ``G`` first (:func:`marked`; ``G``
    itself is left as it is), so a branch whose fork lies outside ``scope`` keeps its roles.

    Parameters
    ----------
    G : networkx.MultiDiGraph
    scope : str
        A module path such as ``"layer2"`` or ``"features.denseblock1"``.
    inputs : bool
        Also keep the nodes outside ``scope`` that feed it, for context.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "a"), ("a", "b"), ("b", "c")])
    >>> nx.set_node_attributes(G, {"x": "", "a": "block", "b": "block.inner", "c": ""}, "scope")
    >>> sorted(scope_subgraph(G, "block")), sorted(scope_subgraph(G, "block", inputs=False))
    (['a', 'b', 'x'], ['a', 'b'])
    """
    G = marked(G)
    inside = {
        n for n, data in G.nodes(data=True)
        if (data.get("scope") or "") == scope or (data.get("scope") or "").startswith(scope + ".")
        or (data.get("op") == "call_module" and str(data.get("target", "")).startswith(scope + "."))
    }
    if not inside:
        scopes = sorted({d.get("scope") or "" for _, d in G.nodes(data=True)} - {""})
        raise FxnxValueError(f"no node of G is inside scope {scope!r}; scopes: {scopes[:10]}")
    keep = set(inside)
    if inputs:
        keep |= {u for n in inside for u in G.predecessors(n)}
    return G.subgraph(sorted(keep, key=lambda n: G.nodes[n].get("order", 0))).copy()


def _largest_activation(G: nx.MultiDiGraph) -> dict[str, Any]:
    """The biggest value the forward pass computes from its inputs, by the bytes on the
    node's out-edges (the first of equal size in topological order wins): not an input, a
    parameter, buffer or constant (``get_attr``, a parameter's or buffer's placeholder in an
    ATen graph),
    nor a value computed from those alone (a weight's transpose, ``torch.arange``)."""
    largest: dict[str, Any] = {"node": None, "shape": None, "nbytes": 0}
    fixed: set[str] = set()  # values that do not depend on the inputs
    primals = G.graph.get("primals", {})  # an ATen graph's placeholders: inputs, parameters, buffers
    for node in topological_order(G):
        data = G.nodes[node]
        op = data.get("op")
        if op == "get_attr" or (op == "placeholder" and primals.get(node, {}).get("kind", "input") != "input"):
            fixed.add(node)
            continue
        if op not in ("call_module", "call_function", "call_method"):
            continue
        if set(G.predecessors(node)) <= fixed:
            fixed.add(node)
            continue
        if data.get("phase") == "backward":
            continue
        for _, _, edge in G.out_edges(node, data=True):
            if (edge.get("nbytes") or 0) > largest["nbytes"]:
                largest = {"node": node, "shape": edge["shape"], "nbytes": edge["nbytes"]}
    return largest


@explained
def summary(G: nx.MultiDiGraph) -> dict[str, Any]:
    """Key facts about a converted graph, as plain data.

    Returns
    -------
    dict
        ``model``, ``nodes``, ``edges``, ``census`` (by op), ``targets``
        (census of call targets), ``num_params``, ``depth`` (longest path, in
        edges), ``skip_connections`` (residuals, counted), ``identity_skips``,
        ``parallel_branches`` (other forks and merges, :data:`SKIP_KINDS`),
        ``largest_activation`` (node, shape and bytes of the biggest activation: a
        forward node's output computed from the inputs, not a parameter, buffer or constant
        nor a value made from those alone, as a weight's transpose),
        ``costs`` (:func:`fxnx.frames.cost_summary`: parameters trainable and frozen, FLOPs,
        multiply-adds) and ``memory`` (the peak of live activation bytes over the pass
        and its node, :func:`fxnx.memory_profile`; None where shapes are unknown).
    """
    from ._memory import memory_profile  # neighbours, and summary is their one user here
    from .frames import cost_summary  # both read G alone; imported here: they import analysis'

    skips = skip_connections(G, "all", annotate=False)  # a summary only reads G
    residuals = [s for s in skips if s.kind in RESIDUALS]
    largest = _largest_activation(G)
    calls = [
        data.get("module_type") or data.get("target")
        for _, data in G.nodes(data=True)
        if data.get("op") in ("call_module", "call_function", "call_method")
    ]
    return {
        "model": G.graph.get("model"),
        "capture": G.graph.get("capture"),
        "level": G.graph.get("level", "module"),
        "opaque_modules": list(G.graph.get("opaque_modules", [])),
        "nodes": G.number_of_nodes(),
        "edges": G.number_of_edges(),
        "census": census(G),
        "targets": dict(Counter(calls).most_common()),
        "num_params": G.graph.get("num_params"),
        "depth": nx.dag_longest_path_length(G),
        "skip_connections": len(residuals),
        "identity_skips": sum(s.identity for s in skips),
        "parallel_branches": sum(s.kind == "parallel" for s in skips),
        "largest_activation": largest,
        "costs": cost_summary(G),
        "memory": _peak(memory_profile, G),
    }


def _peak(profile: Any, G: nx.MultiDiGraph) -> dict[str, Any] | None:
    """The memory peak of ``G``'s pass, or None where the graph has no shapes to count."""
    try:
        p = profile(G)
    except GraphContractError:
        raise  # a broken graph, not one without shapes
    except FxnxValueError:
        return None
    if not p.peak_bytes:  # no shapes: nothing to count
        return None
    return {"bytes": p.peak_bytes, "node": p.peak_node, "saved_bytes": p.saved_bytes}


def node_kind(data: dict[str, Any]) -> str:
    """A node's kind in a word, the one spelling fxnx uses (census, drawings, plots, skip
    kinds): the module's class (``Conv2d``), the function's or method's own name (``add``;
    ``conv2d`` for ATen's ``torch.ops.aten.conv2d.default``), or the role of a node that calls
    nothing (``input``, ``parameter``, ``output``).

    Examples
    --------
    >>> node_kind({"op": "call_module", "module_type": "torch.nn.modules.conv.Conv2d"})
    'Conv2d'
    >>> node_kind({"op": "call_function", "target": "torch.ops.aten.add.Tensor"})
    'add'
    >>> node_kind({"op": "placeholder"})
    'input'
    """
    op: Any = data.get("op")
    if op in ("call_module", "module"):
        return str(data.get("module_type") or "module").rsplit(".", 1)[-1]
    if op in ("call_function", "call_method"):
        return short_name(str(data.get("target")))
    return {"placeholder": "input", "get_attr": "parameter", "output": "output"}.get(op, str(op or ""))


def short_name(target: str) -> str:
    """The last meaningful part of a qualified target: ``conv2d`` for ``torch.ops.aten.conv2d.default``.

    Examples
    --------
    >>> short_name("torch.nn.modules.conv.Conv2d"), short_name("torch.ops.aten.add.Tensor")
    ('Conv2d', 'add')
    """
    if target.startswith("torch.ops.") and target.count(".") >= 3:
        return target.split(".")[3]
    return target.rsplit(".", 1)[-1]


def format_summary(info: dict[str, Any], top: int = 8) -> str:
    """A terminal table of :func:`summary`'s result."""
    shape = info["largest_activation"]["shape"]
    rows = [
        ("model", info["model"]),
        ("captured by", f"{info['capture']} ({info['level']} level)"),
        ("nodes / edges", f"{info['nodes']} / {info['edges']}"),
        ("parameters", f"{info['num_params']:,}" if info["num_params"] is not None else "?"),
        ("depth (longest path)", info["depth"]),
        (
            "skip connections",
            f"{info['skip_connections']} ({info['identity_skips']} identity, "
            f"{info['skip_connections'] - info['identity_skips']} with a projection; "
            f"{info['parallel_branches']} other parallel branches)",
        ),
        (
            "largest activation",
            f"{info['largest_activation']['node']} "
            f"{'×'.join(map(str, shape)) if isinstance(shape, tuple) else shape} "
            f"({info['largest_activation']['nbytes'] / 2**20:.2f} MiB)",
        ),
    ]
    costs, peak = info.get("costs") or {}, info.get("memory")
    if costs.get("trainable_params") is not None:
        rows.append(("trainable / frozen", f"{costs['trainable_params']:,} / {costs['frozen_params']:,}"))
    if costs.get("flops") is not None:
        backward = f", {costs['backward_flops']:,} backward" if costs.get("backward_flops") else ""
        rows.append(("FLOPs", f"{costs['flops']:,} ({costs['flops'] / 1e9:.2f} G{backward})"))
        rows.append(("multiply-adds", f"{costs['macs']:,}" if costs.get("macs") is not None else "?"))
    if peak:
        saved = f"; {peak['saved_bytes'] / 2**20:.2f} MiB saved for backward" if peak["saved_bytes"] else ""
        rows.append(("memory peak", f"{peak['bytes'] / 2**20:.2f} MiB at {peak['node']}{saved}"))
    if info["opaque_modules"]:
        rows.append(("opaque (not traced)", ", ".join(info["opaque_modules"])))
    rows += [("nodes by op", "")] + [(f"  {op}", n) for op, n in info["census"].items()]
    targets = list(info["targets"].items())
    rows += [(f"most called (top {min(top, len(targets))})", "")]
    rows += [(f"  {short_name(t)}", n) for t, n in targets[:top]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
