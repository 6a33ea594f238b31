"""Running a model without leaving a trace on it."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["preserved", "random_state_kept"]


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
def preserved(model: Any) -> Iterator[None]:
    """Restore buffers (BatchNorm running stats, ``num_batches_tracked``), the contents of
    the dicts and lists modules keep as attributes (caches, such as timm LeViT's attention
    biases, filled on a first call in eval mode), torch's CPU random state and Python's
    ``random`` state when the block ends, so running the model inside it changes nothing the
    user sees; buffers nothing wrote are not touched at all.

    Examples
    --------
    >>> bn = nn.BatchNorm1d(2).train()
    >>> with preserved(bn):
    ...     _ = bn(torch.randn(4, 2) + 5)
    >>> bn.running_mean.tolist(), int(bn.num_batches_tracked)
    ([0.0, 0.0], 0)
    """
    buffers = list(model.buffers()) if isinstance(model, nn.Module) else []
    saved = [b.detach().clone() for b in buffers]
    caches = _caches(model)
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


#: nn.Module's own tables (parameters, buffers, submodules): changed only by the model's code.
_TABLES = frozenset(vars(nn.Module()))
#: Those of them that are dicts or lists.
_OWN_DICTS = tuple(name for name, value in vars(nn.Module()).items() if type(value) in (dict, list))


def _caches(model: Any) -> list[tuple[Any, Any]]:
    """Each dict and list a module of ``model`` holds as an attribute, with a copy of its
    contents."""
    if not isinstance(model, nn.Module):
        return []
    found = []
    for m in model.modules():
        own = vars(m)
        kinds = list(map(type, own.values()))
        if kinds.count(dict) + kinds.count(list) == sum(type(own.get(n)) in (dict, list) for n in _OWN_DICTS):
            continue  # nn.Module's own tables alone (most modules): counted in C
        found += [(value, type(value)(value)) for name, value in own.items()
                  if name not in _TABLES and type(value) in (dict, list)]
    return found


def _refill(caches: list[tuple[Any, Any]]) -> None:
    """Give each dict and list the contents it had (the same objects), where they changed."""
    for value, old in caches:
        if type(value) is dict:
            if value.keys() != old.keys() or any(value[k] is not v for k, v in old.items()):
                value.clear()
                value.update(old)
        elif len(value) != len(old) or any(a is not b for a, b in zip(value, old, strict=True)):
            value[:] = old
