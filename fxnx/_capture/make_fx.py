"""The ``make_fx`` route, and ATen-level graphs: the forward pass, or forward and backward in one graph.

The model runs under :func:`torch.func.functional_call` inside
:func:`torch.fx.experimental.proxy_tensor.make_fx`, with its parameters,
buffers and tensor inputs as the traced function's inputs (``primals_*``).
For the joint graph the function also calls :func:`torch.autograd.grad` with
incoming gradients as further inputs (``tangents_*``), so ``make_fx`` records
the backward pass as ordinary ATen operators after the forward ones. Only
public torch APIs are used; torch's source is never patched.

Two annotations ride along through :mod:`torch.fx.traceback`:

- forward hooks on every submodule record the module call stack on each node
  (``meta["nn_module_stack"]``, the format ``symbolic_trace`` uses);
- each autograd node of the forward pass gets a pre-hook that marks the
  backward ops it emits with its sequence number, which is also the sequence
  number of the forward op that created it, so a backward node inherits the
  module path of the forward op it differentiates.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.func import functional_call

from .._compat import (
    VALUE_READS,
    FakeTensorMode,
    OpOverload,
    drop_annotations,
    make_fx_following_values,
    pytree,
    sequence_nr,
)
from .._errors import CaptureError, FxnxValueError, first_line
from .._state import attributes_kept, preserved
from .common import FunctionModule, Route, RouteResult, as_module, drawn, draws_varies, quiet
from .inputs import Inputs
from .options import CaptureOptions
from .shapes import container_items, metadata_from_values

__all__ = ["AtenCapture", "ROUTE", "capture_aten", "reads_random_values", "reads_tensor_values"]

_MODULES = "fxnx_module_stack"
_PHASE = "fxnx_phase"
_GRAD_FN = "fxnx_grad_fn"


@dataclass(frozen=True)
class AtenCapture:
    """An ATen-level graph and what its inputs and outputs stand for (plain data)."""

    gm: fx.GraphModule
    #: Placeholder name to {"kind": "parameter" | "buffer" | "input", "name": ...}.
    primals: dict[str, dict[str, str]]
    #: Placeholder name to the output it is the gradient of, such as "output[0]".
    tangents: dict[str, str]
    #: Parameter or input name to the node computing its gradient (None: no gradient).
    gradients: dict[str, str | None]
    #: Whether a tensor's value decided control flow: the graph holds for this input only.
    specialised: bool
    #: Why the graph holds one random draw of the model's, in words (empty if it does not).
    varies: str = ""


def capture_aten(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    joint: bool,
    fake: bool = False,
) -> AtenCapture:
    """Trace ``model(*args, **kwargs)`` to ATen operators; with ``joint``, its backward pass too.

    Raises
    ------
    CaptureError
        ``make_fx`` could not trace the model.
    FxnxValueError
        ``joint`` and the model has no floating-point output to differentiate.
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    for leaf in leaves:
        held = container_items(leaf)
        if held is not None and any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(held)):
            raise CaptureError(
                f"make_fx cannot take an input of type {type(leaf).__qualname__}: torch's pytree "
                "does not look into it, so its tensors would be fixed in the graph as constants, "
                "with no input for them. Pass its tensors in a dict (dict(batch)) or a tuple"
            )
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    input_names = _leaf_names(model, args, kwargs or {})
    primal_values = [
        *(p.detach().requires_grad_(joint) for p in params.values()),
        *(b.detach().clone() for b in buffers.values()),
        *(_input_leaf(leaves[i], joint) for i in slots),
    ]
    primals = {
        f"primals_{k + 1}": {"kind": kind, "name": name}
        for k, (kind, name) in enumerate(
            [("parameter", n) for n in params]
            + [("buffer", n) for n in buffers]
            + [("input", input_names[i]) for i in slots]
        )
    }
    n_params, n_buffers = len(params), len(buffers)

    def forward(primal_list: list[torch.Tensor]) -> list[Any]:
        state = dict(zip(params, primal_list[:n_params], strict=True))
        state.update(zip(buffers, primal_list[n_params : n_params + n_buffers], strict=True))
        filled = list(leaves)
        for i, value in zip(slots, primal_list[n_params + n_buffers :], strict=True):
            filled[i] = value
        call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
        # torch's functional_call puts a module registered under two names back with its
        # weights swapped for the tensors given: every module's tables are given back.
        with attributes_kept(model):
            out = functional_call(model, state, tuple(call_args), call_kwargs)
        return pytree.tree_flatten(out)[0]

    wrt = [k for k, v in enumerate(primal_values) if v.requires_grad]
    tangent_values: list[torch.Tensor] = []
    differentiable: list[int] = []
    if joint:
        differentiable, tangent_values = _tangents(model, forward, primal_values, fake)

    present: list[bool] = []  # which gradients exist (unused inputs have none)

    def traced(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> Any:
        if not joint:
            return forward(primals)
        with torch.enable_grad(), fx_traceback.annotate({_PHASE: "forward"}):
            outs = forward(primals)
            with _backward_provenance([outs[i] for i in differentiable]):
                with fx_traceback.annotate({_PHASE: "backward"}):
                    grads = torch.autograd.grad(
                        [outs[i] for i in differentiable], [primals[k] for k in wrt],
                        tangents, allow_unused=True,
                    )
        present[:] = [g is not None for g in grads]
        return outs, [g for g in grads if g is not None]

    try:
        with preserved(model), fx_traceback.preserve_node_meta(), drawn(torch_rng=False) as draws:
            drop_annotations()  # what another thread left in torch's global meta stays out
            with _module_stacks(model):
                gm = make_fx_following_values(traced, "fake" if fake else "real")(
                    primal_values, tangent_values
                )
    except Exception as err:
        raise CaptureError(f"make_fx could not trace {type(model).__qualname__}: "
                           f"{type(err).__name__}: {first_line(err)}") from err
    metadata_from_values(gm)
    _finish_metadata(gm, model, joint)
    gradients: dict[str, str | None] = {}
    tangents = {f"tangents_{j + 1}": f"output[{i}]" for j, i in enumerate(differentiable)}
    if joint:
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        grad_nodes = iter(output.args[0][len(output.args[0]) - sum(present) :])
        for k, exists in zip(wrt, present, strict=True):
            name = primals[f"primals_{k + 1}"]["name"]
            gradients[name] = next(grad_nodes).name if exists else None
    varies = draws_varies(draws, "make_fx") or reads_random_values(gm)
    return AtenCapture(gm, primals, tangents, gradients, reads_tensor_values(gm), varies)


def reads_random_values(gm: fx.GraphModule) -> str:
    """Why the graph holds one random draw, if its control flow read a random value (``if
    torch.rand(()) < p``: layer drop in training mode), in words; empty if it did not.

    A value read into Python (``.item()``, a data-dependent branch or its runtime check)
    whose inputs come from a random operation (an ATen operator tagged
    ``nondeterministic_seeded``) chose the branch the graph holds by a random draw.
    """
    random_ops = {n for n in gm.graph.nodes if _seeded(n.target)}
    if not random_ops:
        return ""
    drawn_from: dict[fx.Node, fx.Node | None] = {}
    for n in gm.graph.nodes:  # fx order: inputs before their readers
        drawn_from[n] = n if n in random_ops else next(
            (drawn_from[a] for a in n.all_input_nodes if drawn_from.get(a) is not None), None
        )
        source = drawn_from[n]
        if n.target in VALUE_READS and source is not None:
            return (
                f"its control flow read a value drawn at random (node {n.name!r} reads a value "
                f"of {source.name!r}), such as skipping a layer at random in training "
                "mode, so the graph holds the branch of that one draw and each call may run "
                "another graph"
            )
    return ""


def _seeded(target: Any) -> bool:
    tags = getattr(target, "tags", ()) if isinstance(target, OpOverload) else ()
    return torch.Tag.nondeterministic_seeded in tags


def reads_tensor_values(gm: fx.GraphModule) -> bool:
    """Whether the traced code read a tensor's value into Python (``.item()``, ``if x.sum() > 0``):
    the graph then follows the branches the example input took."""
    return any(
        n.target in VALUE_READS
        for n in gm.graph.nodes
    )


def _input_leaf(value: torch.Tensor, joint: bool) -> torch.Tensor:
    leaf = value.detach()
    return leaf.requires_grad_(joint and (leaf.is_floating_point() or leaf.is_complex()))


def _leaf_names(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
    """``forward``'s parameter name with the path into it, for each pytree leaf of the inputs."""
    forward = model.fn if isinstance(model, FunctionModule) else model.forward
    params = list(inspect.signature(forward).parameters.values())
    starred = next((i for i, p in enumerate(params) if p.kind is p.VAR_POSITIONAL), None)
    names = [p.name for p in params[:starred]]
    out = []
    for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        if path[0].idx == 1:  # a keyword input: its key names it
            out.append(str(path[1].key) + pytree.keystr(path[2:]))
            continue
        index = path[1].idx
        if index < len(names):
            head = names[index]
        elif starred is not None:  # the values of *args
            head = f"{params[starred].name}[{index - starred}]"
        else:
            head = f"input{index}"
        out.append(head + pytree.keystr(path[2:]))
    return out


def _tangents(
    model: nn.Module, forward: Any, primal_values: list[torch.Tensor], fake: bool
) -> tuple[list[int], list[torch.Tensor]]:
    """Which outputs are differentiable, and a tensor of ones for each (their incoming gradient)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with preserved(model), torch.no_grad(), mode:
        outs = forward([p.detach() for p in primal_values])
    differentiable = [
        i for i, o in enumerate(outs)
        if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())
    ]
    if not differentiable:
        raise FxnxValueError(
            f"{type(model).__qualname__} has no floating-point output, so there is no backward "
            "pass to capture; use level='aten' for its forward graph"
        )
    device = primal_values[0].device if primal_values else torch.device("cpu")
    tangents = [
        torch.ones(tuple(outs[i].shape), dtype=outs[i].dtype, device=device)
        for i in differentiable
    ]
    return differentiable, tangents


class _OpenAnnotations:
    """``fx_traceback.annotate`` blocks opened in one hook and closed in a later one.

    Used as a context manager, it removes its hooks and closes whatever a
    failing forward or backward left open.
    """

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self._open: list[contextlib.AbstractContextManager[Any]] = []

    def open(self, annotation: dict[str, Any]) -> None:
        block = fx_traceback.annotate(annotation)
        block.__enter__()
        self._open.append(block)

    def close(self) -> bool:
        """Close the innermost open block; False when none was open."""
        if not self._open:
            return False
        self._open.pop().__exit__(None, None, None)
        return True

    def __enter__(self) -> _OpenAnnotations:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        while self.close():
            pass


@contextlib.contextmanager
def _module_stacks(model: nn.Module) -> Iterator[None]:
    """Annotate every node with the module call stack active when it was recorded."""
    stack: list[str] = []
    annotations: _OpenAnnotations  # the hooks' (declared: mypy took the __future__ import's name)

    def enter(path: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(path)
            annotations.open({_MODULES: tuple(stack)})

        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if annotations.close():
            stack.pop()

    with _OpenAnnotations() as annotations:
        for path, module in model.named_modules():
            if path:
                annotations.handles.append(module.register_forward_pre_hook(enter(path)))
                annotations.handles.append(module.register_forward_hook(leave, always_call=True))
        yield


@contextlib.contextmanager
def _backward_provenance(outputs: list[torch.Tensor]) -> Iterator[None]:
    """Tag the backward ops each autograd node emits with that node's sequence number.

    The forward op that created the autograd node got the same number, so a
    backward op can be traced to the module of the op it differentiates. Ops
    the engine adds between nodes (summing the gradients of a tensor used
    twice) carry no tag.
    """
    annotations: _OpenAnnotations  # the hooks' (declared: mypy took the __future__ import's name)

    def before(seq: int) -> Any:
        return lambda grads: annotations.open({_GRAD_FN: seq})

    def after(grads_in: Any, grads_out: Any) -> None:  # an autograd hook must return None
        annotations.close()

    with _OpenAnnotations() as annotations:
        seen: set[Any] = set()
        todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
        while todo:
            fn = todo.pop()
            if fn in seen:
                continue
            seen.add(fn)
            seq = sequence_nr(fn)
            if seq is not None:  # without it, backward ops take the scope their inputs share
                annotations.handles.append(fn.register_prehook(before(seq)))
            annotations.handles.append(fn.register_hook(after))
            todo.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
        yield


def _finish_metadata(gm: fx.GraphModule, model: nn.Module, joint: bool) -> None:
    """Turn the annotations into ``nn_module_stack`` and ``fxnx_phase`` entries on every node.

    A forward op's stack is the module calls active when it ran. A backward op
    takes the stack of the forward op whose autograd node emitted it; one the
    engine added to sum gradients takes the stack its inputs share.
    """
    classes = {path: type(module) for path, module in model.named_modules()}
    by_seq: dict[int, tuple[str, ...]] = {}
    stacks: dict[fx.Node, tuple[str, ...]] = {}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        phase = custom.get(_PHASE, "forward")
        stack: tuple[str, ...] = custom.get(_MODULES, ())
        if node.op == "placeholder":
            phase = "backward" if node.name.startswith("tangents_") else "forward"
        elif node.op == "output":
            phase = "backward" if joint else "forward"
        elif phase == "forward" and node.meta.get("seq_nr") is not None:
            by_seq.setdefault(node.meta["seq_nr"], stack)
        elif phase == "backward":
            if _GRAD_FN in custom:
                stack = by_seq.get(custom[_GRAD_FN], ())
            else:
                stack = _shared_prefix([stacks[n] for n in node.all_input_nodes if n in stacks])
        stacks[node] = stack
        node.meta["fxnx_phase"] = phase
        node.meta["nn_module_stack"] = {path: (path, classes[path]) for path in stack}


def _shared_prefix(stacks: list[tuple[str, ...]]) -> tuple[str, ...]:
    stacks = [s for s in stacks if s]
    if not stacks:
        return ()
    prefix = stacks[0]
    for stack in stacks[1:]:
        n = 0
        while n < min(len(prefix), len(stack)) and prefix[n] == stack[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _run(model: Any, inputs: Inputs | None, options: CaptureOptions, fake: bool) -> RouteResult:
    """The route: the forward pass as ATen operators, shapes recorded as it runs."""
    assert inputs is not None  # the ladder checks needs_inputs
    with quiet():
        result = capture_aten(
            as_module(model), inputs.args, inputs.kwargs, joint=False, fake=fake
        )
    return RouteResult(result.gm, aten=result, specialised=result.specialised, varies=result.varies)


ROUTE = Route(name="make_fx", level="aten", needs_inputs=True, run=_run)
