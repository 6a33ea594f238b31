"""ATen-level graphs: ``level="aten"`` and the joint forward + backward graph.

Oracles: the captured graph module is run on real tensors and each node's
value is compared with the shape the graph records (recorded while tracing,
not by running it again); the gradients it computes are compared with
``torch.autograd`` in float64; phases are checked against reachability from
the ``tangents_*`` inputs; scopes against the parameters each op reads.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.fx as fx
from torch import nn

import fxnx
import fxnx._convert

from blocktorch import run_without_torch
from conftest import assert_graph_plain, needs_dot


class _Recorder(fx.Interpreter):
    """Runs a graph module and keeps every node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        self.values[n.name] = result = super().run_node(n)
        return result


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _resnet18(torchvision_model):
    import copy

    model = copy.deepcopy(torchvision_model("resnet18")).double()
    return model


def _primal_values(G, model, inputs):
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    values = []
    for primal in G.graph["primals"].values():
        source = {"parameter": params, "buffer": buffers, "input": inputs}[primal["kind"]]
        values.append(source[primal["name"]].detach())
    return values


def _check_joint(G, cap, model, x):
    """Everything the joint graph claims, checked against running it and against autograd."""
    tangents = [n for n in G if n.startswith("tangents_")]
    out = model(x)
    assert len(tangents) == len(G.graph["tangents"]) == 1  # one output, one incoming gradient
    assert G.nodes[tangents[0]]["out_shape"] == tuple(out.shape)
    primals = _primal_values(G, model, {"x": x, "input": x})
    seed = [torch.randn_like(out)]
    recorder = _Recorder(cap.gm)
    outputs, _ = recorder.run(*primals, *seed)
    # Every node's recorded shape is what running it gives.
    for name, value in recorder.values.items():
        if isinstance(value, torch.Tensor):
            assert G.nodes[name]["out_shape"] == tuple(value.shape), name
            assert G.nodes[name]["out_dtype"] == str(value.dtype), name
    # The gradients equal autograd's, parameters and input alike.
    x_ = x.clone().requires_grad_()
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(model(x_), [*model.parameters(), x_], seed)
    expected = dict(zip([*names, "x" if "x" in G.graph["gradients"] else "input"], grads, strict=True))
    for name, node in G.graph["gradients"].items():
        got = recorder.values[node]
        assert G.nodes[node]["out_shape"] == tuple(expected[name].shape), name
        err = torch.linalg.vector_norm(got - expected[name]) / torch.linalg.vector_norm(expected[name])
        assert err <= 1e-12, (name, float(err))
    torch.testing.assert_close(outputs[0], out, rtol=0, atol=0)
    # Phases: the backward pass is exactly what depends on the incoming gradients.
    downstream = nx.descendants(G, tangents[0]) | {tangents[0]}
    for node, data in G.nodes(data=True):
        if data["op"] == "call_function" and node in downstream:
            assert data["phase"] == "backward", node
        if data["phase"] == "forward":
            assert node not in downstream, node
    assert G.nodes["output"]["phase"] == "backward"
    assert_graph_plain(G)


def test_joint_graph_of_an_mlp():
    model, x = _mlp(), torch.randn(5, 4, dtype=torch.float64)
    cap = fxnx.capture(model, (x,), level="joint")
    G = fxnx._convert.graph_from_capture(cap)
    assert G.graph["level"] == "joint" and G.graph["capture"] == "make_fx"
    assert list(G.graph["primals"]) == [f"primals_{i}" for i in range(1, 8)]
    assert [p["name"] for p in G.graph["primals"].values()] == [
        "0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "input"
    ]
    assert G.graph["tangents"] == {"tangents_1": "output[0]"}
    _check_joint(G, cap, model, x)
    # ATen arguments are bound to the schema's names, defaults filled in.
    (addmm, *_) = [d for _, d in G.nodes(data=True) if d["target"] == "torch.ops.aten.addmm.default"]
    assert addmm["node_call_info"] == {
        "self": "primals_2", "mat1": "primals_7", "mat2": "t", "beta": 1, "alpha": 1
    }
    (tanh_bw,) = [d for _, d in G.nodes(data=True) if d["target"] == "torch.ops.aten.tanh_backward.default"]
    assert set(tanh_bw["node_call_info"]) == {"grad_output", "output"}
    assert tanh_bw["scope"] == "1" and tanh_bw["phase"] == "backward"


def test_joint_graph_of_resnet18(torchvision_model):
    model = _resnet18(torchvision_model)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    cap = fxnx.capture(model, (x,), level="joint")
    G = fxnx._convert.graph_from_capture(cap)
    params = dict(model.named_parameters())
    assert set(G.graph["gradients"]) == {*params, "x"}
    for name, node in G.graph["gradients"].items():
        if name in params:
            assert G.nodes[node]["out_shape"] == tuple(params[name].shape)
    _check_joint(G, cap, model, x)
    # Each convolution's backward sits in the scope of the conv whose weight it reads.
    by_primal = {n: p["name"] for n, p in G.graph["primals"].items()}
    backward_convs = [
        d for _, d in G.nodes(data=True) if d["target"] == "torch.ops.aten.convolution_backward.default"
    ]
    assert len(backward_convs) == sum(isinstance(m, nn.Conv2d) for m in model.modules())
    for data in backward_convs:
        weight = by_primal[data["node_call_info"]["weight"]]
        assert data["scope"] == weight.rpartition(".")[0]
    # The forward half finds the same skip connections as the module-level graph.
    forward = G.subgraph(n for n, d in G.nodes(data=True) if d["phase"] == "forward").copy()
    forward.graph.update(G.graph)
    assert len(fxnx.skip_connections(forward)) == len(fxnx.skip_connections(fxnx.convert(model, x))) == 8


def test_aten_level_is_the_forward_pass_alone(torchvision_model):
    model = _resnet18(torchvision_model)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    cap = fxnx.capture(model, (x,), level="aten")
    G = fxnx._convert.graph_from_capture(cap)
    assert G.graph["level"] == "aten" and G.graph["tangents"] == {} and G.graph["gradients"] == {}
    assert {d["phase"] for _, d in G.nodes(data=True)} == {"forward"}
    recorder = _Recorder(cap.gm)
    (out,) = recorder.run(*_primal_values(G, model, {"x": x}))
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    for name, value in recorder.values.items():
        if isinstance(value, torch.Tensor):
            assert G.nodes[name]["out_shape"] == tuple(value.shape), name
    assert G.graph["num_params"] == sum(p.numel() for p in model.parameters())
    assert len(fxnx.skip_connections(G)) == 8
    convs = [d["scope"] for _, d in G.nodes(data=True) if d["target"] == "torch.ops.aten.convolution.default"]
    assert convs == [p for p, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def test_joint_capture_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    G = fxnx.convert(model, x, level="joint")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(p.grad is None for p in model.parameters())
    kinds = [p["kind"] for p in G.graph["primals"].values()]
    assert kinds.count("buffer") == 3  # running mean, var and the batch counter
    assert G.graph["gradients"]["0.weight"] is not None


def test_fake_joint_graph_has_the_real_shapes(torchvision_model):
    model = torchvision_model("resnet18")
    x = torch.randn(1, 3, 32, 32)
    real = fxnx.convert(model, x, level="joint")
    fake = fxnx.convert(model, x, level="joint", fake=True)
    assert fake.graph["shape_source"] == "FakeTensor" and real.graph["shape_source"] == "make_fx"
    assert list(fake.nodes(data="out_shape")) == list(real.nodes(data="out_shape"))
    assert list(fake.edges(data="shape")) == list(real.edges(data="shape"))


def test_joint_graph_pickles_and_loads_without_torch(tmp_path):
    G = fxnx.convert(_mlp(), torch.randn(2, 4, dtype=torch.float64), level="joint")
    fxnx.write_pickle(G, tmp_path / "joint.pkl")
    result = run_without_torch(
        """
        import sys, fxnx
        G = fxnx.read_pickle(sys.argv[1])
        print(G.graph["level"], len(G.graph["tangents"]), sum(d == "backward" for _, d in G.nodes(data="phase")))
        """,
        str(tmp_path / "joint.pkl"),
    )
    assert result.returncode == 0, result.stderr
    backward = sum(d == "backward" for _, d in G.nodes(data="phase"))
    assert result.stdout.split() == ["joint", "1", str(backward)]


@needs_dot
def test_joint_graph_draws_with_its_backward_pass_marked(tmp_path):
    G = fxnx.convert(_mlp(), torch.randn(2, 4, dtype=torch.float64), level="joint")
    dot = fxnx.to_pydot(G).to_string()
    assert "backward pass" in dot and "parameter 0.weight" in dot
    backward = [n for n, d in G.nodes(data=True) if d["phase"] == "backward" and d["op"] == "call_function"]
    assert dot.count('color="#8430CE"') >= len(backward)
    collapsed = fxnx.to_pydot(G, depth=1).to_string()
    assert "<B>4 (backward)" not in collapsed  # the node name is the module's, its style says backward
    assert fxnx.draw(G, tmp_path / "mlp.png", depth=1).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("model", "inputs", "options", "error", "match"),
    [
        (nn.Linear(4, 2), (), dict(level="joint"), fxnx.errors.FxnxTypeError, "pass example inputs"),
        (nn.Linear(4, 2), (torch.randn(1, 4),), dict(level="grad"), fxnx.errors.FxnxValueError, "level must be"),
        (lambda x: x.argmax(-1), (torch.randn(2, 3),), dict(level="joint"), fxnx.errors.FxnxValueError,
         "no floating-point output"),
    ],
)
def test_bad_levels_and_inputs(model, inputs, options, error, match):
    with pytest.raises(error, match=match):
        fxnx.convert(model, *inputs, **options)


def test_credit_is_not_routed_over_a_joint_graph():
    model, x = _mlp(), torch.randn(2, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, level="joint")
    with pytest.raises(fxnx.errors.FxnxValueError, match="level='module'"):
        fxnx.route_credit(G, model, x)


def test_a_plain_function_keeps_its_argument_names():
    G = fxnx.convert(lambda x, scale: (x * scale).sin(), torch.randn(3), torch.randn(3), level="joint")
    assert [p["name"] for p in G.graph["primals"].values()] == ["x", "scale"]
    assert set(G.graph["gradients"]) == {"x", "scale"}


def test_varargs_inputs_are_named_by_their_position_in_args():
    class Summed(torch.nn.Module):
        def forward(self, x, *args, scale=1.0):
            return x * scale + sum(args)

    G = fxnx.convert(Summed(), torch.randn(2), torch.randn(2), torch.randn(2), level="aten")
    assert [p["name"] for p in G.graph["primals"].values()] == ["x", "args[0]", "args[1]"]


def test_level_aten_and_the_make_fx_route_are_one_request_recorded_one_way():
    model = _mlp()
    x = torch.randn(2, 4, dtype=torch.float64)
    A = fxnx.convert(model, x, level="aten")
    B = fxnx.convert(model, x, routes="make_fx")
    assert A.graph["capture_options"] == B.graph["capture_options"]
    assert A.graph["capture_options"]["level"] == "aten"
    assert list(A.nodes(data="target")) == list(B.nodes(data="target"))
