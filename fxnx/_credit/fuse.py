"""The graph pass that finds runs of linear layers in the router's graph and fuses each into
one node: under weight transport (:mod:`.chain`) and under direct feedback alignment
(:mod:`.direct_chain`).

A run is two or more ``nn.Linear`` layers all under one rule family (under direct feedback,
one tap and routing state), each layer's value read by
the next layer alone, directly or through one elementwise activation nothing else reads, one
after another in the graph with nothing between them but the next layer's own attributes (a
write into a weight, ``torch.no_grad()``'s clamp, would otherwise run after the layers past
it), and no layer holding a weight another layer of the run holds (credit summed in autograd's
order). Under direct feedback the output's tap also reads each layer's input: the fused node
returns those inputs for it. A value the model returns (read by the tap as output) ends a run.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch.fx as fx
from torch import nn

from .chain import Activation, Chain, Step, activation_call, activation_of, chain_call
from .direct_chain import DirectChain, DirectStep, direct_chain_call
from .native import NativeSpec, native_call
from .taps import direct_linear, tap_output

__all__ = ["fuse"]

#: A layer of a run: a weight-transport layer's spec, or a direct-feedback ``nn.Linear``.
Layer = NativeSpec | nn.Linear


def fuse(graph: fx.Graph, root: dict[str, Any], origin: dict[str, fx.Node]) -> None:
    """Replace each run of layers in ``graph`` (see the module's docstring; nodes calling
    :func:`.native.native_call` or :func:`.taps.direct_linear`) by one node calling
    :func:`.chain.chain_call` or :func:`.direct_chain.direct_chain_call`. ``root`` holds what
    ``graph``'s attributes name (each run is added to it); ``origin`` maps a node of ``graph``
    to the captured node it computes (the new node computes the run's first)."""
    taken: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node in taken or _layer(node, root) is None:
            continue
        run = _run_from(node, root)
        if len(run) < 2:
            continue
        first, last = run[0][0], run[-1][2] or run[-1][0]
        key = f"_fxnx_chain{len(root)}"
        steps = [(layer, held, activation_call(act_node, act, setting, root),
                  (origin[layer.name], origin[act_node.name] if act_node is not None else None))
                 for layer, held, act_node, act, setting in run]
        with graph.inserting_before(first):
            if first.target is native_call:
                root[key] = Chain([Step(cast(NativeSpec, held), act, pair) for _, held, act, pair in steps])
                value = graph.call_function(chain_call, (graph.get_attr(key), first.args[-1]))
                given = {last: value}
            else:
                root[key] = DirectChain([DirectStep(cast(nn.Linear, held), cast(int, layer.args[2]), act, pair)
                                         for layer, held, act, pair in steps])
                value = graph.call_function(direct_chain_call, (graph.get_attr(key), *first.args[:2], first.args[-1]))
                # its output, then each later layer's input, which the output's tap reads
                places = {last: 0} | {cast(fx.Node, layer.args[-1]): k for k, (layer, *_) in enumerate(run[1:], 1)}
                given = {v: graph.call_function(operator.getitem, (value, k)) for v, k in places.items()}
        for old, new in given.items():
            old.replace_all_uses_with(new)
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


def _run_from(node: fx.Node, root: dict[str, Any]) -> list[tuple[fx.Node, Layer, fx.Node | None, Activation | None, Any]]:
    """The run of layers that begins at the layer ``node``: each layer, what it holds (see
    :func:`_layer`), its activation's node, the activation and its constant."""
    run: list[tuple[fx.Node, Layer, fx.Node | None, Activation | None, Any]] = []
    held: set[int] = set()  # the run's layers and weights, by identity
    current: fx.Node | None = node
    layer = _layer(node, root)
    while current is not None and layer is not None:
        mine = _held(layer)
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
        run.append((current, layer, act_node, act, setting))
        # (direct feedback: the output's tap reads each layer's input too, and a run returns
        # its later layers' inputs for it; a value the model returns, bare or inside its
        # output, ends the run, as a weight-transport run returns only its output)
        following = [user for user in end.users if user.target is not tap_output or _returns(user, end)]
        nxt = following[0] if len(following) == 1 else None
        layer, current = None, None
        if nxt is not None and nxt.target is node.target and nxt.args[-1] is end and (
                node.target is native_call or nxt.args[:2] == node.args[:2]):  # direct: one tap, one state
            layer = _layer(nxt, root)
            current = nxt if layer is not None and _adjacent(end, nxt) else None
    return run


def _returns(tap: fx.Node, value: fx.Node) -> bool:
    """Whether the output's tap takes ``value`` as (part of) the model's output, not only as
    an input it projects onto."""
    found: list[fx.Node] = []
    fx.node.map_arg(tap.args[2], found.append)
    return value in found


def _adjacent(end: fx.Node, layer: fx.Node) -> bool:
    """Whether nothing runs between ``end`` and ``layer`` but ``layer``'s own attributes."""
    between = end.next
    while between is not layer:
        if between.op != "get_attr" or list(between.users) != [layer]:
            return False
        between = between.next
    return True


def _layer(node: fx.Node, root: dict[str, Any]) -> Layer | None:
    """What a node holds where it runs one ``nn.Linear`` on one input: the spec of a node
    calling :func:`.native.native_call`, the layer of one calling :func:`.taps.direct_linear`;
    None for any other node."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is native_call and len(node.args) == 2:
        spec = _attribute(node.args[0], root)
        return spec if isinstance(spec, NativeSpec) and spec.linear is not None else None
    if node.target is direct_linear and len(node.args) == 5 and isinstance(node.args[2], int):
        layer = _attribute(node.args[3], root)
        return layer if type(layer) is nn.Linear else None
    return None


def _attribute(arg: Any, root: dict[str, Any]) -> Any:
    """What ``arg`` names in ``root`` where it is an attribute node; None otherwise."""
    return root.get(str(arg.target)) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None


def _held(layer: Layer) -> set[int]:
    """The identities of a layer and the weights it holds."""
    if isinstance(layer, NativeSpec):
        return {id(layer.linear), *map(id, layer.weights.values())}
    return {id(layer), *(id(p) for p in layer.parameters(recurse=False))}
