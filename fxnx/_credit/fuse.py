"""The graph pass that finds runs of linear layers routed by weight transport in the router's
graph and fuses each into one node (:mod:`.chain`).

A run is two or more ``nn.Linear`` layers, each layer's value read by the next
layer alone, directly or through one elementwise activation nothing else reads, one after
another in the graph with nothing between them but the next layer's own attributes (a write
into a weight, ``torch.no_grad()``'s clamp, would otherwise run after the layers past it), and
no layer holding a weight another layer of the run holds (credit summed in autograd's order).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .chain import Activation, Chain, Step, activation_call, activation_of, chain_call
from .native import NativeSpec, native_call

__all__ = ["fuse"]


def fuse(graph: fx.Graph, root: dict[str, Any], origin: dict[str, fx.Node]) -> None:
    """Replace each run of layers in ``graph`` (see the module's docstring; nodes calling
    :func:`.native.native_call`) by one node calling :func:`.chain.chain_call`. ``root`` holds
    what ``graph``'s attributes name (each run is added to it); ``origin`` maps a node of
    ``graph`` to the captured node it computes (the new node computes the run's first)."""
    taken: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node in taken or _layer(node, root) is None:
            continue
        run = _run_from(node, root)
        if len(run) < 2:
            continue
        first, last = run[0][0], run[-1][2] or run[-1][0]
        key = f"_fxnx_chain{len(root)}"
        root[key] = Chain([
            Step(spec, activation_call(act_node, act, setting, root),
                 (origin[layer.name], origin[act_node.name] if act_node is not None else None))
            for layer, spec, act_node, act, setting in run
        ])
        with graph.inserting_before(first):
            value = graph.call_function(chain_call, (graph.get_attr(key), first.args[-1]))
        last.replace_all_uses_with(value)
        origin[value.name] = origin[first.name]
        for layer, _, act_node, _, _ in reversed(run):
            for n in (act_node, layer):
                if n is None:
                    continue
                taken.add(n)
                own = [a for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr" and len(a.users) == 1]
                graph.erase_node(n)
                for attr in own:
                    graph.erase_node(attr)


def _run_from(node: fx.Node, root: dict[str, Any]) -> list[tuple[fx.Node, NativeSpec, fx.Node | None, Activation | None, Any]]:
    """The run of layers that begins at the layer ``node``: each layer, its spec, its
    activation's node, the activation and its constant."""
    run: list[tuple[fx.Node, NativeSpec, fx.Node | None, Activation | None, Any]] = []
    held: set[int] = set()  # the run's layers and weights, by identity
    current: fx.Node | None = node
    spec = _layer(node, root)
    while current is not None and spec is not None:
        mine = {id(spec.linear), *map(id, spec.weights.values())}
        if held & mine:
            break
        held |= mine
        act_node, act, setting = None, None, None
        end = current
        users = list(current.users)
        if len(users) == 1 and users[0] is current.next:
            found = activation_of(users[0], current, root)
            if found is not None:
                act_node, (act, setting) = users[0], found
                end = act_node
        run.append((current, spec, act_node, act, setting))
        following = list(end.users)
        nxt = following[0] if len(following) == 1 else None
        spec = _layer(nxt, root) if nxt is not None else None
        current = nxt if spec is not None and nxt is not None and nxt.args[-1] is end and _adjacent(end, nxt) else None
    return run


def _adjacent(end: fx.Node, layer: fx.Node) -> bool:
    """Whether nothing runs between ``end`` and ``layer`` but ``layer``'s own attributes."""
    between = end.next
    while between is not layer:
        if between.op != "get_attr" or list(between.users) != [layer]:
            return False
        between = between.next
    return True


def _layer(node: fx.Node, root: dict[str, Any]) -> NativeSpec | None:
    """The spec of a node calling :func:`.native.native_call` for an ``nn.Linear`` on one
    input; None for any other node."""
    if node.op != "call_function" or node.target is not native_call or len(node.args) != 2 or node.kwargs:
        return None
    held = node.args[0]
    spec = root.get(str(held.target)) if isinstance(held, fx.Node) and held.op == "get_attr" else None
    return spec if isinstance(spec, NativeSpec) and spec.linear is not None else None

