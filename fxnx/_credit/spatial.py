"""Direct feedback shared over space: a convolution's feedback as a kernel, not a matrix.

For a convolution's input, :class:`~fxnx.credit.DirectFeedbackAlignment` holds ``B``
of shape ``(D, C_in, *kernel)`` and sends back what a convolution with weight
``B`` (the layer's stride, padding and dilation; no groups) sends to its input
when the output credit ``e`` (``N × D``) is broadcast over its whole output
grid, as BioTorch does (Sanfiz & Akrout, 2021). Since ``e`` is the same at
every output position, that credit is, at each input position, the sum of
``K = e·B`` (``N × C_in × kernel``) over the kernel offsets that reach it from
a valid output position: :meth:`Geometry.credit` computes it as the input
gradient of a depthwise convolution with kernel ``K`` and an all-ones output
gradient, so no ``N × D × H × W`` tensor is ever made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.nn.grad  # declares the submodule to type checkers; torch.nn imports it already
from torch import Tensor

from .kinds import CONVOLUTIONS
from .nodecall import NodeCall

__all__ = ["Geometry", "conv_geometry"]

_aten = torch.ops.aten
_FUNCTIONS = {
    F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, _aten.conv1d.default: 1, _aten.conv2d.default: 2,
    _aten.conv3d.default: 3, _aten.conv1d.padding: 1, _aten.conv2d.padding: 2, _aten.conv3d.padding: 3,
}
_INPUT_GRAD = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}


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
        dims = len(size)
        K = (e @ B.reshape(B.shape[0], -1)).reshape(n * c, 1, *self.kernel)
        padding = self._explicit()
        if padding is None:  # "same" with an odd total padding: let autograd place it
            x = torch.zeros((1, n * c, *size), dtype=K.dtype, device=K.device, requires_grad=True)
            with torch.enable_grad():
                y = _conv(dims)(x, K, None, self.stride, self.padding, self.dilation, n * c)
                (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
            return g.reshape(shape)
        out = [
            (s + 2 * p - d * (k - 1) - 1) // st + 1
            for s, p, d, k, st in zip(size, padding, self.dilation, self.kernel, self.stride, strict=True)
        ]
        ones = torch.ones((), dtype=K.dtype, device=K.device).expand(1, n * c, *out)
        g = _INPUT_GRAD[dims]((1, n * c, *size), K, ones, self.stride, padding, self.dilation, n * c)
        return g.reshape(shape)

    def _explicit(self) -> tuple[int, ...] | None:
        if self.padding == "valid":
            return (0,) * len(self.kernel)
        if self.padding == "same":
            total = [d * (k - 1) for d, k in zip(self.dilation, self.kernel, strict=True)]
            return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)
        return self.padding  # type: ignore[return-value]


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
