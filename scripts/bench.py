"""Benchmarks: fxnx against a baseline measured in the same run, reported as ratios.

    python scripts/bench.py                 # every benchmark
    python scripts/bench.py convert --runs 9

Each benchmark interleaves the candidate and its baseline run by run, so the
machine's drift hits both alike, and reports the ratio of the medians.
Absolute times are printed for context only: on shared machines they mean little.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.fx as fx
import torchvision
from torch.fx.passes.shape_prop import ShapeProp

import fxnx


def _interleaved(
    candidate: Callable[[], object], baseline: Callable[[], object], runs: int
) -> tuple[float, float]:
    """Median seconds of each, alternating which goes first; one warm-up run of each."""
    candidate(), baseline()
    times_c, times_b = [], []
    for i in range(runs):
        pair = [(candidate, times_c), (baseline, times_b)]
        for fn, out in pair if i % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times_c), statistics.median(times_b)


def bench_convert(runs: int) -> None:
    """fxnx.convert(resnet50, x) against bare symbolic_trace + ShapeProp. Target ≤ 1.3×."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(1, 3, 224, 224)

    def baseline() -> None:
        gm = fx.symbolic_trace(model)
        ShapeProp(gm).propagate(x)

    ours, base = _interleaved(lambda: fxnx.convert(model, x), baseline, runs)
    print(
        f"convert(resnet50, 1x3x224x224): {ours / base:.2f}x of symbolic_trace + ShapeProp "
        f"(median of {runs}: {ours * 1e3:.0f} ms vs {base * 1e3:.0f} ms; target <= 1.3x)"
    )


def bench_credit(runs: int) -> None:
    """route_credit(resnet50, batch 8, exact) against autograd forward + backward. Target ≤ 1.3×."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(8, 3, 224, 224)
    G = fxnx.convert(model, x)
    params = [p for p in model.parameters() if p.requires_grad]

    def baseline() -> None:
        leaf = x.detach().requires_grad_()
        torch.autograd.grad(model(leaf).sum(), [leaf, *params])

    ours, base = _interleaved(lambda: fxnx.route_credit(G, model, x), baseline, runs)
    print(
        f"route_credit(resnet50, 8x3x224x224, exact): {ours / base:.2f}x of autograd forward + "
        f"backward (median of {runs}: {ours:.2f} s vs {base:.2f} s; target <= 1.3x)"
    )


def bench_draw(runs: int) -> None:
    """ResNet-50 to PNG, end to end from the model: fxnx against torchview and FxGraphDrawer."""
    import tempfile
    from pathlib import Path

    from torch.fx.passes.graph_drawer import FxGraphDrawer
    from torchview import draw_graph

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    x = torch.randn(1, 3, 224, 224)
    out = Path(tempfile.mkdtemp())

    def ours() -> None:
        fxnx.draw(fxnx.convert(model, x), out / "fxnx.png")

    def torchview() -> None:
        graph = draw_graph(model, input_size=(1, 3, 224, 224), directory=str(out), device="cpu")
        graph.visual_graph.render(filename="torchview", directory=str(out), format="png")

    def fx_drawer() -> None:
        gm = fx.symbolic_trace(model)
        FxGraphDrawer(gm, "resnet50").get_dot_graph().write_png(str(out / "fx.png"))

    runs = max(3, runs // 2)
    t_ours, t_view = _interleaved(ours, torchview, runs)
    _, t_fx = _interleaved(ours, fx_drawer, runs)
    print(
        f"draw(resnet50) to PNG: {t_ours / t_view:.2f}x of torchview, {t_ours / t_fx:.2f}x of "
        f"FxGraphDrawer (median of {runs}: {t_ours:.2f} s, {t_view:.2f} s, {t_fx:.2f} s; "
        "target: faster than both)"
    )


_READ_WITHOUT_TORCH = """
import sys, time, statistics, pickle
sys.modules["torch"] = None  # importing torch now fails
import fxnx
def median(fn):
    fn()
    times = []
    for _ in range({runs}):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return statistics.median(times)
ours = median(lambda: fxnx.read_pickle({pkl!r}))
plain = median(lambda: pickle.load(open({pkl!r}, "rb")))
js = median(lambda: fxnx.read_json({json!r}))
print(ours, plain, js)
"""


def bench_files(runs: int) -> None:
    """Reading the ResNet-152 graph without torch: target < 50 ms; pickle and JSON sizes."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    G = fxnx.convert(torchvision.models.resnet152(weights=None).eval(), torch.randn(1, 3, 224, 224))
    out = Path(tempfile.mkdtemp())
    pkl, js = out / "resnet152.pkl", out / "resnet152.json"
    fxnx.write_pickle(G, pkl)
    fxnx.write_json(G, js)
    code = _READ_WITHOUT_TORCH.format(runs=runs, pkl=str(pkl), json=str(js))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ours, plain, js_time = map(float, done.stdout.split())
    print(
        f"read ResNet-152 graph ({G.number_of_nodes()} nodes) without torch: read_pickle "
        f"{ours * 1e3:.1f} ms (target < 50 ms; {ours / plain:.2f}x of plain pickle.load), "
        f"read_json {js_time * 1e3:.1f} ms ({js_time / ours:.1f}x of read_pickle); files: "
        f"pickle {pkl.stat().st_size / 1024:.0f} KiB, JSON {js.stat().st_size / 1024:.0f} KiB"
    )


BENCHMARKS = {
    "convert": bench_convert,
    "credit": bench_credit,
    "draw": bench_draw,
    "files": bench_files,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each side (default 7)")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    for name in args.names or BENCHMARKS:
        BENCHMARKS[name](args.runs)


if __name__ == "__main__":
    main()
