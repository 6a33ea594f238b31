"""The ``export`` route: :func:`torch.export.export`, non-strict.

It handles Python control flow on shapes (loops over ``x.size(0)``), which it
unrolls for the example. The graph is ATen-level; its placeholders are the
inputs' pytree leaves, in order, and its nodes carry ``meta["nn_module_stack"]``.
Keyword inputs are passed as keywords.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .._compat import pytree, value_reads
from .._errors import CaptureError, first_line
from .._state import preserved
from .common import Route, RouteResult, as_module, drawn, draws_varies, quiet
from .functions import applied
from .inputs import Inputs
from .make_fx import reads_tensor_values
from .options import CaptureOptions

__all__ = ["ROUTE", "export_graph"]


def export_graph(model: Any, inputs: Inputs, *, draft: bool) -> tuple[fx.GraphModule, str, str, str]:
    """The graph ``torch.export`` (non-strict) or ``torch.export.draft_export`` makes, why
    it holds one random draw of the model's, if it does, why autograd over it is not the
    model's backward, if it is not (:attr:`RouteResult.unroutable`), and the conditions on
    tensor values its control flow met (:attr:`RouteResult.reads_values`).

    A random draw: the model drew from Python's ``random`` (or NumPy's) while traced, a
    choice held in the graph. torch's own generator is not watched: export traces fake
    tensors, which draw nothing, and draft_export runs the model's random operations, which
    its graph records. Not the model's backward: the graph holds a custom autograd
    Function's forward operations without its backward, or (draft_export) the branches a
    condition on a tensor's value took for the example."""
    module = as_module(model)
    args, kwargs = _distinct((tuple(inputs.args), dict(inputs.kwargs)))
    name = "torch.export.draft_export" if draft else "torch.export.export(strict=False)"
    try:
        with preserved(module), quiet(), drawn(torch_rng=False) as draws, applied() as functions:
            if draft:
                program = torch.export.draft_export(module, args, kwargs)
            else:
                program = torch.export.export(module, args, kwargs, strict=False)
            gm = program.module(check_guards=False)
    except Exception as err:
        raise CaptureError(f"{name} failed: {type(err).__name__}: {first_line(err)}") from err
    varies = draws_varies(draws, name)
    why = []
    if functions:
        why.append(
            f"its forward applies the autograd Function {', '.join(f.__qualname__ for f in functions)}, "
            f"whose backward {name} does not keep (its graph holds the Function's forward operations)"
        )
    reads = [expr for expr in value_reads(program) if expr] if draft else []
    if draft and not reads and reads_tensor_values(gm):  # (export fails on such reads)
        reads = ["a value read in the graph"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaves = pytree.tree_leaves((args, kwargs))
    if len(placeholders) != len(leaves):
        raise CaptureError(
            f"{name} made a graph with {len(placeholders)} inputs for {len(leaves)} input "
            "values; fxnx cannot tell which is which"
        )
    return gm, varies, "; and ".join(why), ", ".join(reads[:3])


def _distinct(inputs: Any) -> Any:
    """The inputs, each tensor given again (one object for several arguments) as a view of
    itself: torch.export makes one input of an object given twice and records its every use
    through the last argument that holds it, so the graph would have the others read nothing.
    A view shares the memory, so the graph run on these inputs (or on any that share memory
    as these do) sees a write through one argument in the others, as the model's call does."""
    seen: set[int] = set()

    def once(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in seen:
            return value.view_as(value)
        seen.add(id(value))
        return value

    return pytree.tree_map(once, inputs)


def _run(model: Any, inputs: Inputs | None, options: CaptureOptions, fake: bool) -> RouteResult:
    assert inputs is not None  # the ladder checks needs_inputs
    gm, varies, unroutable, _ = export_graph(model, inputs, draft=False)
    return RouteResult(gm, varies=varies, unroutable=unroutable)


ROUTE = Route(name="export", level="aten", needs_inputs=True, run=_run)
