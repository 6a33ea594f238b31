"""Small models for issue 27's tests: writes in place, shape propagation that fails, floats
without gradient, and forwards that change from call to call."""

from __future__ import annotations

import random

import torch
import torch.fx
from torch import nn


class _Two(nn.Module):
    """Two linear layers: ``l`` makes the value written into, ``m`` what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.m = nn.Linear(4, 4), nn.Linear(4, 2)


class SliceIadd(_Two):
    """``h[:, :2] += y``: a write through a view of an intermediate (MViT's ``_add_rel_pos``)."""

    def forward(self, x):
        h = self.l(x)
        h[:, :2] += self.m(x)
        return h * 2


class ViewMethod(_Two):
    """A view written by a tensor method, the base read afterwards."""

    def forward(self, x):
        h = self.l(x)
        v = h[:, :2]
        v.mul_(3)
        return h.sin() + self.m(x).sum(1, keepdim=True)


class AtenCopy(_Two):
    """``torch.ops.aten.copy_`` into a slice (what ``x[i] = y`` becomes under torch.export)."""

    def forward(self, x):
        h = self.l(x)
        torch.ops.aten.copy_(h[:, :2], self.m(x).tanh())
        return h.sin()


@torch.fx.wrap
def _add_tail(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MViT's ``_add_shortcut``: a wrapped function writing into a view of its argument."""
    x[:, 2:] += y
    return x


class WrappedWrite(_Two):
    """A wrapped function writes into its argument through a view; the argument is read after."""

    def forward(self, x):
        h = self.l(x)
        a = _add_tail(h, self.m(x))
        return a * h.cos()


class Setitem(_Two):
    """``h[:, 1:3] = y``: a setitem into an intermediate."""

    def forward(self, x):
        h = self.l(x)
        h[:, 1:3] = self.m(x).exp()
        return h.cos()


class IndexPutChain(_Two):
    """A zeros tensor filled in place by indexed writes, one after another (SSD's postprocess)."""

    def forward(self, x):
        h = self.l(x)
        out = torch.zeros_like(h)
        keep = h[:, 0] > 0
        out[keep] = h[keep] * 2
        out[~keep] = self.m(x)[~keep].sum(1, keepdim=True)
        return out.tanh()


class Bump(nn.Module):
    """A module (kept whole) that writes into its input and returns something else."""

    def forward(self, t):
        t.mul_(2)
        return t.sum(1)


class HiddenWrite(nn.Module):
    """The write of a module kept whole is seen by a later reader of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.bump = nn.Linear(4, 4), Bump()

    def forward(self, x):
        h = self.l(x)
        s = self.bump(h)
        return h.sin() * s[:, None]


WRITES = {
    "slice_iadd": SliceIadd, "view_method": ViewMethod, "aten_copy": AtenCopy,
    "wrapped_write": WrappedWrite, "setitem": Setitem, "index_put_chain": IndexPutChain,
    "hidden_write": HiddenWrite,
}


@torch.fx.wrap
def _clipped(window: list[int], size: list[int]) -> int:
    """torchvision's ``_get_window_and_shift_size``: changes the list it is given."""
    for i in range(len(size)):
        if size[i] <= window[i]:
            window[i] = size[i]
    return window[0] * window[1]


class MutatesList(nn.Module):
    """A wrapped function that changes a list argument (a node's read-only list under torch.fx's
    Interpreter)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        n = _clipped([8, 8], [x.shape[0], x.shape[1]])
        return self.l(x) * n


class Histc(nn.Module):
    """A float without gradient (``histc``) before an integer ``cumsum`` used as an index, as
    Hugging Face's grouped mixture of experts computes its offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.l(x)
        counts = torch.histc(h, bins=4, min=-1, max=1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        index = offsets.clamp(max=x.shape[0] - 1).long()
        return self.o(h[index]) + counts.sum()


class Skips(nn.Module):
    """Residual blocks skipped at random in training mode, by a choice made in Python."""

    def __init__(self, draw: str = "python", p: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.draw, self.p = draw, p

    def forward(self, x):
        for block in self.blocks:
            if self.training and (random.random() if self.draw == "python" else torch.rand(())) < self.p:
                continue
            x = x + block(x).tanh()
        return x


class WarmUp(nn.Module):
    """A model that changes itself on its first call (as BigBird may switch its attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.first = True

    def forward(self, x):
        if self.first:
            self.first = False
            return self.l(x)
        return self.l(x).relu() * 2


class DataDependent(nn.Module):
    """Control flow on a tensor's value: torch.export refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        if h.sum() > 0:
            return h.relu()
        return h.tanh()
