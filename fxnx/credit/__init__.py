"""Credit routing: rules, presets, the router that trains with them, one-shot analysis."""

from .compare import credit_alignment
from .engine import CreditRouter
from .learned import KolenPollack, WeightMirror
from .presets import PRESETS, Preset, method
from .record import NodeCall
from .result import CreditResult, credit_norm
from .router import route_credit
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
