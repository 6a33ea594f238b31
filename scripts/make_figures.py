"""Regenerate every figure in figures/ from scratch, with fxnx's public API only.

    python scripts/make_figures.py [--out figures]

Models are built with weights=None (nothing is downloaded) from a fixed seed,
so the figures are the same on every run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402

import fxnx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "figures")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    # ResNet-18: the whole network, and one stage at paper-column size, both skip kinds visible.
    resnet18 = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(2, 3, 224, 224)
    G = fxnx.convert(resnet18, x)
    fxnx.draw(G, out / "resnet18_skips.png", depth=4, dpi=100)  # depth 4 keeps every node
    fxnx.draw(fxnx.scope_subgraph(G, "layer2"), out / "resnet18_layer2.png", dpi=150)

    # Credit: exact against feedback alignment on ResNet-18, and the credit on the drawing.
    exact = fxnx.route_credit(G, resnet18, x)
    fa = fxnx.route_credit(G, resnet18, x, rule="feedback_alignment", seed=0)
    fxnx.route_credit(G, resnet18, x)  # leave the exact credit norms on G for the drawing
    fxnx.draw(fxnx.scope_subgraph(G, "layer2"), out / "resnet18_layer2_credit.png",
              color_by="credit_norm", dpi=150)
    ax = fxnx.plot.plot_credit_by_depth(G, {"exact (backprop)": exact.norms(),
                                       "feedback alignment": fa.norms()})
    ax.set_title("ResNet-18: credit norm by depth", fontsize=8)
    _save(ax, out / "credit_by_depth.png")
    ax = fxnx.plot.plot_alignment(G, fxnx.credit.credit_alignment(fa, exact))
    ax.set_title("ResNet-18: feedback alignment vs exact credit", fontsize=8)
    _save(ax, out / "fa_alignment.png")

    # ResNet-50 collapsed to its stages.
    resnet50 = torchvision.models.resnet50(weights=None).eval()
    G50 = fxnx.convert(resnet50, torch.randn(1, 3, 224, 224))
    fxnx.draw(G50, out / "resnet50_stages.png", depth=1, dpi=150)

    # DenseNet-121: the first dense block, each dense layer collapsed to one node.
    densenet = torchvision.models.densenet121(weights=None).eval()
    Gd = fxnx.convert(densenet, torch.randn(1, 3, 224, 224))
    fxnx.draw(fxnx.scope_subgraph(Gd, "features.denseblock1"), out / "densenet121_block1.png",
              depth=3, dpi=150)
    # The joint forward + backward ATen graph: a small MLP in full, ResNet-18 by stage.
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fxnx.draw(fxnx.convert(mlp, torch.randn(2, 4), level="joint"), out / "mlp_joint.png", dpi=110)
    Gj = fxnx.convert(resnet18, torch.randn(1, 3, 224, 224), level="joint")
    fxnx.skip_connections(Gj)
    fxnx.draw(Gj, out / "resnet18_joint_stages.png", depth=1, dpi=100)
    for path in sorted(out.glob("*.png")):
        print(path)


def _save(ax, path: Path) -> None:
    ax.figure.savefig(path, dpi=300)
    plt.close(ax.figure)


if __name__ == "__main__":
    main()
