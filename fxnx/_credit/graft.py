"""The router's forward: the captured graph, with each node's rule grafted into autograd.

:func:`graft` turns a compiled :class:`~fxnx._credit.plan.Plan` into a
``GraphModule`` whose forward computes what the model computes and whose
autograd backward *is* the routing over ``G``. Autograd already sums a node's
credit over its out-edges and runs nodes in reverse topological order; what is
left to say is, per node, how its credit goes back to its inputs (:func:`tier`):

- **exact** nodes are the captured graph's own nodes, untouched: autograd's
  backward, at autograd's cost.
- **an edge removed from** ``G`` becomes a ``detach`` of that argument: its
  value flows forward, no credit flows back.
- **weight transport** (feedback alignment, sign symmetry) on linear layers,
  convolutions, attention and transformer layers runs the layer as it is, with
  the feedback weight ``B`` swapped in for ``W`` in what its backward saves
  (:mod:`.native`); a run of linear layers, joined by activations, runs as one
  autograd function (:mod:`.chain`).
- **direct feedback alignment** runs the layer on its inputs detached (its
  parameters get exact credit); autograd functions at the model's output and on
  the layer's output send each such input ``e·B`` (:mod:`.taps`).
- **any other rule** (a user's rule, attention, a layer without a transport of
  its own, anything under autocast) runs its node inside an autograd function
  whose backward calls the rule and checks what it returns (:mod:`.ruled`).

With ``collect=True`` the module also returns every node's value, for
:func:`~fxnx.route_credit` to ask autograd for the credit at each; nodes that
hand an input back unchanged (``nn.Identity``, dropout in eval mode) get a value
of their own, so each node's credit is its own. Writes in place follow the model
(:mod:`.faithful` finds them, however they are spelled): a write that a later node
sees runs in place, and each value it overwrites is reported through a copy taken
before the write; a write nothing sees afterwards runs out of place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx
from torch import Tensor

from .._callinfo import fetch_attr
from .._capture.shapes import node_failure
from .._capture.tracer import NO_GRAD, is_torch_nn
from .._compat import pytree
from .._errors import FxnxValueError
from .chain import chain_call
from .direct_chain import direct_chain_call
from .faithful import Probe, differs
from .fuse import fuse
from .kinds import LINEAR_FUNCTIONS, NATIVE_FUNCTIONS, WEIGHTED_MODULES
from .native import NativeSpec, native_call
from .nodecall import NodeCall, call_target, run_node, runs_out_of_place
from .plan import Entry, Plan
from .ruled import FunctionSpec, detached, function_call, rebuilt
from .rules import DirectFeedbackAlignment, Exact, RoutingState, Transport
from .taps import TapSpec, direct_f_linear, direct_linear, receive, tap_output

__all__ = ["Graft", "graft"]



@dataclasses.dataclass
class Graft:
    """The router's forward over one plan; call it with one value per placeholder."""

    gm: fx.GraphModule
    plan: Plan
    collect: bool
    names: list[str]  # collect: the node whose value is at each place of the second result
    starred: list[str]  # each placeholder's kind: "" plain, "*" rest of the inputs, "**" keywords
    origin: dict[str, fx.Node]  # a node of gm to the captured node it computes
    #: The probe run of the captured graph that made this graft: the first run, on the same
    #: inputs, must give its output (checked once, then dropped).
    expect: Probe | None = dataclasses.field(default=None, repr=False)
    #: Every node routed exactly, every edge in ``G``, no value collected: routing is
    #: autograd's own, and the router runs the model's own forward (:class:`CreditRouter`).
    plain: bool = False
    #: (node, input) for each write a node makes into an input of the model, in place
    writes_inputs: tuple[tuple[str, str], ...] = ()
    #: the type the model returns where the graph returns a plain dict (a ModelOutput)
    rebuild: type | None = None

    def __call__(self, inputs: Sequence[Any]) -> tuple[Any, Any, Any]:
        """Run the graph: (the model's result, the graph's output, node values or None)."""
        out = self.gm(*self.placeholders(inputs))
        if self.plan.counters:
            with torch.no_grad():
                for counter in self.plan.counters:
                    counter.add_(1)
        output, nodes = out if self.collect else (out, None)
        result = self.plan.gm.graph.process_outputs(output)
        if self.expect is not None:
            self._check(result)
        if self.rebuild is not None:  # a ModelOutput the trace made a dict
            result = self.rebuild(**result)
        return result, output, nodes

    def _check(self, result: Any) -> None:
        """The first run's output against the captured graph's (:mod:`.faithful`)."""
        expect, self.expect = self.expect, None
        assert expect is not None  # the caller checks
        problem = differs(result, expect.output)
        if problem is not None:
            raise FxnxValueError(
                f"the credit run's forward pass does not compute what the captured graph "
                f"computes: {problem}. fxnx returns no credit for another forward; route this "
                "model with rule='exact' and no edges removed to find whether a rule or an edit "
                "of G causes it, and report the model if neither does"
            )

    def placeholders(self, inputs: Sequence[Any]) -> list[Any]:
        """One value per placeholder of ``gm``, from the capture's placeholder values."""
        values: list[Any] = []
        feed = iter(inputs)
        for kind, node in zip(self.starred, self.gm.graph.find_nodes(op="placeholder"), strict=True):
            if kind == "*":
                values.append(tuple(feed))
            elif kind == "**":
                values.append({})
            else:
                values.append(next(feed, node.args[0] if node.args else None))
        return values

    def probe(self, inputs: Sequence[Any]) -> None:
        """Run ``gm`` node by node (under ``torch.no_grad()``, by the caller): a node that
        fails raises an error naming the captured node it computes."""
        graft = self

        class Probe(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                if n.target is chain_call:  # a run of layers: each of its nodes on its own
                    chain, x = self.fetch_args_kwargs_from_env(n)[0]
                    return self.run_calls([c for step in chain.steps for c in step.calls()], x)
                if n.target is direct_chain_call:  # its output, then each later layer's input
                    chain, tap, state, x = self.fetch_args_kwargs_from_env(n)[0]
                    outs = [x := self.run_calls(step.calls(tap, state), x) for step in chain.steps]
                    return (outs.pop(), *outs)
                try:
                    return super().run_node(n)
                except Exception as err:
                    captured = graft.origin.get(n.name)
                    if captured is None:
                        raise
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    raise node_failure("the credit run's forward pass", captured, args, kwargs, err) from err

            def run_calls(self, calls: list[tuple[Any, fx.Node]], x: Any) -> Any:
                for call, captured in calls:
                    try:
                        x = call(x)
                    except Exception as err:
                        raise node_failure("the credit run's forward pass", captured, (x,), {}, err) from err
                return x

        Probe(self.gm).run(*self.placeholders(inputs))


def tier(entry: Entry) -> str:
    """How a node's rule enters autograd: "exact", "native", "direct" or "function"."""
    rule = entry.rule
    if rule is None or type(rule).__call__ is Exact.__call__:
        return "exact"
    if isinstance(rule, Transport) and type(rule).__call__ is Transport.__call__ and _native(entry.call):
        return "native"
    if type(rule).__call__ is DirectFeedbackAlignment.__call__:
        return "direct"
    return "function"


def _native(call: NodeCall) -> bool:
    """Whether ``call``'s layer saves its weights as they are (a weight made by a chain that
    may copy, ``W.to(x.dtype)``, is another tensor: its layer runs on its own graph), each
    for its input's credit alone: a product of two weights (``A @ W``, learned queries
    ``F.linear(Q, W)``) saves each for the other's credit, which must stay exact, so it runs
    on its own graph too."""
    if call.module is not None:
        return type(call.module) in WEIGHTED_MODULES
    return (_calls(call, NATIVE_FUNCTIONS) and not any(getattr(chain, "copies", False) for chain in call.param_views.values())
            and sum(p.dim() >= 2 for _, p in call.param_inputs.values()) <= 1)


def graft(plan: Plan, *, seed: int, collect: bool = False, fused: bool = True, probe: Probe | None = None) -> Graft:
    """The router's forward over ``plan`` (see the module's docstring).

    ``probe`` is what one run of the captured graph showed (:func:`.faithful.probe`): nodes
    that hand back a value another node holds get, with ``collect``, an alias of their own;
    writes in place that a later node sees run in place, as in the model, and every value
    they overwrite is reported through a copy of its own (:func:`_snapshot`); a write no later
    node sees may run out of place. Without it, every write is taken as one nothing sees.
    ``fused``: each run of linear layers runs as one node (:func:`.fuse.fuse`; never with
    ``collect``, whose credit is every node's).

    Raises
    ------
    FxnxValueError
        A node whose write later nodes see has a rule that runs it apart from the graph, or
        an edge into what it writes was removed from ``G``.
    """
    probe = probe if probe is not None else Probe()
    gm = plan.gm
    graph = fx.Graph()
    root: dict[str, Any] = {}
    env: dict[fx.Node, fx.Node] = {}
    state: fx.Node | None = None
    taps: list[tuple[Entry, int, fx.Node]] = []  # direct feedback: (entry, occurrence, value)
    tap_spec, tap_node = TapSpec(), None
    # Direct feedback stays at the output for a node written into, writing, or handing back
    # a value another node holds, and for one the backward pass never reaches.
    credited = _credited(plan)
    at_output = {v for victims in probe.writers.values() for v in victims} | set(probe.writers) | probe.shared
    starred, names, collected = [], [], []
    origin: dict[str, fx.Node] = {}
    # Where a write runs out of place its victims keep their values; elsewhere each victim's
    # credit is reported through a copy of its own, taken before the write.
    nodes = {e.node.name: e.node for e in plan.entries}
    # (writer, input) for each write into an input of the model
    writes_inputs = tuple((w, v) for w, victims in probe.writers.items() for v in victims if nodes[v].op == "placeholder")
    if collect:
        _refuse_shared_inputs(writes_inputs)
    apart = {w for w in probe.writers if w not in probe.observed and runs_out_of_place(nodes[w])}
    snapshot: dict[str, list[str]] = {}
    light: set[str] = set()
    for writer, victims in probe.writers.items():
        for victim in victims:
            if writer in apart:
                light.add(victim)
            else:
                snapshot.setdefault(victim, []).append(writer)

    def constant(prefix: str, value: Any) -> fx.Node:
        name = f"_fxnx_{prefix}{len(root)}"
        root[name] = value
        return graph.get_attr(name)

    def routing_state() -> fx.Node:
        nonlocal state
        if state is None:
            with graph.inserting_after(last_placeholder):
                state = graph.call_function(RoutingState, (), {"seed": seed})
        return state

    def tap() -> fx.Node:
        nonlocal tap_node
        if tap_node is None:
            tap_node = constant("tap", tap_spec)
        return tap_node

    def collect_value(name: str, value: fx.Node) -> None:
        names.append(name)
        if collect and name in snapshot:
            value = graph.call_function(_snapshot, (constant("snap", (name, tuple(snapshot[name]))), value))
        elif collect and name in light:
            value = graph.call_function(_light, (value,))
        collected.append(value)

    last_placeholder: fx.Node | None = None
    for entry in plan.entries:
        node = entry.node
        if node.op == "placeholder":
            target = str(node.target)
            starred.append("**" if target.startswith("**") else "*" if target.startswith("*") else "")
            env[node] = last_placeholder = graph.placeholder(f"input_{len(starred)}")
            origin[env[node].name] = node
            collect_value(node.name, env[node])
            continue
        if node.op == "get_attr":
            root[cast(str, node.target)] = fetch_attr(gm, node.target)  # type: ignore[arg-type]
            env[node] = graph.get_attr(node.target)  # type: ignore[arg-type]
            if collect and entry.param is not None:  # its own credit, apart from other readers
                env[node] = graph.call_function(_alias, (env[node],))
            origin[env[node].name] = node
            collect_value(node.name, env[node])
            continue
        kind = tier(entry)
        cut = set(entry.cut)
        if kind == "direct":
            cut |= _projected(entry)
        if node.name in probe.observed:
            _check_seen_write(entry, kind, cut, probe)
        occ = _occurrence_values(node, env)
        projected = sorted(set(cut) - entry.cut)  # direct feedback's inputs of this node
        sent = [tap_spec.add(entry, k) for k in projected]  # their places in the tap
        taps += [(entry, k, occ[k]) for k in projected]
        args, kwargs = _rewired(node, env, cut, graph)
        if node.op == "output":
            out = args[0]
            if taps or any(tier(e) == "function" for e in plan.entries):
                out = graph.call_function(tap_output, (tap(), routing_state(), out, *(v for *_, v in taps)))
            graph.output((out, tuple(collected)) if collect else out)
            continue
        if node.op == "call_module":
            root[cast(str, node.target)] = gm.get_submodule(node.target)  # type: ignore[arg-type]
        if kind == "native":
            value = graph.call_function(
                native_call, (constant("native", NativeSpec(entry)), *args), kwargs
            )
        elif kind == "function":
            spec = constant("rule", FunctionSpec.of(entry))
            value = graph.call_function(function_call, (spec, routing_state(), *_occurrence_values(node, env, cut, graph)))
        elif node.meta.get(NO_GRAD):  # as the model runs it: with gradients off
            value = graph.call_function(_without_grad, (constant("node", entry), *_occurrence_values(node, env, cut, graph)))
        elif (node.name in apart or (runs_out_of_place(node) and node.name not in probe.writers)) and (collect or cut):
            # Out of place, where nothing reads what it writes: the credit of a written value
            # is its own (collect), and a cut input must not be written through its detached alias.
            value = graph.call_function(_out_of_place, (constant("node", entry), *_occurrence_values(node, env, cut, graph)))
        elif kind == "direct" and _one_linear(entry, projected) and node.name in credited and node.name not in at_output:
            # Its input's projection and the layer in one autograd function (where it can be)
            x, rest = occ[0], args[1:]
            graph.erase_node(args[0])  # _rewired's detached input, unused: direct_linear detaches it where needed
            if node.op == "call_module":
                value = graph.call_function(direct_linear, (tap(), routing_state(), sent[0], graph.get_attr(cast(str, node.target)), x))
            else:
                value = graph.call_function(direct_f_linear, (tap(), routing_state(), sent[0], x, *rest))
            sent = []  # received by the layer's own function: no receive() after it
        else:
            value = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        if sent and node.name in credited and node.name not in at_output:
            # Direct feedback reaches the inputs when the backward pass reaches this node,
            # as an exact input credit would, not all at once at the output.
            value = graph.call_function(receive, (tap(), routing_state(), tuple(sent), value, *(occ[k] for k in projected)))
        origin[value.name] = node
        if collect and node.name in probe.shared and node.name not in apart:  # out of place: its own
            value = graph.call_function(_alias, (value,))
        collect_value(node.name, value)
        env[node] = value
    if fused and not collect:
        fuse(graph, root, origin)
    module = fx.GraphModule(root, graph, class_name="Routed")
    plain = not collect and all(tier(e) == "exact" and not e.cut for e in plan.entries)
    return Graft(module, plan, collect, names, starred, origin, plain=plain, writes_inputs=writes_inputs)


def _check_seen_write(entry: Entry, kind: str, cut: set[int], probe: Probe) -> None:
    """Refuse what would keep a write that later nodes read from reaching them: a rule that
    runs the node apart from the graph, or a removed edge into what it writes."""
    call = entry.call
    victims = probe.writers[call.name]
    what = (
        f"node {call.name!r} writes in place into the value of {', '.join(map(repr, victims[:3]))}"
        f"{' …' if len(victims) > 3 else ''}, and later nodes read what it wrote"
    )
    if kind != "exact":
        raise FxnxValueError(
            f"{what}; its rule {entry.rule_name!r} runs the node apart from the graph, where "
            f"the write would not reach them: route it exactly (rules={{{call.name!r}: "
            "fxnx.credit.Exact()}), or write out of place in the model"
        )
    for k in sorted(cut & set(probe.written.get(call.name, ()))):
        raise FxnxValueError(
            f"{what}; G has no edge {call.sources[k]!r} -> {call.name!r} (arg "
            f"{call.labels[k]!r}), and a write cannot be cut from the value it writes into: "
            "remove the edges of the nodes that read the written value instead"
        )


def _credited(plan: Plan) -> set[str]:
    """The nodes whose value the backward pass reaches from the output along edges of ``G``
    (a direct-feedback input always gets credit: at the output or from its node), through
    nodes that pass credit the same way on every call: not a module of the user's kept whole
    (``leaf_modules``), whose forward could detach on one call and not the next.
    :func:`.taps._unreached` checks the rest (``argmax``, ``detach``) on the first forward."""
    credited = {plan.entries[-1].node.name}
    for entry in reversed(plan.entries):
        call, direct = entry.call, tier(entry) == "direct"
        projected = _projected(entry) if direct else set()
        passes = call.name in credited and (call.module is None or is_torch_nn(call.module))
        for k, source in enumerate(call.sources):
            if k not in entry.cut and (passes or k in projected):
                credited.add(source)
    return credited


def _one_linear(entry: Entry, projected: list[int]) -> bool:
    """Whether ``entry`` is an ``nn.Linear`` called on one input, or ``F.linear`` on an input
    and parameters (no view of them between), the input its only projected one and no edge
    into it removed from ``G`` (:mod:`.taps` runs it as one autograd function)."""
    node, call = entry.node, entry.call
    if projected != [0] or entry.cut or node.kwargs:
        return False
    if node.op == "call_module":
        return type(call.module) is torch.nn.Linear and len(node.args) == 1
    return (_calls(call, LINEAR_FUNCTIONS) and len(node.args) in (2, 3) and not call.param_views
            and set(call.param_inputs) == set(range(1, len(node.args))))


def _calls(call: NodeCall, functions: frozenset[Any]) -> bool:
    """Whether ``call`` is a function node calling one of ``functions``."""
    try:
        return call.op == "call_function" and call.target in functions
    except TypeError:  # an unhashable callable
        return False


def _projected(entry: Entry) -> set[int]:
    """Direct feedback: the occurrences that get a projection of the output credit (every
    input but the node's parameters)."""
    return {k for k in range(len(entry.call.sources)) if k not in entry.call.param_inputs}


def _occurrence_values(
    node: fx.Node, env: dict[fx.Node, fx.Node], cut: set[int] | None = None, graph: fx.Graph | None = None
) -> list[fx.Node]:
    """The graph value of each input occurrence of ``node``, in ``occurrences`` order (cut
    ones detached, when ``cut`` is given)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(env[n]) or n)  # type: ignore[func-returns-value]
    if cut and graph is not None:
        found = [graph.call_function(detached, (v,)) if k in cut else v for k, v in enumerate(found)]
    return found


def _rewired(node: fx.Node, env: dict[fx.Node, fx.Node], cut: set[int], graph: fx.Graph) -> tuple[Any, Any]:
    """``node``'s arguments in the new graph, occurrences in ``cut`` detached."""
    count = iter(range(1 << 30))

    def one(n: fx.Node) -> fx.Node:
        value = env[n]
        return graph.call_function(detached, (value,)) if next(count) in cut else value

    return fx.node.map_arg(node.args, one), fx.node.map_arg(node.kwargs, one)


def _refuse_shared_inputs(writes_inputs: tuple[tuple[str, str], ...]) -> None:
    """Refuse, for credit at every node, a write into inputs that share memory (one tensor,
    or its views, given for two arguments): each input's credit is reported on its own, so
    the write could not reach the others as it does in the model's call."""
    by_writer: dict[str, list[str]] = {}
    for writer, written in writes_inputs:
        by_writer.setdefault(writer, []).append(written)
    for writer, inputs in by_writer.items():
        if len(inputs) > 1:
            raise FxnxValueError(
                f"node {writer!r} writes in place into inputs {', '.join(map(repr, inputs))}, which "
                "share memory here (one tensor, or its views, given for several arguments): credit "
                "at every node (route_credit, or a router with node_credit=True) makes each input "
                "a leaf of its own, to report its own credit, so the write could not reach the "
                "others as it does in the model's call. Give each argument a tensor of its own "
                "(x.clone())"
            )


def _snapshot(spec: tuple[str, tuple[str, ...]], value: Any) -> Any:
    """The value of a node that later nodes write into in place, as a value of its own for
    its credit: a copy, written back into the value (so the writes, and every later reader,
    follow the copy, and autograd sends the credit of the value as it was computed to it)."""

    def one(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if not t.requires_grad:
            return t.detach()  # no credit; nothing a later write brings is reported here
        if t.is_leaf:  # a parameter: the model cannot write into it with gradients on
            return t
        own = t.clone()
        try:
            t.copy_(own)
        except RuntimeError as err:
            name, writers = spec
            raise FxnxValueError(
                f"node {writers[0]!r} writes in place into the value of node {name!r}, whose "
                f"credit fxnx cannot keep apart ({err}); write out of place in the model "
                f"(clone the value before writing into it)"
            ) from err
        return own

    return pytree.tree_map(one, value)


def _light(value: Any) -> Any:
    """The value of a node a later write (run out of place where the value carries credit)
    may write into in place where it does not: that write's credit is not this node's."""
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) and not t.requires_grad else t, value)


def _alias(value: Any) -> Any:
    """A value of its own with the same contents, so credit at it is credit at this node."""
    return pytree.tree_map(lambda t: t.view_as(t) if isinstance(t, Tensor) else t, value)



def _without_grad(entry: Entry, *values: Any) -> Any:
    args, kwargs = rebuilt(entry, values)
    with torch.no_grad():  # in place where the model writes in place (an EMA's buffers)
        return call_target(entry.node.op, entry.node.target, entry.call.module, args, kwargs)


def _out_of_place(entry: Entry, *values: Any) -> Any:
    args, kwargs = rebuilt(entry, values)
    return run_node(entry.node, entry.call.module, args, kwargs)
