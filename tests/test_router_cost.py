"""What a router step costs beside autograd's: nothing for exact routing, no copies of the
weights for weight transport, attention and transformer layers inside autograd's own backward.

Oracles: autograd on the model itself (bit for bit where the router runs the model's own
forward, with the same dropout masks where a rule's feedback weights are the weights
themselves), and torch's profiler for what a forward pass allocates.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fxnx

f64 = torch.float64


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def test_exact_routing_follows_the_model_after_its_structure_changes():
    """With every node exact and G whole, routing is autograd's: after the first call the
    router runs the model's own forward, so a module replaced later is trained as autograd
    trains it (router.backward included)."""
    model = _mlp()
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model)
    router(x).sum().backward()
    torch.manual_seed(1)
    model[2] = nn.Linear(7, 3).double()
    model.zero_grad()
    ref = copy.deepcopy(model)
    out = router(x)
    assert torch.equal(out, ref(x))
    res = router.backward(out.pow(2).sum())
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
        assert torch.equal(res.param_credit[name], q.grad), name


class _Attend(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.att = nn.MultiheadAttention(8, 2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.att(h, h, h, need_weights=False)[0])


def test_feedback_inside_attention_with_dropout_is_backprop_when_b_is_w():
    """Attention in training mode with dropout is routed inside autograd's own backward (its
    dropout masks replayed): with each feedback weight the weight itself, feedback alignment
    gives autograd's gradients under the same random draws, and with random ones it differs."""
    torch.manual_seed(0)
    model = _Attend(dropout=0.5).double().train()
    x = torch.randn(2, 5, 6, dtype=f64)
    G = fxnx.convert(model, x)
    own = {"inp": model.inp.weight.detach().clone(), "head": model.head.weight.detach().clone(),
           "att": {"in_proj_weight": model.att.in_proj_weight.detach().clone(),
                   "out_proj.weight": model.att.out_proj.weight.detach().clone()}}
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback=own)
    router(x)  # the first call checks the capture (without gradients) and routes
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    router(x).pow(2).sum().backward()
    mirror = _grads(model)
    torch.manual_seed(7)
    ref(x).pow(2).sum().backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(mirror[name], p.grad, rtol=1e-12, atol=1e-14, msg=name)
    model.zero_grad()
    fa = fxnx.CreditRouter(G, model, rule="feedback_alignment", seed=3)
    torch.manual_seed(7)
    fa(x).pow(2).sum().backward()
    assert fa.feedback["att"].keys() == {"in_proj_weight", "out_proj.weight"}
    moved = (model.inp.weight.grad - ref.inp.weight.grad).norm()
    assert moved > 1e-3 * ref.inp.weight.grad.norm()  # the credit crossed feedback weights


def _held_by_forward(forward, x):
    """Bytes a forward pass allocates that are still allocated when it returns (torch's
    profiler; what the backward pass will read, and nothing else)."""
    forward(x).sum().backward()  # the first call: capture, plan, feedback weights
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward(x)
    out.sum().backward()
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("rule", ["exact", "feedback_alignment", "usf", "frsf", "brsf", "kolen_pollack", "weight_mirror"])
def test_weight_transport_keeps_no_copy_of_the_weights_from_forward_to_backward(rule):
    """Between the forward and the backward pass a router holds what autograd holds. Sign
    symmetry makes sign(W)·M in the backward pass, one layer at a time; brSF draws each
    layer's new M there too, into the memory of that B, and keeps none of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                          nn.Linear(128, 3)).double()
    x = torch.randn(1, 128, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=rule)
    held = _held_by_forward(router, x)
    want = _held_by_forward(model, x)
    # A weight is 128 KiB: a copy of one would show. Either count may miss a block the
    # allocator hands back that was allocated before the profiler started (the output's few
    # bytes, or now and then one 1 KiB activation, with fusion or without: about 1 run in 60),
    # which only lowers it: what is held beyond autograd's is bounded, not what is held less.
    assert held - want < 1024, (held, want)


def test_sign_symmetry_refuses_a_weight_written_between_forward_and_backward():
    """sign(W) is read as the forward pass saw it; a write into W before the backward pass is
    refused, as autograd refuses one into a tensor it saved."""
    model = _mlp()
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="usf")
    out = router(x)
    with torch.no_grad():
        model[2].weight.mul_(2)
    with pytest.raises(fxnx.errors.FxnxValueError, match="written in place .* between the forward pass"):
        out.sum().backward()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.scale = 2.0

    def forward(self, x):
        return self.linear(x) * self.scale


def test_exact_routing_follows_an_attribute_changed_after_capture():
    """The router's forward is the model's own where routing is autograd's: a value a
    traced-through module reads (baked into G as a constant) changed later still gives
    autograd's output and gradients, without capturing again."""
    torch.manual_seed(0)
    model, x = _Scaled().double(), torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model)
    router(x).sum().backward()
    model.scale = 3.0
    model.zero_grad()
    ref = copy.deepcopy(model)
    out = router(x)
    assert torch.equal(out, ref(x))
    out.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _Configured(nn.Module):
    """A forward that reads fields of config objects nested in a list (baked into the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.configs = [_Config(shift=float(i), inner=_Config(scale=1.0 + i)) for i in range(6)]

    def forward(self, x):
        y = self.linear(x)
        for config in self.configs:
            y = y * config.inner.scale + config.shift
        return y


@pytest.mark.parametrize("rule", ["exact_collected", "feedback_alignment"])
def test_a_router_follows_every_config_field_changed_between_calls(rule):
    """Each field of each nested config changed in turn, the router called after each change:
    its output is the model's own every time (the oracle: the model run eagerly). The guard
    keeps its last fingerprint while a watch of what that walk read sees no change: a change
    it missed would give the output of the graph captured before it."""
    torch.manual_seed(0)
    model, x = _Configured().double(), torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    router = (fxnx.CreditRouter(G, model, node_credit=True) if rule == "exact_collected"
              else fxnx.CreditRouter(G, model, rule=rule, seed=0))
    router(x)
    for config in model.configs:
        for owner, field in ((config, "shift"), (config.inner, "scale")):
            setattr(owner, field, getattr(owner, field) + 0.5)
            assert torch.equal(router(x), model(x)), field


class _Doubling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * 2.0


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = _Doubling()

    def forward(self, x):
        return self.sub(x)


def test_a_router_follows_a_forward_patched_on_a_traced_through_class(monkeypatch):
    """A traced-through module's class given another forward that names the same globals
    (none): the router's output is the model's own (the oracle: the model run eagerly). The
    guard had compared the globals a forward names, not which forward it is, and reused the
    graph of the old one."""
    torch.manual_seed(0)
    model, x = _Outer().double(), torch.randn(2, 3, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment", seed=0)
    router(x)
    router(x)
    monkeypatch.setattr(_Doubling, "forward", lambda self, x: self.fc(x) * 3.0)
    assert torch.equal(router(x), model(x))


class _LiveAtTheStart(torch.autograd.Function):
    """The identity; its backward (the last to run, at the model's start) counts the plain
    tensors of the model's value shape that are still alive."""

    counts: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, credit):
        import gc

        gc.collect()
        _LiveAtTheStart.counts.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == (3, 40, 70)))
        return credit


class _Products(nn.Module):
    """``depth`` products by a number, whose backward saves no value."""

    def __init__(self, depth):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 70, dtype=f64))
        self.depth = depth

    def forward(self, x):
        x = _LiveAtTheStart.apply(x * self.w)
        for _ in range(self.depth):
            x = x * 1.5
        return x


def test_route_credit_lets_each_value_go_once_autograd_is_done_with_it():
    """route_credit reports every node's credit, not its value: a value autograd saves for
    nothing is freed as in a plain backward, not held to the end of the backward pass. Oracle:
    the Python tensors alive when the backward reaches the model's start (gc's count; autograd
    holds the credits it has computed so far in C++ until the pass ends), for two depths: each
    product more leaves no tensor more alive (held, its value would be)."""
    x = torch.randn(3, 40, 70, dtype=f64)  # values above the size route_credit holds to the end
    live = []
    for depth in (3, 6):
        model = _Products(depth)
        G = fxnx.convert(model, x)
        _LiveAtTheStart.counts.clear()
        res = fxnx.route_credit(G, model, x)
        assert len(_LiveAtTheStart.counts) == 1
        live.append(_LiveAtTheStart.counts[0])
        assert sum(f"mul_{i}" in res.node_credit for i in range(1, depth + 1)) == depth
        del res  # its credits would be counted at the next depth
    assert live[1] == live[0]
