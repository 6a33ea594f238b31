"""A routing plan: everything about a credit run that does not change from step to step.

:func:`compile_plan` resolves, once per captured graph: the order in which
nodes are visited backward (reverse topological order of ``G``, ties broken by
fx ``order``), the rule bound to each node, which input occurrence each edge of
``G`` stands for, in which order credits arriving over several edges are summed,
which parameters each node owns, and which inputs need credit at all. A step
is then :meth:`Plan.forward` (one pass over the fx nodes, each run on fresh
leaves so that it keeps its own small autograd graph) and :meth:`Plan.backward`
(one pass over the compiled entries, each a rule call).

Sums over edges follow autograd's order (the latest consumer first, its
arguments in order), so exact routing is bit-equal to autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import Tensor, nn

from .._callinfo import bind_call, fetch_attr, occurrences
from .._compat import pytree
from ..analysis import topological_order
from ..capturing.shapes import node_failure
from ..errors import FxnxValueError
from .record import Credit, NodeCall, detached, fresh_leaf, run_node, written_input
from .result import credit_norm
from .rules import RoutingState

__all__ = ["Plan", "Tape", "compile_plan"]

#: Chooses the rule of a node: (skeleton call) -> (bound rule, its reported name).
Chooser = Callable[[NodeCall], tuple[Any, str]]


@dataclass
class _Entry:
    """One fx node, compiled."""

    node: fx.Node
    call: NodeCall  # name, op, target, module, sources, labels, params, wanted; no values
    grad: list[bool]  # per input occurrence: run the node on a leaf that wants credit
    in_slots: list[tuple[int, int]] = field(default_factory=list)  # (occurrence, edge slot)
    out_slots: list[int] = field(default_factory=list)  # edge slots, in summation order
    rule: Any = None
    rule_name: str = "exact"
    param: str | None = None  # placeholder/get_attr: the trainable parameter it is
    index: int = -1  # position in the forward order


@dataclass
class Tape:
    """One recorded forward pass: each computing node's call, and the model's output.

    ``output`` is what the graph's output node took (a flat tuple for graphs from
    ``torch.export``); ``result`` is the output as the model returns it (the graph's
    codegen rebuilds the structure: a ``ModelOutput``, a dict), made of the same tensors.
    """

    calls: list[NodeCall | None]
    output: Any
    result: Any = None

    def graph_credit(self, flat: Sequence[Credit]) -> Credit:
        """Credit for each leaf of ``result`` (``tree_flatten`` order), in the structure of
        ``output``: what the graph's output node routes."""
        leaves, spec = pytree.tree_flatten(self.result)
        if self.result is self.output:
            return pytree.tree_unflatten(list(flat), spec)
        where = {id(t): k for k, t in enumerate(leaves) if isinstance(t, Tensor)}
        out_leaves, out_spec = pytree.tree_flatten(self.output)
        return pytree.tree_unflatten(
            [flat[where[id(t)]] if isinstance(t, Tensor) and id(t) in where else None for t in out_leaves],
            out_spec,
        )


@dataclass
class Plan:
    """A compiled routing plan over one captured graph; see :func:`compile_plan`."""

    gm: fx.GraphModule
    forward_order: list[_Entry]
    backward_order: list[_Entry]
    slots: int
    params: dict[str, Tensor]  # qualified name to every trainable parameter credit can reach
    counters: list[Tensor] = field(default_factory=list)  # see _untraced_counters

    @property
    def rules(self) -> dict[str, Any]:
        """Node name to its bound rule."""
        return {e.call.name: e.rule for e in self.forward_order if e.rule is not None}

    def forward(self, inputs: Sequence[Any]) -> Tape:
        """Run the graph once on ``inputs`` (one value per placeholder)."""
        env: dict[fx.Node, Any] = {}
        calls: list[NodeCall | None] = []
        feed = iter(inputs)
        output = None
        for entry in self.forward_order:
            node = entry.node
            if node.op == "placeholder":  # as torch.fx's Interpreter feeds them
                target = str(node.target)
                if target.startswith("**"):
                    env[node] = {}
                elif target.startswith("*"):
                    env[node] = tuple(feed)
                else:
                    env[node] = next(feed, node.args[0] if node.args else None)
                continue
            if node.op == "get_attr":
                env[node] = fetch_attr(self.gm, node.target)  # type: ignore[arg-type]
                continue
            leaves: list[Any] = []
            flags = iter(entry.grad)

            def substitute(n: fx.Node, leaves: list[Any] = leaves, flags: Any = flags) -> Any:
                value = env[n]
                # Buffers and tensor constants (BatchNorm's running stats) are constants, not
                # leaves: credit never flows into them, and ops such as native_batch_norm
                # refuse to differentiate them.
                if n.op == "get_attr" and not isinstance(value, nn.Parameter):
                    leaf = value
                else:
                    leaf = fresh_leaf(value) if next(flags) else detached(value)
                leaves.append(leaf)
                return leaf

            args = fx.node.map_arg(node.args, substitute)
            kwargs = fx.node.map_arg(node.kwargs, substitute)
            skeleton = entry.call
            if node.op == "output":
                out = output = args[0]
            else:
                try:
                    out = run_node(node, skeleton.module, args, kwargs)
                except Exception as err:
                    raise node_failure("the credit run's forward pass", node, args, kwargs, err) from err
            env[node] = out
            calls.append(NodeCall(
                name=skeleton.name, op=skeleton.op, target=skeleton.target, module=skeleton.module,
                sources=skeleton.sources, labels=skeleton.labels, inputs=leaves, output=out,
                params=skeleton.params, wanted=skeleton.wanted, args=args, kwargs=kwargs,
                param_inputs=skeleton.param_inputs,
            ))
        if self.counters:
            with torch.no_grad():
                for counter in self.counters:
                    counter.add_(1)
        return Tape(calls, output, self.gm.graph.process_outputs(output))

    def backward(
        self, tape: Tape, output_credit: Credit, state: RoutingState, *, keep: bool = True,
        norms: dict[str, float | None] | None = None,
    ) -> tuple[dict[str, Credit], dict[str, Tensor], dict[str, str]]:
        """Route ``output_credit`` back over the plan; consumes ``tape``.

        Returns node credit (only if ``keep``), parameter credit by qualified name,
        and the name of the rule used at each node that had credit. ``norms``, if
        given, receives each node's credit norm, taken while the credit is fresh in
        the cache (a pass over every node's credit afterwards costs a sixth of the run).
        """
        node_credit: dict[str, Credit] = {}
        param_credit: dict[str, Tensor] = {}
        used: dict[str, str] = {}
        edge_credit: list[Credit] = [None] * self.slots
        calls = tape.calls
        for entry in self.backward_order:
            credit = None
            for slot in entry.out_slots:
                c = edge_credit[slot]
                if c is not None:
                    edge_credit[slot] = None
                    credit = c if credit is None else _tree_add(credit, c)
            name = entry.call.name
            if entry.call.op == "output":
                credit = output_credit
            if keep:
                node_credit[name] = credit
            if norms is not None:
                norms[name] = credit_norm(credit)
            if entry.rule is None:  # placeholder or get_attr: credit ends here
                if entry.param is not None and credit is not None:
                    param_credit[entry.param] = _tree_add(param_credit.get(entry.param), credit)
                continue
            if credit is None:
                continue
            call = calls[entry.index]
            calls[entry.index] = None  # free the node's graph and activations once routed
            input_credit, params = entry.rule(call, credit, state)
            used[name] = entry.rule_name
            for i, slot in entry.in_slots:
                if input_credit[i] is not None:
                    edge_credit[slot] = input_credit[i]
            for pname, g in params.items():
                param_credit[pname] = _tree_add(param_credit.get(pname), g)
        return node_credit, param_credit, used


def compile_plan(
    G: nx.MultiDiGraph,
    gm: fx.GraphModule,
    model: Any,
    choose: Chooser,
    *,
    training: bool,
) -> Plan:
    """Compile the routing plan of ``G`` over the captured graph ``gm`` of ``model``.

    ``choose`` gives each computing node its bound rule. With ``training``, only
    inputs through which credit can reach a trainable parameter are run as leaves
    that want credit (as autograd differentiates only what requires grad);
    otherwise every floating input is, so credit is reported at every node.
    """
    named = model.named_parameters() if isinstance(model, nn.Module) else ()
    param_names = {id(p): name for name, p in named}
    entries: dict[str, _Entry] = {}
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        _, names = bind_call(node, gm)
        occ = list(occurrences(node, names))
        params = {}
        if module is not None:
            params = {
                param_names.get(id(p), f"{node.target}.{n}"): p
                for n, p in module.named_parameters()
                if p.requires_grad
            }
        call = NodeCall(
            name=node.name, op=node.op, target=node.target, module=module,
            sources=[src.name for _, src in occ], labels=[label for label, _ in occ],
            inputs=[], output=None, params=params,
            param_inputs=_param_inputs(gm, [src.name for _, src in occ], entries),
        )
        entry = _Entry(node=node, call=call, grad=[])
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)  # type: ignore[arg-type]
            if isinstance(value, nn.Parameter) and value.requires_grad and id(value) in param_names:
                entry.param = param_names[id(value)]
        entries[node.name] = entry
    _check_nodes(G, list(entries))
    _check_writes(gm)

    order = {n: i for i, n in enumerate(topological_order(G))}
    needs = _needs_credit(G, order, entries) if training else None
    slot_of: dict[tuple[str, str, int], int] = {}
    for name in reversed(order):
        # Sum as autograd accumulates: the latest consumer first, its arguments in order.
        out_edges = sorted(G.out_edges(name, keys=True), key=lambda e: (-order[e[1]], e[2]))
        entries[name].out_slots = [slot_of.setdefault(edge, len(slot_of)) for edge in out_edges]

    forward_order = list(entries.values())
    for entry in forward_order:
        call = entry.call
        if call.op in ("placeholder", "get_attr"):
            continue
        matched = _match_edges(G, call)
        wanted = [False] * len(call.sources)
        for edge, k in matched.items():
            if needs is None or needs[edge[0]] or call.op == "output":
                wanted[k] = True
                entry.in_slots.append((k, slot_of[edge]))
        call.wanted = wanted
        # Constants (get_attr buffers) are skipped by the forward; the rest take a flag each.
        entry.grad = [
            wanted[k] or needs is None or call.op == "output"
            for k, src in enumerate(call.sources)
            if not _is_constant(entries[src])
        ]
        entry.rule, entry.rule_name = choose(call)
    _number_calls(forward_order)
    params: dict[str, Tensor] = {}
    for entry in forward_order:
        params.update(entry.call.params)
        if entry.param is not None:
            params[entry.param] = fetch_attr(gm, entry.node.target)  # type: ignore[arg-type]
    backward_order = [entries[n] for n in reversed(order)]
    return Plan(gm, forward_order, backward_order, len(slot_of), params, _untraced_counters(gm, model))


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


def _param_inputs(gm: fx.GraphModule, sources: list[str], entries: dict[str, _Entry]) -> dict[int, tuple[str, Tensor]]:
    """Input occurrence to (qualified name, parameter) for the sources that are trainable
    parameters (get_attr nodes; their entries come before any node that reads them)."""
    found = {}
    for k, src in enumerate(sources):
        entry = entries.get(src)
        if entry is not None and entry.param is not None:
            found[k] = (entry.param, fetch_attr(gm, entry.node.target))  # type: ignore[arg-type]
    return found


def _number_calls(forward_order: list[_Entry]) -> None:
    """Index each computing entry by its place among the recorded calls."""
    k = 0
    for entry in forward_order:
        if entry.call.op in ("placeholder", "get_attr"):
            entry.index = -1
        else:
            entry.index = k
            k += 1


def _is_constant(entry: _Entry) -> bool:
    """A get_attr node that is no parameter (a buffer, a tensor constant): the forward
    passes its value as it is."""
    node = entry.node
    if node.op != "get_attr":
        return False
    return not isinstance(fetch_attr(node.graph.owning_module, node.target), nn.Parameter)  # type: ignore[arg-type]


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


def _needs_credit(G: nx.MultiDiGraph, order: Mapping[str, int], entries: Mapping[str, _Entry]) -> dict[str, bool]:
    """Whether credit at each node can reach a trainable parameter (through G's edges)."""
    needs: dict[str, bool] = {}
    for name in order:
        entry = entries[name]
        needs[name] = bool(entry.call.params) or entry.param is not None or any(
            needs[u] for u in G.predecessors(name)
        )
    return needs


def _check_nodes(G: nx.MultiDiGraph, model_nodes: list[str]) -> None:
    missing = [n for n in model_nodes if n not in G]
    extra = sorted(set(G) - set(model_nodes))
    if missing:
        raise FxnxValueError(
            f"G lacks nodes the model computes: {missing[:8]}{' …' if len(missing) > 8 else ''}. "
            "Route over the graph fxnx.convert made from this model (with the same "
            "leaf_modules and concrete_args); to cut credit paths, remove edges, not nodes. "
            "If the model changed since G was converted, convert it again and build a new router."
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


def _tree_add(a: Credit, b: Credit) -> Credit:
    """Sum two credits of the same structure; None is zero."""
    if a is None:
        return b
    if b is None:
        return a
    return pytree.tree_map(lambda x, y: y if x is None else x if y is None else x + y, a, b)
