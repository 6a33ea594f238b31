"""Custom ``torch.autograd.Function`` calls met by a symbolic trace: one node each.

torch.fx runs a Function's ``forward`` on its proxies, with gradients off as autograd runs
it, so the graph would hold the forward's operations, lose the Function's ``backward`` (a
straight-through estimator, a gradient reversal, timm's memory-efficient activations), and
mark those operations as run without gradients: credit over the graph would stop there,
where the model's own backward passes the Function's credit on. Each call is recorded
instead as one ``call_function`` node of the Function's ``apply`` (:func:`applier`), which
the credit run calls: autograd then runs the Function's own backward.

torch's reentrant checkpoint (``checkpoint(fn, *args, use_reentrant=True)``) is such a
Function, whose values are ``fn``'s: the trace goes through ``fn`` as if there were no
checkpoint, so that rules reach the layers inside it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointFunction

from .._compat import pytree

__all__ = ["applied", "applier", "kept_whole"]

_APPLY = vars(torch.autograd.Function)["apply"]


@functools.cache
def applier(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` as a function named after ``cls`` (the node's target in the graph)."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        return cls.apply(*args, **kwargs)

    apply.__module__, apply.__qualname__ = cls.__module__, f"{cls.__qualname__}.apply"
    apply.__name__ = f"{cls.__name__}.apply"  # the node's target in G; its name is made of it
    return apply


@contextlib.contextmanager
def kept_whole(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces in this thread, a Function applied to a proxy is one node.

    A Function whose ``apply`` was bound before the trace (``ste = STE.apply`` at import)
    reaches its ``forward`` with proxies instead: the trace fails there, naming it, so that
    the capture goes on to a route that says what it cannot keep.
    """
    thread = threading.get_ident()

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread and _proxied(args, kwargs):
            if issubclass(cls, CheckpointFunction):
                function, _preserve_rng_state, *inputs = args
                return function(*inputs)
            return tracer.create_proxy("call_function", applier(cls), args, kwargs)
        return _APPLY.__get__(None, cls)(*args, **kwargs)

    def forward(cls: type[torch.autograd.Function], args: Any, kwargs: Any) -> None:
        if threading.get_ident() == thread and _proxied(args, kwargs):
            raise TypeError(
                f"the autograd Function {cls.__qualname__} was applied through an apply bound "
                f"before tracing, which a trace cannot keep whole: call {cls.__qualname__}.apply(...) "
                "in forward"
            )

    with _applying(apply), _forwards(forward):
        yield


@contextlib.contextmanager
def applied() -> Iterator[list[type[torch.autograd.Function]]]:
    """The custom Functions whose ``forward`` ran in this thread while the block ran, in
    order: what ``torch.export`` inlines, keeping their forward and losing their backward."""
    thread, found = threading.get_ident(), list[type[torch.autograd.Function]]()

    def forward(cls: type[torch.autograd.Function], args: Any, kwargs: Any) -> None:
        if threading.get_ident() == thread and cls not in found and not _an_operators(cls):
            found.append(cls)

    with _forwards(forward):
        yield found


def _an_operators(cls: type[torch.autograd.Function]) -> bool:
    """Whether ``cls`` is the autograd of a custom operator (``torch.library``'s
    ``register_autograd`` makes one): export keeps the operator, whose backward is that."""
    return cls.__module__.startswith("torch._library")


def _proxied(args: Any, kwargs: Any) -> bool:
    return any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs)))


@contextlib.contextmanager
def _applying(apply: Callable[..., Any]) -> Iterator[None]:
    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY  # type: ignore[method-assign]


@contextlib.contextmanager
def _forwards(seen: Callable[[type[torch.autograd.Function], Any, Any], None]) -> Iterator[None]:
    """Every Function class's own ``forward`` calls ``seen(cls, args, kwargs)`` first (autograd
    looks ``forward`` up at each call, however ``apply`` was reached)."""
    kept: list[tuple[Any, staticmethod[..., Any]]] = []
    for cls in _subclasses(torch.autograd.Function):
        original = vars(cls).get("forward")
        if isinstance(original, staticmethod):
            kept.append((cls, original))
            cls.forward = staticmethod(_watched(cls, original.__func__, seen))
    try:
        yield
    finally:
        for cls, original in kept:
            cls.forward = original


def _watched(cls: type[torch.autograd.Function], forward: Callable[..., Any],
             seen: Callable[[type[torch.autograd.Function], Any, Any], None]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def watched(*args: Any, **kwargs: Any) -> Any:
        seen(cls, args, kwargs)
        return forward(*args, **kwargs)

    return watched


def _subclasses(cls: type) -> list[Any]:
    found: list[type] = []
    todo: list[type] = [cls]
    while todo:
        subs: list[type] = todo.pop().__subclasses__()
        for sub in subs:
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found
