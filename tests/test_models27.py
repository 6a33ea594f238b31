"""Issue 27: every model that converts routes credit exactly or says why.

Oracles: the eager model's output and autograd on the model itself (float64, relative norm
error at most 1e-10), for writes in place into intermediates (through views, ``copy_``,
``setitem``, inside wrapped functions and modules kept whole), shape propagation that fails
where the model runs, floats without gradient, and forwards that change from call to call;
the same on torchvision's MViT, Swin3D, SSDLite and SSD300 (slow).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import zoo27
from torch import nn

import fxnx
from fxnx._capture.ladder import capture
from fxnx._capture.registry import ROUTES
from fxnx._credit import faithful
from fxnx._credit import router as engine

from conftest import rel_error

TOL = 1e-10


def _autograd(model: nn.Module, x: torch.Tensor):
    """The eager output and autograd's gradient of ``output.sum()`` at the input and at every
    trainable parameter."""
    x_ = x.clone().requires_grad_()
    out = model(x_)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.sum(), [x_, *(p for _, p in named)], allow_unused=True)
    params = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads[1:], strict=True)}
    return out.detach(), grads[0], params


def _input(G) -> str:
    return next(n for n in G if G.nodes[n]["op"] == "placeholder")


def _assert_exact(res, G, model, x) -> None:
    out, gx, gp = _autograd(model, x)
    assert rel_error(res.output, out) <= TOL
    assert rel_error(res.node_credit[_input(G)], gx) <= TOL
    for name, g in gp.items():
        assert rel_error(res.param_credit.get(name, torch.zeros_like(g)), g) <= TOL, name


def _built(cls, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls().double()


# --- 1. writes in place into intermediates ---------------------------------------------------

@pytest.mark.parametrize("routes", ["auto", "export"])
@pytest.mark.parametrize("case", list(zoo27.WRITES))
def test_a_write_in_place_is_followed_by_route_credit(case, routes):
    model = _built(zoo27.WRITES[case])
    x = torch.randn(5, 4, dtype=torch.float64)
    leaves = [zoo27.Bump] if case == "hidden_write" and routes == "auto" else []
    G = fxnx.convert(model, x, routes=routes, leaf_modules=leaves)
    res = fxnx.route_credit(G, model, x)
    _assert_exact(res, G, model, x)
    again = fxnx.route_credit(G, model, x)  # the graft kept on G: same credit
    assert torch.equal(again.node_credit[_input(G)], res.node_credit[_input(G)])


@pytest.mark.parametrize("routes", ["auto", "export"])
@pytest.mark.parametrize("case", list(zoo27.WRITES))
def test_a_write_in_place_is_followed_by_the_router(case, routes):
    model = _built(zoo27.WRITES[case])
    x = torch.randn(5, 4, dtype=torch.float64)
    leaves = [zoo27.Bump] if case == "hidden_write" and routes == "auto" else []
    router = fxnx.CreditRouter(fxnx.convert(model, x, routes=routes, leaf_modules=leaves), model)
    out, _, gp = _autograd(model, x)
    for _ in range(2):  # the first call checks against the captured graph, the second does not
        model.zero_grad(set_to_none=True)
        got = router(x)
        assert rel_error(got.detach(), out) <= TOL
        got.sum().backward()
        for name, p in model.named_parameters():
            assert rel_error(p.grad, gp[name]) <= TOL, name


def test_the_credit_of_a_value_written_later_is_that_of_the_value_it_computed():
    model = _built(zoo27.SliceIadd)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x)
    # The same computation written out of place: the gradient at h as the linear layer made it.
    h = model.l(x).detach().requires_grad_()
    written = torch.cat([h[:, :2] + model.m(x), h[:, 2:]], 1)
    (want,) = torch.autograd.grad((written * 2).sum(), h)
    assert G.graph["capture"] == "export"
    assert rel_error(res.node_credit["linear"], want) <= TOL
    assert rel_error(res.node_credit["slice_1"], torch.full((5, 2), 2.0, dtype=torch.float64)) <= TOL


def test_a_rule_that_runs_a_written_node_apart_is_refused():
    model = _built(zoo27.SliceIadd)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    mine = {"add_": lambda call, credit, state: call.exact(credit)}
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"node 'add_' writes in place .*route it exactly"):
        fxnx.route_credit(G, model, x, rules=mine)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"node 'add_' writes in place"):
        fxnx.CreditRouter(G, model, rules=mine)(x)


def test_cutting_the_edge_a_write_goes_through_is_refused():
    model = _built(zoo27.SliceIadd)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    G.remove_edge("slice_1", "add_")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"no edge 'slice_1' -> 'add_'.*cannot be cut"):
        fxnx.route_credit(G, model, x)
    H = fxnx.convert(model, x)
    H.remove_edge("linear_1", "add_")  # what is written, not what it is written into: fine
    res = fxnx.route_credit(H, model, x)
    assert "m.weight" not in res.param_credit
    assert rel_error(res.output, model(x)) <= TOL


def test_a_credit_run_that_loses_a_write_is_refused(monkeypatch):
    # A probe that saw no write: the graft runs every write out of place, as before issue 27.
    real = engine.probe
    monkeypatch.setattr(engine, "probe", lambda gm, values: faithful.Probe(output=real(gm, values).output))
    model = _built(zoo27.SliceIadd)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"does not compute what the captured graph computes"):
        fxnx.route_credit(G, model, x)


def test_a_graph_that_computes_another_output_than_the_model_is_refused(monkeypatch):
    real = engine.probe

    def off(gm, values):
        seen = real(gm, values)
        return faithful.Probe(seen.writers, seen.written, seen.observed, seen.shared, seen.output + 1)

    monkeypatch.setattr(engine, "probe", off)
    model = _built(zoo27.SliceIadd)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"does not compute what the model computes.*model\.eval\(\)"):
        fxnx.route_credit(G, model, x)


def test_the_output_check_tells_what_differs():
    a = torch.ones(3, dtype=torch.float64)
    assert faithful.differs(a, a.clone()) is None
    assert faithful.differs(a + 1e-14, a) is None
    assert "differs by" in faithful.differs(a * 1.1, a)
    assert "shape (2,)" in faithful.differs(a[:2], a)
    assert "NaN" in faithful.differs(torch.tensor([float("nan")]), torch.tensor([0.0]))
    assert faithful.differs((a,), (a, a)) is None  # structures that cannot be lined up


# --- 2. a graph that fails shape propagation moves the ladder on -------------------------------

def test_a_function_that_changes_its_list_argument_converts_and_routes():
    # torchvision's Swin3D: shape propagation used to pass torch.fx's read-only lists.
    model = _built(zoo27.MutatesList)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "symbolic_trace"
    _assert_exact(fxnx.route_credit(G, model, x), G, model, x)


def test_a_graph_that_fails_shape_propagation_moves_on_to_the_next_route(monkeypatch):
    route = ROUTES["symbolic_trace"]

    def broken(*args):
        result = route.run(*args)
        for node in result.gm.graph.nodes:
            if node.op == "call_module":
                node.target = "missing"  # a graph that fails where the model runs
        result.gm.recompile()
        return result

    monkeypatch.setitem(ROUTES, "symbolic_trace", type(route)(route.name, route.level, route.needs_inputs, broken))
    cap = capture(nn.Sequential(nn.ReLU(), nn.Linear(4, 2)), (torch.randn(3, 4),))
    assert cap.method == "export"
    (name, why), = cap.failures
    assert name == "symbolic_trace" and "shape propagation" in why


def test_wrong_input_shapes_still_name_the_node():
    with pytest.raises(fxnx.errors.ShapePropagationError, match=r"(?s)fx node '_1'.*\(3, 5\)"):
        capture(nn.Sequential(nn.ReLU(), nn.Linear(4, 2)), (torch.randn(3, 5),))


# --- 3. floats that carry no gradient are constants ------------------------------------------

@pytest.mark.parametrize("routes", ["symbolic_trace", "export"])
@pytest.mark.parametrize("rule", ["exact", "feedback_alignment", "histc_rule"])
def test_a_float_without_gradient_is_a_constant(routes, rule):
    model = _built(zoo27.Histc)
    x = torch.randn(5, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=routes)
    histc = next(n for n in G if "histc" in n)
    options = {"rules": {histc: lambda call, credit, state: call.exact(credit)}} if rule == "histc_rule" else {
        "rule": rule}
    res = fxnx.route_credit(G, model, x, **options)
    router = fxnx.CreditRouter(G, model, **options)
    router(x).sum().backward()
    assert res.node_credit[histc] is None  # a constant: no credit
    if rule != "feedback_alignment":
        _assert_exact(res, G, model, x)
        _, _, gp = _autograd(model, x)
        for name, p in model.named_parameters():
            assert rel_error(p.grad, gp[name]) <= TOL


def test_feedback_alignment_on_an_exported_first_layer_whose_input_needs_no_credit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    router = fxnx.CreditRouter(fxnx.convert(model, x, routes="export"), model, rule="feedback_alignment")
    router(x).sum().backward()  # its bias is an argument of aten.linear: not an input to credit
    assert model[0].weight.grad is not None


def test_a_tiny_mixtral_routes_with_a_rule_on_histc():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, experts_implementation="grouped_mm",
    )
    model = transformers.MixtralModel(config).eval()  # grouped_mm takes float32, not float64
    ids = torch.randint(1, 50, (2, 5))
    G = fxnx.convert(model, ids)
    histc = [n for n in G if n.startswith("histc")]
    assert histc
    mine = {n: (lambda call, credit, state: call.exact(credit)) for n in histc}
    res = fxnx.route_credit(G, model, ids, rules=mine)
    out = model(ids).last_hidden_state
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.sum(), [p for _, p in named], allow_unused=True)
    assert rel_error(res.output.last_hidden_state, out) <= 1e-6
    for (name, p), g in zip(named, grads, strict=True):
        want = torch.zeros_like(p) if g is None else g
        assert rel_error(res.param_credit.get(name, torch.zeros_like(p)), want) <= 1e-5, name
    fxnx.CreditRouter(G, model, rules=mine)(ids).last_hidden_state.sum().backward()


# --- 4. a graph that cannot route credit is announced at convert -------------------------------

def test_convert_warns_when_it_falls_back_to_make_fx():
    model = _built(zoo27.DataDependent)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"captured with make_fx, as export failed.*refuse it"):
        G = fxnx.convert(model, x, routes=["export", "make_fx"])
    with pytest.raises(fxnx.errors.FxnxValueError, match="make_fx"):
        fxnx.route_credit(G, model, x)
    with warnings.catch_warnings(record=True) as caught:  # asked for make_fx: no such warning
        warnings.simplefilter("always")
        fxnx.convert(model, x, routes="make_fx")
    assert not any("route_credit and CreditRouter refuse" in str(w.message) for w in caught)


# --- 5. forwards that change from call to call ----------------------------------------------

@pytest.mark.parametrize("draw", ["python", "torch"])
def test_a_random_choice_in_python_is_refused_in_training_mode(draw):
    torch.manual_seed(0)
    model = zoo27.Skips(draw).double().train()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"forward is not one graph: its forward drew from"):
        G = fxnx.convert(model, x)
    assert G.graph["capture"] == "symbolic_trace"
    for credit in (lambda: fxnx.route_credit(G, model, x), lambda: fxnx.CreditRouter(G, model)(x)):
        with pytest.raises(fxnx.errors.FxnxValueError, match=r"credit cannot be routed over Skips.*random.*eval"):
            credit()
    model.eval()  # no random choice: one graph, routed exactly
    G = fxnx.convert(model, x)
    _assert_exact(fxnx.route_credit(G, model, x), G, model, x)


def test_a_random_branch_that_export_checks_is_refused():
    torch.manual_seed(0)
    model = zoo27.Skips("torch").double().train()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"not one graph: its control flow read a value drawn at random"):
        G = fxnx.convert(model, x, routes="draft_export")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"credit cannot be routed over Skips.*drawn at random"):
        fxnx.route_credit(G, model, x)


def test_a_model_that_changes_itself_while_captured_is_announced():
    model = _built(zoo27.WarmUp)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"WarmUp changed itself while symbolic_trace captured it.*warm-up call"):
        G = fxnx.convert(model, x)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"G lacks nodes .*warm-up call"):
        fxnx.route_credit(G, model, x)
    G = fxnx.convert(model, x)  # after the first call: one graph
    _assert_exact(fxnx.route_credit(G, model, x), G, model, x)


def test_a_runtime_check_that_fails_on_its_own_inputs_stops_the_ladder(monkeypatch):
    from fxnx._capture import ladder
    from fxnx._capture.shapes import node_failure

    tried = []

    def failing(gm, model, values, fake):
        tried.append(gm)
        check = next(n for n in gm.graph.nodes if n.op == "call_module")
        check.target = torch.ops.aten._assert_scalar.default  # as if the graph checked a value
        raise node_failure("shape propagation", check, (False, "Ne(u0, 1)"), {}, RuntimeError("failed"))

    monkeypatch.setattr(ladder, "propagate_shapes", failing)
    with pytest.raises(fxnx.errors.CaptureError, match=r"forward is not one graph.*model\.eval\(\)"):
        capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    assert len(tried) == 1  # no other route is tried: none would hold every call


def test_a_runtime_check_that_fails_says_what_to_do():
    from fxnx._capture.shapes import node_failure

    graph = torch.fx.Graph()
    flag = graph.placeholder("flag")
    check = graph.call_function(torch.ops.aten._assert_scalar.default, (flag, "Ne(u0, 1)"))
    graph.output(None)
    err = node_failure("shape propagation", check, (False, "Ne(u0, 1)"), {}, RuntimeError("Runtime assertion failed"))
    assert err.runtime_check and "model.eval()" in str(err) and "input shapes" in str(err)


# --- torchvision models at small sizes (slow) -------------------------------------------------

def _mvit(train: bool) -> nn.Module:
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    torch.manual_seed(0)
    spec = [(1, 8, 8, [1, 1, 1], [1, 4, 4]), (2, 8, 16, [1, 2, 2], [1, 2, 2]), (2, 16, 16, [1, 1, 1], [1, 1, 1])]
    blocks = [MSBlockConfig(num_heads=h, input_channels=i, output_channels=o, kernel_q=[3, 3, 3],
                            kernel_kv=[3, 3, 3], stride_q=sq, stride_kv=skv) for h, i, o, sq, skv in spec]
    # mvit_v2_s's options (relative positions, pooled residuals, the write-in-place shortcut).
    model = MViT(spatial_size=(32, 32), temporal_size=4, block_setting=blocks, residual_pool=True,
                 residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True,
                 stochastic_depth_prob=0.2, num_classes=5)
    return model.train(train).double()


@pytest.mark.slow
@pytest.mark.parametrize("routes", ["auto", "export"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_mvit_routes_exactly(routes, train):
    model = _mvit(train)
    x = torch.rand(2, 3, 4, 32, 32, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=routes)
    _assert_exact(fxnx.route_credit(G, model, x), G, model, x)


@pytest.mark.slow
@pytest.mark.parametrize("routes", ["auto", "export"])
def test_swin3d_routes_exactly(routes):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.video.swin3d_t(weights=None, num_classes=5).eval().double()
    x = torch.rand(1, 3, 4, 64, 64, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=routes)
    _assert_exact(fxnx.route_credit(G, model, x), G, model, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ssdlite320_mobilenet_v3_large", "ssd300_vgg16"])
def test_ssd_detectors_route_exactly(name):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=3)
    model = model.eval().double()
    image = [torch.rand(3, 64, 64, dtype=torch.float64)]
    G = fxnx.convert(model, image)
    res = fxnx.route_credit(G, model, image)
    want = model(image)[0]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    scores = want["scores"].sum() + want["boxes"].sum()
    grads = torch.autograd.grad(scores, [p for _, p in named], allow_unused=True)
    for key in ("boxes", "scores", "labels"):
        assert torch.allclose(res.output[0][key].to(want[key].dtype), want[key].detach(), rtol=1e-12, atol=0)
    for (n, p), g in zip(named, grads, strict=True):
        assert rel_error(res.param_credit.get(n, torch.zeros_like(p)), torch.zeros_like(p) if g is None else g) <= TOL, n


@pytest.mark.slow
def test_a_detector_that_lands_on_make_fx_is_announced():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64).eval()
    with pytest.warns(UserWarning, match=r"captured with make_fx.*detector"):
        G = fxnx.convert(model, [torch.rand(3, 64, 64)])
    assert G.graph["capture"] == "make_fx"
