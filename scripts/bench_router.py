"""Training with a CreditRouter against training with autograd (issue 21), as ratios.

For each model, in one run, one thread, interleaved run by run against the baseline:

* a training step (zero_grad, forward, loss, ``loss.backward()``, SGD step) through
  ``CreditRouter`` for every preset, against the same step through the model with autograd
  (targets: <= 1.05x for ``exact``, <= 1.10x for every other preset);
* ``route_credit`` after its first call against autograd's forward and backward with
  credit at the input (target <= 1.10x);
* a step's peak memory above what the process held before it (the resident set's high-water
  mark, reset before each step; each side in a process of its own, large blocks given back to
  the system at once), against autograd's (target <= 1.10x).

Run: ``python scripts/bench_router.py [--models mlp100 mobilenet_v3_small ...] [--runs N]``.
Models are built from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench import _interleaved  # scripts/ is on sys.path when this script runs
from torch import nn

import fxnx

PRESETS = ["exact", "feedback_alignment", "usf", "brsf", "frsf", "direct_feedback_alignment", "kolen_pollack", "weight_mirror"]
#: model name -> (batch, runs by default)
MODELS = {
    "mlp100": (1, 40), "mobilenet_v3_small": (4, 12), "resnet18": (8, 6), "resnet50": (8, 3),
    "vit_b_16": (2, 3), "bert_base": (2, 3),
}


def build(name: str) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    """The model (train mode, random weights), its example input and a loss of its output."""
    torch.manual_seed(0)
    batch = MODELS[name][0]
    if name == "mlp100":
        layers: list[nn.Module] = []
        for _ in range(100):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(128, 10))
        return model.train(), (torch.randn(batch, 128),), _classes(batch, 10)
    if name == "bert_base":
        import transformers

        config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertModel(config).train()
        ids = torch.randint(0, config.vocab_size, (batch, 128))
        return model, (ids,), lambda out: out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).train()
    return model, (torch.randn(batch, 3, 224, 224),), _classes(batch, 1000)


def _classes(batch: int, n: int) -> Callable[[Any], torch.Tensor]:
    y = torch.randint(0, n, (batch,), generator=torch.Generator().manual_seed(1))
    return lambda out: nn.functional.cross_entropy(out, y)


def _step(forward: Callable[..., Any], loss_of: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer, inputs: tuple[Any, ...]) -> None:
    opt.zero_grad(set_to_none=True)
    loss_of(forward(*inputs)).backward()
    opt.step()


def _sides(name: str) -> dict[str, Callable[[], None]]:
    """'autograd', each preset and 'route_credit' vs 'autograd_credit': one step each."""
    model, inputs, loss_of = build(name)
    G = fxnx.convert(model, *inputs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    sides = {"autograd": lambda: _step(model, loss_of, opt, inputs)}
    for preset in PRESETS:
        router = fxnx.CreditRouter(G, model, rule=preset)
        sides[preset] = lambda router=router: _step(router, loss_of, opt, inputs)
    params = [p for p in model.parameters() if p.requires_grad]

    def autograd_credit() -> None:
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = model(*leaves)
        flat = [t for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point()]
        wrt = [x for x in leaves if x.requires_grad] + params
        torch.autograd.grad(flat, wrt, [torch.ones_like(t) for t in flat], allow_unused=True)

    sides["autograd_credit"] = autograd_credit
    sides["route_credit"] = lambda: fxnx.route_credit(G, model, *inputs)
    return sides


def times(name: str, runs: int) -> dict[str, float]:
    sides = _sides(name)
    ratios = {}
    for preset in PRESETS:
        ours, base = _interleaved(sides[preset], sides["autograd"], runs)
        ratios[preset] = ours / base
        ratios["step_seconds"] = base
    ours, base = _interleaved(sides["route_credit"], sides["autograd_credit"], runs)
    ratios["route_credit"] = ours / base
    return ratios


def peak(name: str, side: str) -> int:
    """Bytes a step adds to the resident set at its peak (run in a process of its own)."""
    sides = _sides(name)
    step = sides[side]
    step()  # warm-up: captures, plans, feedback weights, optimizer state
    step()
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    step()
    return _rss("VmHWM") - before


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def peaks(name: str) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    got = {}
    for side in ["autograd", *PRESETS]:
        done = subprocess.run(
            [sys.executable, __file__, "--peak", name, side], capture_output=True, text=True, env=env,
            check=True,
        )
        got[side] = json.loads(done.stdout.strip().splitlines()[-1])
    return {side: got[side] / got["autograd"] for side in PRESETS} | {"autograd_bytes": got["autograd"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=0, help="runs per side (default: per model)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--peak", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.peak:
        print(json.dumps(peak(*args.peak)))
        return
    print(f"torch {torch.__version__}, 1 thread; step = zero_grad + forward + loss + backward + SGD step")
    head = " ".join(f"{p[:8]:>8}" for p in PRESETS)
    print(f"{'model':<20} {'step':>7}  time ratio per preset: {head} | route_credit")
    rows = {}
    for name in args.models:
        r = times(name, args.runs or MODELS[name][1])
        rows[name] = r
        cells = " ".join(f"{r[p]:8.2f}" for p in PRESETS)
        print(f"{name:<20} {r['step_seconds']:6.3f}s  {'':22}{cells} | {r['route_credit']:8.2f}", flush=True)
    if args.no_memory:
        return
    print(f"\n{'model':<20} {'autograd':>9}  peak memory ratio per preset: {head}")
    for name in args.models:
        m = peaks(name)
        cells = " ".join(f"{m[p]:8.2f}" for p in PRESETS)
        print(f"{name:<20} {m['autograd_bytes'] / 2**20:7.0f}MB  {'':29}{cells}", flush=True)


if __name__ == "__main__":
    main()
