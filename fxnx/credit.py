"""Learning rules: the objects and presets that say how each node sends credit back.

Use them with :class:`fxnx.CreditRouter` and :func:`fxnx.route_credit`: by preset name, as
one rule object at every weighted layer, or per node name or kind::

    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    router = fxnx.CreditRouter(G, model, rule=fxnx.credit.FeedbackAlignment(init="kaiming"))
    router = fxnx.CreditRouter(G, model, rules={"fc": fxnx.credit.Exact()})

A rule is a :class:`Rule` (or a plain function) called with a :class:`NodeCall`, the credit at
the node's output and the :class:`RoutingState`; a :class:`Preset` maps node kinds to rules;
:data:`PRESETS` holds the named ones.
"""

from ._credit.compare import credit_alignment
from ._credit.learned import KolenPollack, WeightMirror
from ._credit.nodecall import NodeCall
from ._credit.presets import PRESETS, Preset, method
from ._credit.result import credit_norm
from ._credit.rules import (
    DirectFeedbackAlignment,
    Exact,
    FeedbackAlignment,
    RoutingState,
    Rule,
    SignSymmetry,
)

__all__ = [
    "DirectFeedbackAlignment",
    "Exact",
    "FeedbackAlignment",
    "KolenPollack",
    "NodeCall",
    "PRESETS",
    "Preset",
    "RoutingState",
    "Rule",
    "SignSymmetry",
    "WeightMirror",
    "credit_alignment",
    "credit_norm",
    "method",
]
