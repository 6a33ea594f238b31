"""Training with a CreditRouter against training with autograd (issue 21), as ratios.

For each model, in one run, one thread, interleaved run by run against the baseline:

* a training step (zero_grad, forward, loss, ``loss.backward()``, SGD step) through
  ``CreditRouter`` for every preset, against the same step through the model with autograd
  (targets: <= 1.05x for ``exact``, <= 1.10x for every other preset);
* ``route_credit`` after its first call against autograd's forward and backward with
  credit at the input (target <= 1.10x), and against autograd giving what ``route_credit``
  gives, the gradient at every node's value (the model traced by torch.fx, or exported by
  torch.export, and run as a ``GraphModule`` that also returns each node's value).
  Holding every node's credit at once costs memory that the first baseline never holds: on
  this machine the C allocator hands it back to the system after each call and takes fresh
  pages on the next, page faults the first baseline never pays;
* a step's peak memory: the most bytes of tensors it holds at once above what was allocated
  before it, gradients included (the running sum of what each operation allocates and frees,
  from torch's profiler), against autograd's (target <= 1.10x); ``--memory rss`` measures it
  instead by the process's resident memory (Linux), for models whose profile does not fit in
  memory (ResNet-50, ViT-B/16, BERT-base).

Times are the process's CPU time (``time.process_time``) by default: with one thread, that is
the step's own work, which other processes on a shared machine do not inflate as they inflate
the wall clock; ``--clock wall`` measures the wall clock instead. A preset that cannot route a
model (direct feedback alignment where a layer's input is not batch-first) is shown as ``-``.

The ``hf_*`` models are small Hugging Face configurations (two layers, width 32, as in issue
27's zoo), where the router's per-node overhead shows most.

Run: ``python scripts/bench_router.py [--models mlp100 mobilenet_v3_small ...] [--runs N]``.
Models are built from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import sys
import time
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
    "hf_bert": (2, 40), "hf_gpt2": (2, 40), "hf_falcon": (2, 40), "hf_beit": (2, 40),
}
#: The small Hugging Face configurations: two layers of width 32, no dropout.
_SMALL = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64)


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
    if name.startswith("hf_"):
        return _hugging_face(name, batch)
    if name == "bert_base":
        import transformers

        config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertModel(config).train()
        ids = torch.randint(0, config.vocab_size, (batch, 128))
        return model, (ids,), lambda out: out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).train()
    return model, (torch.randn(batch, 3, 224, 224),), _classes(batch, 1000)


def _hugging_face(name: str, batch: int) -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    import transformers

    quiet = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name == "hf_bert":
        config = transformers.BertConfig(**_SMALL, vocab_size=50, **quiet)
    elif name == "hf_gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, bos_token_id=0,
                                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif name == "hf_falcon":
        config = transformers.FalconConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                           vocab_size=50, hidden_dropout=0.0, attention_dropout=0.0)
    else:
        config = transformers.BeitConfig(**_SMALL, image_size=16, patch_size=8, **quiet)
    model = transformers.AutoModel.from_config(config).train()
    x = torch.randn(batch, 3, 16, 16) if name == "hf_beit" else torch.randint(1, 50, (batch, 16))
    return model, (x,), lambda out: out.last_hidden_state.pow(2).mean()


def _classes(batch: int, n: int) -> Callable[[Any], torch.Tensor]:
    y = torch.randint(0, n, (batch,), generator=torch.Generator().manual_seed(1))
    return lambda out: nn.functional.cross_entropy(out, y)


def _step(forward: Callable[..., Any], loss_of: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer, inputs: tuple[Any, ...]) -> None:
    opt.zero_grad(set_to_none=True)
    loss_of(forward(*inputs)).backward()
    opt.step()


def _sides(name: str, only: str | None = None) -> dict[str, Callable[[], None]]:
    """'autograd', each preset (or only the preset ``only``) and 'route_credit' vs
    'autograd_credit': one step each; a preset that cannot route the model is left out."""
    model, inputs, loss_of = build(name)
    G = fxnx.convert(model, *inputs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    sides = {"autograd": lambda: _step(model, loss_of, opt, inputs)}
    for preset in PRESETS if only is None else [p for p in PRESETS if p == only]:
        router = fxnx.CreditRouter(G, model, rule=preset)
        sides[preset] = lambda router=router: _step(router, loss_of, opt, inputs)
        try:
            sides[preset]()
        except fxnx.errors.FxnxError as err:  # the preset cannot route this model
            print(f"{name}, {preset}: {err}", file=sys.stderr)
            del sides[preset]
    params = [p for p in model.parameters() if p.requires_grad]

    def autograd_credit() -> None:
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = model(*leaves)
        flat = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        wrt = [x for x in leaves if x.requires_grad] + params
        torch.autograd.grad(flat, wrt, [torch.ones_like(t) for t in flat], allow_unused=True)

    sides["autograd_credit"] = autograd_credit
    every = _every_node(model, inputs, params)
    if every is not None:
        sides["autograd_every_node"] = lambda: every(*inputs)
    sides["route_credit"] = lambda: fxnx.route_credit(G, model, *inputs)
    sides["clear"] = lambda: opt.zero_grad(set_to_none=True)
    return sides


def _every_node(model: nn.Module, inputs: tuple[Any, ...], params: list[torch.Tensor]) -> Callable[..., Any] | None:
    """Autograd's forward and backward with the gradient at the input, every parameter and
    every node's value, as ``route_credit`` gives them; None for a model torch.fx (or
    torch.export) cannot capture."""
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - Hugging Face models: torch.export's graph, flat in and out
        try:
            fixed = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
            gm = torch.export.export(model, inputs, fixed, strict=False).module()
        except Exception as err:  # noqa: BLE001 - the column is left out
            print(f"{type(model).__name__}: no every-node baseline ({type(err).__name__})", file=sys.stderr)
            return None
        gm.graph._codegen = torch.fx.graph.CodeGen()  # flat: the inputs' leaves in, a tuple out
        gm._forward_pre_hooks.clear()  # export's check of the inputs' structure, now flat
        for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
            gm.graph.erase_node(node)  # export's check of the inputs' values: the inputs are fixed
        gm.graph.eliminate_dead_code()
        for node in [n for n in gm.graph.nodes if n.op == "placeholder"][len(inputs):]:
            gm.graph.erase_node(node)  # a fixed keyword's leaf, used by no node
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    values = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    with graph.inserting_before(output):
        graph.output((output.args[0], values))
    graph.erase_node(output)
    gm.recompile()

    def step(*inputs: Any) -> None:
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
        out, kept = gm(*leaves)
        flat = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        wrt = [x for x in leaves if x.requires_grad] + params
        wrt += [t for t in kept if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(flat, wrt, [torch.ones_like(t) for t in flat], allow_unused=True)

    return step


def _cpu_seconds(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def times(name: str, runs: int, clock: str = "cpu") -> dict[str, float]:
    sides = _sides(name)
    seconds = _cpu_seconds if clock == "cpu" else None
    ratios = {}
    for preset in PRESETS:
        if preset not in sides:
            continue
        ours, base = _interleaved(sides[preset], sides["autograd"], runs, seconds)
        ratios[preset] = ours / base
        ratios["step_seconds"] = base
    ours, base = _interleaved(sides["route_credit"], sides["autograd_credit"], runs, seconds)
    ratios["route_credit"] = ours / base
    if "autograd_every_node" in sides:
        ours, base = _interleaved(sides["route_credit"], sides["autograd_every_node"], runs, seconds)
        ratios["route_credit_every_node"] = ours / base
    return ratios


def _cells(row: dict[str, float]) -> str:
    return " ".join(f"{row[p]:8.2f}" if p in row else f"{'-':>8}" for p in PRESETS)


def peak(step: Callable[[], None], clear: Callable[[], None]) -> int:
    """Bytes of tensors a step holds at its peak, above what was allocated before it: the
    running sum, in the order torch's profiler saw them, of what each operation allocated
    and freed (gradients count: the step makes them afresh). The step before it runs under
    the profiler too, so that frees of what that step made are seen."""
    step()  # warm-up: captures, plans, feedback weights, optimizer state
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        clear()
        with torch.profiler.record_function("bench_router.step"):
            step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    (mark,) = [e for e in events if e.name == "bench_router.step"]
    held, start, top = 0, None, 0
    for event in events:
        if start is None and event.time_range.start >= mark.time_range.start:
            start = top = held
        held += event.self_cpu_memory_usage
        if start is not None:
            top = max(top, held)
    return top - (start or 0)


def peak_rss(step: Callable[[], None], clear: Callable[[], None]) -> int:
    """Bytes the process's resident memory grows by at its peak during one step, above what
    it held just before (Linux: ``VmHWM`` after ``clear_refs`` resets it, against ``VmRSS``).
    Large blocks are mapped and unmapped by the C allocator one by one (a fixed mmap
    threshold), and what is free is given back before the step, so that resident memory
    follows the tensors alive. A measure of its own, independent of torch's profiler, which
    on ResNet-50 needs more memory than this machine has to report its events."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, so large blocks go back at free()
    step()  # warm-up: captures, plans, feedback weights, optimizer state
    clear()
    gc.collect()
    libc.malloc_trim(0)
    before = _proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    step()
    return _proc_status("VmHWM") - before


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peaks(name: str, measure: Callable[..., int] = peak) -> dict[str, float]:
    sides = _sides(name)
    got = {side: measure(sides[side], sides["clear"]) for side in ["autograd", *PRESETS] if side in sides}
    base = got["autograd"] or float("nan")
    return {side: got[side] / base for side in PRESETS if side in got} | {"autograd_bytes": got["autograd"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=0, help="runs per side (default: per model)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-time", action="store_true", help="the memory table alone")
    parser.add_argument("--memory", choices=["profiler", "rss"], default="profiler",
                        help="peak memory from torch's profiler (default) or from the process's "
                        "resident memory (Linux; for models whose profile does not fit in memory)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="time each run by the process's CPU time (default) or the wall clock")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    head = " ".join(f"{p[:8]:>8}" for p in PRESETS)
    if not args.no_time:
        print(f"torch {torch.__version__}, 1 thread, {args.clock} clock; step = zero_grad + forward + loss + "
              "backward + SGD step")
        print(f"{'model':<20} {'step':>7}  time ratio per preset: {head} | route_credit (vs every node)")
        for name in args.models:
            r = times(name, args.runs or MODELS[name][1], args.clock)
            every = f"{r['route_credit_every_node']:8.2f}" if "route_credit_every_node" in r else f"{'-':>8}"
            print(f"{name:<20} {r['step_seconds']:6.3f}s  {'':22}{_cells(r)} | {r['route_credit']:8.2f} {every}",
                  flush=True)
    if args.no_memory:
        return
    print(f"\n{'model':<20} {'autograd':>9}  peak memory ratio per preset ({args.memory}): {head}")
    for name in args.models:
        m = peaks(name, peak_rss if args.memory == "rss" else peak)
        print(f"{name:<20} {m['autograd_bytes'] / 2**20:7.1f}MB  {'':29}{_cells(m)}", flush=True)


if __name__ == "__main__":
    main()
