"""What recording costs adds to ``fxnx.convert`` (issue 24), as ratios.

For each model, in one run, interleaved run by run: ``convert`` as it is (FLOPs,
multiply-adds, trainable parameters and kernel windows recorded) against ``convert`` with
the FLOP count switched off, which is ``convert`` before costs: shape propagation without
the counting mode (``fxnx._convert.propagate_and_count`` replaced by torch.fx-style propagation
alone) and no count on meta tensors for make_fx graphs (``fxnx._convert.node_flops``
replaced by a function that counts nothing). The other cost attributes are read from
attributes and arguments convert already has. Target: <= 1.10x.

For context it also times ``convert`` with a dispatch mode that does nothing around the
same propagation: the floor any count made by a dispatch mode (``FlopCounterMode``'s too)
starts from; ``convert`` counts without one wherever it knows the layer or function.

Torch runs on one thread. Each run is timed by the wall clock and by the CPU time of the
process, both printed: on a machine shared with other work the wall clock also measures
the others, the CPU time of one thread much less.

Run: ``python scripts/bench_costs.py [--models resnet50 bert-base] [--level aten] [--runs N]``.
Models are built from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torchvision
from bench import _interleaved  # scripts/ is on sys.path when this script runs

import fxnx
from fxnx import _convert as conversion
from fxnx._capture.shapes import propagate as propagate_shapes
from fxnx._compat import TorchDispatchMode


def _resnet50() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    return torchvision.models.resnet50(weights=None).eval(), (torch.randn(1, 3, 224, 224),)


def _bert_base() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    import transformers

    model = transformers.BertModel(transformers.BertConfig()).eval()  # BERT-base: 12 layers, 768 wide
    return model, (torch.randint(0, 30522, (1, 128)),)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]] = {
    "resnet50": _resnet50,
    "bert-base": _bert_base,
}


def _propagate_uncounted(gm: Any, model: Any, inputs: Any, fake: bool) -> dict[str, Any]:
    propagate_shapes(gm, model, inputs, fake)
    return {}


def _count_nothing(gm: Any, inputs: Any = None) -> dict[str, Any]:
    return {}


class _Nothing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _propagate_in_empty_mode(gm: Any, model: Any, inputs: Any, fake: bool) -> dict[str, Any]:
    with _Nothing():
        propagate_shapes(gm, model, inputs, fake)
    return {}


class _Clocks:
    """Times one run by the wall clock (what it returns) and keeps its CPU time by side."""

    def __init__(self) -> None:
        self.cpu: dict[Callable[[], None], list[float]] = {}

    def __call__(self, fn: Callable[[], None]) -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        self.cpu.setdefault(fn, []).append(time.process_time() - cpu)
        return time.perf_counter() - wall

    def cpu_times(self, fn: Callable[[], None]) -> list[float]:
        return self.cpu[fn]  # the timed runs (the warm-up runs are not timed)


def _ratios(candidate: Callable[[], None], baseline: Callable[[], None], runs: int) -> str:
    """The ratios of the medians by each clock, and of the fastest runs by CPU time (what
    other work on the machine adds to a run, it adds: the fastest run has the least of it)."""
    clocks = _Clocks()
    ours, base = _interleaved(candidate, baseline, runs, clocks)
    ours_cpu, base_cpu = clocks.cpu_times(candidate), clocks.cpu_times(baseline)
    median_ours, median_base = statistics.median(ours_cpu), statistics.median(base_cpu)
    return (f"{ours / base:.3f}x wall ({ours * 1e3:.1f} vs {base * 1e3:.1f} ms), "
            f"{median_ours / median_base:.3f}x CPU ({median_ours * 1e3:.1f} vs "
            f"{median_base * 1e3:.1f} ms), fastest {min(ours_cpu) / min(base_cpu):.3f}x CPU")


def bench(name: str, runs: int, level: str) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()

    def with_costs() -> None:
        fxnx.convert(model, *inputs, level=level)

    def without_costs() -> None:
        with mock.patch.object(conversion, "propagate_and_count", _propagate_uncounted), \
                mock.patch.object(conversion, "node_flops", _count_nothing):
            fxnx.convert(model, *inputs, level=level)

    def empty_mode() -> None:
        with mock.patch.object(conversion, "propagate_and_count", _propagate_in_empty_mode), \
                mock.patch.object(conversion, "node_flops", _count_nothing):
            fxnx.convert(model, *inputs, level=level)

    G = fxnx.convert(model, *inputs, level=level)
    print(f"convert({name}, level={level!r}): {G.number_of_nodes()} nodes, {G.graph['capture']}, "
          f"{G.graph['flops']:,} FLOPs; medians of {runs} interleaved runs, 1 thread")
    print(f"  with costs / without (target <= 1.10x): {_ratios(with_costs, without_costs, runs)}")
    if level == "module":
        print(f"  an empty dispatch mode around the propagation / without: "
              f"{_ratios(empty_mode, without_costs, runs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--level", choices=["module", "aten"], default="module",
                        help="module (the default): counted while shapes propagate; aten: "
                             "make_fx graphs, counted on meta tensors")
    parser.add_argument("--runs", type=int, default=21, help="timed runs of each side (default 21)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        bench(name, args.runs, args.level)


if __name__ == "__main__":
    main()
