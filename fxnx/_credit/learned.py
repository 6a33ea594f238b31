"""Feedback weights that learn: Kolen–Pollack and weight mirrors (Akrout et al., 2019).

Both route credit as feedback alignment does (``B`` in place of ``W`` on the way
back, natively inside autograd on linear layers and convolutions), and both
bring ``B`` into alignment with ``W`` as training goes, which is what let them
reach backprop's accuracy on ImageNet ("Deep learning without weight transport",
NeurIPS 2019). ``B`` learns when the router is told to:
:meth:`CreditRouter.update_feedback <fxnx.CreditRouter.update_feedback>`, once
per step, after the optimizer's step (a mirror then reflects the ``W`` the next
forward runs with)::

    loss.backward()
    opt.step()
    router.update_feedback(lr=0.05, weight_decay=1e-4)   # the optimizer's lr and decay

or, to have the optimizer call it, ``opt.register_step_post_hook(lambda *_:
router.update_feedback(lr=..., weight_decay=...))``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._compat import version
from .._errors import FxnxValueError
from . import feedback as fb
from .nodecall import NodeCall
from .rules import FeedbackAlignment, Rule, _public
from .transport import feedback_weights

__all__ = ["KolenPollack", "WeightMirror"]


class _Learned(FeedbackAlignment):
    """Feedback alignment whose ``B`` (laid out like ``W``, updated in place) learns."""

    # set on the bound copy by bind
    _call: NodeCall
    _updates: int
    _versions: dict[str, int]
    _warned: bool

    def bind(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        bound = super().bind(call, seed, feedback)
        if not isinstance(bound, _Learned):  # a weightless node: routed exactly
            return bound
        weights = feedback_weights(call)
        # its own B (a user's feedback is not written to), laid out like W to be updated in place
        bound._weights = {p: fb.laid_out_like(B.clone(), weights[p]) for p, B in bound._weights.items()}
        bound.feedback = _public(bound._weights)
        bound._call = call
        bound._updates = 0
        bound._versions = {p: version(W) for p, W in weights.items()}
        bound._warned = False
        return bound

    def feedback_for(self, call: NodeCall) -> dict[str, Tensor]:
        if not self._updates and not self._warned and any(
            version(W) != self._versions[p] for p, W in feedback_weights(call).items()
        ):
            self._warned = True
            warnings.warn(
                f"{self.name} at node {call.name!r}: W has changed but B has not learned; call "
                "router.update_feedback(lr=..., weight_decay=...) after each backward pass",
                stacklevel=2,
            )
        return self._weights

    def learn(self, lr: float | None, weight_decay: float) -> None:
        raise NotImplementedError


class KolenPollack(_Learned):
    """Kolen–Pollack learning (Kolen & Pollack, 1994; Akrout et al., 2019): ``B`` receives
    ``W``'s update, with the same weight decay.

    At each :meth:`~fxnx.CreditRouter.update_feedback` call, every ``B`` takes the
    step plain SGD takes on its ``W`` from ``W.grad``, ``B ← B − lr·(∇W + λ·B)``
    (``B`` is laid out like ``W``: this is Akrout et al.'s update of the
    transposed backward matrix). ``W − B`` then shrinks by ``(1 − lr·λ)`` per
    step, so ``B`` comes into line with ``W`` whatever they started from: give
    the optimizer's learning rate and a weight decay above zero.

    Parameters
    ----------
    seed, init, max_bytes
        As for :class:`~fxnx.credit.FeedbackAlignment`: the starting ``B``.
    """

    name = "kolen_pollack"

    def learn(self, lr: float | None, weight_decay: float) -> None:
        assert lr is not None  # checked for every node first (check_learning)
        with torch.no_grad():
            for p, W in feedback_weights(self._call).items():
                if W.grad is None:
                    continue
                B = self._weights[p]
                B.mul_(1 - lr * weight_decay).sub_(W.grad.to(B.dtype), alpha=lr)
        self._updates += 1


def check_learning(learners: Iterable[Rule], lr: float | None) -> None:
    """Refuse an ``update_feedback`` step that Kolen–Pollack cannot take, before any ``B``
    learns: without the optimizer's ``lr``, or where no weight it routes has a gradient (after
    ``opt.zero_grad()``, which sets ``W.grad`` to None, the step would do nothing)."""
    kp = [rule for rule in learners if isinstance(rule, KolenPollack)]
    if not kp:
        return
    node = kp[0]._call.name
    if lr is None:
        raise FxnxValueError(
            f"kolen_pollack at node {node!r}: B takes W's update, so "
            "update_feedback needs the optimizer's lr= (and weight_decay=)"
        )
    if all(W.grad is None for rule in kp for W in feedback_weights(rule._call).values()):
        raise FxnxValueError(
            f"kolen_pollack at node {node!r}: no weight it routes has a gradient (W.grad is None), "
            "so B has no update to take: call update_feedback after loss.backward() and "
            "opt.step(), before opt.zero_grad()"
        )


class WeightMirror(_Learned):
    """Weight mirrors (Akrout et al., 2019): ``B`` learns from its layer's own response to
    noise, with no access to ``W``.

    At each :meth:`~fxnx.CreditRouter.update_feedback` call, the layer (its weight
    only, no bias) is driven by white noise ``ξ`` of variance ``noise²``, ``batch``
    samples, and ``B`` moves towards the correlation of the layer's output ``y`` with
    its input: ``B ← (1 − rate)·B + rate · E[y ξᵀ] / noise²``. Since ``E[y ξᵀ] =
    noise²·W`` for a linear map, ``B`` tends to ``W``. This is Akrout et al.'s mirror
    update ``ΔB = η·y ξᵀ − λ·B`` with ``η = rate / (batch·noise²)`` and ``λ = rate``.
    Each weight is mirrored on its own: a matrix as a linear map, a convolution's
    kernel on noise patches of the kernel's size; so every layer feedback alignment
    reaches (attention projections, functional and exported layers) can mirror.

    Parameters
    ----------
    rate : float
        How far ``B`` moves towards the mirrored estimate per call.
    noise : float
        The standard deviation of the noise.
    batch : int
        Noise samples per call.
    seed, init, max_bytes
        As for :class:`~fxnx.credit.FeedbackAlignment`: the starting ``B`` and the noise's seed.
    """

    name = "weight_mirror"

    _noise: torch.Generator  # set on the bound copy by bind

    def __init__(
        self, rate: float = 0.1, noise: float = 1.0, batch: int = 64, seed: int | None = None, *,
        init: str = "xavier", max_bytes: float | None = fb.MAX_BYTES,
    ) -> None:
        super().__init__(seed, init=init, max_bytes=max_bytes)
        self.rate, self.noise, self.batch = rate, noise, batch

    def bind(self, call: NodeCall, seed: int, feedback: Any = None) -> Rule:
        bound = super().bind(call, seed, feedback)
        if isinstance(bound, WeightMirror):
            bound._noise = fb.generator(self.seed if self.seed is not None else seed, f"{call.name}.mirror")
        return bound

    def get_extra_state(self) -> dict[str, Any]:
        return {"noise": self._noise.get_state()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if "noise" in state:
            self._noise.set_state(state["noise"])

    def learn(self, lr: float | None, weight_decay: float) -> None:
        with torch.no_grad():
            for p, W in feedback_weights(self._call).items():
                B = self._weights[p]
                B.mul_(1 - self.rate).add_(self._mirrored(W.detach()).to(B.dtype), alpha=self.rate / (self.batch * self.noise**2))
        self._updates += 1

    def _mirrored(self, W: Tensor) -> Tensor:
        """``Σ y ξᵀ`` over ``batch`` noise samples ``ξ`` through ``W`` alone: a linear map for a
        matrix; for a convolution's kernel, a convolution over patches the kernel's size
        (one output position each; grouping and dilation do not change ``E[y ξᵀ] = noise²·W``)."""
        shape = (self.batch, *W.shape[1:])
        xi = torch.randn(shape, generator=self._noise, dtype=W.dtype).to(W.device).mul_(self.noise)
        if W.dim() == 2:
            return F.linear(xi, W).T @ xi
        y = (F.conv1d, F.conv2d, F.conv3d)[W.dim() - 3](xi, W)  # (batch, out, 1, ...)
        return torch.einsum("bo,bi...->oi...", y.reshape(self.batch, -1), xi)
