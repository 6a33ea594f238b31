"""Capturing a model as a ``torch.fx.GraphModule`` with tensor metadata: the one place that runs it.

Named ``_capture``: private, and apart from the public function :func:`fxnx.capture`,
which it defines.

Modules, in the order a capture meets them:

- :mod:`~fxnx._capture.options`: :class:`CaptureOptions`, the options that
  produce a graph as one value, stored as plain data in ``G.graph["capture_options"]``;
- :mod:`~fxnx._capture.inputs`: the example inputs bound to ``forward``;
- :mod:`~fxnx._capture.ladder`: :func:`capture`, which tries the routes in turn;
- :mod:`~fxnx._capture.registry`: every route by name (``ROUTES``), one module each:
  :mod:`~fxnx._capture.symbolic_trace` (with :mod:`~fxnx._capture.tracer`, the
  leaf rule), :mod:`~fxnx._capture.export`, :mod:`~fxnx._capture.draft_export`
  and :mod:`~fxnx._capture.make_fx` (also the ``aten`` and ``joint`` levels);
- :mod:`~fxnx._capture.shapes`: shapes from real, fake or meta tensors;
- :mod:`~fxnx._capture.reuse`: capturing again from a graph's stored options,
  reused across credit runs.
"""

from __future__ import annotations

from .inputs import FIXED_KWARGS
from .ladder import TRACING_LOCK, Capture, capture
from .options import CaptureOptions

# Only the names fxnx re-exports; the rest live in the submodules named above.
__all__ = ["Capture", "CaptureOptions", "FIXED_KWARGS", "TRACING_LOCK", "capture"]
