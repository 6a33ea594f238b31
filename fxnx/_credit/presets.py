"""Presets: which rule each kind of node follows, as plain data that composes.

A :class:`Preset` maps *node kinds* to rule objects (or rule functions). A kind
is a module class, matched along the module's MRO so subclasses count; a
function such as ``torch.add``; or ``method("view")`` for ``x.view(...)``
calls. Any node whose kind has no entry is routed exactly.

A module class matches the nodes that are a module's own computation, whatever
captured the model: a ``call_module`` node calling a module of that class, and a
function or method node whose innermost module (``node.meta["nn_module_stack"]``,
:attr:`NodeCall.owner`) is one, as where ``torch.export`` records a layer as its
ATen calls (``aten.conv2d.default`` for an ``nn.Conv2d``) or a symbolic trace goes
through a subclass with a ``forward`` of its own (``F.linear`` in ``MyLinear(nn.Linear)``).
So ``nn.Conv2d: Exact()`` routes every call a convolution makes itself exactly, on any
graph. Which of those calls a class's rule takes depends on the rule:

- a feedback rule (weight transport, such as feedback alignment and sign symmetry, and
  direct feedback alignment) takes only the module's products with a weight, the
  functions of :data:`.kinds.WEIGHTED_FUNCTIONS` (``aten.linear``, ``aten.conv2d``): the
  rest (padding, the computation of a standardised weight) stays exact as it would be
  anywhere else;
- any other rule (exact, a rule of your own) takes every node of the module's own.

The calls a module leaves to its submodules are theirs: on an exported graph the
``nn.Linear`` layers inside an ``nn.TransformerEncoderLayer`` follow ``nn.Linear``'s entry,
not the encoder layer's (a symbolic trace keeps that layer whole), so key their
classes too, or their nodes by name.

Where a node matches both a module class and a function (``aten.conv2d.default`` inside an
``nn.Conv2d``), the module class wins; but an entry added later with ``|`` wins over
an earlier one, whichever kinds they key, so ``PRESETS["feedback_alignment"] |
{aten.conv2d.default: Exact()}`` routes exported convolutions exactly even though the
preset keys ``nn.Conv2d``. A kind added with ``|`` from a plain dict that matches no node
of the graph is reported by a warning (as is a key of ``rules=``); a preset's own kinds
are not (a preset lists many kinds).

Presets compose with ``|``, the right side winning, as dicts do::

    PRESETS["feedback_alignment"] | {nn.Conv2d: Exact()}

There is no registry to fill: a preset of your own is a ``Preset`` (or a plain
dict) passed as ``rule=``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import nn

from .._errors import FxnxValueError, warn_user
from .kinds import WEIGHTED_FUNCTIONS, WEIGHTED_METHODS, WEIGHTED_MODULES, kind_name, mixes
from .learned import KolenPollack, WeightMirror
from .nodecall import NodeCall
from .rules import DirectFeedbackAlignment, Exact, FeedbackAlignment, Rule, SignSymmetry, Transport
from .transport import has_weights, no_weights

__all__ = ["PRESETS", "Preset", "method"]


def method(name: str) -> tuple[str, str]:
    """The node kind of ``tensor.name(...)`` calls, as a key of a preset.

    Examples
    --------
    >>> method("view")
    ('call_method', 'view')
    """
    return ("call_method", name)


class _Layer(NamedTuple):
    """One table of a preset, and whether it was added with ``|`` as a plain mapping (the
    user's own kinds, which are reported where they match no node)."""

    table: Mapping[Any, Rule]
    added: bool


class Preset(Mapping[Any, Rule]):
    """An immutable map from node kinds to rules, with a name for reports.

    A preset composed with ``|`` keeps its operands as layers: a node takes the rule of
    the last layer that has one for it (:meth:`lookup`), so an entry added later wins
    even where it keys another kind of the same node (a function where the earlier
    layers key its module's class). As a mapping it is the union, the right side winning.

    Parameters
    ----------
    name : str
        What :attr:`CreditResult.rule` and ``G.graph["credit_rule"]`` say.
    table : mapping
        Node kind (module class, function, ``method("name")``) to a rule object
        or a function ``rule(call, credit, state) -> (input_credit, param_credit)``.

    Examples
    --------
    >>> from torch import nn
    >>> from fxnx.credit import Exact
    >>> mine = PRESETS["feedback_alignment"] | {nn.Conv2d: Exact()}
    >>> mine.name, type(mine[nn.Conv2d]).__name__, type(mine[nn.Linear]).__name__
    ('feedback_alignment|custom', 'Exact', 'FeedbackAlignment')
    >>> list(mine.added) == [nn.Conv2d]
    True
    """

    def __init__(self, name: str, table: Mapping[Any, Rule]) -> None:
        check_kinds(table, f"preset {name!r}")
        self.name = name
        self._layers: tuple[_Layer, ...] = (
            table._layers if isinstance(table, Preset)
            else (_Layer(MappingProxyType(dict(table)), added=False),)
        )
        self._table: Mapping[Any, Rule] = _union(self._layers)

    @classmethod
    def _stacked(cls, name: str, layers: tuple[_Layer, ...]) -> Preset:
        preset = cls.__new__(cls)
        preset.name, preset._layers = name, _shadowed(layers)
        preset._table = _union(preset._layers)
        return preset

    def __getitem__(self, kind: Any) -> Rule:
        return self._table[kind]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __or__(self, other: Mapping[Any, Rule]) -> Preset:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Preset._stacked(f"{self.name}|{_name(other)}", self._layers + _layers_of(other))

    def __ror__(self, other: Mapping[Any, Rule]) -> Preset:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Preset._stacked(f"{_name(other)}|{self.name}", _layers_of(other) + self._layers)

    def __repr__(self) -> str:
        return f"Preset({self.name!r}, {self._table!r})"

    @property
    def added(self) -> dict[Any, Rule]:
        """The kinds added to this preset with ``|`` as a plain mapping (``PRESETS[...] |
        {nn.Conv2d: Exact()}``), to their rules: the user's own, which
        :func:`warn_unused_kinds` reports where they match no node."""
        return dict(_union(tuple(layer for layer in self._layers if layer.added)))

    def lookup(self, call: NodeCall) -> Rule | None:
        """The rule for ``call``'s node kind, or None where the preset has none: that of the
        last layer that has one (see the class)."""
        for layer in reversed(self._layers):
            rule = lookup(call, layer.table)
            if rule is not None:
                return rule
        return None


def _shadowed(layers: tuple[_Layer, ...]) -> tuple[_Layer, ...]:
    """``layers`` with each key left only in the last layer that has it: a kind given again
    with ``|`` replaces its earlier entry, as in a dict, so that entry is never found."""
    seen: set[Any] = set()
    kept = []
    for layer in reversed(layers):
        table = {kind: rule for kind, rule in layer.table.items() if kind not in seen}
        seen.update(layer.table)
        if table:
            kept.append(_Layer(MappingProxyType(table), layer.added))
    return tuple(reversed(kept))


def _union(layers: tuple[_Layer, ...]) -> Mapping[Any, Rule]:
    merged: dict[Any, Rule] = {}
    for layer in layers:
        merged.update(layer.table)
    return MappingProxyType(merged)


def _layers_of(table: Mapping[Any, Rule]) -> tuple[_Layer, ...]:
    """``table`` as layers of a composed preset: a preset's own, or one added layer."""
    if isinstance(table, Preset):
        return table._layers
    check_kinds(table, "the mapping added to a preset with |")
    return (_Layer(MappingProxyType(dict(table)), added=True),)


def _name(table: Mapping[Any, Rule]) -> str:
    return table.name if isinstance(table, Preset) else "custom"


def check_kinds(table: Mapping[Any, Any], where: str) -> None:
    """Refuse keys that are not node kinds (a module class, a function, ``method("name")``),
    which no node would ever match."""
    for kind in table:
        if isinstance(kind, type) or (isinstance(kind, tuple) and len(kind) == 2 and kind[0] == "call_method"):
            continue
        if callable(kind) and not isinstance(kind, (str, nn.Module)):
            continue
        if isinstance(kind, nn.Module):  # a layer itself, not its kind: no node is keyed so
            kind = type(kind).__name__ + "(...)"
            hint = (
                "; to route one layer, key it by its node's name (rules={'layer1.0.conv1': ...}, "
                "the names in G), or every layer of its class by the class"
            )
        elif isinstance(kind, str):
            hint = f"; to route the node named {kind!r}, pass rules={{{kind!r}: ...}}"
        else:
            hint = ""
        raise FxnxValueError(
            f"{where} has the key {kind!r}, which is not a node kind (a module class such as "
            f"nn.Linear, a function such as torch.matmul, or fxnx.credit.method('view')){hint}"
        )


def lookup(call: NodeCall, table: Mapping[Any, Rule]) -> Rule | None:
    """The rule in ``table`` for ``call``'s node kind, or None.

    A ``call_module`` node's kind is its module's class. Another node's is, first, the
    class of the module whose own call it is (:attr:`NodeCall.owner`), where the rule
    that class has takes the node (:func:`_takes`); then its function or method.
    """
    if call.module is not None:
        return _by_class(type(call.module), table)
    rule = _by_class(call.owner, table) if call.owner is not None else None
    if rule is not None and _takes(rule, call):
        return rule
    if call.op == "call_method":
        return table.get(method(call.target))
    if call.op == "call_function":
        try:
            return table.get(call.target)
        except TypeError:  # an unhashable callable
            return None
    return None


def _by_class(cls: type, table: Mapping[Any, Rule]) -> Rule | None:
    """The rule of the first class along ``cls``'s MRO that ``table`` keys, or None."""
    for base in cls.__mro__:
        if base in table:
            return table[base]
    return None


#: Rules that stand in for a layer's weights: at a module's own function nodes they take
#: only its products with a weight (see the module docstring).
_FEEDBACK = (Transport, DirectFeedbackAlignment)


def _takes(rule: Any, call: NodeCall) -> bool:
    """Whether a module class's ``rule`` takes ``call``, a function or method node of that
    module's own: a feedback rule only a product with a weight, any other rule every node."""
    if not isinstance(rule, _FEEDBACK):
        return True
    if call.op == "call_method":
        return call.target in WEIGHTED_METHODS
    try:
        return call.op == "call_function" and call.target in _WEIGHTED
    except TypeError:  # an unhashable callable
        return False


_WEIGHTED = frozenset(WEIGHTED_FUNCTIONS)


def check_named(call: NodeCall, rule: Any) -> None:
    """Refuse a weight-transport rule given for ``call``'s node by name where the node has
    no weight, as at a module without one (``nn.Tanh``), whatever the node's op.

    Matched by kind, such a rule leaves a function node without weights exact
    (``q @ k.transpose(-2, -1)`` is a ``torch.matmul`` as ``x @ W`` is); given by name, it
    was meant for that very node, and would otherwise be silently exact there.

    Raises
    ------
    FxnxTypeError
        The node has no parameter of two or more dimensions (trainable, for a module's) among its
        arguments or its module's parameters.
    """
    if isinstance(rule, Transport) and not has_weights(call):
        raise no_weights(call)


#: The ops of the nodes a rule can be chosen for.
_COMPUTING = frozenset({"call_module", "call_function", "call_method"})


def unused_kinds(kinds: Mapping[Any, Any], calls: Iterable[NodeCall]) -> list[Any]:
    """The keys of ``kinds`` (node kind to rule) that match none of ``calls``, as
    :func:`lookup` matches them."""
    computing = [call for call in calls if call.op in _COMPUTING]
    return [
        kind for kind, rule in kinds.items()
        if not any(lookup(call, {kind: rule}) is not None for call in computing)
    ]


def warn_unused_kinds(kinds: Mapping[Any, Any], calls: Iterable[NodeCall], where: str) -> None:
    """Warn once for each key of ``kinds`` that matches none of ``calls``: a rule the user
    gave for a kind this graph does not have (a typo, ``torch.relu`` for ``F.relu``, a
    class the capture left no node of) would otherwise be silently unused.

    ``where`` says where the keys were given (``"rules"``, ``"rule 'feedback_alignment|custom'"``).
    """
    calls = list(calls)
    for kind in unused_kinds(kinds, calls):
        shown = kind_name(kind)
        warn_user(
            f"{where} has a rule for {shown}, but no node of this graph is {shown}, so that "
            f"rule applies to no node; {_present(kind, calls)}. Key a kind the graph has, or "
            "a node by its name (rules={'name': ...}, the names in G)"
        )


def warn_exact_layers(preset: Preset, calls: Iterable[NodeCall], rules: Mapping[str, Any],
                      credited: Mapping[str, bool], overridden: Mapping[Any, Any], named: Mapping[str, Any]) -> None:
    """Warn once where a feedback preset leaves layers with weight matrices of their own exact
    for want of a rule for their kind (:func:`.kinds.mixes`: ``nn.LSTM``, ``nn.Bilinear``, a
    module kept whole that holds linear layers, ``aten.lstm`` in an exported graph,
    ``torch.tensordot`` with a weight): their inputs get backprop's credit, through the weights themselves,
    under a rule whose point is that they do not. Norms and other elementwise weights are not
    named: exact is what a feedback rule means there. ``credited``: whether a node has a
    floating-point input (an embedding's token ids take no credit). Nodes the user gave a
    rule, by name or kind, are left alone."""
    if not any(isinstance(rule, (Transport, DirectFeedbackAlignment)) for rule in preset.values()):
        return
    left = [
        call for call in calls
        if isinstance(rules.get(call.name), Exact) and credited.get(call.name) and call.name not in named
        and lookup(call, overridden) is None and preset.lookup(call) is None and mixes(call)
    ]
    if left:
        kinds = ", ".join(dict.fromkeys(_kind_of(call) for call in left))
        names = ", ".join(repr(call.name) for call in left[:5]) + (", …" if len(left) > 5 else "")
        nodes = f"nodes {names} are" if len(left) > 1 else f"node {names} is"
        module = next((call for call in left if call.module is not None), None)
        give = (f"Give their kind a rule (rules={{{_kind_of(module)}: ...}})" if module is not None
                else "Route them by a rule of your own by name")
        warn_user(
            f"rule {preset.name!r} has no rule for {kinds}, so {nodes} routed exactly: backprop's "
            f"credit, through the layer's own weights. {give}, or name them exact to keep it so "
            f"(rules={{{left[0].name!r}: fxnx.credit.Exact()}})"
        )


def _present(kind: Any, calls: list[NodeCall]) -> str:
    """What the graph has instead of ``kind``: for a module class its kinds with weights (what
    such keys are mostly for), for a function or method all its kinds."""
    weighted = isinstance(kind, type)
    noun = "kinds with weights" if weighted else "node kinds"
    found = list(dict.fromkeys(
        _kind_of(call) for call in calls
        if call.op in _COMPUTING and (not weighted or has_weights(call))
    ))
    if not found:
        return f"the graph has no {noun}"
    return f"its {noun} are {', '.join(found[:8])}{', …' if len(found) > 8 else ''}"


def _kind_of(call: NodeCall) -> str:
    """A node's kind as :func:`warn_unused_kinds` shows it: ``nn.Linear``, or
    ``aten.linear.default in nn.Linear`` for a module's own call."""
    if call.module is not None:
        return kind_name(type(call.module))
    inside = f" in {kind_name(call.owner)}" if call.owner is not None else ""
    shown = kind_name(method(call.target) if call.op == "call_method" else call.target)
    return shown + inside


#: A node of these kinds (:mod:`.kinds`) follows the feedback rule where one of its arguments
#: is a parameter of two or more dimensions (frozen or not), or a view of one (``W.T``); each
#: such parameter gets its own ``B``. It is routed exactly where none is (``q @ k.transpose(-2,
#: -1)`` in attention).


def _every(rule: Rule) -> dict[Any, Rule]:
    return dict.fromkeys((*WEIGHTED_MODULES, *WEIGHTED_FUNCTIONS, *map(method, WEIGHTED_METHODS)), rule)


def preset_of(rule: Rule) -> Preset:
    """``rule`` at every weighted layer and function, exact elsewhere: what each built-in
    preset is for its own rule, so ``rule=FeedbackAlignment(init="kaiming")`` is
    ``"feedback_alignment"`` with that rule."""
    return Preset(getattr(rule, "name", type(rule).__name__), _every(rule))


#: The built-in presets, by the name ``rule=`` takes. Read-only: make your own with ``|``.
PRESETS: Mapping[str, Preset] = MappingProxyType({
    "exact": Preset("exact", {}),
    "feedback_alignment": Preset("feedback_alignment", _every(FeedbackAlignment())),
    "direct_feedback_alignment": Preset("direct_feedback_alignment", _every(DirectFeedbackAlignment())),
    "usf": Preset("usf", _every(SignSymmetry("uniform"))),
    "brsf": Preset("brsf", _every(SignSymmetry("batch_random"))),
    "frsf": Preset("frsf", _every(SignSymmetry("fixed_random"))),
    "kolen_pollack": Preset("kolen_pollack", _every(KolenPollack())),
    "weight_mirror": Preset("weight_mirror", _every(WeightMirror())),
})
