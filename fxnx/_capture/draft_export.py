"""The ``draft_export`` route: :func:`torch.export.draft_export`.

Like ``export``, and it also handles control flow on tensor *values*, which
it specialises to the example input (the ladder warns when it did).
"""

from __future__ import annotations

from typing import Any

from .common import Route, RouteResult
from .export import export_graph
from .inputs import Inputs
from .make_fx import reads_random_values
from .options import CaptureOptions

__all__ = ["ROUTE"]


def _run(model: Any, inputs: Inputs | None, options: CaptureOptions, fake: bool) -> RouteResult:
    assert inputs is not None  # the ladder checks needs_inputs
    gm, varies, unroutable, reads = export_graph(model, inputs, draft=True)
    return RouteResult(
        gm, specialised=bool(reads), varies=varies or reads_random_values(gm), unroutable=unroutable,
        reads_values=reads,
    )


ROUTE = Route(name="draft_export", level="aten", needs_inputs=True, run=_run)
