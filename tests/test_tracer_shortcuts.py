"""fxnx's tracer finds parameter names in a table, reads a function's unpackings once, and
leaves the GraphModule's code to be generated when needed: the graphs are torch.fx's own.

Oracles: torch.fx's default tracer (the same graph, node for node, under torch.fx's leaf
rule) and the eager model (the captured GraphModule, called, gives its outputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxnx
from fxnx._capture import capture
from fxnx._capture.tracer import Tracer


class Shared(nn.Module):
    """A parameter reachable by two names, buffers passed to a functional call, a parameter
    read directly, and shapes unpacked in a loop, in a helper and in a comprehension."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied: torch.fx names it a.weight, its first name
        self.scale = nn.Parameter(torch.randn(4))
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x):
        for _ in range(3):  # the same unpacking, met three times
            n, c = x.shape
            x = self.b(self.a(x)).view(n, c) * self.scale
        x = F.batch_norm(x, self.mean, self.var, self.scale, None, False)
        rows, cols = _dims(x)
        pairs = [(i, j) for i, j in [x.shape]]
        return x.reshape(rows * cols)[: pairs[0][1]] + self.a.weight.sum()


def _dims(t):
    first, second = t.size()
    return first, second


def _nodes(graph: fx.Graph):
    return [(n.op, str(n.target), str(n.args), str(n.kwargs)) for n in graph.nodes]


def test_graph_is_torch_fx_own_under_its_leaf_rule():
    model = Shared()
    ours = Tracer(("torch.nn",), None).trace(model)
    theirs = fx.Tracer().trace(model)
    assert _nodes(ours) == _nodes(theirs)
    targets = {str(n.target) for n in ours.nodes if n.op == "get_attr"}
    assert {"a.weight", "scale", "mean", "var"} <= targets and "b.weight" not in targets


def test_a_tensor_added_during_the_trace_is_still_found():
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            if not hasattr(self, "late"):  # a lazily made parameter, after the table was built
                self.late = nn.Parameter(torch.ones(2))
            return self.lin(x) * self.late

    graphs = []
    for tracer in (Tracer(("torch.nn",), None), fx.Tracer()):
        model = Grows()
        graphs.append(_nodes(tracer.trace(model)))
    assert graphs[0] == graphs[1]
    assert ("get_attr", "late", "()", "{}") in graphs[0]


def test_unpacking_into_too_few_names_fails_as_in_torch_fx():
    class Star(nn.Module):
        def forward(self, x):
            first, *rest = x.shape
            return x * first

    for tracer in (Tracer(("torch.nn",), None), fx.Tracer()):
        with pytest.raises(fx.proxy.TraceError, match="cannot be iterated"):
            tracer.trace(Star())


def test_converting_generates_no_code_and_the_module_still_runs(monkeypatch):
    model = Shared().eval()
    x = torch.randn(2, 4)
    generated = []
    original = fx.Graph.python_code

    def counted(self, *args, **kwargs):
        generated.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counted)
    G = fxnx.convert(model, x)
    assert G.number_of_nodes() > 10 and generated == []
    gm = capture(model, (x,)).gm
    assert generated == []
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert len(generated) == 1 and "batch_norm" in gm.code
