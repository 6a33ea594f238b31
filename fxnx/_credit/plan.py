"""A routing plan: everything about routing over ``G`` that does not change from step to step.

:func:`compile_plan` resolves, once per captured graph: the rule bound to each
node, which input occurrence each edge of ``G`` stands for, which occurrences
have no edge in ``G`` (an edge removed from ``G``: its value still flows forward,
but it carries no credit back), which parameters each node owns, and the
checks that make routing over ``G`` faithful to the model. :mod:`.graft` turns
the plan into the router's forward, in which autograd itself carries the
credit backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch.fx as fx
from torch import Tensor, nn

from .._callinfo import bind_call, fetch_attr, occurrences
from .._capture.tracer import NO_GRAD
from .._errors import FxnxValueError
from .nodecall import NodeCall, written_input
from .rules import Exact
from .weight_inputs import origin, param_inputs

_EXACT = Exact()

__all__ = ["Entry", "Plan", "compile_plan"]

#: Chooses the rule of a node: (skeleton call) -> (bound rule, its reported name).
Chooser = Callable[[NodeCall], tuple[Any, str]]


@dataclass
class Entry:
    """One fx node, compiled."""

    node: fx.Node
    call: NodeCall  # name, op, target, module, sources, labels, params, param_inputs; no values
    cut: frozenset[int] = frozenset()  # input occurrences with no edge in G: no credit flows
    rule: Any = None  # None for placeholders, get_attr and output
    rule_name: str = "exact"
    param: str | None = None  # get_attr: the trainable parameter it reads


@dataclass
class Plan:
    """A compiled routing plan over one captured graph; see :func:`compile_plan`."""

    gm: fx.GraphModule
    entries: list[Entry]  # in fx order
    params: dict[str, Tensor]  # qualified name to every trainable parameter credit can reach
    counters: list[Tensor] = field(default_factory=list)  # see _untraced_counters

    @property
    def rules(self) -> dict[str, Any]:
        """Node name to its bound rule."""
        return {e.call.name: e.rule for e in self.entries if e.rule is not None}


def compile_plan(G: nx.MultiDiGraph, gm: fx.GraphModule, model: Any, choose: Chooser) -> Plan:
    """Compile the routing plan of ``G`` over the captured graph ``gm`` of ``model``.

    ``choose`` gives each computing node its bound rule.
    """
    named = model.named_parameters() if isinstance(model, nn.Module) else ()
    param_names = {id(p): name for name, p in named}
    entries: dict[str, Entry] = {}
    weight_nodes: dict[str, str] = {}  # get_attr node name to the parameter it reads, frozen or not
    origins: dict[str, tuple[str, ...] | None] = {}  # see weight_inputs.origin
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        _, names = bind_call(node, gm)
        occ = list(occurrences(node, names))
        params: dict[str, Tensor] = {}
        if module is not None:
            params = {
                param_names.get(id(p), f"{node.target}.{n}"): p
                for n, p in module.named_parameters()
                if p.requires_grad
            }
        call = NodeCall(
            name=node.name, op=node.op, target=node.target, module=module,
            sources=[src.name for _, src in occ], labels=[label for label, _ in occ],
            inputs=[], output=None, params=params, args=node.args, kwargs=dict(node.kwargs),
            owner=_owner(node, module, model),
            **param_inputs(gm, [src for _, src in occ], weight_nodes, origins),
        )
        entry = Entry(node=node, call=call)
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)  # type: ignore[arg-type]
            if isinstance(value, nn.Parameter) and id(value) in param_names:
                weight_nodes[node.name] = param_names[id(value)]
                if value.requires_grad:
                    entry.param = param_names[id(value)]
        origins[node.name] = origin(node, weight_nodes.get(node.name), origins)
        entries[node.name] = entry
    _check_nodes(G, entries, gm, model)
    _check_outputs(G, entries)
    _check_writes(gm)
    for entry in entries.values():
        call = entry.call
        if call.op in ("placeholder", "get_attr"):
            continue
        matched = set(_match_edges(G, call, gm, model).values())
        entry.cut = frozenset(k for k in range(len(call.sources)) if k not in matched)
        if call.op != "output":
            # A node the model runs with gradients off passes no credit, whatever the rule.
            entry.rule, entry.rule_name = (_EXACT, "exact") if entry.node.meta.get(NO_GRAD) else choose(call)
    params = {}
    for entry in entries.values():
        params.update(entry.call.params)
        if entry.param is not None:
            params[entry.param] = fetch_attr(gm, entry.node.target)  # type: ignore[arg-type]
    return Plan(gm, list(entries.values()), params, _untraced_counters(gm, model))


def _owner(node: fx.Node, module: nn.Module | None, model: Any) -> type | None:
    """The class of the module whose own ``forward`` ran ``node`` (:attr:`NodeCall.owner`).

    A symbolic trace records the classes themselves in ``nn_module_stack`` and nothing for
    the model's own calls; ``torch.export`` records class names, the model included, so
    its classes are found by their paths in ``model`` (or, failing that, by name).
    """
    if module is not None:
        return type(module)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return type(model) if isinstance(model, nn.Module) else None
    path, cls = list(stack.values())[-1]
    if isinstance(cls, type):
        return cls
    if not isinstance(model, nn.Module):
        return None
    try:
        return type(model.get_submodule(str(path)))
    except AttributeError:  # a path that is not an attribute path: find the class by name
        return _classes(model).get(str(cls))


def _classes(model: nn.Module) -> dict[str, type]:
    """Qualified class name to class, for the modules of ``model``."""
    return {f"{type(m).__module__}.{type(m).__qualname__}": type(m) for m in model.modules()}


def _untraced_counters(gm: fx.GraphModule, model: Any) -> list[Tensor]:
    """The ``num_batches_tracked`` buffers the model's forward bumps but the graph does not.

    A batch norm written in Python (timm's ``BatchNormAct2d``) runs
    ``self.num_batches_tracked.add_(1)`` on a real buffer: a symbolic trace runs it
    once while tracing and records nothing. Such a module, traced through (no
    ``call_module`` node calls it or a module holding it), in training mode with
    ``track_running_stats``, and whose counter no node reads, has its counter
    bumped once per forward, as ``nn.BatchNorm2d`` bumps its own.
    """
    if not isinstance(model, nn.Module):
        return []
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    read = {id(fetch_attr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}  # type: ignore[arg-type]
    counters = []
    for path, module in model.named_modules():
        counter = getattr(module, "num_batches_tracked", None)
        if not (isinstance(counter, Tensor) and module.training and getattr(module, "track_running_stats", False)):
            continue
        if id(counter) in read or any(path == c or path.startswith(c + ".") or not c for c in called):
            continue
        counters.append(counter)
    return counters


def _check_writes(gm: fx.GraphModule) -> None:
    """Refuse a value written in place and read again afterwards under its old name.

    ``h.relu_()`` with its result dropped, then ``l2(h)``: the model's ``l2`` reads
    the written values, but the captured graph (and ``G``) has ``l2`` read ``h``
    itself, so neither the forward nor the credit would follow the model.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        written = written_input(node)
        if written is None or written.op == "get_attr":  # buffers: updated as in model(x)
            continue
        later = sorted((u for u in written.users if position[u] > position[node]), key=position.__getitem__)
        if later:
            raise FxnxValueError(
                f"node {node.name!r} writes into {written.name!r} in place, and later nodes "
                f"({', '.join(repr(u.name) for u in later[:4])}) read {written.name!r} again: "
                "the model's forward reads the written values there, but the captured graph "
                f"reads {written.name!r} as it was, so credit cannot follow the model. In the "
                "model, use the in-place call's result (h = h.relu_() or h = torch.relu(h)), "
                "or convert with routes='export' (which records the write)"
            )



def check_arguments(G: nx.MultiDiGraph) -> None:
    """Refuse parallel edges (one source, one target) that claim the same argument (``arg``).

    An edge stands for one place a value appears in the call of the node it enters; a
    second edge on that place (an edge copied, or an ``arg`` changed to another edge's, as
    in ``x * x``) would stand for nothing, and credit routed over ``G`` would silently
    differ from what its edges say. (An edge from another source on a taken place is an
    edge the model does not have, which :func:`compile_plan` refuses, naming it.)
    """
    claimed: dict[tuple[Any, Any, Any], int] = {}
    for u, v, key, arg in G.edges(keys=True, data="arg"):
        first = claimed.setdefault((u, v, arg), key)
        if first != key:
            raise FxnxValueError(
                f"edges {u!r} -> {v!r} (keys {first} and {key}) both claim argument {arg!r} of "
                f"node {v!r}: each place a value appears in a call has one edge. Remove the "
                f"extra one (G.remove_edge({u!r}, {v!r}, {key})), or give it back the arg it has "
                "in the graph fxnx.convert made"
            )


def _check_nodes(G: nx.MultiDiGraph, entries: dict[str, Entry], gm: fx.GraphModule, model: Any) -> None:
    model_nodes = list(entries)
    missing = [n for n in model_nodes if n not in G]
    extra = sorted(set(G) - set(model_nodes))
    inputs = [n for n in missing if entries[n].call.op == "placeholder"]
    own = {n for n, op in G.nodes(data="op") if op == "placeholder"}
    if inputs and own <= {n for n, e in entries.items() if e.call.op == "placeholder"}:
        # G's inputs and more: one G was not converted with (a keyword argument, most often)
        raise FxnxValueError(
            f"the model was called with input{'s' * (len(inputs) > 1)} {inputs} that G was not "
            "converted with, so G has no node for what the model computes from "
            f"{'them' if len(inputs) > 1 else 'it'}: convert with the same inputs, keyword "
            "arguments included (fxnx.convert(model, x, kwargs={...})), and route with a new "
            "router"
        )
    if missing:
        raise FxnxValueError(
            f"G lacks nodes the model computes: {missing[:8]}{' …' if len(missing) > 8 else ''}. "
            "Route over the graph fxnx.convert made from this model (with the same "
            "leaf_modules and concrete_args); to cut credit paths, remove edges, not nodes. "
            "If the model changed since G was converted (a model that changes itself on its "
            "first call needs that call before it is converted: a warm-up call), convert it "
            "again and build a new router." + _other_graph(G, gm, model)
        )
    if extra:
        raise FxnxValueError(
            f"G has nodes the model does not compute: {extra[:8]}; was G converted from "
            "another model, or with other leaf_modules or concrete_args?" + _other_graph(G, gm, model)
        )


def _check_outputs(G: nx.MultiDiGraph, entries: dict[str, Entry]) -> None:
    """Refuse a model whose output now holds more values than when ``G`` was converted (a flag
    such as ``output_hidden_states`` set since): the new values have no edge in ``G``, which
    would read as edges removed, and they would come back with no credit, silently."""
    recorded = G.nodes["output"].get("out_shape") if "output" in G else None
    output = [e.call for e in entries.values() if e.call.op == "output"]
    if recorded is None or not output:
        return
    had, has = _leaves(recorded), len(output[0].sources)
    if has > had:
        raise FxnxValueError(
            f"the model's output now holds {has} values, where G's output held {had} when it was "
            "converted: the model changed since (a flag or config option that adds outputs, such "
            "as output_hidden_states), and credit would not reach the new ones. Convert it again "
            "as it is now and build a new router"
        )


def _leaves(described: Any) -> int:
    """How many values a node's described output (``out_shape``: a shape, or lists and dicts
    of them, None for a value that is not a tensor) holds."""
    if isinstance(described, list):
        return sum(map(_leaves, described))
    if isinstance(described, dict):
        return sum(map(_leaves, described.values()))
    return 1


def _match_edges(G: nx.MultiDiGraph, call: NodeCall, gm: fx.GraphModule, model: Any) -> dict[tuple[str, str, int], int]:
    """Each in-edge of the node in G, mapped to the input occurrence it stands for (in
    ``gm``, the graph captured now)."""
    index = {(src, label): i for i, (src, label) in enumerate(zip(call.sources, call.labels, strict=True))}
    matched = {}
    for u, v, key, arg in G.in_edges(call.name, keys=True, data="arg"):
        i = index.get((u, arg))
        if i is None:
            raise FxnxValueError(
                f"G has an edge {u} -> {v} (arg {arg!r}) that is not an input of node {v!r} in "
                "the model; credit can only be routed along the model's own dataflow." + _other_graph(G, gm, model)
            )
        matched[(u, v, key)] = i
    return matched


#: The capture routes whose graph follows the inputs it was captured with: their shapes, the
#: Python branches taken on them, and which of them were one tensor.
_SPECIALISED = frozenset({"export", "draft_export", "make_fx"})


def swapped_names(model: Any) -> list[str]:
    """The model's parameters that are plain tensors swapped in for this call (what
    ``torch.func.functional_call`` does)."""
    return [n for n, p in model.named_parameters() if not isinstance(p, nn.Parameter)] if isinstance(model, nn.Module) else []


def swapped_in(model: Any) -> str:
    """A sentence naming the model's parameters that are plain tensors swapped in for this
    call (:func:`swapped_names`), or empty: the router routes credit to the model's own
    parameters, and its feedback weights were made for them."""
    swapped = swapped_names(model)
    if not swapped:
        return ""
    return (
        f" Parameters {swapped[:4]}{' …' if len(swapped) > 4 else ''} are plain tensors "
        "swapped in for this call (torch.func.functional_call does this): the router routes "
        "credit to the model's own parameters, and its rules were bound to them. Call the router "
        "with the model's own parameters (copy other values into them under torch.no_grad()), "
        "or use the model itself under torch.func"
    )


def _other_graph(G: nx.MultiDiGraph, gm: fx.GraphModule, model: Any) -> str:
    """Why the graph captured now may differ from ``G`` though neither was edited: parameters
    swapped in for this call (:func:`swapped_in`); the model in the other mode (train or
    eval) than when ``G`` was converted; for a route whose graph
    follows its inputs, the inputs' shapes that changed since (naming them), else the causes
    that leave no trace in ``G``. Empty where none applies."""
    swapped = swapped_in(model)
    if swapped:
        return swapped
    mode = ""
    then = G.graph.get("training")
    if isinstance(model, nn.Module) and isinstance(then, bool) and model.training != then:
        modes = ("eval", "training")
        mode = (
            f" G was converted with the model in {modes[then]} mode, and it is in "
            f"{modes[model.training]} mode now: its graph may differ between the two (a branch on "
            "self.training; dropout and batch norm in an exported graph). Convert G in the mode "
            f"the model runs in here (model.{'train' if model.training else 'eval'}() before "
            "fxnx.convert) and build a new router."
        )
    if G.graph.get("capture") not in _SPECIALISED:
        return mode
    shapes = _shapes_changed(G, gm)
    if mode or shapes:
        return mode + shapes
    return (
        f" If G was not edited, the model's graph ({G.graph['capture']}) follows its inputs, and a "
        "branch in its Python on their values may take another path for these: convert G with "
        "inputs like these"
    )


def _shapes_changed(G: nx.MultiDiGraph, gm: fx.GraphModule) -> str:
    """A sentence naming the inputs whose shapes differ from those ``G`` was converted with,
    for a route whose graph follows them; empty where none does."""
    changed = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value, had = node.meta.get("val"), G.nodes[node.name].get("out_shape") if node.name in G else None
        if isinstance(value, Tensor) and isinstance(had, tuple) and tuple(value.shape) != had:
            changed.append(f"{node.name} {had} then, {tuple(value.shape)} now")
    if changed:
        return (
            f" The model's graph ({G.graph['capture']}) follows its inputs' shapes, and these differ "
            f"from those G was converted with: {'; '.join(changed[:4])}{' …' if len(changed) > 4 else ''}. "
            "Convert G with inputs shaped like these (a branch in the model's Python may take "
            "another path for them)"
        )
    return ""
