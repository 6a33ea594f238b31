"""Checks: assertions in a graph, the reads that only feed them, and reads nothing uses.

Models check their inputs as they run (timm: ``_assert(H == self.img_size[0])``,
torch.fx: ``_assert_is_none``). Tracing records each check as a chain of nodes
(``getattr`` of ``x.shape``, ``getitem``, ``eq``, ``_assert``) that leads nowhere
the model's output depends on; so does a read whose value is dropped (the ``_`` of
``out, _ = attn(x)``). Drawings leave them out unless asked
(``checks=True``): in Swin-T they are half a figure's width. No pydot, no torch.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

__all__ = ["check_nodes", "without_checks"]

#: Calls that test a value and return nothing the model uses (matched on any dotted part of the
#: node's target, so ``torch._assert``, ``aten._assert_async.msg`` and ``_assert_is_none`` all are).
ASSERTIONS = frozenset({
    "_assert", "_assert_async", "_assert_is_none", "_assert_scalar", "_assert_tensor_metadata",
    "_check", "_check_is_size", "sym_constrain_range", "sym_constrain_range_for_size",
})
#: Reads with no effect: one whose value nothing uses belongs to a check (the f-string of an
#: assertion's message reads ``x.ndim`` again).
READS = frozenset({"getattr", "getitem", "size", "dim", "numel"})


def _called(data: dict[str, Any]) -> set[str]:
    if data.get("op") not in ("call_function", "call_method"):
        return set()
    return set(str(data.get("target") or "").split("."))


def check_nodes(G: nx.MultiDiGraph) -> set[Any]:
    """The nodes of ``G`` that only check values: assertions, and nodes all of whose users are
    checks. A node with any use outside checks (a shape that also sizes a ``view``) is kept,
    and so is an assertion whose result is used.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "getattr"), ("getattr", "eq"), ("eq", "_assert"),
    ...                      ("x", "relu"), ("relu", "output")])
    >>> nx.set_node_attributes(G, "call_function", "op")
    >>> nx.set_node_attributes(G, {"x": "placeholder", "output": "output"}, "op")
    >>> nx.set_node_attributes(G, {"getattr": "builtins.getattr", "eq": "_operator.eq",
    ...                            "_assert": "torch._assert", "relu": "torch.relu"}, "target")
    >>> sorted(check_nodes(G))
    ['_assert', 'eq', 'getattr']
    """
    checks: set[Any] = set()
    # Users before the nodes they read: any topological order will do, so not fxnx's stable one.
    for node in reversed(list(nx.topological_sort(G))):
        data = G.nodes[node]
        if data.get("op") in ("placeholder", "output"):
            continue
        users = set(G.successors(node))
        if users:
            if users <= checks:
                checks.add(node)
        elif _called(data) & (ASSERTIONS | READS):
            checks.add(node)
    return checks


def without_checks(G: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """A copy of ``G`` without its checks, or ``G`` itself when it has none; the copy's
    ``graph["checks_left_out"]`` counts the assertions left out."""
    checks = check_nodes(G)
    if not checks:
        return G
    H = G.copy()
    H.remove_nodes_from(checks)
    H.graph["checks_left_out"] = sum(bool(_called(G.nodes[n]) & ASSERTIONS) for n in checks)
    return H
