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
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torchvision
from torch.fx.passes.shape_prop import ShapeProp

import fxnx


def _interleaved(
    candidate: Callable[[], Any], baseline: Callable[[], Any], runs: int,
    seconds: Callable[[Callable[[], Any]], float] | None = None,
) -> tuple[float, float]:
    """Median seconds of each, alternating which goes first; one warm-up run of each.

    ``seconds(fn)`` times one run (by default the wall clock around it; a side that
    runs in another process reports its own time).
    """
    seconds = seconds or _timed
    candidate(), baseline()
    times_c, times_b = [], []
    for i in range(runs):
        pair = [(candidate, times_c), (baseline, times_b)]
        for fn, out in pair if i % 2 == 0 else pair[::-1]:
            out.append(seconds(fn))
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


def bench_train(runs: int) -> None:
    """A ResNet-50 training step (batch 8, SGD): CreditRouter against autograd. Target ≤ 1.1×.

    Exact rule: router forward + loss + router.backward + step against model
    forward + loss.backward + step; then feedback alignment against exact, both
    with the router. Each pair is one interleaved run.
    """
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).train()
    x, y = torch.randn(8, 3, 224, 224), torch.randint(0, 1000, (8,))
    G = fxnx.convert(model, x)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    exact = fxnx.CreditRouter(G, model)
    fa = fxnx.CreditRouter(G, model, rule="feedback_alignment")

    def step(forward: Callable[..., torch.Tensor], backward: Callable[[torch.Tensor], object]) -> None:
        opt.zero_grad()
        backward(torch.nn.functional.cross_entropy(forward(x), y))
        opt.step()

    ours, base = _interleaved(
        lambda: step(exact, exact.backward), lambda: step(model, torch.Tensor.backward), runs
    )
    print(
        f"train step resnet50 8x3x224x224, exact: router {ours / base:.2f}x of autograd "
        f"(median of {runs}: {ours:.2f} s vs {base:.2f} s; target <= 1.1x)", flush=True
    )
    t_fa, t_exact = _interleaved(
        lambda: step(fa, fa.backward), lambda: step(exact, exact.backward), runs
    )
    print(
        f"train step resnet50 8x3x224x224, feedback_alignment: {t_fa / t_exact:.2f}x of exact "
        f"with the router (median of {runs}: {t_fa:.2f} s vs {t_exact:.2f} s)"
    )


#: The drawing zoo: (library, model name), built without weights at 1x3x224x224.
DRAW_ZOO = [
    ("torchvision", "resnet50"), ("torchvision", "densenet121"), ("timm", "vit_tiny_patch16_224"),
    ("timm", "repvgg_a0"), ("timm", "densenet121"), ("timm", "convnext_tiny"),
    ("timm", "efficientnet_b0"), ("timm", "swin_tiny_patch4_window7_224"),
]
#: torchview's Graphviz run is stopped here (on DenseNet it runs for many minutes).
TORCHVIEW_CAP = 120.0


def bench_draw(runs: int) -> None:
    """convert + PNG at default options against torchview at full depth + PNG, on a model zoo.

    Target: at most half of torchview's time on every model, never more. Each
    side runs ``runs`` times, interleaved, median reported; torchview's dot run
    is capped at two minutes (then measured once, reported as a lower bound).
    convert and drawing are also timed apart, to show where fxnx's time goes.
    """
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp())
    runs = max(3, runs // 2)
    ratios = {f"{lib} {name}": _draw_one(lib, name, runs, out) for lib, name in DRAW_ZOO}
    measured = {k: r for k, (r, capped) in ratios.items() if not capped}
    worst = max(measured, key=measured.__getitem__)
    print(f"worst ratio: {measured[worst]:.2f}x ({worst}); target <= 0.5x, never above 1x")


def _draw_one(lib: str, name: str, runs: int, out: Path) -> tuple[float, bool]:
    """One model of the drawing zoo: print its line, return (ratio, torchview capped).

    Each side runs in a process of its own, kept for all its runs: torchview leaves
    objects behind that make the garbage collector, and so any later code in the same
    process, slower (fxnx's convert ran 10x slower after torchview on DenseNet).
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    sides = {}
    for side in ("ours", "torchview"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_draw_worker, args=(child, side, lib, name, str(out)), daemon=True)
        proc.start()
        sides[side] = (parent, proc)

    def run(side: str) -> Callable[[], float]:
        def remote() -> float:
            conn = sides[side][0]
            conn.send("run")
            return conn.recv()
        return remote

    try:
        view, capped = run("torchview")()
        if capped:  # one capped run is enough: its time is a lower bound
            t_view = view
            t_ours = statistics.median(run("ours")()[0] for _ in range(runs))
        else:
            t_ours, t_view = _interleaved(run("ours"), run("torchview"), runs,
                                          seconds=lambda fn: fn()[0])
        conn = sides["ours"][0]
        conn.send("parts")
        nodes, depth, t_convert, t_draw = conn.recv()
    finally:
        for conn, proc in sides.values():
            conn.send("stop")
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    ratio = t_ours / t_view
    print(
        f"draw {lib} {name} ({nodes} nodes, PNG at depth {depth}): "
        f"{'<' if capped else ''}{ratio:.2f}x of torchview (median of {runs}: {t_ours:.2f} s vs "
        f"{'>' if capped else ''}{t_view:.2f} s; convert {t_convert:.2f} s, draw {t_draw:.2f} s)",
        flush=True,
    )
    return ratio, capped


def _draw_worker(conn, side: str, lib: str, name: str, out: str) -> None:
    """A process that builds one model and times one side of the drawing benchmark on request."""
    import subprocess
    import warnings

    import timm

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    if lib == "timm":
        model = timm.create_model(name, pretrained=False).eval()
    else:
        model = torchvision.models.get_model(name, weights=None).eval()
    x = torch.randn(1, 3, 224, 224)
    folder = Path(out)

    def ours() -> bool:
        fxnx.draw(fxnx.convert(model, x), folder / "fxnx.png")
        return False

    def torchview() -> bool:
        from torchview import draw_graph

        graph = draw_graph(model, input_size=(1, 3, 224, 224), depth=10**6, device="cpu",
                           directory=out)
        try:
            subprocess.run(["dot", "-Tpng", "-o", str(folder / "torchview.png")], check=True,
                           input=graph.visual_graph.source.encode(), capture_output=True,
                           timeout=TORCHVIEW_CAP)
        except subprocess.TimeoutExpired:
            return True
        return False

    fn = ours if side == "ours" else torchview
    while (message := conn.recv()) != "stop":
        if message == "run":
            start = time.perf_counter()
            capped = fn()
            conn.send((time.perf_counter() - start, capped))
        else:  # "parts": convert and drawing timed apart, and the depth drawn
            t_convert = statistics.median(_timed(lambda: fxnx.convert(model, x)) for _ in range(3))
            G = fxnx.convert(model, x)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t_draw = _timed(lambda G=G: fxnx.draw(G, folder / "fxnx.png"))
            depth = next((str(w.message).split("below depth ")[1].split(".")[0] for w in caught
                          if "below depth" in str(w.message)), "full")
            conn.send((G.number_of_nodes(), depth, t_convert, t_draw))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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


_META_DECODER = """
import sys, time
import torch
from torch import nn
import fxnx

class Block(nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.gate, self.up, self.down = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

class Decoder(nn.Module):
    def __init__(self, vocab=32000, d=4096, heads=32, hidden=11008, layers=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        n = tokens.size(1)
        mask = torch.full((n, n), float("-inf"), device=tokens.device).triu(1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

start = time.perf_counter()
with torch.device("meta"):
    model = Decoder()
G = fxnx.convert(model, torch.zeros(1, 2048, dtype=torch.long, device="meta"))
wall = time.perf_counter() - start
# VmHWM is this process's own peak; ru_maxrss would carry over the forking parent's peak.
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(G.graph["num_params"], G.number_of_nodes(), wall, int(hwm.split()[1]) / 1024)
"""


def bench_meta(runs: int) -> None:
    """A ~7B-parameter decoder on the meta device: wall time and peak memory of a fresh process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _META_DECODER], capture_output=True, text=True,
                          check=True)
    params, nodes, wall, peak = done.stdout.split()
    print(
        f"convert a {int(params) / 1e9:.2f}B-parameter decoder on the meta device ({nodes} nodes, "
        f"sequence 2048): {float(wall):.1f} s including building it, peak memory of the whole "
        f"process {float(peak):.0f} MiB (targets: under a minute, under 2 GB)"
    )


class _Stack(torch.nn.Module):
    """A family of models of any size: residual MLP blocks, 6 nodes each."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
            for _ in range(blocks)
        )
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        for block in self.blocks:
            x = self.norm(x + block(x))
        return x


def bench_scale(runs: int) -> None:
    """Conversion of a 10,000-node model against a 1,000-node one of the same family: ≤ 12×."""
    x = torch.randn(4, 16)
    small, large = _Stack(200), _Stack(2000)
    n_small = fxnx.convert(small, x).number_of_nodes()
    n_large = fxnx.convert(large, x).number_of_nodes()
    t_large, t_small = _interleaved(
        lambda: fxnx.convert(large, x), lambda: fxnx.convert(small, x), max(3, runs // 2)
    )
    print(
        f"convert {n_large} nodes vs {n_small} nodes: {t_large / t_small:.1f}x "
        f"({t_large:.2f} s vs {t_small:.2f} s; target <= 12x, linear is 10x)"
    )


BENCHMARKS = {
    "convert": bench_convert,
    "credit": bench_credit,
    "draw": bench_draw,
    "files": bench_files,
    "meta": bench_meta,
    "scale": bench_scale,
    "train": bench_train,
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
