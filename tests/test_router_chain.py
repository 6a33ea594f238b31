"""Runs of linear layers routed as one autograd function (fxnx/_credit/chain.py).

Oracles: autograd on the model itself (feedback alignment given ``B = W`` is backprop), and
the same router with the run's layers called one by one (a hook that does nothing on one of
its activations makes the run fall back to its nodes at every call), bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn import functional as F

import fxnx
from fxnx._credit import graft

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


def _runs(out) -> int:
    """How many runs of layers ran as one autograd function in computing ``out``: the
    autograd nodes of the run's function in its graph."""
    seen, todo, found = set(), [out.grad_fn], 0
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        found += type(fn).__name__ == "_ChainBackward"
        todo += [nxt for nxt, _ in fn.next_functions]
    return found


def _nothing(*_):
    return None


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _step(model, router, x, e):
    """The gradients of one step, and how many runs of layers it ran as one function."""
    model.zero_grad(set_to_none=True)
    out = router(x)
    runs = _runs(out)
    (out * e).sum().backward()
    return _grads(model), runs


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
def test_a_fused_run_is_its_nodes_one_by_one_bit_for_bit(name, rule, monkeypatch):
    """Two routers with one seed, one built without fusing runs (each layer its own autograd
    function, as before runs were fused): the same gradients, bits and all, over two steps
    (brSF draws afresh at each)."""
    model = _model(name)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 5, dtype=f64, generator=gen)
    e = torch.randn(4, 3, dtype=f64, generator=gen)
    G = fxnx.convert(model, x)
    fused = fxnx.CreditRouter(G, model, rule=rule, seed=7)
    fused(x)  # its graph, with runs fused
    apart = fxnx.CreditRouter(G, model, rule=rule, seed=7)
    with monkeypatch.context() as patch:
        patch.setattr(graft, "fuse", lambda *_: None)
        apart(x)  # its graph, made now: no run fused
    for _ in range(2):
        want, runs = _step(model, apart, x, e)
        assert runs == 0
        got, runs = _step(model, fused, x, e)
        assert runs == (2 if name == "skip" else 1)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


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
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_frozen_layers_and_an_input_taking_credit():
    model = _model("modules")
    model[2].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    if True:
        gen = torch.Generator().manual_seed(5)
        e = torch.randn(4, 3, dtype=f64, generator=gen)
        base = torch.randn(4, 5, dtype=f64, generator=gen)
        G = fxnx.convert(model, base)
        results = []
        for hooked in (False, True):
            router = fxnx.CreditRouter(G, model, rule="feedback_alignment", seed=1)
            hook = model[1].register_forward_hook(_nothing) if hooked else None
            x = base.clone().requires_grad_()
            model.zero_grad(set_to_none=True)
            out = router(x)
            runs = _runs(out)
            (out * e).sum().backward()
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            results.append((grads, x.grad.clone(), runs))
            if hook is not None:
                hook.remove()
        (fused, fused_x, runs), (apart, apart_x, none) = results
        assert runs >= 1 and none == 0
        assert fused[0 * 2 + 1] is None and fused[1 * 2] is None  # frozen: no credit
        for g, w in zip(fused, apart, strict=True):
            assert (g is None and w is None) or torch.equal(g, w)
        assert torch.equal(fused_x, apart_x)


def test_forward_mode_through_a_fused_run():
    model = _model("functions")
    gen = torch.Generator().manual_seed(6)
    x, t = (torch.randn(4, 5, dtype=f64, generator=gen) for _ in range(2))
    G = fxnx.convert(model, x)
    outs = []
    for hooked in (False, True):
        router = fxnx.CreditRouter(G, model, rule="feedback_alignment", seed=2)
        hook = model[1].fcs[0].register_forward_hook(_nothing) if hooked else None
        with forward_ad.dual_level():
            out = router(forward_ad.make_dual(x, t))
            outs.append(forward_ad.unpack_dual(out).tangent.clone())
        if hook is not None:
            hook.remove()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-14)
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
        model[4].weight.add_(1)  # sign symmetry reads sign(W) as the forward pass saw it
    with pytest.raises(fxnx.errors.FxnxValueError, match="node '_4'.*written in place"):
        out.sum().backward()


def test_kolen_pollack_feedback_written_before_backward_is_refused():
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="kolen_pollack")
    out = router(x)
    with torch.no_grad():
        router.feedback["_6"].mul_(2)
    with pytest.raises(RuntimeError, match="'_6'"):
        out.sum().backward()


def test_create_graph_through_a_fused_run_is_refused():
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    with pytest.raises(fxnx.errors.FxnxValueError, match="create_graph=True through node '_15'"):
        torch.autograd.grad(router(x).sum(), list(model.parameters()), create_graph=True)


def test_runs_fall_back_where_they_cannot_fuse():
    """Under autocast, on a 3-D input and without gradients the run's nodes are called one by
    one: the same output as the model."""
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    with torch.no_grad():
        assert torch.equal(router(x), model(x))
    y = torch.randn(2, 4, 5, dtype=f64)
    G3 = fxnx.convert(model, y)
    router3 = fxnx.CreditRouter(G3, model, rule="feedback_alignment")
    assert torch.equal(router3(y), model(y))
    router3(y).sum().backward()  # routed by the layers' own functions


def test_a_failing_layer_in_a_run_is_named():
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    router(x).sum().backward()
    model[4].weight.data = torch.randn(6, 5, dtype=f64)  # the wrong width for its input
    with pytest.raises(Exception, match="_4"):
        router(x)


def test_an_activation_patched_since_is_called(monkeypatch):
    """An activation whose class's forward was patched after fxnx was imported is called as
    the model calls it (the run falls back to its nodes). Oracle: model(x)."""
    model = _model("modules")
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    original = nn.Tanh.forward
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, v: original(self, v) * 2)
    out = router(x)
    assert _runs(out) == 0
    assert torch.equal(out, model(x))
