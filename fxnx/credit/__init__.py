"""Credit routing: the router, the recorded forward pass, the rule registry, comparisons."""

from .compare import credit_alignment
from .record import NodeCall
from .router import CreditResult, credit_norm, route_credit
from .rules import (
    PRESETS,
    RoutingState,
    Rule,
    exact,
    feedback_alignment,
    method,
    register_rule,
    sign_symmetry,
)

__all__ = [
    "CreditResult",
    "NodeCall",
    "PRESETS",
    "RoutingState",
    "Rule",
    "credit_alignment",
    "credit_norm",
    "exact",
    "feedback_alignment",
    "method",
    "register_rule",
    "route_credit",
    "sign_symmetry",
]
