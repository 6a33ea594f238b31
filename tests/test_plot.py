"""Matplotlib figures: the plotted points are the graph's numbers."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import fxnx  # noqa: E402


@pytest.fixture
def routed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    G = fxnx.convert(model, x)
    exact = fxnx.route_credit(G, model, x)
    fa = fxnx.route_credit(G, model, x, rule="feedback_alignment")
    return G, exact, fa


def test_credit_by_depth_plots_each_nodes_norm_at_its_depth(routed):
    G, exact, fa = routed
    ax = fxnx.plot.plot_credit_by_depth(G, {"exact": exact.norms(), "fa": fa.norms()})
    exact_line, fa_line = ax.get_lines()
    depths = fxnx.node_depths(G)
    expected = sorted((depths[n], v) for n, v in exact.norms().items() if v)
    assert list(zip(exact_line.get_xdata(), exact_line.get_ydata(), strict=True)) == expected
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["exact", "fa"]
    assert ax.get_yscale() == "log"
    assert len(fa_line.get_xdata()) == len(expected)


def test_credit_by_depth_defaults_to_the_norms_on_g(routed):
    G, _, fa = routed  # fa ran last, so its norms are on G
    (line,) = fxnx.plot.plot_credit_by_depth(G).get_lines()
    assert sorted(line.get_ydata()) == sorted(v for v in fa.norms().values() if v)


def test_alignment_plots_the_angle_of_each_layer_in_order(routed):
    G, exact, fa = routed
    angles = fxnx.credit.credit_alignment(fa, exact)
    line = fxnx.plot.plot_alignment(G, angles).get_lines()[0]
    assert list(line.get_ydata()) == [angles["_0"]["angle"], angles["_2"]["angle"]]
    assert line.get_ydata()[-1] < 1e-3  # the last layer's output credit is exact under FA


def test_census_bars(routed):
    G, *_ = routed
    ax = fxnx.plot.plot_census(G)
    bars = {t.get_text(): p.get_width() for t, p in zip(ax.get_yticklabels(), ax.patches, strict=True)}
    assert bars == {"Linear": 2, "Tanh": 1}


def test_plot_module_does_not_import_matplotlib_on_import():
    from blocktorch import run_without_torch

    done = run_without_torch("import sys, fxnx; print('matplotlib' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr
