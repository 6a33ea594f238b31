"""What a rule's own arithmetic costs on issue 21's models, against autograd's training step:
a floor under the router's cell for that rule, on models the by-hand floor
(``bench_rule_floor.py``, an MLP) does not cover.

For each model (``bench_router.py``'s), one thread, CPU time, interleaved run by run against
the same training step through the model with autograd, reported as a fraction of that step:

* ``direct_feedback_alignment``: the projections ``e @ B`` the rule makes at every step, one
  matrix product per feedback tensor of the router (``B`` as the router drew it; for a
  convolution's input, ``B`` flattened over its channels and kernel, before the credit is spread
  over space), ``e`` the output credit's shape. Every implementation reads each ``B`` once a
  step: that read is the least the rule adds. Against it stands what the rule does not do: the
  input gradient of each layer it routes (see the profile the note quotes).
* ``brsf``: fresh magnitudes for every weight the rule routes, drawn as fxnx draws them (16
  random bits a value, ``fxnx._credit.feedback.magnitudes``), and ``sign(W)·M`` made from them
  as the router makes it (``fxnx._credit.rules.signed``): the least the rule adds, as it
  defines a new ``B`` at every step; it saves nothing.

Where a fraction passes 0.10 by more than the rule saves, the 1.10 target is out of reach for
that rule on that model, whatever the router does.

Run: ``python scripts/bench_rule_arithmetic.py [--models mobilenet_v3_small bert_base] [--runs N]``.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections.abc import Callable

import torch
from bench import _interleaved  # scripts/ is on sys.path when this script runs
from bench_router import MODELS, _cpu_seconds, _step, build

import fxnx
from fxnx._credit import feedback as fb
from fxnx._credit.rules import _Later, signed


def _direct_projections(router: fxnx.CreditRouter, batch: int, width: int) -> Callable[[], None]:
    """Every ``e @ B`` of one step: ``e`` of ``batch × width`` against each feedback tensor."""
    e = torch.randn(batch, width)
    matrices = [B.reshape(B.shape[0], -1) for B in _all_tensors(router.feedback)]

    def project() -> None:
        for B in matrices:
            e @ B

    return project


def _sign_draws(router: fxnx.CreditRouter) -> Callable[[], None]:
    """brSF's draw and ``sign(W)·M`` for each weight the router routes by sign symmetry, as
    the router makes them (``rules.signed`` of a fresh draw), for a weight of its shape (the
    values do not change the work)."""
    weights = [torch.randn_like(M) for M in _all_tensors(router.feedback)]
    draws = [_Later({"w": functools.partial(fb.magnitudes, "xavier", W.shape, seed=0, key=str(k), like=W,
                                            max_bytes=None)}) for k, W in enumerate(weights)]

    def draw() -> None:
        for W, M in zip(weights, draws, strict=True):
            signed(M, "w", W)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mobilenet_v3_small", "bert_base"], choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=0, help="runs per side (default: bench_router's per model)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print("1 thread, cpu clock; fraction of autograd's training step that the rule's own arithmetic takes")
    for name in args.models:
        model, inputs, loss_of = build(name)
        G = fxnx.convert(model, *inputs)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        base = functools.partial(_step, model, loss_of, opt, inputs)
        runs = args.runs or MODELS[name][1]
        cells = []
        for rule in ("direct_feedback_alignment", "brsf"):
            router = fxnx.CreditRouter(G, model, rule=rule, seed=0)
            try:
                _step(router, loss_of, opt, inputs)  # draws the feedback
            except fxnx.errors.FxnxError:
                cells.append(f"{rule} -")
                continue
            if rule == "brsf":
                work = _sign_draws(router)
            else:
                work = _direct_projections(router, inputs[0].shape[0], _output_width(model, inputs))
            size = sum(t.numel() * t.element_size() for t in _all_tensors(router.feedback))
            ours, theirs = _interleaved(work, base, runs, _cpu_seconds)
            cells.append(f"{rule} {ours / theirs:.2f} ({size / 2**20:.0f} MB of feedback)")
            del router
        print(f"{name}: " + "; ".join(cells), flush=True)


def _all_tensors(held: object) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(held) if isinstance(t, torch.Tensor)]


def _output_width(model: torch.nn.Module, inputs: tuple[object, ...]) -> int:
    """``D``: the model's output flattened per sample, every output tensor together."""
    with torch.no_grad():
        out = model(*inputs)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim()]
    return sum(t[0].numel() for t in leaves)


if __name__ == "__main__":
    main()
