"""Feedback weights: drawn from a named law, per node, reproducibly from the seed.

Every rule that holds feedback weights (:class:`~fxnx.credit.FeedbackAlignment`, the
sign-symmetry magnitudes, :class:`~fxnx.credit.DirectFeedbackAlignment`'s projections,
:class:`~fxnx.credit.KolenPollack`'s and :class:`~fxnx.credit.WeightMirror`'s starting ``B``)
draws them here, with BioTorch's ``init`` choices (Sanfiz & Akrout, 2021):

- ``"xavier"`` (the default, as in BioTorch): Glorot uniform,
  ``U(±√(6 / (fan_in + fan_out)))``, variance ``2 / (fan_in + fan_out)``;
- ``"kaiming"``: PyTorch's default layer initialisation (Kaiming uniform with
  ``a = √5``), ``U(±1 / √fan_in)``, variance ``1 / (3 · fan_in)``; BioTorch's
  ``"kaiming"`` is this one.

Fans are PyTorch's for ``B``'s shape: ``fan_in = shape[1] · r``, ``fan_out =
shape[0] · r``, ``r`` the product of the dimensions after the second (a
convolution kernel's size). A draw depends only on the seed, the node's name
and what the tensor is for, so a router built again draws the same weights, in
any dtype (drawn in float32, then cast) and under autocast alike; distinct seeds
give unrelated draws.

Before a tensor is made, its size is checked against the rule's ``max_bytes``
(1 GiB by default): a larger allocation is refused with an error naming the
node and the bytes, never attempted.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from .._errors import FxnxTypeError, FxnxValueError

__all__ = [
    "LAWS", "MAX_BYTES", "check_bytes", "check_law", "check_seed", "draw", "fans", "generator", "laid_out_like",
    "magnitudes", "readable", "std",
]

#: The laws a feedback weight can be drawn from.
LAWS = ("xavier", "kaiming")
#: The largest feedback tensor a rule makes unless told otherwise (``max_bytes=``).
MAX_BYTES = 1 << 30


@overload
def check_seed(seed: Any, where: str, *, optional: Literal[False] = False) -> int: ...
@overload
def check_seed(seed: Any, where: str, *, optional: bool) -> int | None: ...
def check_seed(seed: Any, where: str, *, optional: bool = False) -> int | None:
    """``seed`` as an int (NumPy integers too); None passes where ``optional``."""
    if seed is None and optional:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise FxnxTypeError(
            f"{where} seed must be an int{' or None' if optional else ''}, got "
            f"{type(seed).__qualname__} {seed!r:.40}"
        )
    return int(seed)


def check_law(init: str, laws: Sequence[str] = LAWS) -> str:
    if init not in laws:
        raise FxnxValueError(f"init must be one of {', '.join(map(repr, laws))}, got {init!r}")
    return init


def fans(shape: Sequence[int]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight of ``shape``, as PyTorch's initialisers count them."""
    if len(shape) < 2:
        raise FxnxValueError(f"fans need a weight of two or more dimensions, got shape {tuple(shape)}")
    r = math.prod(shape[2:])
    return shape[1] * r, shape[0] * r


def std(init: str, shape: Sequence[int]) -> float:
    """The standard deviation of law ``init`` for a weight of ``shape``."""
    fan_in, fan_out = fans(shape)
    if init == "xavier":
        return math.sqrt(2.0 / (fan_in + fan_out))
    return 1.0 / math.sqrt(3.0 * fan_in)


def check_bytes(size: int, max_bytes: float | None, where: str) -> None:
    """Refuse feedback weights of ``size`` bytes when over ``max_bytes``, before they are made."""
    if max_bytes is not None and size > max_bytes:
        raise FxnxValueError(
            f"{where}: feedback weights would take {readable(size)}, over the limit of "
            f"{readable(max_bytes)}; raise it with the rule's max_bytes= (e.g. "
            "fxnx.credit.DirectFeedbackAlignment(max_bytes=8 * 2**30)), or route this node with a rule "
            "that needs less"
        )


def draw(
    init: str, shape: Sequence[int], *, seed: int, key: str, like: Tensor,
    max_bytes: float | None = MAX_BYTES, where: str = "",
) -> Tensor:
    """A tensor of ``shape`` drawn from law ``init``, from ``seed`` and ``key`` alone, with
    ``like``'s dtype and device (drawn in float32 on the CPU whatever the dtype, so that the
    values do not depend on it)."""
    _check_size(shape, like, max_bytes, where or key)
    gen = generator(seed, key)
    B = torch.empty(tuple(shape), dtype=torch.float32)
    if init == "xavier":
        nn.init.xavier_uniform_(B, generator=gen)
    else:
        nn.init.kaiming_uniform_(B, a=math.sqrt(5), generator=gen)
    return B.to(device=like.device, dtype=like.dtype)


def magnitudes(
    init: str, shape: Sequence[int], *, seed: int, key: str, like: Tensor,
    max_bytes: float | None = MAX_BYTES, where: str = "",
) -> Tensor:
    """``|U|`` for ``U`` drawn from law ``init`` (both laws are uniform on ``(-a, a)``, so
    ``|U|`` is uniform on ``(0, a)``), from ``seed`` and ``key`` alone, as :func:`draw` makes
    them: brSF's fresh magnitudes at every step.

    Each value takes 16 random bits: the midpoints of 65,536 equal steps of ``(0, a)``, four
    from each 64-bit word of the generator. A float draw takes one 32-bit word per value, and
    on BERT-base's 85 million weights that draw alone was a sixth of a training step. The law's
    mean is exact and its variance is off by ``2**-32`` of itself.
    """
    n = math.prod(shape)
    _check_size(shape, like, max_bytes, where or key)
    a = std(init, shape) * math.sqrt(3.0)
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None, generator=generator(seed, key))
    steps = words.view(torch.int16)[:n].view(tuple(shape)).to(torch.float32)  # -32768 ... 32767
    return steps.add_(32768.5).mul_(a / 65536).to(device=like.device, dtype=like.dtype)


def _check_size(shape: Sequence[int], like: Tensor, max_bytes: float | None, where: str) -> None:
    """:func:`check_bytes` for a tensor of ``shape`` with ``like``'s dtype, before it is made."""
    check_bytes(math.prod(shape) * like.element_size(), max_bytes, f"{where} (shape {tuple(shape)}, {like.dtype})")


def laid_out_like(B: Tensor, W: Tensor) -> Tensor:
    """``B`` with ``W``'s strides (so that the same view of each is the same region)."""
    if B.stride() == W.stride():
        return B
    return torch.empty_strided(W.shape, W.stride(), dtype=B.dtype, device=B.device).copy_(B)


def generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator for ``key`` (a node's name and what the draw is for) under ``seed``."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def readable(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError
