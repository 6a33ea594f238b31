"""The capture ladder: models symbolic tracing cannot handle, and opaque leaf modules.

Oracles: the captured graph module, run on the example input, gives the
model's own output; module scopes are checked against the model's modules;
shapes against running the model.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torchvision
from torch import nn

import fxnx
import fxnx._convert

from conftest import assert_graph_plain, assert_graphs_equal, needs_dot


class Gate(nn.Module):
    """Data-dependent: which branch runs depends on the values of ``x``."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = Gate()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.gate(self.a(x)) + x)


class TopLevelBranch(nn.Module):
    """The data-dependent ``if`` is in the model's own forward: no submodule to keep whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return x


class LoopOverSize(nn.Module):
    """A Python loop over a tensor's size, which a Proxy cannot give."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        out = x
        for i in range(x.size(0)):
            out = out + self.a(x[i])
        return out


def _capture(model, *inputs, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cap = fxnx.capture(model, inputs, **options)
    return cap, [str(w.message) for w in caught]


def test_loop_over_a_size_falls_back_to_torch_export():
    torch.manual_seed(0)
    model, x = LoopOverSize().eval(), torch.randn(3, 4)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "export" and G.graph["level"] == "aten"
    assert "Proxy" in G.graph["capture_failures"]["symbolic_trace"]
    linears = [n for n, d in G.nodes(data=True) if d["target"] == "torch.ops.aten.linear.default"]
    assert len(linears) == x.size(0)  # unrolled for the example's size
    assert all(G.nodes[n]["scope"] == "a" for n in linears)
    assert G.graph["modules"]["a"] == "torch.nn.modules.linear.Linear"
    assert G.nodes["output"]["out_shape"] == [tuple(model(x).shape)]
    assert G.graph["num_params"] == sum(p.numel() for p in model.parameters())
    cap, _ = _capture(model, x)
    torch.testing.assert_close(cap.gm(x), model(x), rtol=0, atol=0)
    assert_graph_plain(G)


def test_data_dependent_branch_falls_back_to_draft_export_and_warns():
    torch.manual_seed(0)
    model = Gated().eval()
    for x in (torch.full((2, 4), 3.0), torch.full((2, 4), -3.0)):
        took_positive = bool(model.a(x).sum() > 0)
        cap, caught = _capture(model, x)
        assert cap.method == "draft_export", cap.failures
        assert [route for route, _ in cap.failures] == ["symbolic_trace", "export"]
        assert any("holds for such inputs only" in m for m in caught)
        G = fxnx._convert.graph_from_capture(cap)
        targets = {d["target"] for _, d in G.nodes(data=True)}
        # Only the branch this input took is in the graph.
        assert ("torch.ops.aten.mul.Tensor" in targets) is took_positive
        assert ("torch.ops.aten.neg.default" in targets) is not took_positive
        assert {d["scope"] for _, d in G.nodes(data=True)} >= {"a", "gate", "b"}
        torch.testing.assert_close(cap.gm(x), model(x), rtol=0, atol=0)


def test_leaf_on_failure_keeps_the_failing_submodule_whole_and_marks_it():
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(2, 4)
    G = fxnx.convert(model, x, leaf_on_failure=True)
    assert G.graph["capture"] == "symbolic_trace" and G.graph["level"] == "module"
    assert G.graph["opaque_modules"] == ["gate"]
    assert {n for n, d in G.nodes(data=True) if d["opaque"]} == {"gate"}
    assert G.nodes["gate"]["op"] == "call_module" and G.nodes["gate"]["out_shape"] == (2, 4)
    assert list(G.predecessors("gate")) == ["a"]
    # Everything around it is traced as usual, skip connection included.
    (skip,) = fxnx.skip_connections(G)
    assert (skip.fork, skip.merge, skip.residual) == ("x", "add", ("a", "gate"))


def test_leaf_on_failure_reaches_nested_submodules():
    outer = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Gate()), nn.Linear(4, 2))
    G = fxnx.convert(outer, torch.randn(2, 4), leaf_on_failure=True)
    assert G.graph["opaque_modules"] == ["1.1"]
    assert [n for n, d in G.nodes(data=True) if d["opaque"]] == ["_1_1"]
    assert G.nodes["_1_0"]["opaque"] is False


@pytest.mark.parametrize(
    ("build", "options", "route"),
    [
        (Gated, dict(leaf_on_failure=True), "symbolic_trace"),  # around an opaque leaf
        (LoopOverSize, {}, "export"),
        (Gated, {}, "draft_export"),
    ],
)
def test_credit_routes_exactly_over_fallback_and_opaque_graphs(build, options, route):
    torch.manual_seed(0)
    model = build().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = fxnx.convert(model, x, **options)
        assert G.graph["capture"] == route
        res = fxnx.route_credit(G, model, x)
    x_ = x.clone().requires_grad_()
    grads = torch.autograd.grad(model(x_).sum(), [x_, *model.parameters()])
    assert torch.linalg.vector_norm(res.node_credit["x"] - grads[0]) <= 1e-12 * grads[0].norm()
    for (name, _), grad in zip(model.named_parameters(), grads[1:], strict=True):
        assert torch.linalg.vector_norm(res.param_credit[name] - grad) <= 1e-12 * grad.norm()


def test_a_failure_outside_any_submodule_cannot_be_kept_whole_so_the_ladder_goes_on():
    cap, _ = _capture(TopLevelBranch().eval(), torch.ones(2, 4), leaf_on_failure=True)
    assert cap.method == "draft_export" and cap.opaque == ()


def test_when_every_route_fails_the_error_lists_each_one():
    with pytest.raises(fxnx.errors.CaptureError) as info:
        fxnx.convert(Gated(), torch.ones(2, 4), routes=["symbolic_trace", "export"])
    message = str(info.value)
    assert message.startswith("no capture route worked for Gated:")
    assert "- symbolic_trace: torch.fx could not trace Gated" in message
    assert "inside submodule 'gate'" in message
    assert "- export: torch.export.export(strict=False) failed: GuardOnDataDependentSymNode" in message
    assert "leaf_on_failure=True" in message
    assert len(message) < 3000  # torch's own messages run to whole graphs


class _Embedded(nn.Module):
    """Fails symbolic tracing (a branch on a value), and runs only on integer ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids):
        if ids.sum() > 0:
            ids = ids + 0
        return self.embed(ids)


def test_when_the_model_itself_fails_on_the_inputs_that_is_the_error():
    """Float ids: every route fails because the model does; the error says so, with the
    model's own message first, not each route's."""
    with pytest.raises(fxnx.errors.CaptureError) as info:
        fxnx.convert(_Embedded(), torch.ones(2, 3))
    message = str(info.value)
    assert message.startswith("_Embedded itself fails on the example inputs (RuntimeError: Expected tensor for argument #1 'indices'")
    assert "check the example inputs' shapes and dtypes" in message
    assert fxnx.convert(_Embedded(), torch.ones(2, 3, dtype=torch.long)).graph["capture"] != "symbolic_trace"


def test_routes_that_need_inputs_say_so():
    with pytest.raises(fxnx.errors.CaptureError, match="export needs example inputs"):
        fxnx.convert(Gated(), routes=["symbolic_trace", "export"])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(routes="jit"), "unknown capture route"),
        (dict(routes=[]), "unknown capture route"),
        (dict(level="joint", routes="export"), "always captured with make_fx"),
    ],
)
def test_bad_routes_are_value_errors(options, match):
    with pytest.raises(fxnx.errors.FxnxValueError, match=match):
        fxnx.convert(nn.Linear(4, 2), torch.randn(1, 4), **options)


def test_the_make_fx_route_records_parameters_as_primals():
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(2, 4)
    with pytest.warns(UserWarning, match="holds for such inputs only"):
        G = fxnx.convert(model, x, routes="make_fx")
    assert G.graph["specialised"] is True
    assert G.graph["capture"] == "make_fx" and G.graph["level"] == "aten"
    assert [p["name"] for p in G.graph["primals"].values()] == ["a.weight", "a.bias", "b.weight", "b.bias", "x"]
    assert G.graph["num_params"] == sum(p.numel() for p in model.parameters())
    assert G.nodes["output"]["out_shape"] == [(2, 4)]


def test_the_make_fx_route_runs_fake_tensors_when_asked():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(type(x).__name__)
            return x * 2

    G = fxnx.convert(Spy(), torch.randn(2, 3), routes="make_fx", fake=True)
    assert seen == ["FakeTensor"] and G.graph["shape_source"] == "FakeTensor"
    assert G.nodes["output"]["out_shape"] == [(2, 3)]


@pytest.mark.slow
@needs_dot
def test_a_torchvision_detection_model_converts_through_the_ladder(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None
    ).eval()
    images = [torch.rand(3, 320, 320)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = fxnx.convert(model, images)
    assert G.graph["capture"] == "draft_export"
    assert list(G.graph["capture_failures"]) == ["symbolic_trace", "export"]
    scopes = {d["scope"].split(".")[0] for _, d in G.nodes(data=True)}
    assert {"transform", "backbone", "rpn", "roi_heads"} <= scopes
    assert G.graph["modules"]["backbone.body"].endswith("IntermediateLayerGetter")
    # One conv2d node per Conv2d call (the RPN head runs once per feature level), in its scope.
    calls = Counter()
    hooks = [
        m.register_forward_hook(lambda m, i, o, path=path: calls.update([path]))
        for path, m in model.named_modules() if isinstance(m, nn.Conv2d)
    ]
    (detections,) = model(images)
    for hook in hooks:
        hook.remove()
    convs = Counter(d["scope"] for _, d in G.nodes(data=True) if d["target"] == "torch.ops.aten.conv2d.default")
    assert convs == calls and sum(calls.values()) > len(hooks)
    assert G.nodes["output"]["out_shape"] == [tuple(v.shape) for v in detections.values()]
    assert G.graph["num_params"] == sum(p.numel() for p in model.parameters())
    assert_graph_plain(G)
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    assert_graphs_equal(fxnx.read_pickle(tmp_path / "g.pkl"), G)
    png = fxnx.draw(G, tmp_path / "frcnn.png", depth=1)
    assert png.read_bytes().startswith(b"\x89PNG")
