"""Whether a captured graph computes what its model computes, on real inputs.

A trace can record another computation than the model's without failing: ``h += y`` with an
alias of ``h`` read afterwards (torch.fx's proxies have no ``__iadd__``, so the trace rebinds
``h`` to ``h + y`` where the model writes into the tensor the alias holds), a value of Python's
baked in as a constant, a call the tracer does not see. :func:`computes_another` runs the
model and the graph on the same values from the same random state and says where their
outputs differ; the capture ladder then tries the next route (:mod:`.ladder`), so ``G``
never silently describes another computation than the model's. :func:`differs` is the
comparison, shared with the router's own checks (:mod:`fxnx._credit.faithful`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._compat import pytree, uncompiled
from .._state import attributes_kept, preserved
from .inputs import Inputs, copied_inputs
from .shapes import container_items
from .tracer import mha_fast_path_off

__all__ = ["computes_another", "detached", "differs", "saves_nothing", "tensors"]


def tensors(value: Any) -> list[Tensor]:
    """The tensors among the leaves of ``value`` (pytree order), those of containers pytree does
    not look into (a dataclass, a mapping that is not a dict) included."""
    found: list[Tensor] = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, Tensor):
            found.append(leaf)
        elif (held := container_items(leaf)) is not None:
            found.extend(tensors(held))
    return found


def computes_another(model: Any, inputs: Inputs, concrete: Mapping[str, Any], output: Any) -> str | None:
    """Where ``output``, a captured graph's on ``inputs`` (shape propagation's run), differs
    from ``model`` called on ``inputs`` and the ``concrete_args`` the graph fixed, in words, or
    None: they agree, the model itself fails on them, or neither holds a tensor to compare.

    The model runs as it runs when called: with gradients (saving nothing for a backward), a
    forward branching on ``torch.is_grad_enabled()`` taking the branch the trace took; with
    torch's fused attention fast path off, as the graph was propagated; on a copy of the
    inputs (a model may write into them); from the random state the propagation began in;
    leaving no trace on the model, its attributes, its buffers or the random state
    (:func:`~fxnx._state.preserved`, :func:`~fxnx._state.attributes_kept`).
    """
    call = copied_inputs(inputs)
    assert call is not None
    model = uncompiled(model)  # a torch.compile'd one would be compiled by its first call
    try:
        with preserved(model), attributes_kept(model), torch.enable_grad(), mha_fast_path_off(), \
                saves_nothing():
            want = detached(model(*call.args, **call.kwargs, **concrete))
    except Exception:
        return None  # the ladder's other checks speak for a model that fails
    return differs(output, want)


def saves_nothing() -> torch.autograd.graph.saved_tensors_hooks:
    """Autograd saves no tensor for a backward inside the block: for runs of the model compared
    with a graph, with gradients on as the model runs when called, which never go back (nor
    save into a checkpoint around them)."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _dropped)


def _drop(t: Tensor) -> None:
    """Pack nothing."""


def _dropped(packed: None) -> Tensor:
    raise AssertionError("a comparison run of the model has no backward pass")


def detached(value: Any) -> Any:
    """``value`` with each of its tensors detached."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, value)


def differs(got: Any, want: Any) -> str | None:
    """Where the tensors of ``got`` differ from those of ``want``, in words, or None.

    Tensors are compared leaf by leaf (pytree order): shapes and dtypes exactly, integers and
    booleans exactly, floating values to a relative norm of ``1000·eps`` of their dtype (a
    hundredth at most), NaNs where the other has NaNs. Structures with different numbers of
    tensors are not compared (None).
    """
    a, b = tensors(got), tensors(want)
    if len(a) != len(b):
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        where = "the output" if len(a) == 1 else f"output tensor {i}"
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{where} has shape {tuple(x.shape)} {x.dtype}, not {tuple(y.shape)} {y.dtype}"
        if x.is_meta or y.is_meta or x.numel() == 0:
            continue
        x, y = x.detach(), y.detach()
        if not (x.is_floating_point() or x.is_complex()):
            if not torch.equal(x, y):
                return f"{where} differs in {int((x != y).sum())} of {x.numel()} values"
            continue
        nan = x.isnan()
        if not torch.equal(nan, y.isnan()):
            return f"{where} has NaN in other places"
        x, y = x.masked_fill(nan, 0), y.masked_fill(nan, 0)
        if not torch.equal(x.isinf(), y.isinf()) or not torch.equal(x[x.isinf()], y[y.isinf()]):
            return f"{where} has infinities in other places"
        x, y = x.masked_fill(x.isinf(), 0), y.masked_fill(y.isinf(), 0)
        eps = torch.finfo(x.real.dtype if x.is_complex() else x.dtype).eps
        # Tensor.cdouble exists; torch's stubs lack it
        scale = float(torch.linalg.vector_norm(y.double() if not y.is_complex() else y.cdouble()))  # type: ignore[attr-defined]
        error = float(torch.linalg.vector_norm((x - y).double() if not x.is_complex() else (x - y).cdouble()))  # type: ignore[attr-defined]
        if error > min(1e3 * eps, 1e-2) * scale + 1e-30:
            return f"{where} differs by {error / scale if scale else error:.3g} (relative norm)"
    return None
