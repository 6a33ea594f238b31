"""Capture: clear errors on bad input, and no trace left on the model."""

from __future__ import annotations

import threading

import networkx as nx
import pytest
import torch
from torch import nn

import fxnx
import fxnx._analysis


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # the line the error must name
            return self.lin(x)
        return x


class Gate(nn.Module):
    def forward(self, x):
        if x.mean() > 0:
            return x
        return -x


class HasGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.gate(self.lin(x))


@pytest.mark.parametrize("bad", [42, "resnet18", None, [nn.Linear(2, 2)]])
def test_not_a_model_is_a_type_error_naming_what_was_received(bad):
    with pytest.raises(TypeError, match=f"torch.nn.Module or a callable, got {type(bad).__name__}"):
        fxnx.convert(bad)


def test_a_model_name_string_gets_a_hint():
    with pytest.raises(fxnx.errors.FxnxTypeError, match=r"get_model\('resnet18', weights=None\)"):
        fxnx.convert("resnet18")


def test_wrong_input_shape_names_node_target_and_shapes():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(fxnx.errors.ShapePropagationError) as info:
        fxnx.convert(model, torch.randn(5, 8))
    message = str(info.value)
    assert "fx node '_2'" in message
    assert "call_module 2 (Linear)" in message
    assert "(5, 4) torch.float32" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message
    assert "tlparse" not in message and "While executing" not in message
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is not None


def test_wrong_input_shape_on_resnet18(torchvision_model):
    with pytest.raises(fxnx.errors.ShapePropagationError, match=r"(?s)fx node 'conv1' .*\(1, 1, 64, 64\)"):
        fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 1, 64, 64))


def test_data_dependent_control_flow_names_the_line_and_what_to_do():
    with pytest.raises(fxnx.errors.CaptureError) as info:
        fxnx.convert(DataDependent(), torch.randn(2, 4), routes="symbolic_trace")
    message = str(info.value)
    assert "test_tracing.py" in message
    assert "if x.sum() > 0:" in message
    assert "concrete_args" in message
    assert isinstance(info.value, RuntimeError)


def test_control_flow_in_a_submodule_suggests_that_leaf():
    with pytest.raises(fxnx.errors.CaptureError, match=r"(?s)if x.mean\(\) > 0.*leaf_modules=\['gate'\]"):
        fxnx.convert(HasGate(), torch.randn(2, 4), routes="symbolic_trace")


def test_the_suggested_leaf_module_works():
    G = fxnx.convert(HasGate(), torch.randn(2, 4), leaf_modules=["gate"])
    assert G.nodes["gate"]["op"] == "call_module"
    assert G.nodes["gate"]["out_shape"] == (2, 4)


def test_inputs_that_do_not_fit_forward_are_a_type_error():
    with pytest.raises(fxnx.errors.FxnxTypeError, match=r"ReLU.forward\(input: torch.Tensor\).*too many positional"):
        fxnx.convert(nn.ReLU(), torch.randn(2), torch.randn(2))
    with pytest.raises(fxnx.errors.FxnxTypeError, match="missing 'y'"):
        fxnx.convert(lambda x, y: x + y, torch.randn(2))


def test_unknown_leaf_module_name_suggests_real_ones():
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"'lin2'.*did you mean one of \['lin'\]"):
        fxnx.convert(HasGate(), torch.randn(2, 4), leaf_modules=["lin2"])
    with pytest.raises(fxnx.errors.FxnxTypeError, match="leaf_modules entries"):
        fxnx.convert(HasGate(), torch.randn(2, 4), leaf_modules=[3])


def _state(model: nn.Module):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_train_mode_conversion_leaves_batchnorm_stats_and_rng_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.ReLU()).train()
    before = _state(model)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    x = torch.randn(2, 3, 8, 8)
    rng_mid = torch.get_rng_state()
    G = fxnx.convert(model, x)
    assert torch.equal(torch.get_rng_state(), rng_mid)
    assert not torch.equal(rng_before, rng_mid)  # the check above could fail
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert model.training and all(m.training for m in model.modules())
    assert G.nodes["_1"]["out_shape"] == (2, 4, 6, 6)


def test_running_the_model_really_would_change_the_stats():
    """Guard for the test above: without fxnx's care, a train-mode forward moves them."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    before = _state(model)
    model(torch.randn(2, 3, 8, 8))
    assert not torch.equal(before["1.running_mean"], model.state_dict()["1.running_mean"])


class _WritesIntoItsInput(nn.Module):
    def forward(self, x, ids):
        x.add_(1)
        ids.mul_(2)
        return x * 2, ids


# (level="joint" refuses such a model, as autograd does: its input is a leaf that needs grad.)
@pytest.mark.parametrize("level", ["module", "aten"])
def test_example_inputs_are_not_modified_by_a_model_that_writes_into_them(level):
    model, x, ids = _WritesIntoItsInput(), torch.randn(3, 4), torch.arange(3)
    x_before, ids_before = x.clone(), ids.clone()
    G = fxnx.convert(model, x, ids, level=level)
    assert torch.equal(x, x_before) and torch.equal(ids, ids_before)
    assert G.graph["inputs"][0]["shape"] == (3, 4)
    # The guard: the model really does write into what it is given.
    model(x, ids)
    assert torch.equal(x, x_before + 1) and torch.equal(ids, ids_before * 2)


def test_inplace_relu_leaves_the_example_input_alone():
    model, x = nn.Sequential(nn.ReLU(inplace=True)), torch.randn(3, 4)
    x_before = x.clone()
    fxnx.convert(model, x)
    fxnx.route_credit(fxnx.convert(model, x), model, x)
    assert torch.equal(x, x_before)


def test_concurrent_conversions_give_the_serial_graphs():
    """torch.fx patches nn.Module.__call__ process-wide while tracing: fxnx serialises it."""
    cases = [
        (nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)]), torch.randn(2, 8)),
        (nn.Sequential(*[nn.Conv2d(3, 3, 3, padding=1) for _ in range(20)]), torch.randn(1, 3, 8, 8)),
    ]
    want = [fxnx.convert(m, x) for m, x in cases]
    errors, barrier = [], threading.Barrier(len(cases))

    def work(i: int) -> None:
        model, x = cases[i]
        barrier.wait()
        for _ in range(10):
            try:
                G = fxnx.convert(model, x)
                if not nx.utils.graphs_equal(G, want[i]):
                    errors.append(f"thread {i}: a different graph")
            except Exception as err:  # noqa: BLE001 - any failure is the defect
                errors.append(f"thread {i}: {type(err).__name__}: {err}"[:200])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


class _NoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1, 1, 3))

    def forward(self):
        return torch.tanh(self.p) * 2


def test_a_model_without_inputs_converts_summarises_draws_and_routes(tmp_path):
    model = _NoInputs()
    G = fxnx.convert(model)
    assert sorted(G) == ["mul", "output", "p", "tanh"] and G.nodes["mul"]["out_shape"] == (3,)
    assert "get_attr" in fxnx._analysis.format_summary(fxnx.summary(G))
    assert fxnx.skip_connections(G) == []
    assert fxnx.draw(G, tmp_path / "g.dot").read_text().startswith("digraph")
    res = fxnx.route_credit(G, model)
    p = model.p.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad((torch.tanh(p) * 2).sum(), p)
    assert torch.equal(res.param_credit["p"], want)
