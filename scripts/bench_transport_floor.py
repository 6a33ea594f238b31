"""How cheap can feedback alignment be in PyTorch without C++? A floor for issue 21's small MLP.

On a 100-layer MLP (width 128, batch 1), one thread, each training step (zero_grad, forward,
cross-entropy, ``loss.backward()``, SGD step) is timed against the same step through the
model with autograd, interleaved run by run, and reported as the ratio of the medians:

* ``router``: ``fxnx.CreditRouter(G, model, rule="feedback_alignment")``;
* ``hooked``: feedback alignment written by hand at its cheapest that I know of: the layers
  called as ``F.linear`` (no module frames, which the baseline pays) and ``B`` put into the
  one tensor each layer's backward saves from ``W`` by a hook on that saved tensor, one
  Python call in each pass per layer (``B`` fixed, its transposed view made once);
* ``hooked_W``: the same hooks handing back ``W`` itself: the hooks' cost alone, without
  reading a second matrix in the backward pass;
* ``function``: feedback alignment as a ``torch.autograd.Function`` per layer whose backward
  computes ``credit @ B``, ``credit.T @ x`` and the bias's sum (BioTorch's way);
* ``plain``: the ``F.linear`` loop with autograd, no rule: what leaving out the module
  frames alone saves.

The hand-written sides are the floor the router's per-layer work can approach, not its
rival: they know the model is a chain of ``nn.Linear`` and hold nothing but ``B``.

Run: ``python scripts/bench_transport_floor.py [--runs N] [--width 128] [--depth 100]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from bench import _interleaved  # scripts/ is on sys.path when this script runs
from torch import nn

import fxnx


def _model(depth: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).train()


class _Chain(nn.Module):
    """The model's linear layers as ``step(x, layer, feedback)`` each, ReLU between them
    as ``F.relu`` (no module frames)."""

    def __init__(self, linears: list[nn.Linear], feedback: list[Any], step: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.linears, self.feedback, self.step = linears, feedback, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.linears) - 1
        for i, (layer, B) in enumerate(zip(self.linears, self.feedback, strict=True)):
            x = self.step(x, layer, B)
            x = F.relu(x) if i < last else x
        return x


def _hooked(x: torch.Tensor, layer: nn.Linear, packed: tuple[torch.Tensor]) -> torch.Tensor:
    """F.linear, then ``packed`` (B.T's view: what addmm saves from W is W.T) put into the
    saved W.T by a hook on that saved tensor."""
    out = F.linear(x, layer.weight, layer.bias)
    if x.requires_grad:  # only then does addmm save W.T (for the input's credit)
        out.grad_fn._raw_saved_mat2.register_hooks(lambda _: packed, _first)
    return out


def _first(packed: tuple[torch.Tensor]) -> torch.Tensor:
    return packed[0]


class _FA(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, B: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, B)
        return F.linear(x, W, b)

    @staticmethod
    def backward(ctx: Any, credit: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        x, B = ctx.saved_tensors
        return credit @ B, credit.t() @ x, credit.sum(0), None


def _function(x: torch.Tensor, layer: nn.Linear, B: torch.Tensor) -> torch.Tensor:
    return _FA.apply(x, layer.weight, layer.bias, B)


def _plain(x: torch.Tensor, layer: nn.Linear, _: Any) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _same_credit(model: nn.Module, sides: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
    """The router and the hand-written feedback alignment give the same gradients (float32
    rounding apart): the floor measures the same rule."""
    grads = {}
    for name in ("router", "hooked", "function"):
        model.zero_grad()
        F.cross_entropy(sides[name](x), y).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for name in ("hooked", "function"):
        for got, want in zip(grads[name], grads["router"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    model.zero_grad()


def stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[Callable[[torch.Tensor], torch.Tensor]], Callable[[], None]]:
    """``step(run)``: one training step (zero_grad, ``run(x)``, cross-entropy, backward, SGD)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()
        return go

    return step


def cpu_seconds(fn: Callable[[], Any]) -> float:
    """The CPU time ``fn()`` takes (one thread: its own work, whatever else the machine runs)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(args.depth, args.width)
    x, y = torch.randn(1, args.width), torch.tensor([3])
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment", seed=0)
    router(x)  # draws B
    linears = [m for m in model if isinstance(m, nn.Linear)]
    feedback = [router.feedback[f"_{i}"] for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    sides: dict[str, nn.Module] = {
        "router": router,
        "hooked": _Chain(linears, [(B.t(),) for B in feedback], _hooked),
        "hooked_W": _Chain(linears, [(layer.weight.detach().t(),) for layer in linears], _hooked),
        "function": _Chain(linears, feedback, _function),
        "plain": _Chain(linears, feedback, _plain),
    }
    _same_credit(model, sides, x, y)
    step = stepper(model, x, y)
    print(f"{args.depth} layers of width {args.width}, batch 1, one thread, {args.runs} runs a side; "
          "a step's CPU time as a ratio of autograd's on the model")
    for name, side in sides.items():
        ours, base = _interleaved(step(side), step(model), args.runs, cpu_seconds)
        print(f"  {name:<10} {ours / base:5.2f}   ({ours * 1e3:.2f} ms against {base * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
