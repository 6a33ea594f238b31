"""Runs of linear layers routed as one autograd function (fxnx/_credit/chain.py).

Oracles: autograd on the model itself (feedback alignment given ``B = W`` is backprop; forward
mode is the model's own), and the same router built without fusing runs (each layer its own
autograd function, as before runs were fused), bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from test_rules import _grad_fns
from torch import nn
from torch.autograd import forward_ad
from torch.nn import functional as F

import fxnx

from conftest import rel_error

f64 = torch.float64


class _Functional(nn.Module):
    """Activations spelled as functions and methods, with their constants."""

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(6, 6) for _ in range(7))

    def forward(self, x):
        f = self.fcs
        x = F.relu(f[0](x))
        x = f[1](x).tanh()
        x = F.gelu(f[2](x), approximate="tanh")
        x = F.leaky_relu(f[3](x), 0.2)
        x = torch.sigmoid(f[4](x))
        x = F.silu(f[5](x))
        return f[6](x)


class _Skip(nn.Module):
    """A value read twice (by the next layer and a skip) ends a run: two runs of two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in ((5, 6), (6, 6), (6, 6), (6, 6), (6, 3)))

    def forward(self, x):
        f = self.fcs
        h = torch.relu(f[1](torch.relu(f[0](x))))
        return f[4](torch.tanh(f[3](torch.relu(f[2](h)))) + h)


def _model(name):
    """A fresh model: activations as modules (an in-place ReLU, two layers joined directly),
    or as functions and methods."""
    torch.manual_seed(0)
    if name == "modules":
        return nn.Sequential(
            nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 6), nn.GELU(approximate="tanh"),
            nn.Linear(6, 6), nn.Sigmoid(), nn.Linear(6, 6), nn.SiLU(), nn.Linear(6, 6),
            nn.LeakyReLU(0.3), nn.Linear(6, 6), nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3),
        ).double()
    if name == "skip":
        return _Skip().double()
    return nn.Sequential(nn.Linear(5, 6), _Functional(), nn.Linear(6, 3)).double()


MODELS = ["modules", "functions", "skip"]


def _runs(out, function: str = "_ChainBackward") -> int:
    """How many runs of layers ran as one autograd function in computing ``out``: the
    autograd nodes of the run's function in its graph (``_DirectChainBackward`` under direct
    feedback alignment)."""
    return sum(type(fn).__name__ == function for fn in _grad_fns(out))


def _routers(G, model, x, rule, **options):
    """A router with runs fused, and one with the same seed built without fusing any."""
    return (fxnx.CreditRouter(G, model, rule=rule, seed=7, **options),
            fxnx.CreditRouter(G, model, rule=rule, seed=7, fuse=False, **options))


def _step(model, router, x, e):
    """The gradients of one step (None for a frozen parameter), and how many runs of layers
    it ran as one function."""
    model.zero_grad(set_to_none=True)
    out = router(x)
    runs = _runs(out)
    (out * e).sum().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()], runs


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)


@pytest.mark.parametrize("name", MODELS)
def test_feedback_alignment_with_b_equal_to_w_is_autograd(name):
    model = _model(name)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, dtype=f64, generator=gen, requires_grad=True)
    e = torch.randn(4, 3, dtype=f64, generator=gen)
    G = fxnx.convert(model, x)
    layers = {n: d for n, d in G.nodes(data=True) if d.get("module_type") == "torch.nn.modules.linear.Linear"}
    own = {n: model.get_submodule(d["target"]).weight.detach().clone() for n, d in layers.items()}
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback=own)
    got, runs = _step(model, router, x, e)
    got_x = x.grad.clone()
    assert runs >= 1
    x.grad = None
    model.zero_grad(set_to_none=True)
    (model(x) * e).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rule", ["feedback_alignment", "usf", "brsf", "frsf", "kolen_pollack", "weight_mirror"])
@pytest.mark.parametrize("name", MODELS)
def test_a_fused_run_is_its_nodes_one_by_one_bit_for_bit(name, rule):
    """The same gradients, bits and all, over two steps (brSF draws afresh at each)."""
    model = _model(name)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 5, dtype=f64, generator=gen)
    e = torch.randn(4, 3, dtype=f64, generator=gen)
    fused, apart = _routers(fxnx.convert(model, x), model, x, rule)
    for _ in range(2):
        want, runs = _step(model, apart, x, e)
        assert runs == 0
        got, runs = _step(model, fused, x, e)
        assert runs == (2 if name == "skip" else 1)
        _same(got, want)


def test_a_hook_added_since_calls_the_runs_nodes_one_by_one():
    """A hook on an activation of a run: the run falls back to its nodes at that call, the
    hook runs, and the gradients are the fused run's."""
    model = _model("modules")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 5, dtype=f64, generator=gen)
    e = torch.randn(4, 3, dtype=f64, generator=gen)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="frsf", seed=7)
    want, runs = _step(model, router, x, e)
    assert runs == 1
    seen = []
    hook = model[3].register_forward_hook(lambda *_: seen.append(1))
    got, runs = _step(model, router, x, e)
    hook.remove()
    assert runs == 0 and seen == [1]
    _same(got, want)


@pytest.mark.parametrize("takes_credit", [False, True])
def test_frozen_layers_and_an_input_with_or_without_credit(takes_credit):
    model = _model("modules")
    model[2].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    gen = torch.Generator().manual_seed(5)
    e = torch.randn(4, 3, dtype=f64, generator=gen)
    x = torch.randn(4, 5, dtype=f64, generator=gen)
    fused, apart = _routers(fxnx.convert(model, x), model, x, "feedback_alignment")
    results = []
    for router in (fused, apart):
        given = x.clone().requires_grad_(takes_credit)
        grads, runs = _step(model, router, given, e)
        results.append((grads, given.grad, runs))
    (got, got_x, runs), (want, want_x, none) = results
    assert runs == 1 and none == 0
    assert got[1] is None and got[2] is None  # frozen: no credit
    _same(got, want)
    _same([got_x], [want_x])


@pytest.mark.parametrize("name", ["functions", "modules"])
def test_forward_mode_through_a_fused_run(name):
    """Tangents bit for bit as the unfused router's (SiLU's is torch's forward-mode formula,
    not its backward's), and the model's own to float64 rounding."""
    model = _model(name)
    gen = torch.Generator().manual_seed(6)
    x, t = (torch.randn(4, 5, dtype=f64, generator=gen) for _ in range(2))
    routers = _routers(fxnx.convert(model, x), model, x, "feedback_alignment")
    outs = []
    for router in routers:
        with forward_ad.dual_level():
            out = router(forward_ad.make_dual(x, t))
            outs.append(forward_ad.unpack_dual(out).tangent.clone())
    assert torch.equal(outs[0], outs[1])
    _, want = torch.func.jvp(model, (x,), (t,))  # forward mode is the model's own
    torch.testing.assert_close(outs[0], want, rtol=1e-12, atol=1e-14)


def test_a_write_between_forward_and_backward_names_the_node():
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64, requires_grad=True)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="frsf")
    h = x * 1
    out = router(h)
    h.add_(1)  # the run's input, saved for its first layer's credit
    with pytest.raises(RuntimeError, match="node '_0'.*modified by an inplace operation"):
        out.sum().backward()
    out = router(x)
    with torch.no_grad():
        model[0].weight.add_(1)  # sign symmetry reads sign(W) as the forward pass saw it
        model[4].weight.add_(1)
    with pytest.raises(fxnx.errors.FxnxValueError, match="node '_4'.*written in place"):
        out.sum().backward()  # named as the backward pass meets them: the later layer first


def test_kolen_pollack_feedback_written_before_backward_is_refused():
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="kolen_pollack")
    out = router(x)
    with torch.no_grad():
        router.feedback["_6"].mul_(2)
    with pytest.raises(RuntimeError, match="'_6'"):
        out.sum().backward()


@pytest.mark.parametrize("frozen", [False, True])
def test_create_graph_through_a_fused_run_is_refused(frozen):
    """Refused also where no layer sends credit through B (the input takes none, only the last
    layer trains), where the run's backward would drop the second-order term through GELU's
    input. With fuse=False that backward runs: oracle, the model's own double backward (the
    last layer's weight takes exact credit, and no credit reaches a layer below)."""
    model = _model("modules")
    for p in list(model.parameters())[:-2] if frozen else ():
        p.requires_grad_(False)
    x = torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    with pytest.raises(fxnx.errors.FxnxValueError, match="create_graph=True through nodes '_0' to '_15'.*fuse=False"):
        torch.autograd.grad(router(x).pow(2).sum(), [model[15].weight], create_graph=True)
    if frozen:
        second = []
        for forward in (fxnx.CreditRouter(G, model, rule="feedback_alignment", fuse=False), model):
            (g,) = torch.autograd.grad(forward(x).pow(2).sum(), [model[15].weight], create_graph=True)
            second.append(torch.autograd.grad(g.pow(2).sum(), model[15].weight)[0])
        assert rel_error(second[0], second[1]) <= 1e-12


def test_direct_feedback_with_create_graph_through_a_fused_run_is_refused():
    """Direct feedback alignment too; with fuse=False the second-order credit is that of the
    router whose layers are hooked (each layer run as itself, its input receiving e·B)."""
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64, generator=torch.Generator().manual_seed(9))
    G = fxnx.convert(model, x)
    router = fxnx.CreditRouter(G, model, rule="direct_feedback_alignment")
    with pytest.raises(fxnx.errors.FxnxValueError, match="create_graph=True through nodes '_2' to '_12'.*fuse=False"):
        torch.autograd.grad(router(x).pow(2).sum(), [model[6].weight], create_graph=True)
    second = []
    for hooked in (False, True):
        router = fxnx.CreditRouter(G, model, rule="direct_feedback_alignment", fuse=False)
        handles = [layer.register_forward_hook(lambda *_: None) for layer in model if hooked and isinstance(layer, nn.Linear)]
        (g,) = torch.autograd.grad(router(x.clone().requires_grad_()).pow(2).sum(), model[6].weight, create_graph=True)
        second.append(torch.autograd.grad(g.pow(2).sum(), [model[0].weight, model[6].weight]))
        for handle in handles:
            handle.remove()
    for got, want in zip(*second, strict=True):
        assert rel_error(got, want) <= 1e-12


def test_runs_fall_back_where_they_cannot_fuse():
    """Without gradients, under autocast (each layer then runs through its rule) and on a 3-D
    input the run's nodes are called one by one: the model's output."""
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    with torch.no_grad():
        assert torch.equal(router(x), model(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
        assert _runs(out) == 0
        assert torch.equal(out, model(x))
    y = torch.randn(2, 4, 5, dtype=f64)
    router3 = fxnx.CreditRouter(fxnx.convert(model, y), model, rule="feedback_alignment")
    out = router3(y)
    assert _runs(out) == 0 and torch.equal(out, model(y))


def test_a_failing_layer_in_a_run_is_named():
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    router(x).sum().backward()
    model[4].weight.data = torch.randn(6, 5, dtype=f64)  # the wrong width for its input
    with pytest.raises(Exception, match="_4"):
        router(x)


def test_an_activation_patched_or_made_in_place_since_is_called(monkeypatch):
    """An activation whose class's forward was patched after fxnx was imported, or a leaky
    ReLU with a negative slope made in place after the router was built, is called as the
    model calls it (the run falls back to its nodes). Oracle: the model."""
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    original = nn.Tanh.forward
    with monkeypatch.context() as patch:
        patch.setattr(nn.Tanh, "forward", lambda self, v: original(self, v) * 2)
        out = router(x)
        assert _runs(out) == 0
        assert torch.equal(out, model(x))
    model[11].negative_slope, model[11].inplace = -0.5, True
    with pytest.raises(RuntimeError, match="In-place leakyReLu backward") as theirs:
        model(x).sum().backward()
    with pytest.raises(RuntimeError, match="In-place leakyReLu backward") as ours:
        router(x).sum().backward()
    assert str(ours.value) == str(theirs.value)


class _Clamped(nn.Module):
    """A max-norm constraint written into a later layer's weight between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc1(x)
        with torch.no_grad():
            self.fc2.weight.clamp_(-0.1, 0.1)
        return self.fc2(torch.relu(h))


class _Tied(nn.Module):
    """One layer applied three times in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.fc, self.out = nn.Linear(5, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = torch.tanh(self.fc(h))
        return self.out(h)


@pytest.mark.parametrize("rule", ["feedback_alignment", "frsf"])
def test_a_node_between_layers_keeps_its_place(rule):
    """A write into a weight between two layers runs before the later layer reads it (the
    layers are not fused). Oracle: the model's output after a step leaves the constraint's
    range; sign symmetry reads the weight as the forward pass left it, without a word."""
    torch.manual_seed(0)
    model = _Clamped().double()
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=rule)
    router(x)
    with torch.no_grad():
        model.fc2.weight.mul_(10)
    router(x).sum().backward()
    with torch.no_grad():
        model.fc2.weight.mul_(10)
    assert torch.equal(router(x), model(x))


@pytest.mark.parametrize("rule", ["feedback_alignment", "frsf"])
def test_a_weight_held_twice_ends_a_run(rule):
    """A layer applied three times sums its credit as autograd does, last use first (each use
    ends a run), in float32, where the order shows in the last bits. Oracle: the unfused
    router, bit for bit."""
    torch.manual_seed(0)
    model = _Tied()
    x, e = torch.randn(64, 5), torch.randn(64, 3)
    fused, apart = _routers(fxnx.convert(model, x), model, x, rule)
    want, _ = _step(model, apart, x, e)
    got, runs = _step(model, fused, x, e)
    assert runs >= 1
    _same(got, want)


@pytest.mark.parametrize("takes_credit", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_direct_feedback_runs_are_their_nodes_one_by_one_bit_for_bit(name, takes_credit):
    """Direct feedback alignment over a fused run: the same gradients as the unfused router,
    bits and all, over two steps, the input's credit included (where the input takes none, the
    first layer runs on its own and the rest fused)."""
    model = _model(name)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 5, dtype=f64, generator=gen)
    e = torch.randn(4, 3, dtype=f64, generator=gen)
    fused, apart = _routers(fxnx.convert(model, x), model, x, "direct_feedback_alignment")
    for _ in range(2):
        results = []
        for router in (fused, apart):
            given = x.clone().requires_grad_(takes_credit)
            model.zero_grad(set_to_none=True)
            out = router(given)
            runs = _runs(out, "_DirectChainBackward")
            (out * e).sum().backward()
            results.append(([None if p.grad is None else p.grad.clone() for p in model.parameters()], given.grad, runs))
        (got, got_x, runs), (want, want_x, none) = results
        assert runs >= 1 and none == 0
        _same(got, want)
        _same([got_x], [want_x])



class _Returned(nn.Module):
    """A run ``a → tanh → b → relu → c`` whose output is read only through ``detach``, and
    whose hidden value ``h = tanh(a(x))`` the model also returns."""

    def __init__(self, returns_hidden: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 7)
        self.d, self.e = nn.Linear(7, 3), nn.Linear(5, 3)
        self.returns_hidden = returns_hidden

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = self.c(torch.relu(self.b(h)))
        out = self.d(y.detach()) + self.e(x)
        return (out, h) if self.returns_hidden else out


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("returns_hidden", [True, False])
def test_direct_feedback_reaches_each_layer_input_once_where_a_run_s_output_takes_no_credit(returns_hidden, fuse):
    """Every layer's input gets its projection e·B once, whatever reaches the layer's output.
    Fused, a run whose hidden value the model returned ran on through it, and the run's output
    taking no credit, no layer of it sent any (a's weight 4.3 off, b's None). Fused or not, on
    a router's first call, a node reached only through the input of one that is not (``b``,
    through ``c``'s) was taken for unreached too: its input got e·B from the output and from
    the node (a's weight credit twice DFA's). Oracle: DFA written by hand, at every call."""
    model = _Returned(returns_hidden).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, dtype=f64, generator=gen)
    e_out, e_h = torch.randn(4, 3, dtype=f64, generator=gen), torch.randn(4, 7, dtype=f64, generator=gen)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", fuse=fuse)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        given = x.clone().requires_grad_()
        out = router(given)
        loss = (out[0] * e_out).sum() + (out[1] * e_h).sum() if returns_hidden else (out * e_out).sum()
        loss.backward()
        fb = router.feedback
        e = torch.cat([e_out, e_h], 1) if returns_hidden else e_out
        with torch.no_grad():
            h = torch.tanh(model.a(x))
            at_h = e @ fb["b"] + (e_h if returns_hidden else 0)
            d_a, d_b = at_h * (1 - h**2), (e @ fb["c"]) * (model.b(h) > 0)
        assert rel_error(model.a.weight.grad, d_a.T @ x) <= 1e-12
        assert rel_error(model.b.weight.grad, d_b.T @ h) <= 1e-12
        assert model.c.weight.grad is None  # its output takes no credit
        assert rel_error(given.grad, e @ fb["a"] + e @ fb["e"]) <= 1e-12


def test_direct_feedback_with_a_weight_tied_after_the_router_was_built_runs_the_nodes_one_by_one():
    """Weights tied after the first call: the run no longer fuses (it would sum the tied
    weight's credit in another order than autograd's, 1e-6 apart in float32), and the
    gradients are the unfused router's, bit for bit."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    grads = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())), nn.Linear(16, 3))
        router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment", fuse=fuse)
        router(x)
        model[2].weight = model[4].weight = model[6].weight = model[0].weight
        out = router(x.clone().requires_grad_())
        assert _runs(out, "_DirectChainBackward") == 0
        out.pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    _same(*grads)


@pytest.mark.parametrize("rule", ["feedback_alignment", "direct_feedback_alignment"])
def test_layers_without_bias_fuse(rule):
    """Layers with no bias (``bias=False``) fuse: the same gradients as the unfused router,
    bit for bit, from one autograd function."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(6, 6, bias=False), nn.ReLU())), nn.Linear(6, 2)).double()
    x = torch.randn(4, 6, dtype=f64)
    grads = []
    for router in _routers(fxnx.convert(model, x), model, x, rule):
        model.zero_grad(set_to_none=True)
        given = x.clone().requires_grad_()
        out = router(given)
        grads.append((_runs(out, "_DirectChainBackward" if rule.startswith("direct") else "_ChainBackward"),
                      [p.grad for p in model.parameters()], given.grad))
        out.pow(2).sum().backward()
        grads[-1] = (grads[-1][0], [p.grad for p in model.parameters()], given.grad)
    (runs, got, got_x), (none, want, want_x) = grads
    assert runs == 1 and none == 0
    _same(got, want)
    _same([got_x], [want_x])


class _Hidden(nn.Module):
    """A run whose hidden value the model returns, under weight transport, beside a node
    routed by direct feedback (so the output has a tap)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.relu(self.b(h))) + self.d(x), h


def test_a_weight_transport_run_ends_at_a_value_the_model_returns_beside_a_tap():
    """The tap at the output reads the returned hidden value, and a weight-transport run
    returns only its output: the run ends there (before, building the router's graph failed,
    erasing a node the tap still read). Oracle: with feedback equal to the weights, feedback
    alignment is backprop (autograd on the model), and the unfused router bit for bit."""
    model = _Hidden().double()
    x = torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    rules = {"d": fxnx.credit.DirectFeedbackAlignment()}
    fb = {name: getattr(model, name).weight.detach().clone() for name in "abc"}
    grads = []
    for fuse in (True, False):
        router = fxnx.CreditRouter(G, model, rule="feedback_alignment", rules=rules, feedback=fb, fuse=fuse)
        model.zero_grad(set_to_none=True)
        y, h = router(x)
        (y.pow(2).sum() + h.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    _same(grads[0], grads[1])
    model.zero_grad(set_to_none=True)
    y, h = model(x)
    (y.pow(2).sum() + h.sum()).backward()
    for name in "abc":
        for p in getattr(model, name).parameters():
            got = grads[0][[q is p for q in model.parameters()].index(True)]
            assert rel_error(got, p.grad) <= 1e-12
