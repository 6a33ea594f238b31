"""Credit routing inside autograd: the router that trains with a rule, one-shot routing, and
what a run gives back. The rule-writing names are public in :mod:`fxnx.credit`.
"""

from .collected import route_credit
from .result import CreditResult
from .router import CreditRouter

__all__ = ["CreditResult", "CreditRouter", "route_credit"]
