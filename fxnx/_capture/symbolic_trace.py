"""The ``symbolic_trace`` route: torch.fx's symbolic tracing, with fxnx's leaf rule.

Module-level nodes: modules and functions as the model calls them. Inputs the
call does not pass are fixed at their plain defaults (their placeholders and
torch.fx's checks on them are dropped), ``concrete_args`` as torch.fx users
know them. A ``torch.nn`` composite that tracing fails in is kept whole as an
opaque node; with ``leaf_on_failure`` any failing submodule is. Holds for any
input shape unless a check inside a ``torch.nn`` composite was answered from
the example (:mod:`fxnx._capture.tracer`).
"""

from __future__ import annotations

import contextlib
import operator
import os
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .._compat import graph_module
from .._errors import CaptureError, FxnxValueError
from .._state import module_tables, preserved
from .common import Route, RouteResult, drawn, draws_varies
from .inputs import Inputs
from .options import CLASS_PREFIX, TORCH_NN, CaptureOptions
from .tracer import NeedValue, Tracer, evaluate, is_torch_nn, torch_nn_traceable

__all__ = ["ROUTE", "copy_graph_module"]

#: Checks on input values answered in one trace before giving up.
_MAX_ANSWERS = 1000


def _run(model: Any, inputs: Inputs | None, options: CaptureOptions, fake: bool) -> RouteResult:
    """Symbolic tracing with the inputs the call does not pass fixed at their defaults.

    Only plain defaults (None, bool, int, float, str) are fixed; others stay
    inputs of the graph, at their default values. Where torch.fx cannot fix
    them (a parameter name it would clash with), symbolic tracing fails and the
    ladder goes on: traced with them as placeholders, ``if mask is not None``
    would take the wrong branch.
    """
    if isinstance(model, nn.Module) and "forward" in vars(model):
        # torch.fx traces type(model).forward; the instance's own would be ignored.
        raise CaptureError(
            f"{type(model).__qualname__}.forward is replaced on this instance, and torch.fx "
            "traces the class's forward"
        )
    defaulted = inputs.defaulted if inputs is not None else {}
    fixed = {k: v for k, v in defaulted.items() if v is None or type(v) in (bool, int, float, str)}
    concrete = {**fixed, **dict(options.concrete_args)}
    unstored = options.unstored
    if unstored:
        raise CaptureError(
            f"concrete_args {unstored} were not stored with the graph (not plain data); "
            "pass them again as concrete_args="
        )
    values = None
    if inputs is not None and not fake:
        values = {**inputs.arguments, **concrete}
    gm, opaque, evaluated, varies = _trace(model, options, concrete, values)
    read = [n.target for n in gm.graph.nodes if n.op == "placeholder"
            and str(n.target).startswith("**") and n.users]
    if read:
        # torch.fx runs a graph with positional values only: ``**kwargs`` would get a list.
        raise CaptureError(
            f"forward reads {read[0]}, which a torch.fx graph cannot be called with"
        )
    if fixed:
        _drop_placeholders(gm)
    _follow_writes(gm)
    return RouteResult(gm, opaque=tuple(opaque), shape_specialised=evaluated, varies=varies)


def _follow_writes(gm: fx.GraphModule) -> None:
    """Later readers of a value written in place read the write's node instead.

    A trace records ``h.relu_()`` whose result is dropped, then ``l2(h)``, as ``l2`` reading
    ``h``'s node: the graph would show ``relu_`` leading nowhere and ``l2`` reading the value
    before the write, though ``l2`` reads the written one. An in-place call returns the very
    tensor it wrote into (a tensor's ``_`` methods, ``torch.relu_``, ``inplace=True`` on a
    function or a torch.nn module), so each use of that value after the write becomes a use
    of the write's node: the same tensor at run time, and the edge the dataflow has.
    Parameters and buffers (``get_attr``) are left as they are, and so is a write through a
    view (``h[:, :2].mul_(3)``), whose value is not ``h``'s. (``h += y`` is traced as
    ``h = h + y``: torch.fx's proxies have no ``__iadd__``.)"""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node) or first.op == "get_attr" or not _returns_written(gm, node):
            continue
        later = [user for user in first.users if order[user] > order[node]]
        for user in later:
            user.replace_input_with(first, node)
        changed = changed or bool(later)
    if changed:
        gm.recompile()


def _returns_written(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument in place and returns it."""
    target = node.target
    if node.op == "call_method":
        return isinstance(target, str) and _in_place_name(target) and hasattr(torch.Tensor, target)
    if node.op == "call_module":
        module = gm.get_submodule(str(target))
        return is_torch_nn(module) and getattr(module, "inplace", None) is True
    if node.op == "call_function":
        name = getattr(target, "__name__", "")
        torch_function = getattr(target, "__module__", "") or ""
        return node.kwargs.get("inplace") is True or (
            _in_place_name(name) and torch_function.startswith("torch"))
    return False


def _in_place_name(name: Any) -> bool:
    """``relu_``, ``add_``: the name of an in-place call (not ``__iadd__``, nor a private
    ``_foreach_add_``, which returns nothing)."""
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


def _trace(
    model: nn.Module | Callable[..., Any],
    options: CaptureOptions,
    concrete_args: dict[str, Any],
    values: Mapping[str, Any] | None,
) -> tuple[fx.GraphModule, list[str], bool, str]:
    """Trace (:func:`_traced`); also return whether a check was answered from the example,
    and why the graph holds one random draw (:func:`~fxnx._capture.common.draws_varies`),
    if it does."""
    leaves = _checked_leaves(model, options.leaf_modules)
    opaque: list[str] = []
    # torch.fx runs code on buffers as it traces (timm's BatchNormAct2d counts batches with
    # num_batches_tracked.add_(1)): the model's buffers are restored afterwards.
    with preserved(model), _constants_removed(model):
        # A proxy draws nothing: a random number drawn while tracing was drawn by the model's
        # Python code, and the graph holds it as a constant or as the branch it chose.
        with _proxies_given_back(model), torch_nn_traceable(), drawn(torch_rng=True) as draws:
            tracer, graph, answered = _traced(model, options, leaves, opaque, concrete_args, values)
        name = type(model).__name__ if isinstance(model, nn.Module) else model.__name__
        # made once the model holds its own values again: a buffer the forward rebinds
        # (self.ema = ...) is read by the graph as it was before the call
        return graph_module(tracer.root, graph, name), opaque, answered, draws_varies(draws, "torch.fx")


def _traced(
    model: Any, options: CaptureOptions, leaves: tuple[str, ...], opaque: list[str],
    concrete_args: dict[str, Any], values: Mapping[str, Any] | None,
) -> tuple[Tracer, fx.Graph, bool]:
    """The trace, with each failing submodule kept whole where that is allowed (added to
    ``opaque``), and whether a check was answered from the example."""
    answers: list[Any] = []
    while True:
        tracer = Tracer(leaves + tuple(opaque), answers if values is not None else None)
        try:
            return tracer, tracer.trace(model, concrete_args or None), bool(answers)
        except NeedValue as need:  # a check in a torch.nn composite: answer, trace again
            if len(answers) >= _MAX_ANSWERS:
                raise CaptureError(
                    f"torch.fx could not trace {type(model).__qualname__}: more than "
                    f"{_MAX_ANSWERS} checks on input values"
                ) from None
            assert values is not None
            answers.append(need.convert(evaluate(tracer, need.node, values)))
        except Exception as err:
            failing = _failing_submodule(tracer, options.leaf_on_failure)
            if not failing or failing in opaque:
                raise CaptureError(_explain_trace_failure(model, tracer, err)) from err
            opaque.append(failing)
            answers = []  # the checks met before may differ with the submodule whole


def _failing_submodule(tracer: Tracer, leaf_on_failure: bool) -> str:
    """The submodule to keep whole after a failed trace, or "" if none may be.

    With ``leaf_on_failure``: the innermost submodule being traced. Without:
    the innermost torch.nn composite being traced, if the failure came from
    its own code (a user's module inside it fails as it would anywhere).
    """
    stack = list(getattr(tracer, "module_stack", {}).values())
    stack = [(path, cls) for path, cls in stack if path]
    if not stack:
        return ""
    path, cls = stack[-1]
    if leaf_on_failure:
        return path
    module = tracer.root.get_submodule(path)
    return path if is_torch_nn(module) and tracer.traced_into(module) else ""


def _checked_leaves(model: Any, leaf_modules: tuple[str, ...]) -> tuple[str, ...]:
    """``leaf_modules`` with every path checked against the model's submodules."""
    if not leaf_modules:
        return leaf_modules
    known = dict(model.named_modules()) if isinstance(model, nn.Module) else {}
    for spec in leaf_modules:
        if spec == TORCH_NN or spec.startswith(CLASS_PREFIX) or spec in known:
            continue
        close = sorted(p for p in known if p and (spec in p or p in spec))[:5]
        raise FxnxValueError(
            f"leaf_modules names {spec!r}, which is not a submodule of "
            f"{type(model).__qualname__}; "
            + (f"did you mean one of {close}?" if close else "see model.named_modules().")
            + f" (Use {TORCH_NN!r} to keep every torch.nn module whole.)"
        )
    return leaf_modules


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


@contextlib.contextmanager
def _proxies_given_back(model: Any) -> Iterator[None]:
    """Give back, once the block ends, each attribute any module set to a torch.fx ``Proxy``
    while traced (a value it caches on itself, or a buffer it rebinds, ``self.ema = ...``),
    or remove it if new: kept, the model's next call (and the graph made from the trace)
    would compute with it. (What it caches in a dict or list, such as timm LeViT's attention
    biases, :func:`~fxnx._state.preserved` refills.)"""
    if not isinstance(model, nn.Module):
        yield
        return
    before = [(m, [dict(table) for table in module_tables(m)]) for m in model.modules()]
    try:
        yield
    finally:
        for m, olds in before:
            for table, old in zip(module_tables(m), olds, strict=True):
                for name, value in list(table.items()):
                    if isinstance(value, fx.Proxy):
                        if name in old:
                            table[name] = old[name]
                        else:
                            del table[name]


@contextlib.contextmanager
def _constants_removed(model: Any) -> Iterator[None]:
    """Remove, once the block ends, each tensor constant torch.fx stored on the root as it met
    it (``torch.tensor([...])`` in a ``forward``: ``_tensor_constant0``, …); the GraphModule
    keeps its own reference, and the names stay the same from one trace to the next."""
    if not isinstance(model, nn.Module):
        yield
        return
    root = _own_attributes(model)
    try:
        yield
    finally:
        for name in sorted(_own_attributes(model) - root):
            delattr(model, name)


def _own_attributes(module: nn.Module) -> set[str]:
    return (
        set(vars(module))
        | {name for name, _ in module.named_parameters(recurse=False)}
        | {name for name, _ in module.named_buffers(recurse=False)}
        | {name for name, _ in module.named_children()}
    )


def _explain_trace_failure(
    model: nn.Module | Callable[..., Any], tracer: Tracer, err: Exception
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


_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and fxnx: the user's line."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith(_LIBRARY_DIRS) and not f.filename.startswith("<")
    ]
    return frames[-1] if frames else None


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, so metadata never lands on the user's."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph, type(gm).__name__)


ROUTE = Route(name="symbolic_trace", level="module", needs_inputs=False, run=_run)
