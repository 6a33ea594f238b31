"""The router's forward: the captured graph, with each node's rule grafted into autograd.

:func:`graft` turns a compiled :class:`~fxnx._credit.plan.Plan` into a
``GraphModule`` whose forward computes what the model computes and whose
autograd backward *is* the routing over ``G``. Autograd already sums a node's
credit over its out-edges and runs nodes in reverse topological order; what is
left to say is, per node, how its credit goes back to its inputs:

- **exact** nodes are the captured graph's own nodes, untouched: autograd's
  backward, at autograd's cost.
- **an edge removed from** ``G`` becomes a ``detach`` of that argument: its
  value flows forward, no credit flows back.
- **weight transport** (feedback alignment, sign symmetry) on linear layers,
  convolutions, attention and transformer layers runs the layer as it is, but
  while it runs every tensor that the layer's backward saves from a weight ``W``
  is swapped for the same view of the feedback weight ``B`` (a
  ``saved_tensors_hooks`` pair). Autograd's own backward then sends ``credit·B``
  to the input and the exact credit to ``W`` and the bias (dropout inside the
  layer replays its own mask). Fixed ``B`` costs no Python in the backward pass;
  sign symmetry's ``sign(W)·M`` is made there, one layer at a time, and dropped
  after it.
- **direct feedback alignment** runs the layer on its inputs detached (its
  parameters get exact credit); an autograd function at the model's output takes
  ``e``, the credit there, and one on the layer's output sends each such input
  ``e·B`` when the backward pass reaches the layer (one projection alive at a
  time, as exact credit would be). A layer whose output is written in place, or
  that no edge of ``G`` joins to the output, gets its ``e·B`` at the output.
- **any other rule** (a user's rule, attention, a layer without a transport of
  its own, anything under autocast) runs its node inside an
  :class:`autograd.Function <torch.autograd.Function>` whose backward calls the
  rule with the node's :class:`~fxnx._credit.nodecall.NodeCall`, and checks what it
  returns against the node's inputs and parameters.

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
import math
import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx
from torch import Tensor

from .._callinfo import fetch_attr
from .._capture.shapes import node_failure
from .._capture.tracer import NO_GRAD, is_torch_nn
from .._compat import linear_parameters, pytree, saved_tensors_hooks_calls, version
from .._errors import FxnxTypeError, FxnxValueError
from .faithful import Probe, differs
from .feedback import check_bytes, readable
from .kinds import NATIVE_FUNCTIONS, WEIGHTED_MODULES
from .nodecall import Credit, NodeCall, call_target, fresh_leaf, run_node, runs_out_of_place
from .plan import Entry, Plan
from .rules import DirectFeedbackAlignment, Exact, RoutingState, SignSymmetry, Transport, signed
from .transport import feedback_weights

__all__ = ["Graft", "graft"]

_aten = torch.ops.aten



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
                try:
                    return super().run_node(n)
                except Exception as err:
                    captured = graft.origin.get(n.name)
                    if captured is None:
                        raise
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    raise node_failure("the credit run's forward pass", captured, args, kwargs, err) from err

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
    may copy, ``W.to(x.dtype)``, is another tensor: its layer runs on its own graph)."""
    if call.module is not None:
        return type(call.module) in WEIGHTED_MODULES
    try:
        native = call.op == "call_function" and call.target in NATIVE_FUNCTIONS
    except TypeError:  # an unhashable callable
        return False
    return native and not any(getattr(chain, "copies", False) for chain in call.param_views.values())


def graft(plan: Plan, *, seed: int, collect: bool = False, probe: Probe | None = None) -> Graft:
    """The router's forward over ``plan`` (see the module's docstring).

    ``probe`` is what one run of the captured graph showed (:func:`.faithful.probe`): nodes
    that hand back a value another node holds get, with ``collect``, an alias of their own;
    writes in place that a later node sees run in place, as in the model, and every value
    they overwrite is reported through a copy of its own (:func:`_snapshot`); a write no later
    node sees may run out of place. Without it, every write is taken as one nothing sees.

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
    tap_spec, tap_node = _TapSpec(), None
    # Direct feedback stays at the output for a node written into, writing, or handing back
    # a value another node holds, and for one the backward pass never reaches.
    credited = _credited(plan)
    at_output = {v for victims in probe.writers.values() for v in victims} | set(probe.writers) | probe.shared
    starred, names, collected = [], [], []
    origin: dict[str, fx.Node] = {}
    # Where a write runs out of place its victims keep their values; elsewhere each victim's
    # credit is reported through a copy of its own, taken before the write.
    nodes = {e.node.name: e.node for e in plan.entries}
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
                out = graph.call_function(_tap, (tap(), routing_state(), out, *(v for *_, v in taps)))
            graph.output((out, tuple(collected)) if collect else out)
            continue
        if node.op == "call_module":
            root[cast(str, node.target)] = gm.get_submodule(node.target)  # type: ignore[arg-type]
        if kind == "native":
            value = graph.call_function(
                _native_call, (constant("native", _NativeSpec(entry)), *args), kwargs
            )
        elif kind == "function":
            spec = constant("rule", _FunctionSpec.of(entry))
            value = graph.call_function(_function_call, (spec, routing_state(), *_occurrence_values(node, env, cut, graph)))
        elif node.meta.get(NO_GRAD):  # as the model runs it: with gradients off
            value = graph.call_function(_without_grad, (constant("node", entry), *_occurrence_values(node, env, cut, graph)))
        elif (node.name in apart or (runs_out_of_place(node) and node.name not in probe.writers)) and (collect or cut):
            # Out of place, where nothing reads what it writes: the credit of a written value
            # is its own (collect), and a cut input must not be written through its detached alias.
            value = graph.call_function(_out_of_place, (constant("node", entry), *_occurrence_values(node, env, cut, graph)))
        else:
            value = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        if sent and node.name in credited and node.name not in at_output:
            # Direct feedback reaches the inputs when the backward pass reaches this node,
            # as an exact input credit would, not all at once at the output.
            value = graph.call_function(_receive, (tap(), routing_state(), tuple(sent), value, *(occ[k] for k in projected)))
        origin[value.name] = node
        if collect and node.name in probe.shared and node.name not in apart:  # out of place: its own
            value = graph.call_function(_alias, (value,))
        collect_value(node.name, value)
        env[node] = value
    module = fx.GraphModule(root, graph, class_name="Routed")
    plain = not collect and all(tier(e) == "exact" and not e.cut for e in plan.entries)
    return Graft(module, plan, collect, names, starred, origin, plain=plain)


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
    :func:`_unreached` checks the rest (``argmax``, ``detach``) on the first forward."""
    credited = {plan.entries[-1].node.name}
    for entry in reversed(plan.entries):
        call, direct = entry.call, tier(entry) == "direct"
        projected = _projected(entry) if direct else set()
        passes = call.name in credited and (call.module is None or is_torch_nn(call.module))
        for k, source in enumerate(call.sources):
            if k not in entry.cut and (passes or k in projected):
                credited.add(source)
    return credited


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
        found = [graph.call_function(_detach, (v,)) if k in cut else v for k, v in enumerate(found)]
    return found


def _rewired(node: fx.Node, env: dict[fx.Node, fx.Node], cut: set[int], graph: fx.Graph) -> tuple[Any, Any]:
    """``node``'s arguments in the new graph, occurrences in ``cut`` detached."""
    count = iter(range(1 << 30))

    def one(n: fx.Node) -> fx.Node:
        value = env[n]
        return graph.call_function(_detach, (value,)) if next(count) in cut else value

    return fx.node.map_arg(node.args, one), fx.node.map_arg(node.kwargs, one)


def _detach(value: Any) -> Any:
    """An edge removed from G: the value flows on, no credit flows back."""
    if isinstance(value, Tensor):
        return value.detach()
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


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


def _rebuilt(entry: Entry, values: Sequence[Any]) -> tuple[Any, Any]:
    """``entry``'s node arguments with ``values`` in the places of its input occurrences."""
    feed = iter(values)
    node = entry.node
    return (
        fx.node.map_arg(node.args, lambda _: next(feed)),
        fx.node.map_arg(node.kwargs, lambda _: next(feed)),
    )


def _without_grad(entry: Entry, *values: Any) -> Any:
    args, kwargs = _rebuilt(entry, values)
    with torch.no_grad():  # in place where the model writes in place (an EMA's buffers)
        return call_target(entry.node.op, entry.node.target, entry.call.module, args, kwargs)


def _out_of_place(entry: Entry, *values: Any) -> Any:
    args, kwargs = _rebuilt(entry, values)
    return run_node(entry.node, entry.call.module, args, kwargs)


# ----------------------------------------------------------------------------------------------
# Weight transport, natively: B swapped in for W in what the layer's backward saves.


class _NativeSpec:
    """A weight-transport node run natively, made once per node: what it calls, its weights,
    and a ``saved_tensors_hooks`` pair kept across calls whose pack function swaps each view
    of a weight ``W`` that the layer saves for the same view of ``B``.

    Fixed feedback (feedback alignment, Kolen–Pollack, weight mirrors) is swapped in as it
    is, each view made once; the unpack function is ``operator.itemgetter(0)``, in C.
    Sign symmetry's ``B = sign(W)·M`` is made in the backward pass, when the layer's backward
    unpacks it, and dropped once the layer's backward is done (:class:`_SignOf`): no copy of
    the weights lives from the forward pass to the backward pass.
    """

    def __init__(self, entry: Entry) -> None:
        call = entry.call
        self.entry, self.call, self.rule = entry, call, entry.rule
        self.fn = call.module if call.module is not None else call.target
        #: an nn.Linear, called as F.linear while nothing hooks it (_run)
        self.linear = call.module if isinstance(call.module, torch.nn.Linear) else None
        self.weights = feedback_weights(call)  # parameter name to W
        self.first = next(iter(self.weights))
        self.device = next(iter(self.weights.values())).device.type
        #: sign symmetry of its own kind: B made lazily from sign(W) and the magnitudes
        self.signs = isinstance(self.rule, SignSymmetry) and type(self.rule).feedback_for is SignSymmetry.feedback_for
        #: start, end, W, B or M, the given feedback, and its version where B is a copy of it
        self.spans: list[tuple[int, int, Tensor, Any, Any, int | None]] = []
        self.views: dict[tuple[Any, ...], Tensor] = {}
        self.hits = 0
        self.unpack = _unpack if self.signs else _FIRST
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def use(self) -> None:
        """Take this call's feedback: ``B`` for each weight (laid out like ``W``), or for sign
        symmetry the magnitudes ``M`` (drawn afresh at each call for brSF)."""
        if self.signs:
            magnitudes = self.rule.magnitudes(self.call)
            self.spans = [  # M read when unpacked (brSF draws it then)
                (W.data_ptr(), W.data_ptr() + W.numel() * W.element_size(), W, (magnitudes, name), None, None)
                for name, W in self.weights.items()
            ]
            return
        feedback = self.rule.feedback_for(self.call)
        old = self.spans
        if len(old) == 1:  # one weight (a linear or convolution layer): no loop
            if _current(old[0], feedback[self.first]):
                return  # the same B (feedback alignment): its views are kept
        elif old and all(_current(span, feedback[name]) for span, name in zip(old, self.weights, strict=True)):
            return
        spans = []
        for name, W in self.weights.items():
            given = feedback[name]
            B, stamp = given.detach(), None
            if B.stride() != W.stride() or B.dtype != W.dtype or B.device != W.device:
                B = torch.empty_strided(W.shape, W.stride(), dtype=W.dtype, device=W.device).copy_(B)
                stamp = version(given)  # a copy: made again once the given B is written
            start = W.data_ptr()
            spans.append((start, start + W.numel() * W.element_size(), W, B, given, stamp))
        self.views = {}
        self.spans = spans

    def pack(self, t: Tensor) -> Any:
        ptr = t.data_ptr()
        for start, end, W, B, _, _ in self.spans:
            if start <= ptr < end and t.dtype == W.dtype:
                self.hits += 1
                if self.signs:
                    return _SignOf(W, B, t)
                key = (id(B), ptr, t.size(), t.stride())
                view = self.views.get(key)
                if view is None:
                    offset = t.storage_offset() - W.storage_offset() + B.storage_offset()
                    view = self.views[key] = B.as_strided(t.size(), t.stride(), offset)
                return (view,)
        return (t,)


def _current(span: tuple[int, int, Tensor, Any, Any, int | None], given: Any) -> bool:
    """Whether ``span`` holds ``given`` as it is now: the same tensor, ``W`` where it was, and
    a copy of ``given`` (another dtype or layout than ``W``'s) made since its last write
    (Kolen–Pollack and weight mirrors update ``B`` in place)."""
    start, _, W, _, held, stamp = span
    return held is given and W.data_ptr() == start and (stamp is None or stamp == version(given))


_FIRST = operator.itemgetter(0)
_HOOKS = saved_tensors_hooks_calls()


class _SignOf:
    """A view of ``W`` saved by a layer under sign symmetry: on unpacking, the same view of
    ``sign(W)·M`` (``W`` as it was when saved: a write into it since is refused, as autograd
    refuses one into a tensor it saved)."""

    __slots__ = ("W", "M", "version", "size", "stride", "offset", "B")

    def __init__(self, W: Tensor, M: Any, t: Tensor) -> None:
        self.W, self.M, self.version = W, M, version(W)
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - W.storage_offset()
        self.B: Tensor | None = None

    def unpack(self) -> Tensor:
        if self.B is None:
            W = self.W
            if version(W) != self.version:
                raise FxnxValueError(
                    "a weight routed by sign symmetry was written in place (an optimizer step?) "
                    "between the forward pass and its backward pass, which reads sign(W) as the "
                    "forward pass saw it: call backward before changing the weights"
                )
            magnitudes, name = self.M
            B = signed(magnitudes, name, W.detach())
            self.B = B.as_strided(self.size, self.stride, B.storage_offset() + self.offset)
        return self.B


def _unpack(packed: Any) -> Tensor:
    return packed[0] if type(packed) is tuple else packed.unpack()


def _native_call(spec: _NativeSpec, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # nothing is saved: the layer as it is
        return spec.fn(*args, **kwargs)
    if torch.is_autocast_enabled(spec.device):
        # The layer would save a cast copy of W, not W: route it through its rule instead.
        entry = spec.entry
        return _function_call(_FunctionSpec.of(entry), RoutingState(), *_inputs_of(entry, args, kwargs))
    spec.use()
    hits = spec.hits
    if _HOOKS is None:
        with spec.hooks:
            out = _run(spec, args, kwargs)
    else:  # the same as the context manager, without its frames: once per layer and forward
        _HOOKS[0](spec.pack, spec.unpack)
        try:
            out = _run(spec, args, kwargs)
        finally:
            _HOOKS[1]()
    if spec.hits == hits and _needs_input_credit(args, kwargs, spec.call):
        call = spec.call
        raise FxnxValueError(
            f"node {call.name!r}: its backward did not read its weight where feedback weights "
            f"were to replace it, so {spec.entry.rule_name} cannot be applied natively; route it "
            f"with rules={{{call.name!r}: fxnx.credit.Exact()}} or report this model"
        )
    return out


def _run(spec: _NativeSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The node's call; an ``nn.Linear`` that nothing hooks as ``F.linear`` on its weight
    and bias, which is all its call would do (small layers pay most for its frames)."""
    if spec.linear is not None and len(args) == 1 and not kwargs:
        params = linear_parameters(spec.linear)
        if params is not None:
            return torch.nn.functional.linear(args[0], *params)
    return spec.fn(*args, **kwargs)


def _inputs_of(entry: Entry, args: Any, kwargs: Any) -> list[Any]:
    """The values of ``entry``'s input occurrences among concrete ``args``/``kwargs``."""
    found: list[Any] = []

    def walk(template: Any, value: Any) -> None:
        if isinstance(template, fx.Node):
            found.append(value)
        elif isinstance(template, (list, tuple)):
            for t, v in zip(template, value, strict=True):
                walk(t, v)
        elif isinstance(template, dict):
            for key, t in template.items():
                walk(t, value[key])
        elif isinstance(template, slice):
            for part in ("start", "stop", "step"):
                walk(getattr(template, part), getattr(value, part))

    walk((tuple(entry.node.args), dict(entry.node.kwargs)), (tuple(args), dict(kwargs)))
    return found


def _needs_input_credit(args: Any, kwargs: Any, call: NodeCall) -> bool:
    """Whether an input other than the node's parameters (an ATen node's weight and bias are
    arguments) carries credit: only then must its backward have read the weight."""
    # A parameter, route_credit's alias of it, or a view of it that copies nothing (W.T)
    own = {(p.data_ptr(), p.numel()) for p in call.own_parameters()}
    return any(
        isinstance(t, Tensor) and t.requires_grad and (t.data_ptr(), t.numel()) not in own
        for t in pytree.tree_leaves((args, kwargs))
    )


# ----------------------------------------------------------------------------------------------
# Any rule: the node inside an autograd.Function whose backward is the rule.


@dataclasses.dataclass
class _FunctionSpec:
    entry: Entry
    params: list[tuple[str, Tensor]]

    @classmethod
    def of(cls, entry: Entry) -> _FunctionSpec:
        return cls(entry, list(entry.call.params.items()))


def _function_call(spec: _FunctionSpec, state: RoutingState, *values: Any) -> Any:
    flat: list[Tensor] = []
    for value in values:
        flat.extend(t for t in pytree.tree_leaves(value) if isinstance(t, Tensor))
    holder: list[Any] = []  # the output's structure, filled in by the forward
    outs = _RuleNode.apply(spec, state, values, holder, *flat, *(p for _, p in spec.params))
    feed = iter(outs if isinstance(outs, tuple) else (outs,))
    leaves, tree = holder
    return pytree.tree_unflatten([next(feed) if isinstance(v, Tensor) else v for v in leaves], tree)


class _RuleNode(torch.autograd.Function):
    """One node run on leaves of its own (its own small autograd graph), whose backward is
    its rule: ``rule(call, credit, state) -> (input credits, parameter credits)``."""

    @staticmethod
    def forward(ctx: Any, spec: _FunctionSpec, state: RoutingState, values: tuple[Any, ...], holder: list[Any], *flat: Tensor) -> Any:  # type: ignore[override]
        entry = spec.entry
        leaves = [fresh_leaf(v) if _wants(v) else _detach(v) for v in values]
        args, kwargs = _rebuilt(entry, leaves)
        out = run_node(entry.node, entry.call.module, args, kwargs)
        skeleton = entry.call
        ctx.call = dataclasses.replace(
            skeleton, inputs=leaves, output=out, args=args, kwargs=kwargs,
            wanted=[_wants(v) for v in values],
        )
        ctx.spec, ctx.state, ctx.values = spec, state, values
        ctx.set_materialize_grads(False)
        leaves_out, tree = pytree.tree_flatten(out)
        tensors = [t.detach() for t in leaves_out if isinstance(t, Tensor)]
        # What carries no gradient in the node's own run carries none here: integers, and
        # floats of operations without a derivative (histc), which autograd gives no history;
        # marked so, later nodes (an integer cumsum of them) take them as constants.
        ctx.mark_non_differentiable(*(
            d for d, t in zip(tensors, (t for t in leaves_out if isinstance(t, Tensor)), strict=True)
            if not (t.requires_grad and (t.is_floating_point() or t.is_complex()))
        ))
        ctx.tree = tree
        holder.extend((leaves_out, tree))
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        spec, call = ctx.spec, ctx.call
        _check_once(spec, call)
        feed = iter(grads)
        leaves_out = pytree.tree_flatten(call.output)[0]
        credit = pytree.tree_unflatten(
            [next(feed) if isinstance(t, Tensor) else None for t in leaves_out], ctx.tree
        )
        n_flat = sum(isinstance(t, Tensor) for v in ctx.values for t in pytree.tree_leaves(v))
        none = (None, None, None, None, *([None] * (n_flat + len(spec.params))))
        if all(g is None for g in pytree.tree_leaves(credit)):
            return none
        with torch.enable_grad():  # a rule may differentiate its node's own small graph
            routed = spec.entry.rule(call, credit, ctx.state)
        inputs, params = checked(call, routed, spec.entry.rule_name)
        out: list[Tensor | None] = [None, None, None, None]
        for value, c in zip(ctx.values, inputs, strict=True):
            tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, Tensor)]
            got = [g for g, t in zip(pytree.tree_leaves(c), pytree.tree_leaves(value), strict=False) if isinstance(t, Tensor)] if c is not None else []
            out.extend(got if got else [None] * len(tensors))
        out.extend(params.get(name) for name, _ in spec.params)
        ctx.call = None  # free the node's graph once routed
        return tuple(out)


def _check_once(spec: _FunctionSpec, call: NodeCall | None) -> None:
    """Refuse what a rule run on its node's own small graph cannot give: a second backward
    pass through the node (its recorded call is freed by the first, lest every step keep its
    node's values until the next), and a differentiable credit (``create_graph=True``: the
    node's small graph starts from leaves of its own, so the credit would not depend on the
    model's parameters, and a gradient penalty would miss this node's terms)."""
    where = f"node {spec.entry.call.name!r} (rule {spec.entry.rule_name!r}, run on the node's own graph)"
    if call is None:
        raise FxnxValueError(
            f"backward ran twice through {where}: its recorded call is freed after one backward "
            "pass, so retain_graph=True (or autograd.grad twice) cannot route it again. Run the "
            "forward again for each backward pass, or route this node with rule 'exact'"
        )
    if torch.is_grad_enabled():
        raise FxnxValueError(
            f"create_graph=True needs credit differentiable in the model's parameters, and "
            f"{where} gives none: a gradient penalty would miss its terms. Route this node with "
            "rule 'exact' (rules={name: fxnx.credit.Exact()}) for higher-order gradients"
        )


def _wants(value: Any) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


def checked(call: NodeCall, routed: Any, name: str) -> tuple[list[Credit], dict[str, Tensor | None]]:
    """What a rule returned, checked against its node: one credit per input occurrence, each
    like that input (its shape; floating dtypes cast to the input's, as autograd casts), and
    credit only for the node's own parameters, each of its parameter's shape."""
    where = f"rule {name!r} at node {call.name!r}"
    if not (isinstance(routed, (tuple, list)) and len(routed) == 2 and isinstance(routed[0], (list, tuple))
            and isinstance(routed[1], dict)):
        raise FxnxTypeError(
            f"{where} returned {type(routed).__qualname__} {routed!r:.60}; a rule returns "
            "(input_credits, param_credits): a list with one credit (or None) per input "
            "occurrence of call.inputs, and a dict of parameter name to credit"
        )
    inputs, params = routed
    if len(inputs) != len(call.inputs):
        raise FxnxValueError(
            f"{where} returned {len(inputs)} input credits; the node has {len(call.inputs)} "
            f"input occurrences ({', '.join(map(repr, call.labels))}): give None where no credit flows"
        )
    fixed: list[Credit] = []
    for k, (c, x) in enumerate(zip(inputs, call.inputs, strict=True)):
        if c is None or not call.wanted[k]:
            fixed.append(None)
            continue
        arg = f"input {call.labels[k]!r} (from {call.sources[k]!r})"
        c_leaves, c_spec = pytree.tree_flatten(c)
        x_leaves, x_spec = pytree.tree_flatten(x)
        if len(c_leaves) != len(x_leaves):
            raise FxnxValueError(f"{where}: credit for {arg} has structure {c_spec}, the input {x_spec}")
        fixed.append(pytree.tree_unflatten(
            [_like(g, t, f"{where}: credit for {arg}") for g, t in zip(c_leaves, x_leaves, strict=True)], x_spec
        ))
    own = call.params
    for pname in params:
        if pname not in own:
            raise FxnxValueError(
                f"{where} returned credit for parameter {pname!r}, which is not the node's own "
                f"(its parameters: {sorted(own) or 'none'}; parameters passed as arguments get "
                "their credit as input credits)"
            )
    return fixed, {p: _like(g, own[p], f"{where}: credit for parameter {p!r}") for p, g in params.items() if g is not None}


def _like(g: Any, x: Any, what: str) -> Tensor | None:
    if g is None or not isinstance(x, Tensor) or not x.requires_grad:
        return None
    if not isinstance(g, Tensor):
        raise FxnxTypeError(f"{what} is {type(g).__qualname__} {g!r:.40}, expected a tensor of shape {tuple(x.shape)}")
    if g.shape != x.shape:
        raise FxnxValueError(f"{what} has shape {tuple(g.shape)}, expected {tuple(x.shape)}")
    if g.dtype != x.dtype:
        if not (g.is_floating_point() and x.is_floating_point()):
            raise FxnxTypeError(f"{what} has dtype {g.dtype}, expected {x.dtype}")
        g = g.to(x.dtype)
    if g.device != x.device:
        raise FxnxValueError(f"{what} is on {g.device}, expected {x.device}")
    return g


# ----------------------------------------------------------------------------------------------
# The output tap: the credit at the model's output, for direct feedback and for every rule's
# state; it sends each projected input of a direct-feedback node e·B.


class _TapSpec:
    """The direct-feedback inputs a tap projects onto, ``(entry, occurrence)`` each, and what
    it keeps across calls: the input shapes last checked, and each input's sender (see
    :meth:`DirectFeedbackAlignment.sender`) with the key it is valid for."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Entry, int]] = []
        self.checked: Any = None
        self.drawn = True
        self.senders: list[tuple[Any, Any]] = []
        self.reach: Any = None  # the forward whose receivers were last checked (see _unreached)
        self.unreached: set[int] = set()  # places whose node the backward pass does not reach

    def add(self, entry: Entry, k: int) -> int:
        """Project onto ``entry``'s input occurrence ``k``; its place among the pairs."""
        self.pairs.append((entry, k))
        self.senders.append((None, None))
        self.drawn = False
        return len(self.pairs) - 1

    def send(self, j: int, e: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        key = (e.shape[1], e.dtype, shape, dtype)
        known, sender = self.senders[j]
        if known != key:
            entry, k = self.pairs[j]
            sender = entry.rule.sender(entry.call, k, e, shape, dtype)
            self.senders[j] = (key, sender)
        return sender(e)


def _tap(spec: _TapSpec, state: RoutingState, out: Any, *projected: Any) -> Any:
    leaves, tree = pytree.tree_flatten(out)
    slots = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
    if not slots:
        return out
    if state._received and spec.reach != (slots, state._received):  # once per kind of forward
        state._received -= _unreached(spec, [leaves[i] for i in slots], projected, state._received)
        spec.reach = (slots, set(state._received))
    tapped = _Tap.apply(spec, state, (leaves, tree, slots), *(leaves[i] for i in slots), *projected)
    for i, t in zip(slots, tapped if isinstance(tapped, tuple) else (tapped,), strict=True):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, tree)


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _TapSpec, state: RoutingState, where: Any, *tensors: Any) -> Any:  # type: ignore[override]
        leaves, tree, slots = where
        outs, projected = tensors[:len(slots)], tensors[len(slots):]
        shapes = [x.shape if isinstance(x, Tensor) else None for x in projected]
        batch = {t.shape[0] if t.dim() else None for t in outs}
        wanted = [isinstance(x, Tensor) and x.requires_grad for x in projected]
        if spec.checked != (batch, shapes, wanted):  # checked once per shape
            for (entry, k), x, want in zip(spec.pairs, projected, wanted, strict=True):
                if want and (x.dim() == 0 or batch != {x.shape[0]}):
                    raise FxnxValueError(
                        f"direct feedback alignment at node {entry.call.name!r}: its input {k} has "
                        f"shape {tuple(x.shape)}, whose first dimension is not the output's batch size "
                        f"({', '.join(map(str, sorted(b for b in batch if b is not None))) or 'none'}); "
                        f"route this node another way, e.g. rules={{{entry.call.name!r}: Exact()}}"
                    )
            if not spec.drawn:
                if any(not entry.rule.drawn(k) for entry, k in spec.pairs):  # before the first draws only
                    _check_feedback_bytes(spec.pairs, outs, projected)
                else:
                    spec.drawn = True
            spec.checked = (batch, shapes, wanted)
        ctx.spec, ctx.state, ctx.where = spec, state, (leaves, tree, slots)
        ctx.shapes = shapes
        ctx.dtypes = [x.dtype if isinstance(x, Tensor) else None for x in projected]
        return outs if len(outs) != 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        leaves, tree, slots = ctx.where
        credit: list[Any] = [None] * len(leaves)
        for i, g in zip(slots, grads, strict=True):
            credit[i] = g
        ctx.state.output_credit = pytree.tree_unflatten(credit, tree)
        sent: list[Tensor | None] = []
        spec = ctx.spec
        if spec.pairs:
            e = ctx.state._direct = torch.cat([g.reshape(g.shape[0], -1) for g in grads], 1)
            needs = ctx.needs_input_grad[3 + len(slots):]
            received = ctx.state._received
            for j, (shape, dtype, needed) in enumerate(zip(ctx.shapes, ctx.dtypes, needs, strict=True)):
                sent.append(spec.send(j, e, shape, dtype) if needed and j not in received else None)
        return (None, None, None, *grads, *sent)


def _receive(spec: _TapSpec, state: RoutingState, places: tuple[int, ...], value: Any, *inputs: Any) -> Any:
    """``value``, a direct-feedback node's output, through :class:`_Receive`: its inputs
    (the tap's ``places``) get their projection of the output credit when the backward pass
    reaches the node. Left to the tap where there is nothing to receive or no tensor to
    receive it by."""
    wanted = [isinstance(x, Tensor) and x.requires_grad for x in inputs]
    if not torch.is_grad_enabled() or not isinstance(value, Tensor) or not any(wanted):
        return value
    if spec.unreached and not spec.unreached.isdisjoint(places):
        return value
    state._received.update(j for j, want in zip(places, wanted, strict=True) if want)
    return _Receive.apply(spec, state, places, value, *inputs)


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _TapSpec, state: RoutingState, places: tuple[int, ...], value: Tensor, *inputs: Any) -> Tensor:  # type: ignore[override]
        ctx.spec, ctx.state, ctx.places = spec, state, places
        ctx.shapes = [x.shape if isinstance(x, Tensor) else None for x in inputs]
        ctx.dtypes = [x.dtype if isinstance(x, Tensor) else None for x in inputs]
        return value

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        e, spec = ctx.state._direct, ctx.spec
        if e is None:  # the output's tap sets it: the backward pass always passes it first
            entry, _ = spec.pairs[ctx.places[0]]
            raise FxnxValueError(
                f"direct feedback alignment at node {entry.call.name!r}: credit reached it by "
                "a path that does not pass through the router's output; compute the loss from "
                "the output router(...) returned"
            )
        needs = ctx.needs_input_grad[4:]
        sent = [
            spec.send(j, e, shape, dtype) if needed else None
            for j, shape, dtype, needed in zip(ctx.places, ctx.shapes, ctx.dtypes, needs, strict=True)
        ]
        return (None, None, None, credit, *sent)


def _unreached(spec: _TapSpec, outs: list[Tensor], projected: Sequence[Any], received: set[int]) -> set[int]:
    """The places in ``received`` whose :class:`_Receive` the backward pass does not reach: a
    node read only through what carries no credit (``argmax``, ``detach``, a ``zeros_like``)
    by every path to the output. They get their projection at the output, as direct feedback
    defines, and later forwards leave them to the output (``spec.unreached``).

    The backward pass starts at ``outs`` and at every input the tap itself projects onto
    (those not in ``received``, then those of each node found unreached): from there autograd's
    graph is walked, once per kind of forward (what a captured graph records the same way each
    time); :func:`_credited` has already left out what could differ from call to call.
    """
    seen: set[Any] = set()
    reached: set[int] = set()
    roots = list(outs) + [x for j, x in enumerate(projected) if j not in received]
    missed: set[int] = set()
    while roots:
        stack = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            if getattr(fn, "spec", None) is spec and hasattr(fn, "places"):  # a _Receive of this tap
                reached.update(fn.places)
            stack.extend(f for f, _ in fn.next_functions if f is not None and f not in seen)
        new = received - reached - missed
        missed |= new
        roots = [projected[j] for j in sorted(new)]  # sent at the output instead: walked on from there
    spec.unreached |= missed
    return missed


def _check_feedback_bytes(spec: list[tuple[Entry, int]], outs: Sequence[Tensor], projected: Sequence[Any]) -> None:
    """Refuse, before drawing any, direct feedback whose weights would take more than the
    rule allows (``max_bytes``), naming the largest."""
    d = sum(t[0].numel() if t.dim() else 1 for t in outs)
    sizes = []
    for (entry, k), x in zip(spec, projected, strict=True):
        if isinstance(x, Tensor) and x.requires_grad:
            shape = entry.rule.feedback_shape(k, d, x.shape)
            sizes.append((math.prod(shape) * x.element_size(), entry, k, shape))
    limits = [entry.rule.max_bytes for entry, _ in spec if entry.rule.max_bytes is not None]
    total = sum(size for size, *_ in sizes)
    if limits and total > min(limits):
        size, entry, k, shape = max(sizes, key=operator.itemgetter(0))
        check_bytes(
            total, min(limits),
            f"direct feedback alignment at {len(sizes)} inputs (the largest: node "
            f"{entry.call.name!r}, input {k}, shape {tuple(shape)}, {readable(size)})",
        )
