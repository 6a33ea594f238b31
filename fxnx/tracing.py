"""Turning a model into a ``torch.fx.GraphModule`` with tensor metadata.

This is the only module that runs the model. It traces with ``torch.fx``
(custom leaf modules and ``concrete_args`` as torch.fx users know them), then
propagates the example inputs as :class:`torch.fx.passes.shape_prop.ShapeProp`
does, so that every node carries ``meta["tensor_meta"]`` and ``meta["type"]``. Failures become
:class:`~fxnx.errors.CaptureError` or :class:`~fxnx.errors.ShapePropagationError`
with the source line or node that caused them.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ._aten import AtenCapture, capture_aten, reads_tensor_values
from ._compat import pytree
from ._routes import ROUTES, as_module, export_route, quiet
from ._shapes import empty_inputs, shape_source
from ._shapes import propagate as propagate_shapes
from ._state import preserved
from .errors import CaptureError, FxnxTypeError, FxnxValueError, first_line, warn_user

__all__ = ["Capture", "FIXED_KWARGS", "TRACING_LOCK", "capture"]

LeafSpec = type[nn.Module] | str


LEVELS = ("module", "aten", "joint")

#: Keyword inputs fxnx sets when ``forward`` has them and the caller did not pass them, and
#: why. ``use_cache``: a cache is state kept for generation, not dataflow, and torch.export and
#: make_fx cannot return Hugging Face's Cache objects. Recorded in ``G.graph["fixed_kwargs"]``.
FIXED_KWARGS = {"use_cache": False}


@dataclass(frozen=True)
class Inputs:
    """The example inputs, bound to ``forward``'s signature.

    Attributes
    ----------
    args, kwargs
        As the caller gave them (keywords stay keywords), plus :data:`FIXED_KWARGS`
        that apply. ``torch.export`` and ``make_fx`` take these.
    arguments : dict
        Every ``forward`` parameter's value, defaults filled in (a ``*args``
        parameter holds a tuple): what symbolic tracing's placeholders take.
    fixed : dict
        The keyword inputs fxnx added.
    defaulted : dict
        Parameters the caller did not pass, at their defaults. Symbolic tracing
        fixes them (``if mask is not None`` takes the branch the call takes), so
        they are not inputs of the graph.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arguments: dict[str, Any]
    fixed: dict[str, Any]
    defaulted: dict[str, Any] = field(default_factory=dict)


#: Held while fxnx traces or runs a model. torch.fx replaces ``torch.nn.Module.__call__`` (and
#: a few functions) for the whole process while it traces symbolically, so two traces at once
#: would record into each other; fxnx's captures and credit runs therefore take turns.
TRACING_LOCK = threading.RLock()


@dataclass(frozen=True)
class Capture:
    """A traced model: the fx graph module, how it was obtained, and whether shapes are known.

    Attributes
    ----------
    gm : torch.fx.GraphModule
        The graph module. When ``propagated`` is true every node that produced
        tensors has ``meta["tensor_meta"]`` and every node has ``meta["type"]``.
    model : nn.Module or callable
        What the user passed in.
    method : str
        The route that captured the graph: ``"symbolic_trace"``, ``"graph_module"``
        (an already traced ``GraphModule`` was given), ``"export"``,
        ``"draft_export"`` or ``"make_fx"``.
    propagated : bool
        Whether example inputs were run through the graph.
    inputs : list or None
        The example inputs as one value per placeholder, in order; None without inputs.
    fixed_kwargs : dict
        Keyword inputs fxnx set (:data:`FIXED_KWARGS`), such as ``use_cache=False``.
    shape_source : str or None
        ``"ShapeProp"`` (real tensors), ``"FakeTensor"``, ``"meta"`` or
        ``"make_fx"`` (recorded while tracing real tensors); None without shapes.
    level : str
        ``"module"`` (torch.fx's graph: modules and functions as the model calls
        them), ``"aten"`` (ATen operators) or ``"joint"`` (ATen forward and backward).
    failures : tuple of (route, message)
        The routes tried before ``method`` and why each failed.
    opaque : tuple of str
        Submodules kept whole because tracing through them failed (``leaf_on_failure``).
    aten : fxnx._aten.AtenCapture or None
        For graphs made by ``make_fx``: what the ``primals_*`` and ``tangents_*``
        inputs stand for and which node computes each gradient.
    """

    gm: fx.GraphModule
    model: nn.Module | Callable[..., Any]
    method: str
    propagated: bool
    inputs: list[Any] | None = None
    shape_source: str | None = None
    level: str = "module"
    failures: tuple[tuple[str, str], ...] = ()
    opaque: tuple[str, ...] = ()
    aten: AtenCapture | None = None
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)


def capture(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    leaf_modules: Iterable[LeafSpec] = (),
    concrete_args: Mapping[str, Any] | None = None,
    propagate: bool = True,
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
        Passed to the model's ``forward``. With neither, and a ``forward`` that
        needs inputs, nothing runs and shapes stay unknown.
    leaf_modules : iterable of module classes or qualified submodule names
        Modules to keep whole as single ``call_module`` nodes instead of
        tracing through them (besides torch's own ``torch.nn`` modules).
    concrete_args : mapping, optional
        Inputs to fix to constant values while tracing, as in
        ``torch.fx.symbolic_trace``; use it for flags that select a branch.
    propagate : bool
        Run the example inputs through the graph to record shapes (default).
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
        whole as one opaque node and trace everything around it.

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
    """
    with TRACING_LOCK:
        return _capture(
            model, args, kwargs, leaf_modules=leaf_modules, concrete_args=concrete_args,
            propagate=propagate, input_shape=input_shape, dtype=dtype, fake=fake, level=level,
            routes=routes, leaf_on_failure=leaf_on_failure,
        )


def _capture(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    leaf_modules: Iterable[LeafSpec],
    concrete_args: Mapping[str, Any] | None,
    propagate: bool,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None,
    dtype: torch.dtype,
    fake: bool,
    level: str,
    routes: str | Sequence[str],
    leaf_on_failure: bool,
) -> Capture:
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
    if level not in LEVELS:
        raise FxnxValueError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")
    route_names = _route_names(routes, level)
    if input_shape is not None:
        if args:
            raise FxnxTypeError("give example inputs or input_shape, not both")
        args = empty_inputs(model, input_shape, dtype)
    # Copies: a model that writes into its input must not write into the caller's tensor.
    inputs = bind_inputs(model, args, kwargs, concrete_args)
    fixed = inputs.fixed if inputs is not None else {}
    if level != "module":
        return _capture_aten(model, inputs, level, fake)
    aten = None
    if isinstance(model, fx.GraphModule):
        gm, method, failures, opaque = _copy_graph_module(model), "graph_module", [], []
    else:
        gm, method, failures, opaque, aten = _ladder(
            model, inputs, route_names, leaf_modules, dict(concrete_args or {}), leaf_on_failure,
            fake,
        )
    values = placeholder_values(inputs, method, gm)
    run = aten is not None or (propagate and values is not None)  # make_fx recorded every shape
    if run and aten is None:
        propagate_shapes(gm, model, values, fake)
    return Capture(
        gm=gm, model=model, method=method, propagated=run, inputs=values,
        shape_source=(_source(model, fake, method) if run else None),
        level="module" if method in ("symbolic_trace", "graph_module") else "aten",
        failures=tuple(failures), opaque=tuple(opaque), aten=aten, fixed_kwargs=dict(fixed),
    )


def _route_names(routes: str | Sequence[str], level: str) -> tuple[str, ...]:
    names = ROUTES if routes == "auto" else (routes,) if isinstance(routes, str) else tuple(routes)
    unknown = [r for r in names if r not in ROUTES]
    if unknown or not names:
        raise FxnxValueError(
            f"unknown capture route {unknown or routes!r}; routes are 'auto' or any of "
            f"{', '.join(map(repr, ROUTES))}"
        )
    if level != "module" and routes != "auto" and names != ("make_fx",):
        raise FxnxValueError(
            f"level={level!r} is always captured with make_fx; leave routes='auto'"
        )
    return names


def _ladder(
    model: nn.Module | Callable[..., Any],
    inputs: Inputs | None,
    route_names: Sequence[str],
    leaf_modules: Iterable[LeafSpec],
    concrete_args: dict[str, Any],
    leaf_on_failure: bool,
    fake: bool,
) -> tuple[fx.GraphModule, str, list[tuple[str, str]], list[str], AtenCapture | None]:
    """Try each route in turn; the first graph wins. Raise with every route's reason if none works.

    Returns the graph, the route, the earlier routes' failures, the submodules
    kept opaque, and for ``make_fx`` what its inputs stand for.
    """
    failures: list[tuple[str, str]] = []
    errors: list[CaptureError] = []
    for route in route_names:
        try:
            if route == "symbolic_trace":
                defaulted = inputs.defaulted if inputs is not None else {}
                gm, opaque = _trace_at_defaults(
                    model, leaf_modules, concrete_args, leaf_on_failure, defaulted
                )
                return gm, route, failures, opaque, None
            if inputs is None:
                raise CaptureError(f"{route} needs example inputs (or input_shape=) to run the model")
            if route == "make_fx":
                with quiet():
                    result = capture_aten(
                        as_module(model), inputs.args, inputs.kwargs, joint=False, fake=fake
                    )
                _warn_specialised(route, result.specialised)
                return result.gm, route, failures, [], result
            gm = export_route(model, inputs.args, inputs.kwargs, draft=route == "draft_export")
            _warn_specialised(route, route == "draft_export" and reads_tensor_values(gm))
            return gm, route, failures, [], None
        except CaptureError as err:
            failures.append((route, first_line(err)))
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]
    lines = [f"no capture route worked for {_qualname(model)}:"]
    for (route, _), err in zip(failures, errors, strict=True):
        detail = str(err).splitlines()
        lines.append(f"- {route}: " + "\n    ".join(line[:400] for line in detail[:4]))
    lines.append(
        "What to do: pass leaf_on_failure=True (or leaf_modules=[...]) to keep the failing "
        "submodule whole, or concrete_args={...} to fix the values that decide a branch."
    )
    raise CaptureError("\n".join(lines)) from errors[-1]


def _drop_placeholders(gm: fx.GraphModule) -> None:
    """Remove the placeholders torch.fx keeps for fixed ``concrete_args``, with the checks it
    adds on them (``_assert_is_none``; ``eq`` then ``_assert``): they are not inputs of the
    graph. A placeholder is one of them when checks are all it feeds."""
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        checks = list(node.users)
        if not checks or not all(_is_fx_check(user) for user in checks):
            continue
        for check in checks:
            for assertion in list(check.users):
                gm.graph.erase_node(assertion)
            gm.graph.erase_node(check)
        gm.graph.erase_node(node)
    gm.recompile()


def _is_fx_check(node: fx.Node) -> bool:
    """Whether ``node`` is a check torch.fx adds on a fixed concrete argument."""
    name = getattr(node.target, "__name__", "")
    if name == "_assert_is_none":
        return not node.users
    return (
        node.target is operator.eq and bool(node.users)
        and all(getattr(u.target, "__name__", "") == "_assert" and not u.users for u in node.users)
    )


def _warn_specialised(route: str, specialised: bool) -> None:
    if specialised:
        warn_user(
            f"captured with {route}: the model's control flow read tensor values, so the graph "
            "follows the branches the example input took and holds for such inputs only"
        )


def _capture_aten(model: Any, inputs: Inputs | None, level: str, fake: bool) -> Capture:
    if inputs is None:
        raise FxnxTypeError(
            f"level={level!r} runs the model: pass example inputs or input_shape="
        )
    result = capture_aten(
        as_module(model), inputs.args, inputs.kwargs, joint=level == "joint", fake=fake
    )
    _warn_specialised("make_fx", result.specialised)
    return Capture(
        gm=result.gm, model=model, method="make_fx", propagated=True,
        inputs=pytree.tree_leaves((inputs.args, inputs.kwargs)),
        shape_source=_source(model, fake, "make_fx"), level=level, aten=result,
        fixed_kwargs=dict(inputs.fixed),
    )


def _source(model: Any, fake: bool, method: str) -> str:
    source = shape_source(model, fake)
    return "make_fx" if method == "make_fx" and source == "ShapeProp" else source


class _Tracer(fx.Tracer):
    """A tracer that also keeps the user's leaf modules whole."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            module_qualified_name in self.leaf_paths
            or isinstance(m, self.leaf_types)
            or super().is_leaf_module(m, module_qualified_name)
        )


def _trace(
    model: nn.Module | Callable[..., Any],
    leaf_modules: Iterable[LeafSpec],
    concrete_args: dict[str, Any],
    leaf_on_failure: bool = False,
) -> tuple[fx.GraphModule, list[str]]:
    """Symbolic tracing; with ``leaf_on_failure``, retried with each failing submodule kept whole."""
    leaf_types, leaf_paths = _split_leaf_specs(model, leaf_modules)
    opaque: list[str] = []
    # torch.fx runs code on buffers as it traces (timm's BatchNormAct2d counts batches with
    # num_batches_tracked.add_(1)): the model's buffers are restored afterwards.
    with preserved(model), _no_new_attributes(model):
        while True:
            tracer = _Tracer(leaf_types, leaf_paths | frozenset(opaque))
            try:
                graph = tracer.trace(model, concrete_args or None)
                break
            except Exception as err:
                stack = list(getattr(tracer, "module_stack", {}).values())
                failing = stack[-1][0] if stack else ""
                if not (leaf_on_failure and failing and failing not in opaque):
                    raise CaptureError(_explain_trace_failure(model, tracer, err)) from err
                opaque.append(failing)
        name = type(model).__name__ if isinstance(model, nn.Module) else model.__name__
        try:
            return fx.GraphModule(tracer.root, graph, name), opaque
        except Exception as err:  # torch.fx traced something it cannot turn into code
            raise CaptureError(
                f"torch.fx traced {name} but could not compile the graph: "
                f"{type(err).__name__}: {first_line(err)}"
            ) from err


def _trace_at_defaults(
    model: nn.Module | Callable[..., Any],
    leaf_modules: Iterable[LeafSpec],
    concrete_args: dict[str, Any],
    leaf_on_failure: bool,
    defaulted: Mapping[str, Any],
) -> tuple[fx.GraphModule, list[str]]:
    """Symbolic tracing with the inputs the call does not pass fixed at their defaults.

    Only plain defaults (None, bool, int, float, str) are fixed; others stay
    inputs of the graph, at their default values. Where torch.fx cannot fix
    them (a parameter name it would clash with), symbolic tracing fails and the
    ladder goes on: traced with them as placeholders, ``if mask is not None``
    would take the wrong branch.
    """
    fixed = {k: v for k, v in defaulted.items() if v is None or type(v) in (bool, int, float, str)}
    gm, opaque = _trace(model, leaf_modules, {**fixed, **concrete_args}, leaf_on_failure)
    if fixed:
        _drop_placeholders(gm)
    return gm, opaque

@contextlib.contextmanager
def _no_new_attributes(model: Any) -> Iterator[None]:
    """Remove what tracing adds to the model when the block ends.

    torch.fx stores each tensor constant it meets (``torch.tensor([...])`` in a
    ``forward``) on the module it traces, as ``_tensor_constant0``, …; the
    GraphModule keeps its own reference, so the user's model need not keep one.
    Removing them also keeps the names the same from one trace to the next.
    """
    if not isinstance(model, nn.Module):
        yield
        return
    before = _own_attributes(model)
    try:
        yield
    finally:
        for name in sorted(_own_attributes(model) - before):
            delattr(model, name)


def _own_attributes(module: nn.Module) -> set[str]:
    return (
        set(vars(module))
        | {name for name, _ in module.named_parameters(recurse=False)}
        | {name for name, _ in module.named_buffers(recurse=False)}
        | {name for name, _ in module.named_children()}
    )


def _split_leaf_specs(
    model: nn.Module | Callable[..., Any], leaf_modules: Iterable[LeafSpec]
) -> tuple[tuple[type, ...], frozenset[str]]:
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = [leaf_modules]
    types: list[type] = []
    paths: list[str] = []
    known = dict(model.named_modules()) if isinstance(model, nn.Module) else {}
    for spec in leaf_modules:
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            types.append(spec)
        elif isinstance(spec, str):
            if spec not in known:
                close = sorted(p for p in known if p and (spec in p or p in spec))[:5]
                raise FxnxValueError(
                    f"leaf_modules names {spec!r}, which is not a submodule of "
                    f"{type(model).__qualname__}; "
                    + (f"did you mean one of {close}?" if close else "see model.named_modules().")
                )
            paths.append(spec)
        else:
            raise FxnxTypeError(
                "leaf_modules entries must be nn.Module subclasses or qualified submodule names "
                f"(str), got {spec!r} of type {type(spec).__qualname__}"
            )
    return tuple(types), frozenset(paths)


def _explain_trace_failure(
    model: nn.Module | Callable[..., Any], tracer: _Tracer, err: Exception
) -> str:
    name = type(model).__qualname__ if isinstance(model, nn.Module) else model.__qualname__
    lines = [f"torch.fx could not trace {name}: {type(err).__name__}: {err}"]
    frame = _user_frame(err)
    if frame is not None:
        lines.append(f"  at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}")
    stack = list(getattr(tracer, "module_stack", {}).values())
    if stack:
        path, cls = stack[-1]
        lines.append(f"  inside submodule {path!r} ({cls.__qualname__})")
        lines.append(
            "What to do: keep that submodule whole as one node with "
            f"leaf_modules=[{path!r}] (or leaf_modules=[{cls.__qualname__}]), "
            "or fix the values that decide the branch with concrete_args={...}."
        )
    else:
        lines.append(
            "What to do: fix the inputs that decide the branch with concrete_args={name: value}, "
            "or move the data-dependent part into a submodule and list it in leaf_modules."
        )
    return "\n".join(lines)


_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and fxnx: the user's line."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith(_LIBRARY_DIRS) and not f.filename.startswith("<")
    ]
    return frames[-1] if frames else None


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, so metadata never lands on the user's."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph, type(gm).__name__)


def _bind_inputs(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    concrete_args: Mapping[str, Any],
) -> Inputs | None:
    """The example inputs bound to ``forward``'s parameters.

    Returns None when no inputs were given and ``forward`` needs some: the
    graph is then converted without shapes.
    """
    forward = model.forward if isinstance(model, nn.Module) else model
    sig = inspect.signature(forward)
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in concrete_args
    ]
    if not args and not kwargs and required:
        return None
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError as err:
        raise FxnxTypeError(
            f"the example inputs do not fit {_qualname(model)}.forward{sig}: {err}"
        ) from err
    missing = [p.name for p in required if p.name not in bound.arguments]
    if missing:
        raise FxnxTypeError(
            f"the example inputs do not fit {_qualname(model)}.forward{sig}: "
            f"missing {', '.join(map(repr, missing))}; pass them positionally or in kwargs="
        )
    fixed = {
        name: value for name, value in FIXED_KWARGS.items()
        if name in sig.parameters and name not in bound.arguments and name not in concrete_args
    }
    bound = sig.bind_partial(*args, **kwargs, **fixed)
    defaulted = {
        p.name: p.default for p in sig.parameters.values()
        if p.name not in bound.arguments and p.name not in concrete_args
        and p.default is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    bound.apply_defaults()
    arguments = {
        name: concrete_args.get(name, bound.arguments.get(name)) for name in sig.parameters
    }
    return Inputs(tuple(args), {**kwargs, **fixed}, arguments, fixed, defaulted)


def bind_inputs(
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    concrete_args: Mapping[str, Any] | None = None,
) -> Inputs | None:
    """The example inputs bound to ``forward``, every tensor copied (see :func:`capture`)."""
    return _copied(_bind_inputs(model, args, dict(kwargs or {}), concrete_args or {}))


def placeholder_values(inputs: Inputs | None, method: str, gm: fx.GraphModule) -> list[Any] | None:
    """The values to run ``gm`` (captured by ``method``) on, as torch.fx's Interpreter takes them:
    one per placeholder, the values of a ``*args`` placeholder spread at the end."""
    if inputs is None:
        return None
    if method not in ("symbolic_trace", "graph_module"):
        return pytree.tree_leaves((inputs.args, inputs.kwargs))
    values: list[Any] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or str(node.target).startswith("**"):
            continue
        name = str(node.target).lstrip("*")
        if name not in inputs.arguments:  # torch.fx names a concrete argument's placeholder x_1
            name = name.rpartition("_")[0]
        value = inputs.arguments.get(name, node.args[0] if node.args else None)
        if str(node.target).startswith("*"):
            values.extend(value or ())
        else:
            values.append(value)
    return values


def _copied(inputs: Inputs | None) -> Inputs | None:
    """The inputs with every tensor copied once (meta and fake tensors copy for free)."""
    if inputs is None:
        return None
    copies: dict[int, torch.Tensor] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in copies:  # a tensor passed twice stays one tensor
            copies[id(t)] = t.clone()
        return copies[id(t)]

    args, kwargs, arguments = pytree.tree_map(copy, (inputs.args, inputs.kwargs, inputs.arguments))
    return Inputs(args, kwargs, arguments, inputs.fixed, inputs.defaulted)


def _qualname(model: Any) -> str:
    return type(model).__qualname__ if isinstance(model, nn.Module) else model.__qualname__
