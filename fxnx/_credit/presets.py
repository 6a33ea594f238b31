"""Presets: which rule each kind of node follows, as plain data that composes.

A :class:`Preset` maps *node kinds* to rule objects (or rule functions). A kind
is a module class, matched along the module's MRO so subclasses count; a
function such as ``torch.add``; or ``method("view")`` for ``x.view(...)``
calls. Any node whose kind has no entry is routed exactly.

Presets compose with ``|``, the right side winning, as dicts do::

    PRESETS["feedback_alignment"] | {nn.Conv2d: Exact()}

There is no registry to fill: a preset of your own is a ``Preset`` (or a plain
dict) passed as ``rule=``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

from .._errors import FxnxValueError
from .kinds import WEIGHTED_FUNCTIONS, WEIGHTED_MODULES
from .learned import KolenPollack, WeightMirror
from .nodecall import NodeCall
from .rules import DirectFeedbackAlignment, FeedbackAlignment, Rule, SignSymmetry

__all__ = ["PRESETS", "Preset", "method"]


def method(name: str) -> tuple[str, str]:
    """The node kind of ``tensor.name(...)`` calls, as a key of a preset.

    Examples
    --------
    >>> method("view")
    ('call_method', 'view')
    """
    return ("call_method", name)


class Preset(Mapping[Any, Rule]):
    """An immutable map from node kinds to rules, with a name for reports.

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
    """

    def __init__(self, name: str, table: Mapping[Any, Rule]) -> None:
        check_kinds(table, f"preset {name!r}")
        self.name = name
        self._table: Mapping[Any, Rule] = MappingProxyType(dict(table))

    def __getitem__(self, kind: Any) -> Rule:
        return self._table[kind]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __or__(self, other: Mapping[Any, Rule]) -> Preset:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Preset(f"{self.name}|{_name(other)}", {**self._table, **other})

    def __ror__(self, other: Mapping[Any, Rule]) -> Preset:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Preset(f"{_name(other)}|{self.name}", {**other, **self._table})

    def __repr__(self) -> str:
        return f"Preset({self.name!r}, {self._table!r})"

    def lookup(self, call: NodeCall) -> Rule | None:
        """The rule for ``call``'s node kind, or None where the preset has none."""
        return lookup(call, self._table)


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
    """The rule in ``table`` for ``call``'s node kind, or None."""
    if call.module is not None:
        for cls in type(call.module).__mro__:
            if cls in table:
                return table[cls]
        return None
    if call.op == "call_method":
        return table.get(method(call.target))
    if call.op == "call_function":
        try:
            return table.get(call.target)
        except TypeError:  # an unhashable callable
            return None
    return None



#: A node of these kinds (:mod:`.kinds`) follows the feedback rule where one of its arguments
#: is a trainable parameter of two or more dimensions, or a transpose of one (``W.T``); each
#: such parameter gets its own ``B``. It is routed exactly where none is (``q @ k.transpose(-2,
#: -1)`` in attention).


def _every(rule: Rule) -> dict[Any, Rule]:
    return dict.fromkeys((*WEIGHTED_MODULES, *WEIGHTED_FUNCTIONS), rule)


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
