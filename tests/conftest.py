"""Shared fixtures and helpers, the one place tests take them from: torchvision models (no
weights, built once per session), graph checks, relative errors, re-initialising zero-initialised
layers, and the mark for tests that need Graphviz's ``dot``."""

from __future__ import annotations

import functools
import math
import shutil
import signal

import pytest
import torch
import torchvision


def pytest_configure(config):
    # A suite started in the background of a script inherits Ctrl-C ignored (SIG_IGN), and so
    # would the fxnx processes the CLI tests interrupt: hear it again, as a terminal does.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite the golden DOT files in tests/golden from the current code (review the diff)",
    )


#: Tests that run Graphviz's ``dot`` (PNG, SVG, PDF): skipped only where it is not installed.
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖``, detached, in float64; the absolute error where ``want`` is 0."""
    got, want = got.detach().double(), want.detach().double()
    scale, diff = float(want.norm()), float((got - want).norm())
    return diff / scale if scale else diff


def reinit(model: torch.nn.Module) -> torch.nn.Module:
    """Give zero-initialised parameters values, so that credit through them is not vacuous."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                torch.nn.init.uniform_(p, -0.5, 0.5)
    return model


#: The torchvision classifiers the contract is checked on, with readable test ids.
TORCHVISION = ["resnet18", "resnet50", "densenet121", "mobilenet_v3_small", "vit_b_16"]


@functools.cache
def _torchvision_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).eval()


@pytest.fixture
def torchvision_model():
    """Return a builder: name -> the (shared, eval-mode) torchvision model, no weights."""
    return _torchvision_model


PLAIN_SCALARS = (str, int, float, bool, type(None))


def assert_plain(value, where: str = "") -> None:
    """Fail on anything in ``value`` that is not plain Python data (exact builtin types)."""
    if type(value) in PLAIN_SCALARS:
        if type(value) is float:
            assert math.isfinite(value), f"non-finite float at {where}"
        return
    if type(value) in (tuple, list):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for key, item in value.items():
            assert type(key) in PLAIN_SCALARS, f"key {key!r} of type {type(key)} at {where}"
            assert_plain(item, f"{where}[{key!r}]")
        return
    raise AssertionError(f"{type(value).__module__}.{type(value).__qualname__} at {where}: {value!r}")


def assert_graph_plain(G) -> None:
    assert_plain(G.graph, "G.graph")
    for node, data in G.nodes(data=True):
        assert type(node) is str, f"node key {node!r} is not a str"
        assert_plain(data, f"node {node}")
    for u, v, k, data in G.edges(keys=True, data=True):
        assert type(k) is int
        assert_plain(data, f"edge {u}->{v}#{k}")


def assert_graphs_equal(G, H) -> None:
    """Equal in nodes (and their order), edges, edge keys and every attribute."""
    assert G.graph == H.graph
    assert list(G.nodes(data=True)) == list(H.nodes(data=True))
    assert list(G.edges(keys=True, data=True)) == list(H.edges(keys=True, data=True))


@pytest.fixture
def dot_runs(monkeypatch):
    """The formats Graphviz's ``dot`` runs for while the test runs, in order (it still runs)."""
    from fxnx import _drawing as dr

    runs = []
    real = dr.graphviz.run_dot

    def counted(*args, **kwargs):
        runs.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(dr.graphviz, "run_dot", counted)
    return runs
