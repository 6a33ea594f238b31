"""Credit by path length in residual networks, after Veit et al. (2016), Fig. 6: exactly.

    python scripts/path_length_figure.py [--out figures] [--size 112] [--batch 2]

For ResNet-18, ResNet-50 and a ViT, with torchvision's random initialisation (weights=None,
eval mode, nothing downloaded), writes figures/path_length_credit.png and
figures/path_length_credit.md:

(a) the distribution of path lengths: the share of the 2**n input-to-output paths that go
    through exactly k residual branches (``fxnx.path_length_counts``, binomial);
(b) the credit each length carries to the input: the norm of ``fxnx.path_length_credit``'s
    term k, as a share of the sum of the terms' norms. The credit at the output is the
    gradient of the cross-entropy loss for random labels.

The ViT is torchvision's ``VisionTransformer`` at ViT-Ti's width and depth (12 layers,
width 192, 3 heads, MLP 768) on 64x64 images cut into 8x8 patches; its classifier head,
which torchvision initialises to zero, gets ``nn.Linear``'s default initialisation.
Runs in about a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

import fxnx  # noqa: E402
from fxnx._paths import path_length_counts, path_length_credit  # noqa: E402

#: Okabe–Ito colours, with markers and dashes so the lines part in grayscale too.
STYLES = [
    {"color": "#0072B2", "marker": "o", "linestyle": "-"},
    {"color": "#D55E00", "marker": "s", "linestyle": "--"},
    {"color": "#009E73", "marker": "^", "linestyle": ":"},
]


def models(size: int) -> list[tuple[str, torch.nn.Module, int]]:
    vit = torchvision.models.VisionTransformer(
        image_size=64, patch_size=8, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768)
    vit.heads.head.reset_parameters()  # torchvision zero-initialises it: no credit would flow
    return [
        ("ResNet-18", torchvision.models.resnet18(weights=None), size),
        ("ResNet-50", torchvision.models.resnet50(weights=None), size),
        ("ViT-Ti/8 (12 layers)", vit, 64),
    ]


def measure(name: str, model: torch.nn.Module, size: int, batch: int) -> dict[str, object]:
    model.eval()
    x = torch.randn(batch, 3, size, size)
    G = fxnx.convert(model, x)
    counts = path_length_counts(G)
    with torch.no_grad():
        logits = model(x)
    labels = torch.randint(0, logits.shape[1], (batch,))
    credit = F.softmax(logits, 1) - F.one_hot(labels, logits.shape[1])  # d(cross-entropy)/d(logits)
    terms = path_length_credit(G, model, x, output_credit=credit)
    x_ = x.clone().requires_grad_()
    (exact,) = torch.autograd.grad(model(x_), x_, credit)
    norms = {k: t.norm().item() for k, t in terms.items()}
    total = sum(norms.values())
    return {
        "name": name,
        "blocks": len(counts) - 1,
        "counts": counts,
        "share": {k: v / total for k, v in norms.items()},
        "per_path": {k: norms[k] / counts[k] for k in counts if counts[k]},
        "error": ((sum(terms.values()) - exact).norm() / exact.norm()).item(),
        "size": size,
    }


def plot(results: list[dict], path: Path) -> None:
    with plt.rc_context({"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 7}):
        fig, (top, bottom) = plt.subplots(
            2, 1, figsize=(3.3, 3.6), sharex=True, layout="constrained")
        for r, style in zip(results, STYLES, strict=False):
            ks = sorted(r["counts"])
            paths = 2 ** r["blocks"]
            kw = {**style, "markersize": 3, "linewidth": 1}
            label = f"{r['name']}, n = {r['blocks']}"
            top.plot(ks, [r["counts"][k] / paths for k in ks], label=label, **kw)
            bottom.plot(ks, [r["share"][k] for k in ks], **kw)
        top.set_ylabel("share of paths")
        top.set_title("(a) paths through k residual branches", loc="left")
        top.legend(frameon=False, handlelength=2.2)
        bottom.set_ylabel("share of input credit")
        bottom.set_xlabel("path length k (residual branches taken)")
        bottom.set_title(r"(b) $\|$credit of the length-k paths$\|$, exact", loc="left")
        for ax in (top, bottom):
            ax.spines[["top", "right"]].set_visible(False)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.25, linewidth=0.5)
            ax.set_ylim(bottom=0)
        fig.savefig(path, dpi=300)
        plt.close(fig)


def table(results: list[dict], batch: int) -> str:
    lines = [
        "# Credit by path length",
        "",
        "Written by `python scripts/path_length_figure.py` (torch "
        f"{torch.__version__}); random weights (torchvision's initialisation, eval mode), "
        f"a batch of {batch} Gaussian images, output credit the cross-entropy gradient for "
        "random labels. `share` is the norm of `fxnx.path_length_credit`'s term k over the sum "
        "of the terms' norms; `mean length` weights each length by that share (the paths' own "
        "mean is n/2); `per path` is the term's norm over the number of its paths (the norm "
        "of the mean path's credit). `error`: the terms' sum against autograd's input "
        "gradient, relative, float32.",
        "",
        "| model | n | image | mean length (paths) | mean length (credit) | peak k | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        mean = sum(k * s for k, s in r["share"].items())
        peak = max(r["share"], key=r["share"].get)
        lines.append(f"| {r['name']} | {r['blocks']} | {r['size']} | {r['blocks'] / 2:.1f} | "
                     f"{mean:.2f} | {peak} | {r['error']:.1e} |")
    lines += ["", "| model | k | paths | share of credit | per path |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        for k in sorted(r["counts"]):
            lines.append(f"| {r['name']} | {k} | {r['counts'][k]} | {r['share'][k]:.3f} | "
                         f"{r['per_path'][k]:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "figures")
    parser.add_argument("--size", type=int, default=112, help="image size for the ResNets")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    results = []
    for name, model, size in models(args.size):
        results.append(measure(name, model, size, args.batch))
        r = results[-1]
        assert math.isclose(sum(r["counts"].values()), 2 ** r["blocks"])
        print(f"{name}: n = {r['blocks']}, relative error of the sum {r['error']:.1e}", flush=True)
    plot(results, args.out / "path_length_credit.png")
    (args.out / "path_length_credit.md").write_text(table(results, args.batch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
