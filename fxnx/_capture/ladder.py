"""Capturing a model: the ladder of routes, and the captured graph with its options.

This is the only place that runs the model while capturing. :func:`capture`
binds the example inputs, tries each route of :data:`~fxnx._capture.registry.ROUTES`
in turn until one gives a graph, then propagates the example inputs as
:class:`torch.fx.passes.shape_prop.ShapeProp` does, so that every node carries
``meta["tensor_meta"]`` and ``meta["type"]``. Failures become
:class:`~fxnx.errors.CaptureError` or :class:`~fxnx.errors.ShapePropagationError`
with the source line or node that caused them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .._compat import pytree
from .._errors import (
    CaptureError,
    FxnxTypeError,
    FxnxValueError,
    ShapePropagationError,
    first_line,
    warn_user,
)
from .._state import attributes_kept, preserved
from .agree import computes_another
from .common import alone, as_module
from .inputs import (
    Inputs,
    bind_inputs,
    copied_inputs,
    device_of,
    empty_inputs,
    placeholder_values,
    qualname,
)
from .make_fx import AtenCapture, capture_aten
from .options import CaptureOptions, LeafSpec, check_level, concrete_items, leaf_names
from .registry import ROUTE_NAMES, ROUTES
from .shapes import propagate as propagate_shapes
from .shapes import shape_source
from .symbolic_trace import copy_graph_module

__all__ = ["Capture", "TRACING_LOCK", "capture", "capture_with"]

#: Held while fxnx traces or runs a model. torch.fx replaces ``torch.nn.Module.__call__`` (and
#: a few functions) for the whole process while it traces symbolically, so two traces at once
#: would record into each other; fxnx's captures and credit runs therefore take turns.
TRACING_LOCK = threading.RLock()


@dataclass(frozen=True)
class Capture:
    """A captured model: the fx graph module, the options that made it, and whether shapes are known.

    Attributes
    ----------
    gm : torch.fx.GraphModule
        The graph module. When ``propagated`` is true every node that produced
        tensors has ``meta["tensor_meta"]`` and every node has ``meta["type"]``.
    model : nn.Module or callable, or None
        What the user passed in (None in a capture kept for reuse, which must not hold it).
    options : CaptureOptions
        The options asked for, with the route that made the graph and the
        submodules it kept whole: enough to capture the same graph again.
    propagated : bool
        Whether example inputs were run through the graph.
    inputs : list or None
        The example inputs as one value per placeholder, in order; None without inputs.
    shape_source : str or None
        ``"ShapeProp"`` (real tensors), ``"FakeTensor"``, ``"meta"`` or
        ``"make_fx"`` (recorded while tracing real tensors); None without shapes.
    level : str
        ``"module"`` (torch.fx's graph: modules and functions as the model calls
        them), ``"aten"`` (ATen operators) or ``"joint"`` (ATen forward and backward).
    failures : tuple of (route, message)
        The routes tried before the winning one and why each failed.
    aten : fxnx._capture.make_fx.AtenCapture or None
        For graphs made by ``make_fx``: what the ``primals_*`` and ``tangents_*``
        inputs stand for and which node computes each gradient.
    fixed_kwargs : dict
        Keyword inputs fxnx set (:data:`~fxnx._capture.inputs.FIXED_KWARGS`),
        such as ``use_cache=False``.
    shape_specialised : bool
        Whether the graph holds for the example's input shapes only.
    varies : str
        Why the model's forward is not one graph, where fxnx saw that it is not (a random
        choice made in Python while it was captured, a control flow that read a random
        value), in words; empty otherwise.
    unroutable : str
        Why autograd over the graph may not be the model's backward (a custom autograd
        Function inlined), in words; empty otherwise. Credit runs other than the model's own
        forward compare the parameters' gradients with the model's, once per capture, and
        refuse it where they differ.
    reads_values : str
        The conditions on tensor values the graph's branches follow for the example; empty
        where none was seen. Credit runs other than the model's own forward compare the
        graph's output with the model's at every call over such a capture.
    propagation : Any
        What a ``propagate=`` function returned for the winning graph (None otherwise).
    """

    gm: fx.GraphModule
    model: nn.Module | Callable[..., Any] | None
    options: CaptureOptions
    propagated: bool
    inputs: list[Any] | None = None
    shape_source: str | None = None
    level: str = "module"
    failures: tuple[tuple[str, str], ...] = ()
    aten: AtenCapture | None = None
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)
    shape_specialised: bool = True
    varies: str = ""
    unroutable: str = ""
    reads_values: str = ""
    propagation: Any = None

    @property
    def method(self) -> str:
        """The route that captured the graph: ``"symbolic_trace"``, ``"graph_module"`` (an
        already traced ``GraphModule`` was given), ``"export"``, ``"draft_export"`` or
        ``"make_fx"``."""
        return str(self.options.route)

    @property
    def opaque(self) -> tuple[str, ...]:
        """Submodules kept whole because tracing through them failed."""
        return self.options.opaque


def capture(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    leaf_modules: Iterable[LeafSpec] | LeafSpec = (),
    concrete_args: Mapping[str, Any] | None = None,
    propagate: bool | Propagator = True,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
    dtype: torch.dtype = torch.float32,
    fake: bool = False,
    level: str = "module",
    routes: str | Sequence[str] = "auto",
    leaf_on_failure: bool = False,
) -> Capture:
    """Trace ``model`` and record the shape and dtype of every value in the graph.

    Parameters
    ----------
    model : nn.Module, fx.GraphModule or callable
        The model. A ``GraphModule`` is used as it is, without tracing again
        (a copy of its graph receives the metadata; the original is untouched).
    args, kwargs : example inputs
        Passed to the model's ``forward``: a tuple or list of positional inputs (one
        tensor stands for ``(x,)``) and a mapping of keyword inputs. With neither, and a ``forward`` that
        needs inputs, nothing runs and shapes stay unknown.
    leaf_modules : iterable of module classes, qualified submodule names or "torch.nn"
        Modules to keep whole as single ``call_module`` nodes instead of
        tracing through them. By default torch's primitive layers (modules
        without submodules, and ``nn.MultiheadAttention``) stay whole and its
        composites (``nn.TransformerEncoder``, ``nn.Transformer``, containers)
        are traced into; ``"torch.nn"`` keeps every ``torch.nn`` module whole,
        torch.fx's own rule. Classes may also be named ``"class:<module>.<qualname>"``.
    concrete_args : mapping, optional
        Inputs to fix to constant values while tracing, as in
        ``torch.fx.symbolic_trace``; use it for flags that select a branch.
    propagate : bool or callable
        Run the example inputs through the graph to record shapes (default), as each route's
        graph is made: a graph that fails where the model itself runs is that route's
        failure (in ``failures``), and the next route is tried. A function
        ``propagate(gm, model, values, fake)`` propagates instead of
        :func:`~fxnx._capture.shapes.propagate` (raising ``ShapePropagationError`` as it
        does); what it returns is ``Capture.propagation``. With fxnx's own propagation, a
        graph whose output on real inputs differs from the model's is that route's failure
        too (:mod:`fxnx._capture.agree`).
    input_shape : shape or list of shapes, optional
        Instead of example inputs: the shape of each positional input, made as
        empty tensors of ``dtype`` on the model's device.
    fake : bool
        Propagate fake tensors (``FakeTensorMode``): shapes without real compute
        or memory. A model on the ``meta`` device propagates meta tensors anyway.
    level : {"module", "aten", "joint"}
        ``"module"``: torch.fx's graph of modules and functions. ``"aten"``: the
        forward pass as ATen operators. ``"joint"``: forward and backward passes
        as ATen operators in one graph, inputs ``primals_*`` (parameters,
        buffers, data) and ``tangents_*`` (gradients arriving at the outputs).
    routes : "auto", a route name, or a sequence of them
        How to capture a module-level graph, tried in order until one works:
        ``"symbolic_trace"``, then ``"export"`` (``torch.export``, non-strict),
        ``"draft_export"`` and ``"make_fx"``. The last three need example
        inputs and give ATen-level nodes that keep their module path.
    leaf_on_failure : bool
        When symbolic tracing fails inside a submodule, keep that submodule
        whole as one opaque node and trace everything around it. A
        ``torch.nn`` composite that tracing fails in is kept whole anyway.

    Returns
    -------
    Capture

    Raises
    ------
    FxnxTypeError
        ``model`` is neither a module nor a callable, or the inputs do not fit
        its ``forward`` signature.
    FxnxValueError
        A ``leaf_modules`` entry names no submodule, or an unknown level or route.
    CaptureError
        Every route failed; the message says what each one said.
    ShapePropagationError
        Running the example inputs failed at a node (wrong input shape).

    Examples
    --------
    >>> import torch
    >>> cap = capture(torch.nn.Linear(3, 2), (torch.zeros(4, 3),))
    >>> cap.method, cap.level, cap.propagated
    ('symbolic_trace', 'module', True)
    >>> cap.options.to_plain()["routes"]
    ['symbolic_trace', 'export', 'draft_export', 'make_fx']
    """
    names = _route_names(routes, level)
    if names == ("make_fx",) and level == "module":
        level = "aten"  # what make_fx alone captures: one request, recorded one way
    options = CaptureOptions(
        routes=names,
        leaf_modules=leaf_names(leaf_modules),
        concrete_args=concrete_items(concrete_args),
        level=level,
        leaf_on_failure=bool(leaf_on_failure),
    )
    return capture_with(
        model, args, kwargs, options, propagate=propagate, input_shape=input_shape, dtype=dtype,
        fake=fake,
    )


def capture_with(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    options: CaptureOptions,
    *,
    propagate: bool | Propagator = True,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
    dtype: torch.dtype = torch.float32,
    fake: bool = False,
) -> Capture:
    """:func:`capture` with the options as one value (see :meth:`CaptureOptions.replay`)."""
    with TRACING_LOCK:
        return _capture(model, args, kwargs, options, propagate, input_shape, dtype, fake)


def _example_args(args: Any) -> Sequence[Any]:
    """``args`` as a sequence of positional inputs: one tensor stands for itself, as in
    ``capture(model, x)``, never for the sequence of its rows."""
    if isinstance(args, torch.Tensor):
        return (args,)
    if not isinstance(args, (tuple, list)):
        raise FxnxTypeError(
            f"args must be a tuple or list of example inputs (or one tensor), got "
            f"{type(args).__qualname__}: capture(model, (x, y)); keyword inputs go in kwargs=..."
        )
    return args


def _capture(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    options: CaptureOptions,
    propagate: bool | Propagator,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None,
    dtype: torch.dtype,
    fake: bool,
) -> Capture:
    args = _example_args(args)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise FxnxTypeError(
            f"kwargs must be a mapping of keyword inputs, got {type(kwargs).__qualname__}; pass "
            "positional inputs as args, e.g. capture(model, (x,))"
        )
    kwargs = dict(kwargs or {})
    if not isinstance(model, nn.Module) and not callable(model):
        hint = ""
        if isinstance(model, str):
            hint = (
                " To convert a torchvision model by name, build it first "
                f"(torchvision.models.get_model({model!r}, weights=None)) or use the "
                f"command line: fxnx convert {model}."
            )
        raise FxnxTypeError(
            f"model must be a torch.nn.Module or a callable, got {type(model).__qualname__}.{hint}"
        )
    if input_shape is not None:
        if args:
            raise FxnxTypeError("give example inputs or input_shape, not both")
        args = empty_inputs(model, input_shape, dtype)
    # Copies: a model that writes into its input must not write into the caller's tensor.
    inputs = bind_inputs(model, args, kwargs, dict(options.concrete_args))
    fixed = dict(inputs.fixed) if inputs is not None else {}
    if options.level != "module":
        if inputs is None:
            raise FxnxTypeError(
                f"level={options.level!r} runs the model: pass example inputs or input_shape="
            )
        if options.level == "joint":
            return _capture_joint(model, inputs, options, fake)
    varies, unroutable, reads, propagation = "", "", "", None
    failures: list[tuple[str, str]]
    if isinstance(model, fx.GraphModule):
        gm, failures = copy_graph_module(model), []
        options, level, aten, specialised = options.captured("graph_module", ()), "module", None, False
        values = placeholder_values(inputs, gm, level)
        if propagate and values is not None:
            propagation, _ = _propagated(propagate, gm, model, values, fake)
    else:
        name, result, failures, propagation = _ladder(model, inputs, options, fake, propagate)
        gm, aten, specialised, varies = result.gm, result.aten, result.shape_specialised, result.varies
        unroutable, reads = result.unroutable, result.reads_values
        options, level = options.captured(name, result.opaque), ROUTES[name].level
        if level == "aten":
            specialised = True  # torch.export and make_fx specialise to the example's shapes
        values = placeholder_values(inputs, gm, level)
    run = aten is not None or (bool(propagate) and values is not None)  # make_fx recorded every shape
    if unroutable:
        warn_user(
            f"{qualname(model)} was captured with {options.route}, but {unroutable}: credit "
            "over this graph (route_credit, CreditRouter but with rule='exact' and "
            "node_credit=False) is first checked against the model's own gradients, and "
            "refused where they differ"
        )
    if varies:
        warn_user(
            f"{qualname(model)}'s forward is not one graph: {varies}. Convert it in eval mode "
            "(model.eval()) for the graph every call runs; route_credit and CreditRouter refuse "
            "it as it is"
        )
    return Capture(
        gm=gm, model=model, options=options, propagated=run, inputs=values,
        shape_source=(_source(model, fake, options.route) if run else None), level=level,
        failures=tuple(failures), aten=aten, fixed_kwargs=fixed, shape_specialised=specialised,
        varies=varies, unroutable=unroutable, reads_values=reads, propagation=propagation,
    )


def _route_names(routes: str | Sequence[str], level: str) -> tuple[str, ...]:
    check_level(level)
    names = ROUTE_NAMES if routes == "auto" else (routes,) if isinstance(routes, str) else tuple(routes)
    unknown = [r for r in names if r not in ROUTES]
    if unknown or not names:
        raise FxnxValueError(
            f"unknown capture route {unknown or routes!r}; routes are 'auto' or any of "
            f"{', '.join(map(repr, ROUTE_NAMES))}"
        )
    if level != "module":
        if routes != "auto" and names != ("make_fx",):
            raise FxnxValueError(
                f"level={level!r} is always captured with make_fx; leave routes='auto'"
            )
        names = ("make_fx",)
    return names


def _ladder(
    model: nn.Module | Callable[..., Any],
    inputs: Inputs | None,
    options: CaptureOptions,
    fake: bool,
    propagate: bool | Propagator,
) -> tuple[str, Any, list[tuple[str, str]], Any]:
    """Try each route in turn; the first graph wins. Raise with every route's reason if none works.

    With ``propagate``, a route's graph must also run the example inputs (shape propagation,
    :func:`~fxnx._capture.shapes.propagate`): a graph that fails where the model itself runs
    is that route's failure, and the next route is tried. Returns the winning route's name,
    its result, the earlier routes' failures and what propagation returned.
    """
    failures: list[tuple[str, str]] = []
    errors: list[Exception] = []
    failed: list[ShapePropagationError] = []  # graphs that failed shape propagation
    # The inputs as given: a forward that writes into its inputs (x.sub_(0.5)) wrote into those
    # a route ran, so each graph and the model it is compared with run on a copy of these.
    given = copied_inputs(inputs)
    for name in options.routes:
        route = ROUTES[name]
        try:
            if route.needs_inputs and inputs is None:
                raise CaptureError(f"{name} needs example inputs (or input_shape=) to run the model")
            with alone(model) if route.level == "aten" else contextlib.nullcontext(), \
                    _changes(model) as changed:
                result = route.run(model, inputs, options, fake)
            propagation = None
            if propagate and result.aten is None:
                values = placeholder_values(copied_inputs(given), result.gm, route.level)
                if values is not None:
                    propagation, output = _propagated(propagate, result.gm, model, values, fake)
                    if not changed:  # else the graph is that call's, as the warning below says
                        _check_computes_the_model(model, result, given, options, output, fake)
        except CaptureError as err:
            failures.append((name, first_line(err)))
            errors.append(err)
            continue
        except ShapePropagationError as err:
            if getattr(err, "runtime_check", False):  # no other route mends this
                raise CaptureError(_not_one_graph(model, name, err)) from err
            if not failed and not _model_runs(model, inputs, fake):
                raise  # the model fails on these inputs too: the inputs are at fault
            failures.append((name, f"its graph failed shape propagation: {first_line(err)}"))
            errors.append(err)
            failed.append(err)
            continue
        _warn_specialised(name, result.specialised)
        if changed:
            warn_user(
                f"{qualname(model)} changed itself while {name} captured it ({changed[0]}): "
                "the graph is that of this call. If its first call differs from later ones (a "
                "model that rewrites its modules when first run), call it once before "
                "converting it (a warm-up call) and convert it again"
            )
        if options.leaf_modules and route.level == "aten":
            warn_user(
                f"captured with {name}, whose graph holds ATen operators: leaf_modules "
                f"({', '.join(options.leaf_modules)}) keep modules whole only when symbolic "
                "tracing captures the model; this graph has every operator inside them"
            )
        if name == "make_fx" and failures:
            warn_user(
                f"captured with make_fx, as {', '.join(n for n, _ in failures)} failed (see "
                "G.graph['capture_failures']): its graph is for analysis, and route_credit and "
                "CreditRouter refuse it. To route credit, convert the part of the model that "
                "torch.export captures (for a detector, its backbone and heads without the "
                "data-dependent postprocessing such as NMS), or make export work"
            )
        return name, result, failures, propagation
    own = _model_failure(model, copied_inputs(given), fake) if len(errors) > 1 else None
    if own is not None:  # no route can capture a call that fails: the inputs are at fault
        raise CaptureError(
            f"{qualname(model)} itself fails on the example inputs ({type(own).__name__}: "
            f"{first_line(own)}), so no capture route can run it: check the example inputs' "
            "shapes and dtypes"
        ) from own
    if failed and len(failed) == len(errors):
        raise failed[0]  # every route's graph failed where it ran: name the first node
    if len(errors) == 1:
        raise errors[0]
    lines = [f"no capture route worked for {qualname(model)}:"]
    for (route_name, _), error in zip(failures, errors, strict=True):
        detail = str(error).splitlines()
        lines.append(f"- {route_name}: " + "\n    ".join(line[:400] for line in detail[:4]))
    lines.append(
        "What to do: pass leaf_on_failure=True (or leaf_modules=[...]) to keep the failing "
        "submodule whole, or concrete_args={...} to fix the values that decide a branch."
    )
    raise CaptureError("\n".join(lines)) from errors[-1]


#: A shape propagation: ``propagate(gm, model, values, fake)``, raising ShapePropagationError;
#: what it returns is ``Capture.propagation``.
Propagator = Callable[[fx.GraphModule, Any, list[Any], bool], Any]

#: The attribute that marks fxnx's own propagations, which return ``(what they found, the
#: graph's output)``: the output is compared with the model's (:mod:`.agree`).
WITH_OUTPUT = "fxnx_returns_output"


def _propagated(
    propagate: bool | Propagator, gm: fx.GraphModule, model: Any, values: list[Any], fake: bool,
) -> tuple[Any, Any]:
    """What ``propagate`` found and the graph's output (:data:`NO_OUTPUT` where a caller's own
    propagation does not say it)."""
    if not callable(propagate):
        return None, propagate_shapes(gm, model, values, fake)
    if getattr(propagate, WITH_OUTPUT, False):
        return propagate(gm, model, values, fake)  # type: ignore[no-any-return]
    return propagate(gm, model, values, fake), NO_OUTPUT


#: The graph's output where a propagation of the caller's does not give it: nothing compared.
NO_OUTPUT = object()


def _not_one_graph(model: Any, route: str, err: Exception) -> str:
    """The words for a graph whose runtime check failed on the very inputs it was captured from."""
    return (
        f"{qualname(model)}'s forward is not one graph: the graph {route} captured checks that a "
        "value its control flow read is what it was while capturing, and on the very inputs it "
        "was captured from it is not. Its control flow depends on random draws (such as "
        "skipping layers at random in training mode, as wav2vec2 and HuBERT do) or on state "
        "that changes between calls. Call model.eval() (layer drop and stochastic depth are "
        "off in eval mode), or call the model once before converting it if it changes itself "
        f"when first run\n{err}"
    )


def _check_computes_the_model(
    model: Any, result: Any, inputs: Inputs | None, options: CaptureOptions, output: Any, fake: bool,
) -> None:
    """Fail the route whose graph computes another output than the model on the example inputs
    (real ones on the CPU: fake and ``meta`` values hold nothing to compare, and another
    device's random generators are not restored between the two runs), so the ladder goes on
    to the next route (:mod:`.agree`). A graph already known to be one call's (``varies``, or a model
    that changed itself while captured: both warned about) is left to that warning."""
    if fake or inputs is None or result.varies or output is NO_OUTPUT or device_of(model).type != "cpu":
        return
    why = computes_another(model, inputs, dict(options.concrete_args), output)
    if why is not None:
        raise CaptureError(
            f"its graph does not compute what the model computes on the example inputs ({why}): "
            "the trace recorded another computation than the model's"
        )


def _model_runs(model: Any, inputs: Inputs | None, fake: bool) -> bool:
    """Whether the model itself runs on the example inputs (see :func:`_model_failure`)."""
    return _model_failure(model, inputs, fake) is None


def _model_failure(model: Any, inputs: Inputs | None, fake: bool) -> Exception | None:
    """What the model itself raises on the example inputs (nothing it changes is kept), run
    with gradients on, as it runs when called (a forward calling ``h.retain_grad()`` fails
    without); None where it runs, or where that cannot be told without real values."""
    if inputs is None or fake:
        return None
    try:
        with torch.enable_grad(), preserved(model), attributes_kept(model):
            model(*inputs.args, **inputs.kwargs)
    except Exception as err:  # noqa: BLE001 - the model's own error, reported as such
        return err
    return None


_PLAIN = (bool, int, float, str, type(None))


@contextlib.contextmanager
def _changes(model: Any) -> Iterator[list[str]]:
    """What the block changed on the model, in words (one entry, or none if nothing fxnx
    watches changed): its submodules, parameters and buffers (by identity) and each module's
    public plain attributes (numbers, strings, booleans, None), such as ``self.first = False``
    or the module BigBird puts in place of its attention on its first call. Private ones
    (Hugging Face's ``_output_capturing_hooks_installed``) are an implementation's own state."""
    found: list[str] = []
    ids, plain = _model_state(model)
    yield found
    ids_, plain_ = _model_state(model)
    replaced = [k for k in {**ids, **ids_} if ids.get(k) != ids_.get(k)]
    if replaced:
        found.append(f"{replaced[0]} was {'replaced' if replaced[0] in ids and replaced[0] in ids_ else 'added or removed'}")
        return
    for key in {**plain, **plain_}:
        a, b = plain.get(key, _PLAIN), plain_.get(key, _PLAIN)
        if not (a is b or a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)):
            found.append(f"{key} went from {plain.get(key, '(none)')!r} to {plain_.get(key, '(none)')!r}")
            return


def _model_state(model: Any) -> tuple[dict[str, int], dict[str, Any]]:
    if not isinstance(model, nn.Module):
        return {}, {}
    ids = {
        **{f"module {p!r}": id(m) for p, m in model.named_modules(remove_duplicate=False)},
        **{f"parameter {n!r}": id(t) for n, t in model.named_parameters(remove_duplicate=False)},
        **{f"buffer {n!r}": id(t) for n, t in model.named_buffers(remove_duplicate=False)},
    }
    plain = {
        f"{path or type(m).__qualname__}.{k}": v
        for path, m in model.named_modules() for k, v in vars(m).items()
        if type(v) in _PLAIN and not k.startswith("_")  # private: caches, hook flags
    }
    return ids, plain


def _warn_specialised(route: str, specialised: bool) -> None:
    if specialised:
        warn_user(
            f"captured with {route}: the model's control flow read tensor values, so the graph "
            "follows the branches the example input took and holds for such inputs only"
        )


def _capture_joint(model: Any, inputs: Inputs, options: CaptureOptions, fake: bool) -> Capture:
    """The forward and backward passes as ATen operators in one graph, by make_fx. (The forward
    alone, ``level="aten"``, is the ladder's make_fx route, as ``routes="make_fx"`` is.)"""
    with alone(model):
        result = capture_aten(as_module(model), inputs.args, inputs.kwargs, joint=True, fake=fake)
    _warn_specialised("make_fx", result.specialised)
    return Capture(
        gm=result.gm, model=model, options=options.captured("make_fx", ()), propagated=True,
        inputs=pytree.tree_leaves((inputs.args, inputs.kwargs)),
        shape_source=_source(model, fake, "make_fx"), level="joint", aten=result,
        fixed_kwargs=dict(inputs.fixed),
    )


def _source(model: Any, fake: bool, method: str | None) -> str:
    source = shape_source(model, fake)
    return "make_fx" if method == "make_fx" and source == "ShapeProp" else source
