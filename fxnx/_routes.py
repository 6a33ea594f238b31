"""Capture routes for models ``torch.fx.symbolic_trace`` cannot trace.

Each route takes the model and its example inputs (one value per ``forward``
parameter) and returns an ATen-level ``fx.GraphModule`` whose placeholders are
the inputs' pytree leaves, in order, and whose nodes carry
``meta["nn_module_stack"]``; or raises :class:`~fxnx.errors.CaptureError` with
one line saying why.

- ``export``: :func:`torch.export.export`, non-strict. Handles Python control
  flow on shapes (loops over ``x.size(0)``), which it unrolls for the example.
- ``draft_export``: :func:`torch.export.draft_export`. Also handles control
  flow on tensor *values*, which it specialises to the example input.
- ``make_fx``: :func:`fxnx._aten.capture_aten` without the backward pass. It
  runs the model on real tensors and records whatever ran.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ._compat import pytree
from ._state import preserved
from .errors import CaptureError, first_line

__all__ = ["ROUTES", "FunctionModule", "as_module", "export_route", "quiet"]

#: Every capture route, in the order ``routes="auto"`` tries them.
ROUTES = ("symbolic_trace", "export", "draft_export", "make_fx")


def export_route(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    draft: bool,
) -> fx.GraphModule:
    """The graph ``torch.export`` (non-strict) or ``torch.export.draft_export`` makes;
    keyword inputs are passed as keywords."""
    module = as_module(model)
    args, kwargs = tuple(args), dict(kwargs)
    name = "torch.export.draft_export" if draft else "torch.export.export(strict=False)"
    try:
        with preserved(module), quiet():
            if draft:
                program = torch.export.draft_export(module, args, kwargs)
            else:
                program = torch.export.export(module, args, kwargs, strict=False)
            gm = program.module(check_guards=False)
    except Exception as err:
        raise CaptureError(f"{name} failed: {type(err).__name__}: {first_line(err)}") from err
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaves = pytree.tree_leaves((args, kwargs))
    if len(placeholders) != len(leaves):
        raise CaptureError(
            f"{name} made a graph with {len(placeholders)} inputs for {len(leaves)} input "
            "values; fxnx cannot tell which is which"
        )
    return gm


def as_module(model: nn.Module | Callable[..., Any]) -> nn.Module:
    """``model`` itself, or a plain function wrapped as a module (``torch.export`` and
    ``functional_call`` take only modules)."""
    return model if isinstance(model, nn.Module) else FunctionModule(model)


class FunctionModule(nn.Module):
    """A plain function as a module; ``fn`` keeps the function and its signature."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what torch prints while a route is tried; a failure is reported by the ladder."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with (
            contextlib.redirect_stderr(io.StringIO()),
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)

