"""Two processes, gloo on 127.0.0.1: DistributedDataParallel(CreditRouter) against the mean of
each rank's routed credit computed without DDP. Run by tests/test_router_autograd.py.

    python tests/ddp_router.py PRESET PORT OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxnx


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _data(rank):
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(6, 5, generator=gen, dtype=torch.float64), torch.randn(6, 3, generator=gen, dtype=torch.float64)


def worker(rank: int, preset: str, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model()
        x, e = _data(rank)
        G = fxnx.convert(model, x)
        router = fxnx.CreditRouter(G, model, rule=preset, seed=1)
        ddp = nn.parallel.DistributedDataParallel(router)
        (ddp(x) * e).sum().backward()
        # The oracle, without DDP: each rank's routed credit on its own data, then the mean.
        fb = router.feedback
        parts = [fxnx.route_credit(G, _model(), *(_data(r)[:1]), output_credit=_data(r)[1],
                                   rule=preset, seed=1, feedback=fb) for r in range(2)]
        worst, checked, differs = 0.0, 0, False
        for name, p in model.named_parameters():
            mean = (parts[0].param_credit[name] + parts[1].param_credit[name]) / 2
            worst = max(worst, float((p.grad - mean).norm() / mean.norm()))
            differs |= not torch.allclose(p.grad, parts[rank].param_credit[name])
            checked += 1
        torch.save({"max_rel_error": worst, "checked": checked, "differs_from_own": differs},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    preset, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(worker, args=(preset, port, out), nprocs=2, join=True)
