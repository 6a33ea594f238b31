"""Each rule's own arithmetic at its cheapest on issue 21's small MLP: the floor under the
router's cells for that model.

On a 100-layer MLP (width 128, batch 1), one thread, a training step (zero_grad, forward,
cross-entropy, ``loss.backward()``, SGD step) is timed against the same step through the model
with autograd, interleaved run by run, and reported as the ratio of the medians, for each rule:

* ``router``: ``fxnx.CreditRouter(G, model, rule=...)``;
* ``by hand``: the rule written as one ``torch.autograd.Function`` per layer whose backward does
  the rule's arithmetic and nothing else, the layers called as ``F.linear`` and the ReLUs as
  ``F.relu`` (no module frames, which the baseline pays): feedback alignment's ``credit @ B``;
  sign symmetry's ``sign(W)·M`` made from the weight at every step, as the rule defines it
  (uSF, M the Xavier standard deviation; frSF, M fixed; brSF, M drawn afresh at every step, 16
  random bits a value as fxnx draws it); direct feedback alignment's ``e @ B`` from the output's
  credit, kept by a hook on the output.

Before any timing, each hand-written rule but brSF (whose draws are its own) is checked to give
the router's gradients with the router's feedback weights: the floor measures the same rule.
Where ``by hand`` is above a target, the rule's arithmetic alone exceeds it on this model.

Run: ``python scripts/bench_rule_floor.py [--runs N] [--width 128] [--depth 100] [--rules ...]``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from bench import _interleaved  # scripts/ is on sys.path when this script runs
from bench_transport_floor import _model, cpu_seconds, stepper
from torch import nn

import fxnx

RULES = ["feedback_alignment", "usf", "frsf", "brsf", "direct_feedback_alignment"]


class _Transport(torch.autograd.Function):
    """``F.linear``; the input's credit ``credit @ make(W)`` (``B`` itself, or ``sign(W)·M``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, W)
        ctx.make = make
        return F.linear(x, W, b)

    @staticmethod
    def backward(ctx: Any, credit: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, W = ctx.saved_tensors
        return credit @ ctx.make(W), credit.t() @ x, credit.sum(0), None


class _Direct(torch.autograd.Function):
    """``F.linear``; the input's credit ``e @ B``, ``e`` the output's credit (``slot["e"]``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, B: torch.Tensor, slot: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, B)
        ctx.slot = slot
        return F.linear(x, W, b)

    @staticmethod
    def backward(ctx: Any, credit: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, B = ctx.saved_tensors
        return ctx.slot["e"] @ B, credit.t() @ x, credit.sum(0), None, None


def _drawn(a: float, generator: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """brSF's ``sign(W)·M`` with ``M`` uniform on ``(0, a)``, 16 random bits a value, drawn at each call."""
    def make(W: torch.Tensor) -> torch.Tensor:
        n = W.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None, generator=generator)
        M = words.view(torch.int16)[:n].view(W.shape).to(torch.float32).add_(32768.5).mul_(a / 65536)
        return M.copysign_(W)
    return make


def by_hand(rule: str, router: fxnx.CreditRouter, model: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's forward with ``rule`` written by hand at every linear layer, with the
    router's feedback weights (drawn by its first step)."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    slot: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)

    def xavier(W: torch.Tensor) -> float:
        return math.sqrt(2.0 / (W.shape[0] + W.shape[1]))

    feedback = [router.feedback.get(f"_{i}") for i, m in enumerate(model) if isinstance(m, nn.Linear)]  # None: DFA's first layer
    if rule == "direct_feedback_alignment":
        steps = [lambda x, m=m, B=B: _Direct.apply(x, m.weight, m.bias, B, slot) if B is not None
                 else F.linear(x, m.weight, m.bias) for m, B in zip(linears, feedback, strict=True)]
    else:
        scales = [xavier(lin.weight) for lin in linears]
        if rule == "feedback_alignment":
            makers = [lambda _, B=B: B for B in feedback]
        elif rule == "usf":
            makers = [lambda W, m=m: torch.sign(W).mul_(m) for m in scales]
        elif rule == "frsf":
            makers = [lambda W, M=M: torch.sign(W).mul_(M) for M in feedback]
        else:  # brsf: Xavier's uniform bound
            makers = [_drawn(m * math.sqrt(3.0), generator) for m in scales]
        steps = [lambda x, m=m, make=make: _Transport.apply(x, m.weight, m.bias, make) for m, make in zip(linears, makers, strict=True)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        last = len(steps) - 1
        for i, step in enumerate(steps):
            x = step(x)
            x = F.relu(x) if i < last else x
        if rule == "direct_feedback_alignment":
            x.register_hook(lambda g: slot.__setitem__("e", g))
        return x

    return forward


def _same_credit(model: nn.Module, rule: str, router: Callable[..., Any], hand: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> None:
    grads = []
    for run in (router, hand):
        model.zero_grad()
        F.cross_entropy(run(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{rule}: {m}")
    model.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--rules", nargs="*", default=RULES, choices=RULES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(args.depth, args.width)
    x, y = torch.randn(1, args.width), torch.tensor([3])
    G = fxnx.convert(model, x)
    step = stepper(model, x, y)

    print(f"{args.depth} layers of width {args.width}, batch 1, one thread, {args.runs} runs a side; "
          "a step's CPU time as a ratio of autograd's on the model")
    print(f"  {'rule':<28} {'router':>7} {'by hand':>8}")
    for rule in args.rules:
        router = fxnx.CreditRouter(G, model, rule=rule, seed=0)
        F.cross_entropy(router(x), y).backward()  # draws the feedback
        hand = by_hand(rule, router, model)
        if rule != "brsf":
            _same_credit(model, rule, router, hand, x, y)
        ratios = []
        for side in (router, hand):
            ours, base = _interleaved(step(side), step(model), args.runs, cpu_seconds)
            ratios.append(ours / base)
        print(f"  {rule:<28} {ratios[0]:7.2f} {ratios[1]:8.2f}", flush=True)


if __name__ == "__main__":
    main()
