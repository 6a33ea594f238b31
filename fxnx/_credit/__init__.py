"""Credit routing: rules, presets, the router that trains with them, one-shot analysis."""

from .collected import route_credit
from .compare import credit_alignment
from .learned import KolenPollack, WeightMirror
from .nodecall import NodeCall
from .presets import PRESETS, Preset, method
from .result import CreditResult, credit_norm
from .router import CreditRouter
from .rules import (
    DirectFeedbackAlignment,
    Exact,
    FeedbackAlignment,
    RoutingState,
    Rule,
    SignSymmetry,
)

__all__ = [
    "CreditResult",
    "CreditRouter",
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
    "route_credit",
]
