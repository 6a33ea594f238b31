"""Benchmarks on the models people use: Hugging Face transformers and timm (issue 11).

Prints ratios against a baseline measured in the same run (these machines are noisy):

* ``route_credit`` after its first call (the capture is reused) against autograd's forward and
  backward, on BERT-base- and GPT-2-small-sized configs with random weights, batch 4 x 128;
* ``convert`` through ``torch.export`` against ``convert`` through ``symbolic_trace`` on timm's
  ViT-Tiny.

Run: ``python scripts/bench_models.py [--repeats N]``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
import warnings

import timm
import torch
import transformers
from bench import _interleaved  # scripts/ is on sys.path when this script runs

import fxnx


def _autograd_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    out = model(ids, attention_mask=mask, use_cache=False)
    leaves = [t for t in torch.utils._pytree.tree_leaves(dict(out)) if t.is_floating_point()]
    torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    model.zero_grad(set_to_none=True)


def credit_vs_autograd(name: str, config: object, repeats: int) -> float:
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    ids = torch.randint(0, 1000, (4, 128))
    mask = torch.ones(4, 128, dtype=torch.long)
    G = fxnx.convert(model, ids, kwargs={"attention_mask": mask})
    start = time.perf_counter()
    fxnx.route_credit(G, model, ids, kwargs={"attention_mask": mask})
    first = time.perf_counter() - start
    ours, base = _interleaved(  # run by run, alternating, so drift hits both alike
        lambda: fxnx.route_credit(G, model, ids, kwargs={"attention_mask": mask}),
        lambda: _autograd_step(model, ids, mask), repeats,
    )
    print(f"{name:<22} {len(G):>5} nodes ({G.graph['capture']})  autograd {base:6.2f} s  "
          f"route_credit {ours:6.2f} s  ratio {ours / base:.2f}x  (first call {first:.1f} s)")
    return ours / base


def export_vs_symbolic(repeats: int) -> float:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224)
    export, symbolic = _interleaved(lambda: fxnx.convert(model, x, routes="export"),
                                    lambda: fxnx.convert(model, x, routes="symbolic_trace"), repeats)
    print(f"{'timm vit_tiny convert':<22} symbolic_trace {symbolic:6.2f} s  export {export:6.2f} s"
          f"  ratio {export / symbolic:.2f}x")
    return export / symbolic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    bert = transformers.BertConfig()  # BERT-base: 12 layers, 768 wide, 12 heads
    gpt2 = transformers.GPT2Config()  # GPT-2 small: 12 layers, 768 wide, 12 heads
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.repeats}")
    credit_vs_autograd("BERT-base 4x128", bert, args.repeats)
    credit_vs_autograd("GPT-2 small 4x128", gpt2, args.repeats)
    export_vs_symbolic(args.repeats)


if __name__ == "__main__":
    main()
