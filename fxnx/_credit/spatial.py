"""Direct feedback shared over space: a convolution's feedback as a kernel, not a matrix.

For a convolution's input, :class:`~fxnx.credit.DirectFeedbackAlignment` holds ``B``
of shape ``(D, C_in, *kernel)`` and sends back what a convolution with weight
``B`` (the layer's stride, padding and dilation; no groups) sends to its input
when the output credit ``e`` (``N × D``) is broadcast over its whole output
grid, as BioTorch does (Sanfiz & Akrout, 2021). Since ``e`` is the same at
every output position, that credit is, at each input position, the sum of
``K = e·B`` (``N × C_in × kernel``) over the kernel offsets that reach it from
a valid output position. Which offsets reach which input positions depends on
the geometry and the input's size alone: :func:`coverage` finds it once (as the
input gradient of a convolution with one one-hot kernel per offset and an
all-ones output gradient, run by autograd), a ``kernel × H × W`` matrix of 0s
and 1s, and :meth:`Geometry.credit` is one matrix product of ``K`` with it. No
``N × D × H × W`` tensor is ever made.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from .kinds import CONVOLUTIONS
from .nodecall import NodeCall

__all__ = ["Geometry", "conv_geometry", "coverage"]

_aten = torch.ops.aten
_FUNCTIONS = {
    F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, _aten.conv1d.default: 1, _aten.conv2d.default: 2,
    _aten.conv3d.default: 3, _aten.conv1d.padding: 1, _aten.conv2d.padding: 2, _aten.conv3d.padding: 3,
}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A convolution's kernel size, stride, padding (numbers, or "same"/"valid") and dilation."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]

    def credit(self, e: Tensor, B: Tensor, shape: Sequence[int]) -> Tensor:
        """The credit at an input of ``shape`` for output credit ``e`` (``N × D``) through
        feedback kernel ``B`` (``D × C_in × kernel``)."""
        n, c, *size = shape
        K = (e @ B.reshape(B.shape[0], -1)).reshape(n * c, math.prod(self.kernel))  # N·C_in × kernel offsets
        return (K @ coverage(self, tuple(size), K.dtype, K.device)).reshape(shape)


@functools.lru_cache(maxsize=64)
def coverage(geometry: Geometry, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Which kernel offsets reach each input position of ``size`` from a valid output
    position: a ``kernel offsets × positions`` matrix of 0s and 1s (a column holds several
    1s where a stride smaller than the kernel overlaps them), for :meth:`Geometry.credit`."""
    dims, offsets = len(size), math.prod(geometry.kernel)
    one_hot = torch.eye(offsets, dtype=dtype, device=device).reshape(offsets, 1, *geometry.kernel)
    x = torch.zeros((1, offsets, *size), dtype=dtype, device=device, requires_grad=True)
    with torch.enable_grad():
        y = _conv(dims)(x, one_hot, None, geometry.stride, geometry.padding, geometry.dilation, offsets)
        (reached,) = torch.autograd.grad(y, x, torch.ones_like(y))
    return reached.reshape(offsets, -1).to(dtype)  # 0s and 1s: exact in any dtype


def conv_geometry(call: NodeCall) -> Geometry | None:
    """``call``'s convolution geometry when its node is an ordinary (not transposed)
    convolution whose weight and geometry are known, else None."""
    module = call.module
    if isinstance(module, CONVOLUTIONS):
        return Geometry(
            tuple(module.kernel_size), tuple(module.stride),
            module.padding if isinstance(module.padding, str) else tuple(module.padding),
            tuple(module.dilation),
        )
    if module is not None or call.op != "call_function":
        return None
    try:
        dims = _FUNCTIONS.get(call.target)
    except TypeError:  # an unhashable callable
        return None
    args = list(call.args)
    if dims is None or len(args) < 2 or call.kwargs:
        return None
    weight = args[1]
    shape = next(
        (P.shape for k, (_, P) in call.param_inputs.items()
         if isinstance(weight, fx.Node) and call.sources[k] == weight.name),
        None,
    )
    given = args[3:6]
    rest = [*given, *[1, 0, 1][len(given):]]  # stride, padding, dilation, as the signature orders them
    if shape is None or len(shape) != dims + 2 or any(isinstance(a, fx.Node) for a in rest):
        return None
    stride, padding, dilation = (v if isinstance(v, str) else _tuple(v, dims) for v in rest)
    return Geometry(tuple(int(k) for k in shape[2:]), stride, padding, dilation)  # type: ignore[arg-type]


def _conv(dims: int) -> Any:
    return (F.conv1d, F.conv2d, F.conv3d)[dims - 1]


def _tuple(value: Any, dims: int) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),) * dims
