"""Running a model without leaving a trace on it."""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._compat import own_buffers, own_tables

__all__ = ["attributes_kept", "module_tables", "preserved", "random_state_kept", "tensor_values_kept"]


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Give back torch's CPU random state and Python's ``random`` state when the block ends
    (a forward that draws numbers, ``torch.rand(1)`` or ``random.random()``, draws them)."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(state)


@contextlib.contextmanager
def preserved(model: Any, modules: list[nn.Module] | None = None) -> Iterator[None]:
    """Restore buffers (BatchNorm running stats, ``num_batches_tracked``), the contents of
    the dicts and lists modules keep as attributes (caches, such as timm LeViT's attention
    biases, filled on a first call in eval mode), the state of random generators they keep
    (``torch.Generator``), torch's CPU random state and Python's ``random`` state when the
    block ends, so running the model inside it changes nothing the
    user sees; buffers nothing wrote are not touched at all. (Attributes a forward sets:
    :func:`attributes_kept`.) ``modules``: ``list(model.modules())``, where the caller has
    it already.

    Examples
    --------
    >>> bn = nn.BatchNorm1d(2).train()
    >>> with preserved(bn):
    ...     _ = bn(torch.randn(4, 2) + 5)
    >>> bn.running_mean.tolist(), int(bn.num_batches_tracked)
    ([0.0, 0.0], 0)
    """
    if modules is None:
        modules = list(model.modules()) if isinstance(model, nn.Module) else []
    buffers = list({id(b): b for m in modules for b in own_buffers(m)}.values())
    saved = [b.detach().clone() for b in buffers]
    caches = _caches(modules)
    with random_state_kept():
        try:
            yield
        finally:
            _refill(caches)
            with torch.no_grad():
                # Only buffers whose values changed, and past autograd's version counter (as
                # BatchNorm's own update of its statistics is): a counted write would break a
                # backward of the user's that saved the buffer, though it gets back the very
                # values that backward saved.
                for buf, old in zip(buffers, saved, strict=True):
                    if not buf.is_meta and not torch.equal(buf, old):
                        buf.data.copy_(old)


@contextlib.contextmanager
def attributes_kept(model: Any) -> Iterator[list[str]]:
    """Give every module of ``model`` back the attributes, buffers and parameters it had (the
    same objects) when the block ends: an attribute a forward sets (``self.feat = h``,
    ``self.calls += 1``) is removed or given back, a buffer it rebinds (``self.ema = ...``)
    given back, a tensor attribute it writes into given its values (:func:`tensor_values_kept`).
    Yields a list that gets the names of the attributes the block set (``"encoder.feat"``) as
    it ends.

    For runs of the model fxnx makes beside the user's (comparing a graph with the model),
    so that the model is left as the user's own calls left it.

    Examples
    --------
    >>> m = nn.Sequential(nn.Linear(2, 2))
    >>> with attributes_kept(m) as changed:
    ...     m[0].seen = True
    >>> changed, hasattr(m[0], "seen")
    (['0.seen'], False)
    """
    named = list(model.named_modules(remove_duplicate=False)) if isinstance(model, nn.Module) else []
    kept = [(path, m, *map(dict, module_tables(m))) for path, m in named]
    changed: list[str] = []
    try:
        with tensor_values_kept(model):
            yield changed
    finally:
        for path, m, *tables in kept:
            for table, old in zip(module_tables(m), tables, strict=True):
                if len(table) == len(old) and all(map(operator.is_, table.values(), old.values())):
                    continue
                changed.extend(f"{path}.{name}" if path else name for name, value in table.items()
                               if name not in _TABLES and (name not in old or old[name] is not value))
                for name in [name for name in table if name not in old]:
                    del table[name]
                table.update(old)


@contextlib.contextmanager
def tensor_values_kept(model: Any) -> Iterator[None]:
    """Give every tensor a module of ``model`` keeps as a plain attribute (not a buffer: a
    running mean ``self.mean`` a forward updates in place) its values back when the block
    ends. Each is copied: for fxnx's runs of the model and of its graph beside the user's,
    not for every call."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    tensors = [v for m in modules for name, v in vars(m).items()
               if name not in _TABLES and isinstance(v, torch.Tensor) and not v.is_meta]
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        for t, old in zip(tensors, saved, strict=True):
            t.data.copy_(old)  # past the version counter, as buffers are given back


def module_tables(m: nn.Module) -> tuple[dict[str, Any], ...]:
    """A module's ``__dict__`` (its plain attributes and nn.Module's own tables), its buffers
    and its parameters."""
    return (vars(m), *own_tables(m))


#: nn.Module's own attributes (its tables of parameters, buffers, submodules and hooks, and
#: ``training``): changed only by the model's code.
_TABLES = frozenset(vars(nn.Module()))
#: The types of attribute :func:`preserved` gives back the contents or state of.
_CACHES = (dict, list, torch.Generator)


def _caches(modules: list[nn.Module]) -> list[tuple[Any, Any]]:
    """Each dict and list one of ``modules`` holds as an attribute, with a copy of its
    contents, and each random generator (``torch.Generator``), with its state."""
    found = []
    for m in modules:
        own = vars(m)
        # a module's own attributes (Linear's sizes, Conv2d's stride): found by a set
        # difference, in C, and looked at in their order only where one is a cache
        extra = own.keys() - _TABLES
        if any(type(own[name]) in _CACHES for name in extra):
            found += [(value, _kept(value)) for name, value in own.items()
                      if name in extra and type(value) in _CACHES]
    return found


def _kept(value: Any) -> Any:
    """What :func:`_refill` gives back: a generator's state, a dict's or list's contents."""
    if type(value) is torch.Generator:
        return value.get_state()
    return type(value)(value)


def _refill(caches: list[tuple[Any, Any]]) -> None:
    """Give each dict and list the contents it had (the same objects), where they changed,
    and each generator its state."""
    for value, old in caches:
        if type(value) is torch.Generator:
            value.set_state(old)
        elif type(value) is dict:
            if value.keys() != old.keys() or any(value[k] is not v for k, v in old.items()):
                value.clear()
                value.update(old)
        elif len(value) != len(old) or any(a is not b for a, b in zip(value, old, strict=True)):
            value[:] = old
