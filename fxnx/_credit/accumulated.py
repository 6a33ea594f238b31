"""The backward passes that report the credit they route.

:func:`routed` (``route_credit``'s) is ``torch.autograd.grad``: credit at each value and
parameter, nothing accumulated. :func:`accumulated` (``router.backward``'s) is
``loss.backward()`` itself, with what it routes captured:
``torch.autograd.backward`` runs as ``loss.backward()`` runs it, so every leaf the loss
reaches gets its ``.grad`` (a head outside the model, the input), and parameters' hooks and
``DistributedDataParallel``'s reducer fire; a hook on each parameter and on each value keeps
a copy of the credit that reached it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from .._compat import graph_task, pytree


def reaches(roots: list[Tensor], targets: list[Tensor]) -> bool:
    """Whether the backward pass from ``roots`` reaches any of ``targets`` (a walk of
    autograd's graph, before anything runs)."""
    want = {t.grad_fn for t in targets if t.grad_fn is not None}
    leaves = {id(t) for t in targets if t.grad_fn is None and t.requires_grad}
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    if any(id(t) in leaves for t in roots):
        return True
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node in want or id(getattr(node, "variable", None)) in leaves:
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


#: A value of at most this many elements is held to the end of the backward pass (taking its
#: edge costs more than holding it: a deep MLP's hundreds of small values).
_HELD = 1 << 12


def watched(names: list[str], values: Any) -> tuple[list[Place], list[Any]]:
    """Where each named value's credit will be found (:func:`routed`'s ``places``) and the
    gradient edge of each of its tensors that requires grad (a leaf, or a small tensor: the
    tensor itself). Edges hold no value: a caller that drops the values after this
    (``route_credit``) lets autograd free each value as a plain backward does, once nothing
    left needs it."""
    edges: list[Any] = []

    def watch(t: Tensor) -> int:
        edges.append(t if t.grad_fn is None or t.numel() <= _HELD else get_gradient_edge(t))
        return len(edges) - 1

    return _taken_apart(names, values, watch), edges


def routed(
    places: list[Place], edges: list[Any], roots: list[Tensor], grads: list[Tensor] | None, params: dict[str, Tensor],
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Autograd's backward from ``roots``: the credit at each value :func:`watched` took
    (``places``, ``edges``) and at each parameter. Nothing is accumulated."""
    if not (edges or params) or not roots:
        return {name: None for name, *_ in places}, {}
    got = torch.autograd.grad(roots, [*params.values(), *edges], grads, allow_unused=True)
    # autograd hands one tensor to a value and to a parameter it passes credit on to unchanged
    # (h + b): the parameter's credit gets its own
    at_nodes = {g.data_ptr() for g in got[len(params):] if g is not None}
    param_credit = {n: g.clone() if g.data_ptr() in at_nodes else g
                    for n, g in zip(params, got, strict=False) if g is not None}
    return _credit_at(places, got[len(params):].__getitem__), param_credit


def accumulated(
    names: list[str], values: Any, roots: list[Tensor], grads: list[Tensor] | None, params: dict[str, Tensor],
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``torch.autograd.backward(roots, grads)``, returning the credit that reached each of
    ``values`` (named by ``names``; None where none did) and each of ``params`` (its own
    copy: what was added to its ``.grad``)."""
    got: dict[int, Tensor] = {}
    task: list[Any] = []  # this backward pass's name, taken at its roots
    current, thread = graph_task(), threading.get_ident()

    def start(_: Tensor) -> None:
        if not task:
            task.append(current())

    def keep(at: int) -> Any:
        def hook(g: Tensor) -> None:
            # its own copy: autograd may hand on this very tensor (a parameter's .grad takes it
            # where the value is the parameter itself, or the caller's output credit passes
            # through unchanged), and a later write into either would change the credit
            got[at] = g.detach().clone()
        return hook

    def keep_own(at: int) -> Any:  # a parameter's hooks run in every thread's backward pass
        def hook(g: Tensor) -> None:
            # this pass, or one it started on this thread (a reentrant checkpoint's)
            if threading.get_ident() == thread or (task and current() == task[0]):
                got[at] = g.detach().clone()
        return hook

    handles = [t.register_hook(start) for t in roots if t.requires_grad]
    for at, p in enumerate(params.values()):  # registered last: sees what is accumulated
        handles.append(p.register_hook(keep_own(at)))
    slots = itertools.count(len(params))

    def watch(t: Tensor) -> int:
        at = next(slots)
        handles.append(t.register_hook(keep(at)))
        return at

    places = _taken_apart(names, values, watch)
    try:
        torch.autograd.backward(roots, grads)
    finally:
        for handle in handles:
            handle.remove()
    # A parameter the credit reaches unchanged (one the model returns) can take the caller's
    # tensor itself as its .grad, where plain autograd gives it a copy: it gets a copy too.
    given = {g.untyped_storage().data_ptr() for g in grads or () if isinstance(g, Tensor)}
    for p in params.values() if given else ():
        if p.grad is not None and p.grad.untyped_storage().data_ptr() in given:
            p.grad = p.grad.clone()
    param_credit = {name: got[i] for i, name in enumerate(params) if i in got}
    return _credit_at(places, got.get), param_credit


#: a value's name, its structure (None for a tensor) and, for each of its leaves, where its
#: credit will be found (None for a leaf that takes none)
Place = tuple[str, Any, list[int | None]]


def _taken_apart(names: list[str], values: Any, watch: Callable[[Tensor], int]) -> list[Place]:
    """Each named value's leaves: ``watch(t)`` for each tensor that requires grad says where
    its credit will be found."""
    places: list[Place] = []
    for name, value in zip(names, values or (), strict=False):
        leaves, tree = ([value], None) if isinstance(value, Tensor) else pytree.tree_flatten(value)
        index = [watch(t) if isinstance(t, Tensor) and t.requires_grad else None for t in leaves]
        places.append((name, tree, index))
    return places


def _credit_at(places: list[Place], found: Callable[[int], Tensor | None]) -> dict[str, Any]:
    """Each value's credit, in its structure: None where none reached it."""
    credit: dict[str, Any] = {}
    for name, tree, index in places:
        parts = [None if i is None else found(i) for i in index]
        if tree is None:
            credit[name] = parts[0]
        else:
            credit[name] = None if all(p is None for p in parts) else pytree.tree_unflatten(parts, tree)
    return credit
