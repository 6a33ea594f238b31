"""What every capture route shares: the route record, its result, and small helpers.

A route is a :class:`Route`: a name, the level of the graphs it makes, whether
it needs example inputs, and a function ``run(model, inputs, options, fake)`` that
returns a :class:`RouteResult` or raises :class:`~fxnx.errors.CaptureError`
with one line saying why. :mod:`fxnx._capture.registry` lists them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from .._errors import ConcurrentUseError

if TYPE_CHECKING:
    from .inputs import Inputs
    from .make_fx import AtenCapture
    from .options import CaptureOptions

__all__ = ["FunctionModule", "Route", "RouteResult", "alone", "as_module", "drawn", "draws_varies", "quiet"]


@dataclass(frozen=True)
class RouteResult:
    """A route's graph, what it kept whole, and whether it holds for the example input only.

    Attributes
    ----------
    gm : torch.fx.GraphModule
    opaque : tuple of str
        Submodules kept whole because tracing failed in them.
    aten : AtenCapture or None
        For ``make_fx``: what its inputs stand for.
    specialised : bool
        Control flow read a tensor's value: the graph follows the example's branches.
    shape_specialised : bool
        Control flow read a shape: the graph holds for the example's shapes.
    varies : str
        Why the graph holds one of the model's forwards among several (it drew random
        numbers in Python while it was captured), in words; empty otherwise.
    unroutable : str
        Why autograd over the graph is not the model's backward (a custom autograd
        Function's forward inlined without its backward), in words; empty otherwise.
    reads_values : str
        The conditions on tensor values the graph's branches were taken on for the example
        (``u0 > 1``), where the graph may not show them; empty where none was seen.
    """

    gm: fx.GraphModule
    opaque: tuple[str, ...] = ()
    aten: AtenCapture | None = None
    specialised: bool = False
    shape_specialised: bool = True
    varies: str = ""
    unroutable: str = ""
    reads_values: str = ""


@dataclass(frozen=True)
class Route:
    """One way to capture a model.

    Attributes
    ----------
    name : str
        What ``routes=`` calls it.
    level : str
        The level of its graphs: ``"module"`` (modules and functions as the model
        calls them) or ``"aten"`` (ATen operators that keep their module path).
    needs_inputs : bool
        Whether it runs the model, so needs example inputs.
    run : callable
        ``run(model, inputs, options, fake) -> RouteResult``; ``fake``: run fake
        tensors, not the example's values, where the route runs the model.
    """

    name: str
    level: str
    needs_inputs: bool
    run: Callable[[Any, Inputs | None, CaptureOptions, bool], RouteResult]


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


@contextlib.contextmanager
def alone(model: Any) -> Iterator[None]:
    """Refuse a capture during which another thread called one of ``model``'s modules.

    torch.export and make_fx change process-wide state while they trace (the
    module call and the tensor modes they install), so another thread's forward
    through the same modules can reach the graph or break the trace. The check is
    a forward pre-hook for every module while the block runs.
    """
    if not isinstance(model, nn.Module):
        yield
        return
    mine, owner = {id(m) for m in model.modules()}, threading.get_ident()
    others: list[str] = []

    def seen(module: nn.Module, args: Any) -> None:
        if id(module) in mine and threading.get_ident() != owner and not others:
            others.append(type(module).__qualname__)

    handle = nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        yield
    finally:
        handle.remove()
        if others:
            raise ConcurrentUseError(
                f"another thread ran {type(model).__qualname__} (its {others[0]} module) while "
                "fxnx captured it with torch.export or make_fx, which trace the whole process: "
                "the graph could hold that thread's calls. Convert it while no other thread "
                "runs the model"
            )


@contextlib.contextmanager
def drawn(*, torch_rng: bool) -> Iterator[list[str]]:
    """Note the random number generators the block drew from: Python's ``random``, NumPy's
    (when imported) and, with ``torch_rng``, torch's CPU generator.

    Use it inside the block that restores the generators (``preserved``). A trace that draws
    from them ran the model's random choices in Python: the graph holds one draw.
    """
    found: list[str] = []
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    before = numpy.random.get_state() if numpy is not None else None
    cpu = torch.random.get_rng_state() if torch_rng else None
    try:
        yield found
    finally:
        if random.getstate() != python:
            found.append("Python's random module")
        if numpy is not None and not _same_numpy_state(before, numpy.random.get_state()):
            found.append("NumPy's random generator")
        if cpu is not None and not torch.equal(cpu, torch.random.get_rng_state()):
            found.append("torch's random generator")


def _same_numpy_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])


def draws_varies(found: list[str], route: str) -> str:
    """The words for a capture that drew random numbers in Python (see :func:`drawn`)."""
    if not found:
        return ""
    return (
        f"its forward drew from {' and '.join(found)} while {route} captured it, outside any "
        "operation a graph records (a random choice made in Python, such as skipping a layer "
        "at random in training mode), so the graph holds that one draw and each call may run "
        "another graph"
    )
