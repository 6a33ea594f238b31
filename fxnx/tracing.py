"""Turning a model into a ``torch.fx.GraphModule`` with tensor metadata.

This is the only module that runs the model. It traces with ``torch.fx``
(custom leaf modules and ``concrete_args`` as torch.fx users know them), then
propagates the example inputs as :class:`torch.fx.passes.shape_prop.ShapeProp`
does, so that every node carries ``meta["tensor_meta"]`` and ``meta["type"]``. Failures become
:class:`~fxnx.errors.CaptureError` or :class:`~fxnx.errors.ShapePropagationError`
with the source line or node that caused them.
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._pytree import tree_map

from ._state import preserved
from .errors import CaptureError, FxnxTypeError, FxnxValueError, ShapePropagationError

__all__ = ["Capture", "capture"]

LeafSpec = type[nn.Module] | str


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
        How the graph was captured: ``"symbolic_trace"`` or ``"graph_module"``
        (an already traced ``GraphModule`` was given).
    propagated : bool
        Whether example inputs were run through the graph.
    inputs : list or None
        The example inputs as one value per placeholder, in order; None without inputs.
    shape_source : str or None
        ``"ShapeProp"`` (real tensors), ``"FakeTensor"`` or ``"meta"``; None without shapes.
    """

    gm: fx.GraphModule
    model: nn.Module | Callable[..., Any]
    method: str
    propagated: bool
    inputs: list[Any] | None = None
    shape_source: str | None = None


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
) -> Capture:
    """Trace ``model`` with torch.fx and propagate example inputs through it.

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

    Returns
    -------
    Capture

    Raises
    ------
    FxnxTypeError
        ``model`` is neither a module nor a callable, or the inputs do not fit
        its ``forward`` signature.
    FxnxValueError
        A ``leaf_modules`` entry names no submodule.
    CaptureError
        Tracing failed, for instance on data-dependent control flow.
    ShapePropagationError
        Running the example inputs failed at a node (wrong input shape).

    Examples
    --------
    >>> import torch
    >>> cap = capture(torch.nn.Linear(3, 2), (torch.zeros(4, 3),))
    >>> cap.method, cap.propagated
    ('symbolic_trace', True)
    """
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
        args = _empty_inputs(model, input_shape, dtype)
    inputs = _bind_inputs(model, args, kwargs, concrete_args or {})
    if isinstance(model, fx.GraphModule):
        gm, method = _copy_graph_module(model), "graph_module"
    else:
        gm, method = _trace(model, leaf_modules, dict(concrete_args or {})), "symbolic_trace"
    run = propagate and inputs is not None
    if run:
        _propagate(gm, model, inputs, fake)
    return Capture(
        gm=gm, model=model, method=method, propagated=run, inputs=inputs,
        shape_source=(_shape_source(model, fake) if run else None),
    )


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
) -> fx.GraphModule:
    leaf_types, leaf_paths = _split_leaf_specs(model, leaf_modules)
    tracer = _Tracer(leaf_types, leaf_paths)
    try:
        graph = tracer.trace(model, concrete_args or None)
    except Exception as err:
        raise CaptureError(_explain_trace_failure(model, tracer, err)) from err
    name = type(model).__name__ if isinstance(model, nn.Module) else model.__name__
    return fx.GraphModule(tracer.root, graph, name)


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
) -> list[Any] | None:
    """The example inputs as one positional list in ``forward``'s parameter order.

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
    bound.apply_defaults()
    values: list[Any] = []
    for param in sig.parameters.values():
        value = concrete_args.get(param.name, bound.arguments.get(param.name))
        if param.kind is param.VAR_POSITIONAL:
            values.extend(value or ())
        elif param.kind is not param.VAR_KEYWORD:
            values.append(value)
    return values


def _qualname(model: Any) -> str:
    return type(model).__qualname__ if isinstance(model, nn.Module) else model.__qualname__


class _ShapeProp(fx.Interpreter):
    """torch.fx's ShapeProp, recording the same ``tensor_meta`` and ``type`` metadata.

    Unlike ShapeProp it prints nothing on failure: it raises one error that names
    the node, its target and the shapes the node received.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our message already names the node

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as err:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            got = tree_map(_describe_value, (args, kwargs))
            raise ShapePropagationError(
                f"shape propagation failed at fx node {n.name!r} ({n.op} {_target_str(n)}): "
                f"{type(err).__name__}: {err}\n"
                f"  node: {n.format_node()}\n"
                f"  input shapes: args={got[0]} kwargs={got[1]}\n"
                "What to do: check the example inputs' shapes and dtypes against what the "
                "model expects."
            ) from err
        tensors = []

        def extract(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                return _extract_tensor_metadata(obj)
            return obj

        meta = map_aggregate(result, extract)
        if tensors:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = torch.Tensor if isinstance(result, FakeTensor) else type(result)
        return result


def _target_str(node: fx.Node) -> str:
    if node.op == "call_module":
        mod = node.graph.owning_module.get_submodule(node.target)  # type: ignore[union-attr]
        return f"{node.target} ({type(mod).__qualname__})"
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "?")


def _describe_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return value


def _propagate(gm: fx.GraphModule, model: Any, inputs: list[Any], fake: bool) -> None:
    """Run the inputs through the graph without leaving a trace on the model, buffers or RNG."""
    with preserved(model), torch.no_grad():
        if fake and _device(model).type != "meta":
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
                _ShapeProp(gm).run(*fakes)
        else:
            _ShapeProp(gm).run(*inputs)


def _device(model: Any) -> torch.device:
    if isinstance(model, nn.Module):
        for tensor in (*model.parameters(), *model.buffers()):
            return tensor.device
    return torch.device("cpu")


def _shape_source(model: Any, fake: bool) -> str:
    if _device(model).type == "meta":
        return "meta"
    return "FakeTensor" if fake else "ShapeProp"


def _empty_inputs(model: Any, input_shape: Sequence[Any], dtype: torch.dtype) -> tuple[Any, ...]:
    shapes = [input_shape] if all(isinstance(d, int) for d in input_shape) else list(input_shape)
    device = _device(model)
    return tuple(torch.empty(tuple(shape), dtype=dtype, device=device) for shape in shapes)
