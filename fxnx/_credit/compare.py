"""Comparing two credit runs node by node: what feedback-alignment papers plot."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .._compat import pytree
from .result import CreditResult

__all__ = ["cosine_angle", "credit_alignment", "flat"]


def credit_alignment(
    result: CreditResult, reference: CreditResult, *, params: bool = False
) -> dict[str, dict[str, float]]:
    """Cosine, angle and relative error of ``result``'s credit against ``reference``'s.

    Parameters
    ----------
    result, reference : CreditResult
        Two runs over the same graph, for example ``rule="feedback_alignment"``
        against ``rule="exact"``.
    params : bool
        Compare parameter credit instead of node credit.

    Returns
    -------
    dict
        Node (or parameter) name to ``{"cosine", "angle", "rel_error"}``, the
        angle in degrees and the error ``‖result − reference‖ / ‖reference‖``;
        only where both runs have a nonzero credit.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(16, 4)
    >>> G = fxnx.convert(model, x)
    >>> fa = fxnx.route_credit(G, model, x, rule="feedback_alignment")
    >>> bp = fxnx.route_credit(G, model, x)
    >>> angles = credit_alignment(fa, bp)
    >>> angles["_2"]["angle"] < 1e-3  # the last layer's output: same credit under both
    True
    >>> angles["_0"]["angle"] > 1  # below a random feedback matrix: a different direction
    True
    """
    ours = result.param_credit if params else result.node_credit
    theirs = reference.param_credit if params else reference.node_credit
    out = {}
    for name, ref in theirs.items():
        a, b = flat(ours.get(name)), flat(ref)
        if a is None or b is None or a.shape != b.shape:
            continue
        cosine, angle = cosine_angle(a, b)
        if cosine is None:
            continue
        out[name] = {"cosine": cosine, "angle": angle, "rel_error": float((a - b).norm() / b.norm())}
    return out


def cosine_angle(a: Tensor, b: Tensor) -> tuple[float | None, float]:
    """The cosine of two flat tensors and their angle in degrees ((None, nan) if one is 0)."""
    norm_a, norm_b = float(a.norm()), float(b.norm())
    if norm_a == 0.0 or norm_b == 0.0:
        return None, math.nan
    cosine = max(-1.0, min(1.0, float(a @ b) / (norm_a * norm_b)))
    return cosine, math.degrees(math.acos(cosine))


def flat(credit: Any) -> Tensor | None:
    """``credit``'s tensors as one float64 vector, or None where it holds none."""
    tensors = [t.detach().reshape(-1).double() for t in pytree.tree_flatten(credit)[0] if isinstance(t, Tensor)]
    return torch.cat(tensors) if tensors else None
