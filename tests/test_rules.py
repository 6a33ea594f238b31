"""Each rule against a reference computed by hand on a small MLP, written out in the test."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxnx

from conftest import rel_error

f64 = torch.float64


def _mlp(*sizes):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


def _route(model, x, rule, e, steps=1, **options):
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=rule, node_credit=True, **options)
    results = []
    for _ in range(steps):
        router(x)
        results.append(router.backward(output_credit=e, node_credit=True))
    return router, results


def test_feedback_alignment_by_hand():
    model = _mlp(5, 7, 3)
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router, (res,) = _route(model, x, "feedback_alignment", e)
    W1, b1 = model[0].weight.detach(), model[0].bias.detach()
    B1, B2 = router.feedback["_0"], router.feedback["_2"]
    a = torch.tanh(x @ W1.T + b1)
    d_a = e @ B2  # B2 in place of W2
    d_h = d_a * (1 - a**2)
    assert torch.allclose(res.node_credit["_1"], d_a, rtol=1e-12, atol=0)
    assert torch.allclose(res.param_credit["2.weight"], e.T @ a, rtol=1e-12, atol=0)  # exact
    assert torch.allclose(res.param_credit["0.weight"], d_h.T @ x, rtol=1e-12, atol=1e-15)
    assert torch.allclose(res.param_credit["0.bias"], d_h.sum(0), rtol=1e-12, atol=1e-15)
    assert torch.allclose(model[0].weight.grad, d_h.T @ x, rtol=1e-12, atol=1e-15)
    assert res.node_credit["input_1"] is None  # nothing to learn below the first layer
    once = fxnx.route_credit(fxnx.convert(model, x), model, x, rule="feedback_alignment",
                             output_credit=e, feedback=router.feedback)
    assert torch.allclose(once.node_credit["input_1"], d_h @ B1, rtol=1e-12, atol=1e-15)
    bound = math.sqrt(6 / (7 + 3))  # Glorot uniform for a (3, 7) weight: BioTorch's default
    assert B2.shape == (3, 7) and float(B2.abs().max()) <= bound
    assert not torch.allclose(B2, model[2].weight)


def test_feedback_weights_are_reusable_in_route_credit():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    router, (res,) = _route(model, x, "feedback_alignment", torch.ones(4, 3, dtype=f64), seed=9)
    again = fxnx.route_credit(fxnx.convert(model, x), model, x, rule="feedback_alignment",
                              feedback=router.feedback)
    assert torch.equal(again.node_credit["_1"], res.node_credit["_1"])
    assert torch.equal(again.feedback["_2"], router.feedback["_2"])


@pytest.mark.parametrize("variant", ["usf", "frsf", "brsf"])
def test_sign_symmetry_by_hand(variant):
    model = _mlp(5, 7, 3)
    x, e = torch.randn(3, 5, dtype=f64), torch.eye(3, dtype=f64)  # credit at a = B itself
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=variant, node_credit=True)
    seen = []
    for _ in range(2):
        router(x)
        res = router.backward(output_credit=e, node_credit=True)
        B = res.node_credit["_1"]  # e = I: row i of the credit is row i of B
        assert torch.equal(B.sign(), model[2].weight.sign())
        magnitude = B.abs()
        if variant == "usf":  # the Xavier standard deviation of a (3, 7) weight, as BioTorch scales
            assert torch.allclose(magnitude, torch.full((3, 7), math.sqrt(2 / (7 + 3)), dtype=f64), rtol=1e-15, atol=0)
        else:
            assert torch.equal(magnitude, router.feedback["_2"])
            assert float(magnitude.max()) <= math.sqrt(6 / (7 + 3)) and float(magnitude.min()) >= 0
        seen.append(magnitude)
        with torch.no_grad():  # the weights change between steps; sign(W) follows them
            model[2].weight.neg_()
    if variant == "brsf":
        assert not torch.equal(seen[0], seen[1])  # redrawn every step
    else:
        assert torch.equal(seen[0], seen[1])  # uniform, or drawn once


@pytest.mark.parametrize("width", [3, 300])  # brSF's B made two ways: small, and large (90,000 values)
@pytest.mark.parametrize("variant", ["usf", "frsf", "brsf"])
def test_sign_symmetry_sends_nothing_through_a_zero_weight_and_nan_through_a_nan(variant, width):
    """torch.sign (BioTorch's sign) is 0 at a zero weight, either sign of zero, and at a NaN:
    B is zero there, as the formula by hand says, however M was made."""
    model = _mlp(5, 7 if width == 3 else width, width)
    with torch.no_grad():
        model[2].weight[0, 1] = 0.0
        model[2].weight[1, 2] = -0.0
    x, e = torch.randn(width, 5, dtype=f64), torch.eye(width, dtype=f64)  # credit at a = B itself
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=variant, node_credit=True)
    router(x)
    B = router.backward(output_credit=e, node_credit=True).node_credit["_1"]
    M = router.feedback["_2"] if variant != "usf" else math.sqrt(2 / sum(model[2].weight.shape))
    assert torch.equal(B, torch.sign(model[2].weight.detach()) * M)
    assert B[0, 1] == 0 and B[1, 2] == 0
    with torch.no_grad():
        model[2].weight[2, 3] = float("nan")
    router(x)
    B = router.backward(output_credit=e, node_credit=True).node_credit["_1"]
    M = router.feedback["_2"] if variant != "usf" else M
    assert B[2, 3] == 0 and torch.equal(B, torch.sign(model[2].weight.detach()) * M)


def test_a_brsf_step_can_be_routed_again_with_its_magnitudes():
    """route_credit(feedback=router.feedback) replays brSF's latest draw; without it, a new one."""
    model = _mlp(5, 7, 3)
    x, e = torch.randn(3, 5, dtype=f64), torch.eye(3, dtype=f64)
    router, (res,) = _route(model, x, "brsf", e)
    G = fxnx.convert(model, x)
    again = fxnx.route_credit(G, model, x, rule="brsf", output_credit=e, feedback=router.feedback)
    assert torch.equal(again.node_credit["_1"], model[2].weight.detach().sign() * router.feedback["_2"])
    assert torch.equal(again.node_credit["_1"], res.node_credit["_1"])
    fresh = fxnx.route_credit(G, model, x, rule="brsf", output_credit=e, seed=1)
    assert not torch.equal(fresh.node_credit["_1"].abs(), router.feedback["_2"])
    with pytest.raises(fxnx.errors.FxnxValueError, match="uses sign"):
        fxnx.route_credit(G, model, x, rule="usf", feedback=router.feedback)


def test_direct_feedback_alignment_by_hand():
    model = _mlp(5, 7, 6, 3)  # Linear, Tanh, Linear, Tanh, Linear
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router, (res,) = _route(model, x, "direct_feedback_alignment", e)
    fb = router.feedback
    assert set(fb) == {"_2", "_4"}  # the first layer's input needs no credit: none drawn
    B1, B2 = fb["_2"], fb["_4"]
    assert B1.shape == (3, 7) and B2.shape == (3, 6)
    W0, b0 = model[0].weight.detach(), model[0].bias.detach()
    W1, b1 = model[2].weight.detach(), model[2].bias.detach()
    a0 = torch.tanh(x @ W0.T + b0)
    a1 = torch.tanh(a0 @ W1.T + b1)
    d_a1 = e @ B2  # straight from the output, not W2ᵀ·e
    d_a0 = e @ B1  # straight from the output, not W1ᵀ·(...)
    assert torch.allclose(res.node_credit["_3"], d_a1, rtol=1e-12, atol=0)
    assert torch.allclose(res.node_credit["_1"], d_a0, rtol=1e-12, atol=0)
    assert torch.allclose(res.param_credit["4.weight"], e.T @ a1, rtol=1e-12, atol=0)
    assert torch.allclose(res.param_credit["2.weight"], (d_a1 * (1 - a1**2)).T @ a0, rtol=1e-12, atol=1e-15)
    assert torch.allclose(res.param_credit["0.weight"], (d_a0 * (1 - a0**2)).T @ x, rtol=1e-12, atol=1e-15)
    assert float(B1.abs().max()) <= math.sqrt(6 / (3 + 7)) and float(B2.abs().max()) <= math.sqrt(6 / (3 + 6))


@pytest.mark.parametrize(("rule", "changes"), [("direct_feedback_alignment", False), ("exact", True)])
def test_dfa_credit_at_a_hidden_layer_ignores_the_weights_above_it(rule, changes):
    model = _mlp(5, 7, 6, 3)
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    G = fxnx.convert(model, x)
    before = fxnx.route_credit(G, model, x, rule=rule, output_credit=e)
    with torch.no_grad():
        for layer in (model[2], model[4]):  # every weight between _1 and the output
            layer.weight.mul_(-3).add_(0.5)
    after = fxnx.route_credit(G, model, x, rule=rule, output_credit=e)
    for node in ("_1", "_0"):
        assert torch.equal(before.node_credit[node], after.node_credit[node]) is not changes


def test_dfa_reaches_both_sides_of_a_skip():
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return self.head(torch.tanh(self.b(h)) + h)

    torch.manual_seed(0)
    model, x, e = Skip().double(), torch.randn(3, 4, dtype=f64), torch.randn(3, 2, dtype=f64)
    router, (res,) = _route(model, x, "direct_feedback_alignment", e)
    fb = router.feedback
    # h feeds b and the add: its credit is b's projection plus what the add passes on (the
    # head's projection), summed at the fan-out.
    assert torch.allclose(res.node_credit["a"], e @ fb["b"] + e @ fb["head"], rtol=1e-12, atol=0)


class _Logged(torch.autograd.Function):
    """The identity, noting when the backward pass reaches it."""

    @staticmethod
    def forward(ctx, x, note, name):
        ctx.note, ctx.name = note, name
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.note(("reached", ctx.name))
        return g, None, None


class _Mark(nn.Module):
    def __init__(self, log, name):
        super().__init__()
        self.note, self.name = log.append, name  # not the list: route_credit restores lists

    def forward(self, x):
        return _Logged.apply(x, self.note, self.name)


def test_dfa_sends_to_a_layer_when_the_backward_pass_reaches_it(monkeypatch):
    """Each layer's input gets its projection of the output credit when autograd reaches the
    layer, as exact credit would, not all at the output (where every projection would be
    held at once: the memory of a whole backward pass). The credit is the same by hand."""
    from fxnx._credit import graft, taps

    log = []
    real = taps.TapSpec.send

    def send(self, j, e, shape, dtype, state):
        log.append(("sent", self.pairs[j][0].call.name))
        return real(self, j, e, shape, dtype, state)

    monkeypatch.setattr(taps.TapSpec, "send", send)
    monkeypatch.setattr(graft, "is_torch_nn", lambda module: True)  # the marks pass credit on every call
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), _Mark(log, "_0"), nn.Tanh(), nn.Linear(7, 6), _Mark(log, "_3"),
                          nn.Tanh(), nn.Linear(6, 3)).double()
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    G = fxnx.convert(model, x, leaf_modules=[_Mark])
    res = fxnx.route_credit(G, model, x, rule="direct_feedback_alignment", output_credit=e)
    # route_credit reports credit at the input too: the first layer is projected onto as well
    assert log == [("sent", "_6"), ("reached", "_3"), ("sent", "_3"), ("reached", "_0"), ("sent", "_0")]
    fb = res.feedback
    assert rel_error(res.node_credit["_2"], e @ fb["_3"]) <= 1e-12
    assert rel_error(res.node_credit["_5"], e @ fb["_6"]) <= 1e-12


def test_dfa_into_a_value_written_in_place_is_the_same_credit():
    """A layer whose output a ReLU(inplace=True) overwrites gets its projection at the output
    instead (autograd forbids writing into what a custom function hands back as is): the same
    credit as the model with ReLU()."""
    def net(inplace):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=inplace), nn.Linear(7, 6),
                             nn.ReLU(inplace=inplace), nn.Linear(6, 3)).double()

    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    plain = fxnx.route_credit(fxnx.convert(net(False), x), net(False), x, rule="direct_feedback_alignment", output_credit=e)
    model = net(True)
    written = fxnx.route_credit(fxnx.convert(model, x), model, x, rule="direct_feedback_alignment",
                                output_credit=e, feedback=plain.feedback)
    for node in ("_1", "_3"):
        assert rel_error(written.node_credit[node], plain.node_credit[node]) <= 1e-12
    for name, g in plain.param_credit.items():
        assert rel_error(written.param_credit[name], g) <= 1e-12, name


def test_dfa_still_projects_onto_a_layer_whose_output_edge_is_removed():
    """A layer cut off from the output in G (its one outgoing edge removed) still has its
    input projected onto, as direct feedback defines, and its own weights get no credit."""
    model = _mlp(5, 7, 6, 3)  # Linear, Tanh, Linear, Tanh, Linear
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    G = fxnx.convert(model, x)
    G.remove_edge("_2", "_3")
    res = fxnx.route_credit(G, model, x, rule="direct_feedback_alignment", output_credit=e)
    assert rel_error(res.node_credit["_1"], e @ res.feedback["_2"]) <= 1e-12
    assert res.param_credit.get("2.weight") is None or not res.param_credit["2.weight"].any()


class _ThroughArgmax(nn.Module):
    """``a`` is read only through ``argmax``: autograd never reaches it from the output."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.a, self.table, self.head = nn.Linear(5, 4), nn.Linear(4, 4), nn.Embedding(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h0 = torch.tanh(self.first(x))
        return self.head(self.table(self.a(h0).argmax(-1)) + h0)


def test_dfa_projects_onto_a_layer_that_credit_cannot_reach():
    """Direct feedback goes to every layer's input, whatever lies between the layer and the
    output: a layer read only through argmax has its input projected onto, on every step,
    as the rule's formula says (e·B_a, plus the head's projection through the skip)."""
    torch.manual_seed(0)
    model, x, e = _ThroughArgmax().double(), torch.randn(6, 5, dtype=f64), torch.randn(6, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", node_credit=True)
    for step in range(3):  # the first forward finds `a` unreached; the next ones know it
        model.zero_grad()
        router(x)
        res = router.backward(output_credit=e, node_credit=True)
        fb = router.feedback
        h0 = torch.tanh(x @ model.first.weight.detach().T + model.first.bias.detach())
        d_h0 = e @ fb["a"] + e @ fb["head"]
        assert rel_error(res.node_credit["tanh"], d_h0) <= 1e-12, step
        assert rel_error(model.first.weight.grad, (d_h0 * (1 - h0**2)).T @ x) <= 1e-12, step
        assert model.a.weight.grad is None, step  # nothing reaches a's own output


class _Sometimes(nn.Module):
    """Detaches its input on calls whose input sums to less than zero: kept whole, it cannot
    be read ahead of the call."""

    def forward(self, x):
        return x.detach() if float(x.detach().sum()) < 0 else x


class _Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.a, self.gate, self.head = nn.Linear(5, 4), nn.Linear(4, 4), _Sometimes(), nn.Linear(4, 3)

    def forward(self, x):
        h0 = torch.tanh(self.first(x))
        return self.head(self.gate(self.a(h0)) + h0)


def test_dfa_projects_through_a_module_that_detaches_on_some_calls():
    """A module kept whole may pass credit on one call and not the next: the layer behind it
    gets its projection on every call all the same."""
    torch.manual_seed(0)
    model, x, e = _Flaky().double(), torch.randn(6, 5, dtype=f64), torch.randn(6, 3, dtype=f64)
    G = fxnx.convert(model, x, leaf_modules=[_Sometimes])
    router = fxnx.CreditRouter(G, model, rule="direct_feedback_alignment", node_credit=True)
    for bias in (10.0, -10.0, 10.0):  # passes, detaches, passes
        with torch.no_grad():
            model.a.bias.fill_(bias)
        router(x)
        res = router.backward(output_credit=e, node_credit=True)
        fb = router.feedback
        assert rel_error(res.node_credit["tanh"], e @ fb["a"] + e @ fb["head"]) <= 1e-12, bias
        assert (res.param_credit.get("a.weight") is None) is (bias < 0), bias


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)
        nn.init.normal_(self.attn.in_proj_bias)  # nonzero biases: a real check

    def forward(self, x, mask):
        h = self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return self.head(h)


def _autograd(model, x, mask, e):
    x_ = x.clone().requires_grad_()
    grads = torch.autograd.grad((model(x_, mask) * e).sum(), [x_, *model.parameters()])
    return grads[0], dict(zip([n for n, _ in model.named_parameters()], grads[1:], strict=True))


def test_feedback_alignment_inside_attention():
    torch.manual_seed(0)
    model = _Attn().double()
    x = torch.randn(2, 5, 8, dtype=f64)
    mask = torch.full((5, 5), float("-inf"), dtype=f64).triu(1)
    e = torch.randn(2, 5, 3, dtype=f64)
    G = fxnx.convert(model, x, mask)
    want_x, want = _autograd(model, x, mask, e)
    fa = fxnx.route_credit(G, model, x, mask, rule="feedback_alignment", output_credit=e)
    assert fa.rules["attn"] == "feedback_alignment"
    assert set(fa.feedback["attn"]) == {"in_proj_weight", "out_proj.weight"}
    # out_proj's own weight credit is exact: the credit reaching it is exact (head's input
    # credit went through head's B, so compare with the same credit through exact routing).
    exact_below_head = fxnx.route_credit(
        G, model, x, mask, rule=fxnx.credit.PRESETS["feedback_alignment"] | {nn.MultiheadAttention: fxnx.credit.Exact()},
        output_credit=e,
    )
    assert torch.allclose(fa.node_credit["getitem"], exact_below_head.node_credit["getitem"], rtol=1e-12, atol=0)
    assert torch.allclose(fa.param_credit["attn.out_proj.weight"],
                          exact_below_head.param_credit["attn.out_proj.weight"], rtol=1e-10, atol=1e-14)
    # ... while the credit crossing the attention differs from the exact one.
    assert rel_error(fa.node_credit["x"], exact_below_head.node_credit["x"]) > 0.1
    # With B = W throughout, the recomputed attention gives autograd's credit exactly.
    same = {"head": model.head.weight.detach(),
            "attn": {"in_proj_weight": model.attn.in_proj_weight.detach(),
                     "out_proj.weight": model.attn.out_proj.weight.detach()}}
    mirror = fxnx.route_credit(G, model, x, mask, rule="feedback_alignment", feedback=same, output_credit=e)
    assert rel_error(mirror.node_credit["x"], want_x) <= 1e-10
    for name, g in want.items():
        assert rel_error(mirror.param_credit[name], g) <= 1e-10, name


def test_attention_built_from_linear_layers_uses_feedback_weights():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            w = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 2, -1)
            return self.o(w @ self.v(x))

    torch.manual_seed(0)
    model, x = Attention().double(), torch.randn(2, 3, 4, dtype=f64)
    res = fxnx.route_credit(fxnx.convert(model, x), model, x, rule="feedback_alignment")
    assert {res.rules[n] for n in ("q", "k", "v", "o")} == {"feedback_alignment"}


def test_presets_compose_and_stay_read_only():
    fa = fxnx.credit.PRESETS["feedback_alignment"]
    mine = fa | {nn.Linear: fxnx.credit.Exact()}
    assert isinstance(mine[nn.Linear], fxnx.credit.Exact) and isinstance(fa[nn.Linear], fxnx.credit.FeedbackAlignment)
    assert isinstance(({nn.Tanh: fxnx.credit.Exact()} | fa)[nn.Tanh], fxnx.credit.Exact)
    with pytest.raises(TypeError):
        fxnx.credit.PRESETS["mine"] = mine  # type: ignore[index]
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    with pytest.warns(UserWarning, match=r"'feedback_alignment\|custom' applies to no node"):
        res = fxnx.route_credit(fxnx.convert(model, x), model, x, rule=mine)
    assert set(res.rules.values()) == {"exact"} and res.rule == "feedback_alignment|custom"


def test_a_rule_object_of_ones_own_and_a_seed_of_its_own():
    class Halve(fxnx.credit.Rule):
        name = "halve"

        def __call__(self, call, credit, state):
            inputs, params = call.exact(credit)
            return [None if c is None else c / 2 for c in inputs], params

    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, rules={nn.Tanh: Halve()})
    exact = fxnx.route_credit(G, model, x)
    assert res.rules["_1"] == "halve"
    assert torch.allclose(res.node_credit["_0"], exact.node_credit["_0"] / 2, rtol=1e-15, atol=0)
    a = fxnx.route_credit(G, model, x, rule={nn.Linear: fxnx.credit.FeedbackAlignment(seed=5)}, seed=1)
    b = fxnx.route_credit(G, model, x, rule={nn.Linear: fxnx.credit.FeedbackAlignment(seed=5)}, seed=2)
    assert torch.equal(a.feedback["_2"], b.feedback["_2"])  # its own seed wins


def test_feedback_rules_refuse_layers_without_weights():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    with pytest.raises(fxnx.errors.FxnxTypeError, match=r"node '_1' \(Tanh\) has no weight"):
        fxnx.route_credit(fxnx.convert(model, x), model, x, rules={nn.Tanh: fxnx.credit.FeedbackAlignment()})
    with pytest.raises(fxnx.errors.FxnxValueError, match="magnitude must be one of"):
        fxnx.credit.SignSymmetry("random")


@pytest.mark.parametrize(
    "config",
    [
        {"batch_first": True},
        {"batch_first": False, "kdim": 6, "vdim": 5},
        {"batch_first": True, "padding": True, "average": False},
        {"batch_first": True, "unbatched": True},
    ],
    ids=["batch_first", "kdim_vdim", "padding_per_head", "unbatched"],
)
def test_the_recomputed_attention_is_torchs(config):
    from fxnx._credit.transport import attention

    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=config["batch_first"], kdim=config.get("kdim"),
                              vdim=config.get("vdim")).double().eval()
    L, S, N = 4, 5, 3
    shape = (lambda n, d: (N, n, d)) if config["batch_first"] else (lambda n, d: (n, N, d))
    q = torch.randn(shape(L, 8), dtype=f64)
    k = torch.randn(shape(S, config.get("kdim", 8)), dtype=f64)
    v = torch.randn(shape(S, config.get("vdim", 8)), dtype=f64)
    options = {"attn_mask": torch.randn(L, S, dtype=f64), "average_attn_weights": config.get("average", True)}
    if config.get("padding"):
        options["key_padding_mask"] = torch.tensor([[False] * 4 + [True]] * N)
        options["attn_mask"] = torch.ones(L, S, dtype=torch.bool).triu(1)  # boolean masks both
    if config.get("unbatched"):
        q, k, v = q[0], k[0], v[0]
    want = m(q, k, v, need_weights=True, **options)
    got = attention(m, q, k, v, need_weights=True, **options)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_feedback_weights_depend_on_the_seed_and_node_alone():
    """The same seed draws the same B for a float32 and a float64 model, and for DFA under
    autocast (kept in the layer's dtype, not bfloat16); distinct seeds draw unrelated B
    (2**63 is not 0 again)."""
    torch.manual_seed(0)
    m32 = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    m64 = _copy_double(m32)
    x, e = torch.randn(5, 8), torch.randn(5, 4)
    G32, G64 = fxnx.convert(m32, x), fxnx.convert(m64, x.double())

    def B(G, model, x, e, rule="feedback_alignment", seed=0):
        return fxnx.route_credit(G, model, x, rule=rule, output_credit=e, seed=seed).feedback["_2"]

    assert torch.equal(B(G32, m32, x, e).double(), B(G64, m64, x.double(), e.double()))
    assert not torch.equal(B(G32, m32, x, e, seed=2**63), B(G32, m32, x, e))
    router = fxnx.CreditRouter(G32, m32, rule="direct_feedback_alignment", seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    (out.float() * e).sum().backward()
    assert router.feedback["_2"].dtype == torch.float32
    assert torch.equal(router.feedback["_2"], B(G32, m32, x, e, rule="direct_feedback_alignment"))


def _copy_double(model):
    import copy

    return copy.deepcopy(model).double()


def test_what_no_rule_can_use_is_refused_by_name():
    """A layer itself as a ``rules`` key (no node is keyed by it), negative sign-symmetry
    magnitudes (B would oppose sign(W)), and direct feedback that is not one floating tensor
    per input: each one error, where they were ignored, taken or failed inside torch."""
    import numpy as np

    model = _mlp(3, 5, 2)
    x, e = torch.randn(6, 3, dtype=f64), torch.randn(6, 2, dtype=f64)
    G = fxnx.convert(model, x)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"'Linear\(...\)'.*key it by its node's name"):
        fxnx.route_credit(G, model, x, rules={model[2]: fxnx.credit.FeedbackAlignment()}, output_credit=e)
    for rule in ("frsf", "brsf"):
        with pytest.raises(fxnx.errors.FxnxValueError, match="magnitudes M >= 0"):
            fxnx.route_credit(G, model, x, rule=rule, output_credit=e, feedback={"_2": -torch.ones(2, 5, dtype=f64)})
    dfa = dict(rule="direct_feedback_alignment", output_credit=e)
    for bad in (np.zeros((2, 5)), "B", torch.zeros(2, 5, dtype=torch.int64)):
        with pytest.raises(fxnx.errors.FxnxTypeError, match="must be a floating-point tensor"):
            fxnx.route_credit(G, model, x, feedback={"_2": bad}, **dfa)
    with pytest.raises(fxnx.errors.FxnxValueError, match="gives 3 tensors, but the node has 1 input"):
        fxnx.route_credit(G, model, x, feedback={"_2": [torch.zeros(2, 5, dtype=f64)] * 3}, **dfa)
    drawn = fxnx.route_credit(G, model, x, **dfa)
    again = fxnx.route_credit(G, model, x, feedback=drawn.feedback, **dfa)
    assert torch.equal(again.param_credit["0.weight"], drawn.param_credit["0.weight"])


def test_dfa_defers_a_send_that_the_backward_pass_reaches_past_one_made_at_the_output():
    """Below a layer whose output a ReLU(inplace=True) overwrites (its inputs get their
    projection at the output), the layers the backward pass reaches from that projection
    still get theirs when it reaches them: none is taken for unreached (which would hold
    every projection at once, the memory this design saves)."""
    from fxnx._credit import taps

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 6),
                          nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    (router(x) * e).sum().backward()
    (spec,) = {id(v): v for run in router._grafts.values() for v in vars(run.gm).values()
               if isinstance(v, taps.TapSpec)}.values()
    received = {spec.pairs[j][0].call.name for j in range(len(spec.pairs)) if j not in spec.unreached}
    assert "_2" in received and not spec.unreached  # _2 is reached only from _4's projection


def _dfa_by_hand(model, x, e, fb):
    """Direct feedback alignment's weight credit on ``_mlp(5, 7, 6, 3)`` written out: each
    hidden layer's output credit is ``e·B`` through its tanh, the last layer's is ``e``."""
    W0, b0 = model[0].weight.detach(), model[0].bias.detach()
    W1, b1 = model[2].weight.detach(), model[2].bias.detach()
    a0 = torch.tanh(x @ W0.T + b0)
    a1 = torch.tanh(a0 @ W1.T + b1)
    d1, d0 = (e @ fb["_4"]) * (1 - a1**2), (e @ fb["_2"]) * (1 - a0**2)
    return {"4.weight": e.T @ a1, "4.bias": e.sum(0), "2.weight": d1.T @ a0, "2.bias": d1.sum(0),
            "0.weight": d0.T @ x, "0.bias": d0.sum(0)}


@pytest.mark.parametrize("hooked", [False, True])
def test_dfa_on_linear_layers_by_hand_as_one_function_and_as_the_layer(hooked):
    """A 2-D ``nn.Linear`` under direct feedback alignment runs as one autograd function
    (its input's projection and the layer); a hooked one as the layer on its input detached,
    then the projection. Both give the credit written out by hand, through loss.backward()."""
    model = _mlp(5, 7, 6, 3)
    if hooked:  # a forward hook keeps a layer a module call: the general path
        for layer in (model[2], model[4]):
            layer.register_forward_hook(lambda *_: None)
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    out = router(x)
    kinds = {type(fn).__name__ for fn in _grad_fns(out)}
    # one function: the run of layers fused (the first runs on its own, its input taking no credit)
    assert bool(kinds & {"_DirectLinearBackward", "_DirectChainBackward"}) is not hooked
    (out * e).sum().backward()
    want = _dfa_by_hand(model, x, e, router.feedback)
    for name, p in model.named_parameters():
        assert rel_error(p.grad, want[name]) <= 1e-12, name


def _grad_fns(t):
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo += [f for f, _ in fn.next_functions]
    return seen


def test_dfa_on_a_linear_layer_under_a_checkpoint_and_with_frozen_parts():
    """The one-function path saves its input through the caller's saved-tensor hooks (a
    non-reentrant checkpoint recomputes it) and sends credit only where it is wanted: a
    frozen weight gets none, a layer without bias works, the input still gets its projection."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6, bias=False), nn.Tanh(), nn.Linear(6, 3)).double()
    model[2].weight.requires_grad_(False)
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    (router(x) * e).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    out = torch.utils.checkpoint.checkpoint(router, x, use_reentrant=False)
    (out * e).sum().backward()
    assert model[2].weight.grad is None
    fb = router.feedback
    a0 = torch.tanh(model[0](x)).detach()
    a1 = torch.tanh(model[2](a0)).detach()
    d0 = (e @ fb["_2"]) * (1 - a0**2)
    assert rel_error(model[0].weight.grad, d0.T @ x) <= 1e-12
    assert rel_error(model[4].weight.grad, e.T @ a1) <= 1e-12
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, plain[name]), name


@pytest.mark.parametrize("fuse", [True, False])
def test_dfa_under_a_reentrant_checkpoint_is_the_plain_step(fuse):
    """A reentrant checkpoint of the router runs the router's forward and backward again inside
    the outer backward pass, as a pass of its own: that inner pass sets and projects its own
    ``e``, and the gradients are the plain step's, bit for bit. (A regression guard for keeping
    ``e`` per pass: it passed before too.)"""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", fuse=fuse)
    (router(x) * e).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (checkpoint(router, x.clone().requires_grad_(), use_reentrant=True) * e).sum().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, plain[name]), name


def test_dfa_on_a_linear_layer_refuses_its_input_written_before_backward():
    """As autograd refuses a write into a tensor it saved: the one-function path checks its
    saved input, and the error names the node."""
    model = _mlp(5, 7, 3)
    leaf = torch.randn(4, 5, dtype=f64, requires_grad=True)
    router = fxnx.CreditRouter(fxnx.convert(model, leaf.detach()), model, rule="direct_feedback_alignment")
    router(leaf.clone())  # a first call, which draws the feedback (and runs on a copy)
    x = leaf.clone()  # a value the router reads as it is (a leaf is taken as a copy)
    out = router(x)
    assert {type(fn).__name__ for fn in _grad_fns(out)} & {"_DirectLinearBackward", "_DirectChainBackward"}
    x.add_(1)
    with pytest.raises(RuntimeError, match="node '_0'.*modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("inplace", [False, True])
def test_dfa_on_linear_layers_over_tokens_by_hand(inplace):
    """Linear layers on (batch, tokens, features) inputs, as in a transformer, under direct
    feedback alignment: each hidden input gets ``e·B`` reshaped to its shape, each weight
    ``creditᵀ·x`` summed over batch and tokens. An in-place activation after a hidden layer
    (which writes into F.linear's output, a view for a 3-D input, so that layer runs as before:
    an autograd function may not hand back a view written later) gives the same credit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.ReLU(inplace=inplace),
                          nn.Linear(6, 3), nn.Flatten()).double()
    x, e = torch.randn(4, 2, 5, dtype=f64), torch.randn(4, 6, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    out = router(x)
    assert "_DirectLinearBackward" in {type(fn).__name__ for fn in _grad_fns(out)}
    (out * e).sum().backward()
    fb = router.feedback
    a0 = torch.tanh(x @ model[0].weight.detach().T + model[0].bias.detach())
    a1 = torch.relu(a0 @ model[2].weight.detach().T + model[2].bias.detach())
    d1 = (e @ fb["_4"].reshape(6, -1)).reshape(4, 2, 6) * (a1 > 0)  # B: (output, tokens·features)
    d0 = (e @ fb["_2"].reshape(6, -1)).reshape(4, 2, 7) * (1 - a0**2)
    want = {"4.weight": e.reshape(4, 2, 3).reshape(8, 3).T @ a1.reshape(8, 6), "4.bias": e.reshape(8, 3).sum(0),
            "2.weight": d1.reshape(8, 6).T @ a0.reshape(8, 7), "2.bias": d1.reshape(8, 6).sum(0),
            "0.weight": d0.reshape(8, 7).T @ x.reshape(8, 5), "0.bias": d0.reshape(8, 7).sum(0)}
    for name, p in model.named_parameters():
        assert rel_error(p.grad, want[name]) <= 1e-12, name


def test_dfa_on_f_linear_by_hand():
    """``F.linear`` on a module's parameters (a symbolic trace records it as a function) under
    direct feedback alignment, with and without a bias: the credit written out by hand."""

    class Functional(nn.Module):
        def __init__(self, reference: nn.Sequential) -> None:
            super().__init__()
            self.w0, self.b0 = reference[0].weight, reference[0].bias
            self.w2 = reference[2].weight
            self.w4, self.b4 = reference[4].weight, reference[4].bias

        def forward(self, x):
            h = torch.tanh(nn.functional.linear(x, self.w0, self.b0))
            h = torch.tanh(nn.functional.linear(h, self.w2))
            return nn.functional.linear(h, self.w4, self.b4)

    reference = _mlp(5, 7, 6, 3)
    model = Functional(reference)
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    out = router(x)
    assert "_DirectLinearBackward" in {type(fn).__name__ for fn in _grad_fns(out)}
    (out * e).sum().backward()
    fb = {"_2": router.feedback["linear_1"], "_4": router.feedback["linear_2"]}  # the 2nd and 3rd linear
    with torch.no_grad():
        reference[2].bias.zero_()  # the functional model's second layer has none
    want = _dfa_by_hand(reference, x, e, fb)
    for name, p in model.named_parameters():
        assert rel_error(p.grad, want[{"w0": "0.weight", "b0": "0.bias", "w2": "2.weight", "w4": "4.weight",
                                       "b4": "4.bias"}[name]]) <= 1e-12, name


def test_dfa_on_a_linear_layer_with_create_graph_is_the_layer_on_its_input_detached():
    """With create_graph=True, a weight's credit under direct feedback alignment is a function
    of the credit at the layer's output alone (the layer ran on its input detached), whether the
    layer runs as one function or, hooked, as the layer. A second-order pass that comes back
    through a layer without passing through the router's output has no output credit: its
    projection ``e·B`` is nothing, so the first layer gets no second-order credit. (It read the
    first pass's ``e``: a silent credit of another pass's. Fused: a run of layers as one
    function refuses create_graph, test_router_chain.)"""
    seconds = []
    for hooked in (False, True):
        model = _mlp(5, 7, 6, 3)
        if hooked:
            for layer in (model[2], model[4]):
                layer.register_forward_hook(lambda *_: None)
        x = torch.randn(4, 5, dtype=f64, generator=torch.Generator().manual_seed(1))
        router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", fuse=False)
        (g4,) = torch.autograd.grad(router(x).sum(), model[4].weight, create_graph=True)
        assert not g4.requires_grad  # eᵀ·a1 with a1 taken as it is (the input detached): no graph below
        (g2,) = torch.autograd.grad(router(x).sum(), model[2].weight, create_graph=True)
        assert g2.requires_grad  # through the activation's derivative at the layer's output
        second = torch.autograd.grad(g2.pow(2).sum(), [model[2].weight, model[0].weight], allow_unused=True)
        assert second[0] is not None and second[1] is None, hooked
        seconds.append(second[0])
    assert rel_error(seconds[0], seconds[1]) <= 1e-12


def test_dfa_backward_calls_add_up_as_one_backward_of_their_sum():
    """A loss on a value inside the model (a forward hook's) run in a backward pass of its own,
    after the main loss's: that pass never reaches the output, so its output credit is zero and
    it projects nothing; the two passes add up to one backward of the sum (routing is linear in
    the credit). It projected the main pass's ``e`` again: layer 0's weight got twice its credit.
    (Unfused only: the hook keeps the layers apart, and a fused run's hidden values are its own,
    so no pass reaches a fused run without passing through the output.)"""
    model = _mlp(5, 7, 6, 3)
    x = torch.randn(4, 5, dtype=f64, generator=torch.Generator().manual_seed(1))
    E = torch.randn(4, 3, dtype=f64, generator=torch.Generator().manual_seed(2))
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    hidden = []
    model[3].register_forward_hook(lambda _m, _i, out: hidden.append(out))
    grads = []
    for split in (False, True):
        model.zero_grad()
        out = router(x)
        main, aux = (out * E).sum(), hidden[-1].pow(2).sum()
        if split:
            main.backward(retain_graph=True)
            aux.backward()
        else:
            (main + aux).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        assert rel_error(grads[1][name], grads[0][name]) <= 1e-12, name


def test_dfa_keeps_no_output_credit_after_its_backward_pass_ends():
    """Each backward pass's ``e`` is dropped when the pass ends: five passes through one forward
    kept with retain_graph (a Jacobian row by row) leave none behind in the forward's routing
    state (five N × D tensors were kept as long as the graph). Oracle: the state's own count,
    found by walking autograd's graph."""
    model = _mlp(5, 7, 6, 3)
    x = torch.randn(4, 5, dtype=f64, generator=torch.Generator().manual_seed(1))
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", fuse=False)
    out = router(x)
    states = {id(s): s for fn in _grad_fns(out) if (s := getattr(fn, "state", None)) is not None}
    assert len(states) == 1
    (state,) = states.values()
    assert type(state).__name__ == "RoutingState"
    for k in range(5):
        torch.autograd.grad(out[:, k % 3].sum(), list(model.parameters()), retain_graph=True)
        assert len(state._direct) == 0


class _Gate(torch.autograd.Function):
    """The identity; its backward calls ``_Gate.hold`` (a thread's pause) where it is set."""

    hold = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Gate.hold is not None:
            _Gate.hold()
        return g


def test_dfa_two_threads_backward_through_one_forward_each_project_their_own_credit():
    """Thread A's backward pass pauses below the output (its ``e`` set) while thread B runs a
    whole pass through the same forward with another output credit; then A goes on. A's
    gradients are those of A's pass alone, bit for bit: each pass projects its own ``e`` (A
    projected B's: layers a and b got twice their credit)."""
    import threading

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.c(_Gate.apply(torch.tanh(self.b(torch.tanh(self.a(x))))))

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(4, 5, dtype=f64)
    E = torch.randn(4, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", fuse=False)
    (router(x) * E).sum().backward()
    alone = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = router(x)
    a_paused, b_done = threading.Event(), threading.Event()
    errors = []

    def hold():
        if threading.current_thread().name == "A":
            a_paused.set()
            b_done.wait(30)

    def a():
        try:
            (out * E).sum().backward(retain_graph=True)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def b():
        a_paused.wait(30)
        try:
            torch.autograd.grad((out * (2 * E)).sum(), list(model.parameters()), retain_graph=True)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)
        b_done.set()

    _Gate.hold = hold
    try:
        threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        _Gate.hold = None
    assert a_paused.is_set() and b_done.is_set() and not errors
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, alone[name]), name


def test_direct_feedback_alignment_names_an_output_without_the_batch():
    """A scalar among the outputs (an auxiliary loss returned beside the logits): direct
    feedback alignment said the layer's input "first dimension is not the output's batch
    size (4)", of an input whose first dimension is 4. It names the outputs now."""

    class Aux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.c = nn.Linear(5, 7), nn.Linear(7, 3)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return {"out": self.c(h), "aux": h.sum()}

    model, x = Aux(), torch.randn(4, 5)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"every output tensor must have the batch as its first dimension; the model's outputs have shapes \(4, 3\), \(\)"):
        router(x.requires_grad_())["out"].sum().backward()
