"""Credit routing against torch.autograd, and the rules against hand-computed transports."""

from __future__ import annotations

import copy
import math

import networkx as nx
import pytest
import torch
import torch.fx as fx
import torchvision
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import fxnx

from conftest import TORCHVISION, rel_error
from zoo import CASES

# --- the oracle: plain autograd over an independent trace, in-place ops switched off ----------


def _no_inplace(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    for module in ref.modules():
        if getattr(module, "inplace", False):
            module.inplace = False
    return ref


def autograd_credit(model, inputs, output_credit=None, edit=None):
    """dL/d(output of every node) and dL/d(every parameter), L = <output, output_credit>.

    Each node's output is wrapped in a fresh view, so a node that returns its
    input unchanged still has a gradient of its own. ``edit(gm)`` may change the
    fx graph first (to detach a skip branch).
    """
    ref = _no_inplace(model)
    gm = fx.symbolic_trace(ref)
    for node in gm.graph.nodes:  # functional in-place calls: F.relu(x, inplace=True)
        if node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
    gm.recompile()
    if edit is not None:
        edit(gm)
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = tree_map(
                lambda t: t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t,
                super().run_node(n),
            )
            values[n.name] = out
            return out

    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = Recorder(gm).run(*leaves)
    out_flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    credit = (
        [torch.ones_like(t) for t in out_flat]
        if output_credit is None
        else [t for t in tree_flatten(output_credit)[0] if isinstance(t, torch.Tensor)]
    )
    slots = [
        (name, i, t)
        for name, value in values.items()
        for i, t in enumerate(tree_flatten(value)[0])
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    params = list(ref.named_parameters())
    grads = torch.autograd.grad(
        out_flat, [t for *_, t in slots] + [p for _, p in params], credit, allow_unused=True
    )
    nodes: dict[str, dict[int, torch.Tensor]] = {}
    for (name, i, t), g in zip(slots, grads, strict=False):
        nodes.setdefault(name, {})[i] = torch.zeros_like(t) if g is None else g
    param_grads = {
        n: (torch.zeros_like(p) if g is None else g)
        for (n, p), g in zip(params, grads[len(slots) :], strict=True)
    }
    return nodes, param_grads


def assert_matches_autograd(res, nodes, params, tol):
    worst = 0.0
    for name, expected in nodes.items():
        flat = tree_flatten(res.node_credit[name])[0]
        for i, g in expected.items():
            got = (
                flat[i]
                if i < len(flat) and isinstance(flat[i], torch.Tensor)
                else torch.zeros_like(g)
            )
            err = rel_error(got, g)
            worst = max(worst, err)
            assert err <= tol, f"node {name}[{i}]: relative error {err:.3e}"
    assert set(res.param_credit) <= set(params)
    for name, g in params.items():
        got = res.param_credit.get(name, torch.zeros_like(g))
        err = rel_error(got, g)
        assert err <= tol, f"parameter {name}: relative error {err:.3e}"
    # Not vacuous: credit reached the first input and most nodes.
    nonzero = sum(any(float(g.norm()) > 0 for g in e.values()) for e in nodes.values())
    assert nonzero >= 0.7 * len(nodes)
    first_input = next(iter(nodes))
    assert float(nodes[first_input][0].norm()) > 0
    return worst


# --- exact equals autograd --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["float64", "float32"]
)
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", CASES)
def test_exact_equals_autograd_on_the_zoo(name, mode, dtype, tol):
    case = CASES[name]
    torch.manual_seed(0)
    model = getattr(case.build().to(dtype), mode)()
    inputs = [t.to(dtype) for t in case.inputs()]
    kwargs = {k: v.to(dtype) for k, v in case.kwargs().items()}
    G = fxnx.convert(model, *inputs, kwargs=kwargs)
    res = fxnx.route_credit(G, model, *inputs, kwargs=kwargs)
    all_inputs = inputs + list(kwargs.values())
    if name == "multi_input_kwargs":
        all_inputs = all_inputs + [torch.tensor(2.0, dtype=dtype)]
    nodes, params = autograd_credit(model, all_inputs)
    if name == "multi_input_kwargs":  # the oracle made scale a tensor; fxnx keeps the float
        del nodes["scale"]
    assert_matches_autograd(res, nodes, params, tol=tol)


def _vision_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "vit_b_16":
        model = torchvision.models.vit_b_16(weights=None, image_size=32)
        nn.init.normal_(model.heads.head.weight, std=0.02)  # zero by default: would prove nothing
        nn.init.normal_(model.heads.head.bias, std=0.02)
        return model
    return torchvision.models.get_model(name, weights=None)


def _vision_check(name, mode, dtype, tol, batch=2):
    model = getattr(_vision_model(name).to(dtype), mode)()
    x = torch.randn(batch, 3, 32 if name == "vit_b_16" else 64, 64, dtype=dtype)
    if name == "vit_b_16":
        x = x[..., :32]
    G = fxnx.convert(model, x)
    torch.manual_seed(1)
    res = fxnx.route_credit(G, model, x)
    torch.manual_seed(1)
    nodes, params = autograd_credit(model, [x])
    assert set(params) == {n for n, p in model.named_parameters() if p.requires_grad}
    return assert_matches_autograd(res, nodes, params, tol=tol), res


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["float64", "float32"]
)
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", TORCHVISION)
def test_exact_equals_autograd_on_torchvision(name, mode, dtype, tol):
    _, res = _vision_check(name, mode, dtype, tol=tol)
    if name == "vit_b_16":  # get_attr parameters get their credit
        assert {"class_token", "encoder.pos_embedding"} <= set(res.param_credit)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_exact_equals_autograd_on_resnet18_float64(mode):
    _vision_check("resnet18", mode, torch.float64, tol=1e-12)


def test_exact_equals_autograd_on_resnet18_float32():
    _vision_check("resnet18", "train", torch.float32, tol=1e-5)


def test_output_credit_is_used():
    model = CASES["tuple_output"].build().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    credit = (torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))
    res = fxnx.route_credit(fxnx.convert(model, x), model, x, output_credit=credit)
    nodes, params = autograd_credit(model, [x], output_credit=credit)
    assert_matches_autograd(res, nodes, params, tol=1e-12)


# --- the contract's routing semantics ---------------------------------------------------------


def test_fan_out_sums_and_add_branches():
    model = CASES["skip_block"].build().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x)
    # add sends its credit, unchanged, to both inputs; x sums the residual and the skip credit.
    assert torch.equal(res.node_credit["relu"], res.node_credit["add"])
    W = model.lin.weight
    through_lin = (res.node_credit["relu"] * (res.node_credit["lin"] != 0)) @ W
    assert torch.allclose(res.node_credit["x"], res.node_credit["add"] + through_lin)


def test_removing_a_skip_edge_routes_only_through_the_residual():
    model = torchvision.models.resnet18(weights=None).double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    G = fxnx.convert(model, x)
    full = fxnx.route_credit(G, model, x)
    G.remove_edge("maxpool", "add", 0)
    cut = fxnx.route_credit(G, model, x)

    def detach_skip(gm):  # the oracle: the same add, with its skip input detached
        add = next(n for n in gm.graph.nodes if n.name == "add")
        with gm.graph.inserting_before(add):
            detached = gm.graph.call_method("detach", (add.args[1],))
        add.args = (add.args[0], detached)
        gm.recompile()

    nodes, params = autograd_credit(model, [x], edit=detach_skip)
    for name in ("maxpool", "x", "conv1"):
        assert rel_error(cut.node_credit[name], nodes[name][0]) <= 1e-12
    assert rel_error(cut.node_credit["maxpool"], full.node_credit["maxpool"]) > 0.01
    assert rel_error(cut.param_credit["conv1.weight"], params["conv1.weight"]) <= 1e-12


def test_non_tensor_nodes_carry_no_credit():
    model = CASES["functional_and_methods"].build().double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x)
    assert res.node_credit["size"] is None and res.node_credit["dim"] is None
    assert res.node_credit["x"].shape == x.shape


def test_multi_output_node_credit_is_a_tuple_of_its_slices():
    model = CASES["cat_chunk"].build().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, output_credit=torch.arange(8.0).reshape(2, 4))
    first, second = res.node_credit["chunk"]
    credit = torch.arange(8.0, dtype=torch.float64).reshape(2, 4)
    assert torch.equal(second, credit[:, :2]) and torch.equal(first, credit[:, 2:])
    assert torch.equal(res.node_credit["x"], torch.cat([credit[:, 2:], credit[:, :2]], 1))


def test_credit_norm_is_written_onto_g():
    model = CASES["skip_block"].build()
    x = torch.randn(2, 4)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x)
    assert G.nodes["add"]["credit_norm"] == pytest.approx(float(res.node_credit["add"].norm()))
    assert G.graph["credit_rule"] == "exact"
    assert type(G.nodes["x"]["credit_norm"]) is float


def test_credit_norms_of_many_small_credits_are_each_credit_s_own():
    """Small credits of one shape are stacked for their norms (one norm, not hundreds, on a
    deep MLP). Oracle: torch.linalg.vector_norm of each credit on its own, to 1e-12; of every
    kind of group: one shape many times, a shape once, large, empty, float32 beside float64,
    a view, and a tuple of tensors."""
    from fxnx._credit.result import credit_norms

    gen = torch.Generator().manual_seed(0)
    credits = {f"small{i}": torch.randn(1, 128, dtype=torch.float64, generator=gen) * i for i in range(40)}
    credits |= {
        "once": torch.randn(3, 5, dtype=torch.float64, generator=gen),
        "large": torch.randn(200, 200, dtype=torch.float64, generator=gen),
        "empty": torch.zeros(0, 128, dtype=torch.float64),
        "single": torch.randn(7, generator=gen), "single2": torch.randn(7, generator=gen),
        "view": torch.randn(128, 1, dtype=torch.float64, generator=gen).T,
        "pair": (torch.randn(2, 2, generator=gen), torch.randn(3, generator=gen)),
        "none": None,
    }
    got = credit_norms(credits)
    assert got["none"] is None
    for name, credit in credits.items():
        if credit is None:
            continue
        parts = credit if isinstance(credit, tuple) else (credit,)
        want = math.sqrt(sum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in parts))
        tolerance = 1e-12 if all(t.dtype == torch.float64 for t in parts) else 1e-6
        assert abs(got[name] - want) <= tolerance * max(want, 1e-300), name


# --- no side effects --------------------------------------------------------------------------


def test_no_side_effects_in_train_mode():
    model = torchvision.models.resnet18(weights=None).train()
    x = torch.randn(2, 3, 64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    G = fxnx.convert(model, x)
    torch.manual_seed(5)
    fxnx.route_credit(G, model, x)
    rng_after = torch.get_rng_state()
    torch.manual_seed(5)
    assert torch.equal(rng_after, torch.get_rng_state())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.training and all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert int(model.bn1.num_batches_tracked) == 0


def test_output_is_unchanged_afterwards_in_eval_mode():
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert torch.equal(res.output, before)


def test_inplace_relu_gives_the_credit_of_inplace_off():
    torch.manual_seed(0)
    model = CASES["inplace_relu"].build().double()
    off = _no_inplace(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    on_res = fxnx.route_credit(fxnx.convert(model, x), model, x)
    off_res = fxnx.route_credit(fxnx.convert(off, x), off, x)
    for name, credit in off_res.node_credit.items():
        if credit is not None:
            assert torch.equal(on_res.node_credit[name], credit), name
    assert model.act.inplace  # the model itself is untouched


# --- rules ------------------------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def test_feedback_alignment_transports_through_b_by_hand():
    model = _mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, rule="feedback_alignment")
    B = res.feedback["_2"]
    assert B.shape == model[2].weight.shape
    # Credit at the tanh output is the output credit through B, not through W.
    assert torch.allclose(res.node_credit["_1"], torch.ones(4, 3, dtype=torch.float64) @ B)
    # The layer's own weight credit is exact given the credit at its output.
    assert torch.allclose(
        res.param_credit["2.weight"], torch.ones(4, 3).double().T @ torch.tanh(model[0](x))
    )
    assert res.rules == {
        "output": "exact",
        "_2": "feedback_alignment",
        "_1": "exact",
        "_0": "feedback_alignment",
    }
    assert "feedback_alignment on 2 nodes" in res.describe()


def test_feedback_alignment_with_b_equal_to_w_reproduces_exact():
    model = torchvision.models.resnet18(weights=None).double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    G = fxnx.convert(model, x)
    exact = fxnx.route_credit(G, model, x)
    weights = {
        n: model.get_submodule(d["target"]).weight.detach().clone()
        for n, d in G.nodes(data=True)
        if d["op"] == "call_module" and d["module_type"].endswith(("Conv2d", "Linear"))
    }
    fa = fxnx.route_credit(G, model, x, rule="feedback_alignment", feedback=weights)
    assert sum(r == "feedback_alignment" for r in fa.rules.values()) == 21
    for name, credit in exact.node_credit.items():
        if credit is not None:
            assert rel_error(fa.node_credit[name], credit) <= 1e-12, name
    for name, credit in exact.param_credit.items():
        assert rel_error(fa.param_credit[name], credit) <= 1e-12, name


def test_random_feedback_differs_and_is_reproducible():
    model = torchvision.models.resnet18(weights=None).double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    G = fxnx.convert(model, x)
    exact = fxnx.route_credit(G, model, x)
    a = fxnx.route_credit(G, model, x, rule="feedback_alignment", seed=3)
    b = fxnx.route_credit(G, model, x, rule="feedback_alignment", seed=3)
    c = fxnx.route_credit(G, model, x, rule="feedback_alignment", seed=4)
    assert torch.equal(a.node_credit["x"], b.node_credit["x"])
    assert not torch.equal(a.node_credit["x"], c.node_credit["x"])
    angles = fxnx.credit.credit_alignment(a, exact)
    assert angles["fc"]["angle"] < 1e-6  # nothing above fc: its credit is exact
    assert angles["flatten"]["angle"] > 30  # through a random B: another direction
    assert angles["layer1_0_conv1"]["rel_error"] > 0.5


def test_sign_symmetry_transports_through_sign_w():
    model = _mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x, rule="usf")
    scale = math.sqrt(2 / (7 + 3))  # BioTorch's uSF: sign(W) times W's Xavier standard deviation
    expected = torch.ones(4, 3, dtype=torch.float64) @ model[2].weight.detach().sign().mul_(scale)
    assert torch.equal(res.node_credit["_1"], expected)


def test_feedback_alignment_on_a_conv_matches_torch_nn_grad():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3)
    ).double()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x, rule="feedback_alignment")
    B = res.feedback["_2"]
    relu_out = model[1](model[0](x))
    expected = torch.nn.grad.conv2d_input(relu_out.shape, B, res.node_credit["_2"])
    assert torch.allclose(res.node_credit["_1"], expected)


def test_feedback_alignment_on_same_padding_conv():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding="same", padding_mode="reflect")).double()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    G = fxnx.convert(model, x)
    fa = fxnx.route_credit(
        G, model, x, rule="feedback_alignment", feedback={"_0": model[0].weight.detach()}
    )
    exact = fxnx.route_credit(G, model, x)
    assert rel_error(fa.node_credit["input_1"], exact.node_credit["input_1"]) <= 1e-12


def test_user_rule_by_node_name_is_the_one_called():
    model = _mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    calls = []

    def halve(call, credit, state):
        calls.append(call.name)
        inputs, params = call.exact(credit)
        return [None if c is None else c / 2 for c in inputs], params

    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, rules={"_1": halve})
    exact = fxnx.route_credit(G, model, x)
    assert calls == ["_1"]
    assert res.rules["_1"] == "halve"
    assert torch.allclose(res.node_credit["_0"], exact.node_credit["_0"] / 2)
    assert torch.equal(res.node_credit["_1"], exact.node_credit["_1"])


def test_user_rule_by_kind_and_a_preset_of_ones_own():
    model = _mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    G = fxnx.convert(model, x)

    def block(call, credit, state):
        return [None] * len(call.inputs), {}

    res = fxnx.route_credit(G, model, x, rules={nn.Tanh: block})
    assert res.node_credit["_0"] is None and res.rules["_1"] == "block"
    res = fxnx.route_credit(G, model, x, rule=fxnx.credit.Preset("block_tanh", {nn.Tanh: block}))
    assert res.node_credit["_0"] is None and res.rules["_1"] == "block"
    assert res.rule == "block_tanh" and G.graph["credit_rule"] == "block_tanh"


def test_a_preset_that_applies_nowhere_says_so():
    model = nn.Sequential(nn.Tanh())
    x = torch.randn(2)
    with pytest.warns(UserWarning, match="applies to no node"):
        fxnx.route_credit(fxnx.convert(model, x), model, x, rule="feedback_alignment")


# --- bad input --------------------------------------------------------------------------------


def _skip():
    model = CASES["skip_block"].build()
    x = torch.randn(2, 4)
    return fxnx.convert(model, x), model, x


def test_unknown_rule_lists_the_known_ones():
    G, model, x = _skip()
    with pytest.raises(
        ValueError, match="unknown rule 'fa'; known rules: exact, feedback_alignment"
    ):
        fxnx.route_credit(G, model, x, rule="fa")


def test_a_cycle_is_refused():
    G, model, x = _skip()
    u, v, data = next(iter(G.in_edges("lin", data=True)))
    G.add_edge("add", "lin", **data)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"G has a cycle \(.*'add' -> 'lin'"):
        fxnx.route_credit(G, model, x)


def test_a_missing_node_is_refused():
    G, model, x = _skip()
    G.remove_node("relu")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"lacks nodes the model computes: \['relu'\]"):
        fxnx.route_credit(G, model, x)


def test_an_edge_the_model_lacks_is_refused():
    G, model, x = _skip()
    (_, _, data), *_ = G.in_edges("relu", data=True)
    G.add_edge("x", "relu", **data)  # a well-formed edge the model does not have
    with pytest.raises(fxnx.errors.FxnxValueError, match="x -> relu .* not an input of node 'relu'"):
        fxnx.route_credit(G, model, x)


def test_a_graph_of_another_model_is_refused():
    G, _, x = _skip()
    with pytest.raises(fxnx.errors.FxnxValueError, match="lacks nodes"):
        fxnx.route_credit(G, nn.Sequential(nn.Linear(4, 4)), x)


def test_output_credit_of_the_wrong_shape_is_refused():
    G, model, x = _skip()
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"output_credit has shape \(3,\)"):
        fxnx.route_credit(G, model, x, output_credit=torch.ones(3))
    with pytest.raises(TypeError, match="MultiDiGraph"):
        fxnx.route_credit(nx.DiGraph(), model, x)


class _MethodInplace(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inplace = inplace

    def forward(self, x):
        h = self.lin(x)
        h = h.relu_() if self.inplace else h.relu()
        return h * 2 + x


class _HiddenInplace(nn.Module):
    """A leaf module whose in-place write fxnx cannot see from the graph."""

    def forward(self, x):
        y = x.clone() if not self.training else x
        return y.mul_(3) if self.training else y.mul(3)


def test_method_and_hidden_inplace_writes_route_as_out_of_place():
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    on, off = _MethodInplace(True).double(), _MethodInplace(False).double()
    off.load_state_dict(on.state_dict())
    on_res = fxnx.route_credit(fxnx.convert(on, x), on, x)
    off_res = fxnx.route_credit(fxnx.convert(off, x), off, x)
    assert torch.equal(on_res.node_credit["x"], off_res.node_credit["x"])
    assert torch.equal(on_res.param_credit["lin.weight"], off_res.param_credit["lin.weight"])
    outer = nn.Sequential(nn.Linear(4, 4), _HiddenInplace()).double()
    G = fxnx.convert(outer, x, leaf_modules=[_HiddenInplace])
    res = fxnx.route_credit(G, outer, x, leaf_modules=[_HiddenInplace])  # train: writes in place
    assert torch.equal(res.node_credit["_0"], torch.full((3, 4), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("given", [1.0, 1, "ones", (1.0,)], ids=["float", "int", "str", "tuple"])
def test_output_credit_of_the_wrong_kind_names_what_was_expected(given):
    G, model, x = _skip()
    with pytest.raises(fxnx.errors.FxnxTypeError, match=r"output_credit must be a tensor of shape \(2, 4\)"):
        fxnx.route_credit(G, model, x, output_credit=given)


def test_output_credit_none_for_one_output_routes_nothing_there():
    model = _TwoOutputs()
    x = torch.randn(2, 3)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, output_credit=(torch.ones(2, 3), None))
    nodes, _ = autograd_credit(model, [x], output_credit=(torch.ones(2, 3), torch.zeros(2, 3)))
    assert torch.equal(res.node_credit["x"], nodes["x"][0])


class _TwoOutputs(nn.Module):
    def forward(self, x):
        return x * 2, x.sin()


def test_a_wrong_input_shape_names_the_node():
    G, model, x = _skip()
    with pytest.raises(fxnx.errors.ShapePropagationError, match=r"(?s)fx node '.*' \(call_module .*Linear.*input shapes"):
        fxnx.route_credit(G, model, torch.randn(3, 7))


def test_a_graph_that_breaks_the_contract_is_refused_by_name():
    G, model, x = _skip()
    G.nodes["lin"]["num_params"] = "many"
    with pytest.raises(fxnx.errors.GraphContractError, match=r"node 'lin'.*num_params"):
        fxnx.route_credit(G, model, x)


class _FunctionalBatchNorm(nn.Module):
    """BatchNorm as timm's BatchNormAct2d writes it: buffers passed to F.batch_norm, so a traced
    graph reads them through get_attr instead of calling an nn.BatchNorm2d leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        nn.init.uniform_(self.bn.weight, 0.5, 1.5)  # not the default ones: a real oracle
        nn.init.uniform_(self.bn.bias, -0.5, 0.5)

    def forward(self, x):
        h = self.conv(x)
        bn = self.bn
        h = nn.functional.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                     self.training, bn.momentum, bn.eps)
        return torch.relu(h).mean((2, 3))


def _autograd_param_and_input_credit(model, x):
    ref = copy.deepcopy(model)
    x_ = x.clone().requires_grad_()
    out = ref(x_)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.sum(), [x_, *[p for _, p in ref.named_parameters()]])
    return grads[0], dict(zip(names, grads[1:], strict=True))


@pytest.mark.parametrize("routes", ["symbolic_trace", "export"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_buffers_read_through_get_attr_are_constants(routes, mode):
    torch.manual_seed(0)
    model = getattr(_FunctionalBatchNorm().double(), mode)()
    model.bn.running_mean.uniform_(-1, 1)  # eval mode reads them: not the default zeros
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=routes)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    res = fxnx.route_credit(G, model, x)
    want_x, want = _autograd_param_and_input_credit(model, x)
    assert rel_error(res.node_credit[G.graph["inputs"][0]["name"]], want_x) <= 1e-12
    assert sorted(res.param_credit) == sorted(want)
    for name, g in want.items():
        assert rel_error(res.param_credit[name], g) <= 1e-12, name
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in stats.items())


def test_a_tensor_constant_leaves_no_attribute_on_the_model():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * torch.tensor([1.0, 2.0, 3.0])

    model, x = Scaled(), torch.randn(2, 3)
    before = (set(vars(model)), dict(model.named_buffers()), dict(model.named_parameters()))
    G1 = fxnx.convert(model, x)
    G2 = fxnx.convert(model, x)
    assert nx.utils.graphs_equal(G1, G2)
    assert (set(vars(model)), dict(model.named_buffers()), dict(model.named_parameters())) == before
    res = fxnx.route_credit(G1, model, x)  # re-captures: the same names again
    assert (set(vars(model)), dict(model.named_buffers())) == before[:2]
    x_ = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(x_).sum(), x_)
    assert torch.allclose(res.node_credit["x"], want, rtol=0, atol=1e-6)


class _CountingCapture:
    def __init__(self, monkeypatch):
        from fxnx._capture import reuse as _reuse

        self.calls = 0
        real = _reuse.capture

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(_reuse, "capture", counted)


def _input_and_weight_credit(model, x, weight):
    ref = copy.deepcopy(model)
    x_ = x.clone().requires_grad_()
    return torch.autograd.grad(ref(x_).sum(), [x_, ref.get_parameter(weight)])


@pytest.mark.parametrize("routes", ["symbolic_trace", "export"])
def test_the_capture_is_reused_while_only_parameter_values_change(routes, monkeypatch):
    torch.manual_seed(0)
    model = CASES["skip_block"].build().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=routes)
    counter = _CountingCapture(monkeypatch)
    for step in range(3):
        res = fxnx.route_credit(G, model, x * (step + 1))
        want_x, want_w = _input_and_weight_credit(model, x * (step + 1), "lin.weight")
        assert rel_error(res.node_credit[G.graph["inputs"][0]["name"]], want_x) <= 1e-12
        assert rel_error(res.param_credit["lin.weight"], want_w) <= 1e-12
        with torch.no_grad():  # what an optimizer step does: values change in place
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    assert counter.calls == 1


def test_a_changed_structure_is_captured_again(monkeypatch):
    torch.manual_seed(0)
    model = CASES["skip_block"].build().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    counter = _CountingCapture(monkeypatch)
    fxnx.route_credit(G, model, x)
    model.lin = nn.Linear(4, 4).double()  # same shapes, another module
    res = fxnx.route_credit(G, model, x)
    _, want_w = _input_and_weight_credit(model, x, "lin.weight")
    assert rel_error(res.param_credit["lin.weight"], want_w) <= 1e-12
    model.eval()  # was in training mode
    fxnx.route_credit(G, model, x)
    assert counter.calls == 3
    x5 = torch.randn(5, 4, dtype=torch.float64)
    res = fxnx.route_credit(G, model, x5)  # a symbolic trace holds for any batch size
    assert counter.calls == 3
    want_x, _ = _input_and_weight_credit(model, x5, "lin.weight")
    assert rel_error(res.node_credit["x"], want_x) <= 1e-12


@pytest.mark.parametrize("leaf", ["act", nn.Tanh], ids=["name", "class"])
def test_a_single_leaf_module_spec_is_not_split_into_characters(leaf):
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.act = nn.Tanh()

        def forward(self, x):
            return self.act(self.lin(x))

    model, x = Block().double(), torch.randn(2, 3, dtype=torch.float64)
    G = fxnx.convert(model, x, leaf_modules=leaf)
    res = fxnx.route_credit(G, model, x, leaf_modules=leaf)
    x_ = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(x_).sum(), x_)
    assert rel_error(res.node_credit["x"], want) <= 1e-12


def test_a_changed_plain_attribute_is_captured_again():
    """Symbolic tracing bakes `self.scale` into the graph: changing it must not reuse the graph."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = 1.0

        def forward(self, x):
            return self.lin(x) * self.scale

    model, x = Scaled().double(), torch.randn(2, 3, dtype=torch.float64)
    G = fxnx.convert(model, x)
    fxnx.route_credit(G, model, x)
    model.scale = 5.0
    res = fxnx.route_credit(G, model, x)
    want_x, _ = _input_and_weight_credit(model, x, "lin.weight")
    assert rel_error(res.node_credit["x"], want_x) <= 1e-12


def test_the_capture_cache_keeps_no_model_alive():
    import gc
    import weakref

    class Child(nn.Module):
        def forward(self, x):
            return x * 2

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Child()
            self.child.__dict__["parent"] = self  # a back-reference, as some codebases keep

        def forward(self, x):
            return self.child(x) + 1

    model, x = Parent(), torch.randn(2, 3)
    G = fxnx.convert(model, x, leaf_modules=[Child])
    fxnx.route_credit(G, model, x, leaf_modules=[Child])
    ref = weakref.ref(model)
    del model, G
    gc.collect()
    assert ref() is None


def test_the_kept_capture_stays_out_of_copies_and_pickles():
    import pickle

    model, x = CASES["skip_block"].build(), torch.randn(2, 4)
    G = fxnx.convert(model, x)
    fxnx.route_credit(G, model, x)
    plain = pickle.dumps(G)  # what a user's own pickle.dump writes
    assert b"fxnx._capture" not in plain and b"GraphModule" not in plain and b"torch.fx" not in plain
    H = pickle.loads(plain)
    assert nx.utils.graphs_equal(G, H) and nx.utils.graphs_equal(G, copy.deepcopy(G))
    res = fxnx.route_credit(H, model, x)  # an unpickled graph routes as well
    assert res.node_credit["x"] is not None


def test_repeated_calls_compile_the_plan_once_and_follow_edits_of_g(monkeypatch):
    from fxnx._credit import router as engine

    compiled = []
    real = engine.compile_plan
    monkeypatch.setattr(engine, "compile_plan", lambda *a, **k: compiled.append(1) or real(*a, **k))
    G, model, x = _skip()
    first = fxnx.route_credit(G, model, x)
    again = fxnx.route_credit(G, model, x)
    assert len(compiled) == 1  # the second call reused the plan
    assert all(torch.equal(first.param_credit[k], again.param_credit[k]) for k in first.param_credit)
    u, v, key = next((u, v, k) for u, v, k in G.edges(keys=True) if v == "add")
    G.remove_edge(u, v, key)  # an edit of G: a new plan, and credit that follows the cut
    cut = fxnx.route_credit(G, model, x)
    assert len(compiled) == 2
    fresh = fxnx.route_credit(copy.deepcopy(G), model, x)  # a copy starts without kept routers
    assert all(torch.equal(cut.param_credit[k], fresh.param_credit[k]) for k in fresh.param_credit)
    assert all(torch.equal(cut.node_credit[k], fresh.node_credit[k]) for k in fresh.node_credit
               if fresh.node_credit[k] is not None)
    assert not torch.equal(cut.node_credit["x"], first.node_credit["x"])  # the cut shows
    fxnx.route_credit(G, model, x, rule="brsf")
    fxnx.route_credit(G, model, x, rule="brsf")
    assert len(compiled) == 5  # (the deep copy's, then) brSF redraws per run: never kept


def test_routers_kept_on_a_graph_stay_out_of_its_pickles():
    """A graph loaded from a pickle, routed again, still pickles without the kept router."""
    import pickle

    G, model, x = _skip()
    fxnx.route_credit(G, model, x)
    loaded = pickle.loads(pickle.dumps(G))
    fxnx.route_credit(loaded, model, x)  # keeps a router on the loaded graph
    data = pickle.dumps(loaded)
    assert b"fxnx.credit" not in data  # no router object in the file
    assert vars(pickle.loads(data))["_fxnx_routers"] == {}


def test_a_result_shows_as_a_summary_not_its_tensors():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x)
    text = repr(res)
    assert len(text) < 300 and "tensor(" not in text
    n_params = len(list(model.parameters()))
    assert f"credit at {len(res.node_credit)} of {len(res.node_credit)} nodes, {n_params} parameters" in text
    assert "output (1, 1000)" in text and text.startswith("CreditResult(rule='exact'")
