"""Every capture route by name, in the order ``routes="auto"`` tries them.

The registry is data: a dict built once from the route modules' ``ROUTE``
records. To add a route, write a module with a ``ROUTE`` (see
:class:`fxnx._capture.common.Route`) and list it here.
"""

from __future__ import annotations

from . import draft_export, export, make_fx, symbolic_trace
from .common import Route

__all__ = ["ROUTES", "ROUTE_NAMES"]

#: Route name to route, in the order ``routes="auto"`` tries them.
ROUTES: dict[str, Route] = {
    route.name: route
    for route in (symbolic_trace.ROUTE, export.ROUTE, draft_export.ROUTE, make_fx.ROUTE)
}

#: The route names, in order.
ROUTE_NAMES: tuple[str, ...] = tuple(ROUTES)
