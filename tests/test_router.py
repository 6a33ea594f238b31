"""CreditRouter: training with routed credit against training with autograd."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxnx

from conftest import rel_error


class _Net(nn.Module):
    """Conv, train-mode BatchNorm, in-place ReLU, a skip connection, a frozen-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x)))
        h = self.act(self.bn2(self.conv2(h)) + h)  # the skip
        return self.head(h.mean((2, 3)))


def _batches(steps, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 3, 8, 8, generator=gen, dtype=dtype), torch.randint(0, 3, (6,), generator=gen))
        for _ in range(steps)
    ]


def _train(model, forward, backward, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        backward(loss)
        opt.step()


def test_exact_training_equals_autograd_training():
    torch.manual_seed(0)
    ours = _Net().double().train()
    theirs = copy.deepcopy(ours)
    batches = _batches(4)
    router = fxnx.CreditRouter(fxnx.convert(ours, batches[0][0]), ours)
    _train(ours, router, router.backward, batches)
    _train(theirs, theirs, lambda loss: loss.backward(), batches)  # the oracle: autograd
    moved = 0.0
    torch.manual_seed(0)
    start = _Net().double()  # the initial values: the training must have moved the weights
    for (name, p), q, p0 in zip(ours.named_parameters(), theirs.parameters(), start.parameters(), strict=True):
        assert rel_error(p.detach(), q.detach()) <= 1e-10, name
        moved = max(moved, rel_error(p.detach(), p0.detach()))
    assert moved > 1e-2
    for (name, b), c in zip(ours.named_buffers(), theirs.buffers(), strict=True):
        assert torch.equal(b, c), name  # running statistics updated as model(x) updates them
    assert int(ours.bn.num_batches_tracked) == 4
    assert ours.act.inplace  # the model itself is untouched


def test_exact_training_is_bit_equal_on_a_torchvision_cnn():
    import torchvision

    torch.manual_seed(0)
    ours = torchvision.models.resnet18(weights=None, num_classes=5).double().train()
    theirs = copy.deepcopy(ours)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.float64),
                torch.randint(0, 5, (2,), generator=gen)) for _ in range(2)]
    router = fxnx.CreditRouter(fxnx.convert(ours, batches[0][0]), ours)
    _train(ours, router, router.backward, batches)
    _train(theirs, theirs, lambda loss: loss.backward(), batches)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_grad_accumulates_and_frozen_parameters_stay_untouched():
    torch.manual_seed(0)
    model = _Net().double().eval()
    model.conv.weight.requires_grad_(False)
    frozen = model.conv.weight.detach().clone()
    ref = copy.deepcopy(model)
    (x1, y1), (x2, y2) = _batches(2)
    router = fxnx.CreditRouter(fxnx.convert(model, x1), model)
    model.head.weight.grad = torch.ones_like(model.head.weight)  # kept and added to
    ref.head.weight.grad = torch.ones_like(ref.head.weight)
    for x, y in ((x1, y1), (x2, y2)):  # two backward calls add up
        res = router.backward(nn.functional.cross_entropy(router(x), y))
        nn.functional.cross_entropy(ref(x), y).backward()
    assert model.conv.weight.grad is None and torch.equal(model.conv.weight, frozen)
    assert "conv.weight" not in res.param_credit
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p.requires_grad:
            assert rel_error(p.grad, q.grad) <= 1e-12, name
    # The last backward's own credit is in the result; .grad holds the sum.
    assert not torch.equal(res.param_credit["head.bias"], model.head.bias.grad)


def test_grads_that_autograd_would_share_are_not_shared():
    class TwoBiases(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(3, dtype=torch.float64))
            self.b = nn.Parameter(torch.zeros(3, dtype=torch.float64))

        def forward(self, x):
            return x + self.a + self.b  # add sends one tensor to both parameters

    model, x = TwoBiases(), torch.randn(2, 3, dtype=torch.float64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model)
    for _ in range(2):
        router.backward(router(x).sum())
    assert torch.equal(model.a.grad, torch.full((3,), 4.0, dtype=torch.float64))
    assert torch.equal(model.b.grad, torch.full((3,), 4.0, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_forward_is_the_models_forward(mode):
    torch.manual_seed(0)
    model = getattr(_Net().double(), mode)()
    ref = copy.deepcopy(model)
    x = _batches(1)[0][0]
    router = fxnx.CreditRouter(fxnx.convert(model, x), model)
    out = router(x)
    assert torch.equal(out, ref(x))
    for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, c), name
    assert all(p.grad is None for p in model.parameters())  # the forward alone adds nothing
    with torch.no_grad():
        assert torch.equal(router(x), ref(x))


def test_output_credit_instead_of_a_loss():
    torch.manual_seed(0)
    model = _Net().double().eval()
    ref = copy.deepcopy(model)
    x = _batches(1)[0][0]
    credit = torch.randn(6, 3, dtype=torch.float64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, node_credit=True)
    router(x)
    res = router.backward(output_credit=credit, node_credit=True)
    ref(x).backward(credit)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert rel_error(p.grad, q.grad) <= 1e-12, name
    assert torch.equal(res.node_credit["output"], credit)


def test_misuse_is_refused_with_what_to_do():
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"call output = router\(x\)"):
        router.backward(torch.tensor(1.0))
    out = router(x)
    with pytest.raises(fxnx.errors.FxnxValueError, match="exactly one"):
        router.backward(out.sum(), output_credit=torch.ones(4, 2))
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"loss must be a scalar .*shape \(4, 2\)"):
        router.backward(out * 2)
    with pytest.raises(fxnx.errors.FxnxValueError, match="does not depend on the output"):
        router.backward(torch.tensor(1.0, requires_grad=True) * 2)
    router.backward(out.sum())
    with pytest.raises(fxnx.errors.FxnxValueError, match="once per forward"):
        router.backward(out.sum())
    with pytest.raises(fxnx.errors.FxnxValueError, match="unknown rule 'fa'"):
        fxnx.CreditRouter(fxnx.convert(model, x), model, rule="fa")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"rules name nodes that G does not have: \['nope'\]"):
        fxnx.CreditRouter(fxnx.convert(model, x), model, rules={"nope": fxnx.credit.Exact()})
    with pytest.raises(fxnx.errors.FxnxTypeError, match=r"pass an instance: Exact\(\)"):
        fxnx.CreditRouter(fxnx.convert(model, x), model, rules={nn.Linear: fxnx.credit.Exact})


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, scale=None):
        y = self.lin(x)
        return y if scale is None else y * scale


def test_misuse_of_inputs_edges_and_rules_says_what_to_do():
    """A keyword input G was not converted with; a G with every edge into the output removed; a rule that calls call.exact twice without keeping the graph: each says
    what was wrong and what to do, where torch's own errors (or a list of missing nodes)
    came before."""
    model = _Scaled().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    G = fxnx.convert(model, x)
    two = torch.tensor(2.0, dtype=torch.float64)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"called with input \['scale'\] that G was not converted with.*kwargs="):
        fxnx.CreditRouter(G, model, rule="feedback_alignment")(x, scale=two)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"input \['scale'\]"):
        fxnx.route_credit(G, model, x, kwargs={"scale": two})
    routed = fxnx.route_credit(fxnx.convert(model, x, kwargs={"scale": two}), model, x, kwargs={"scale": two})
    assert torch.equal(routed.output, model(x, scale=two))  # converted with it, it routes

    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    cut = fxnx.convert(mlp, x)
    cut.remove_edges_from(list(cut.in_edges("output", keys=True)))
    with pytest.warns(UserWarning, match=r"every edge into the output node 'output' was removed from G"):
        out = fxnx.CreditRouter(cut, mlp)(x)
    assert torch.equal(out, mlp(x)) and not out.requires_grad  # its value flows, no credit

    class Written(nn.Module):  # credit reaches p through a write into a buffer: no warning
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.randn(3, dtype=torch.float64))
            self.register_buffer("buf", torch.zeros(3, dtype=torch.float64))

        def forward(self, x):
            self.buf.copy_(self.p * 2)
            return x + self.buf

    written = Written()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxnx.CreditRouter(fxnx.convert(written, x), written)(x).sum().backward()
    assert torch.equal(written.p.grad, torch.full((3,), 8.0, dtype=torch.float64))

    def twice(call, credit, state):
        call.exact(credit)
        return call.exact(credit)

    router = fxnx.CreditRouter(fxnx.convert(mlp, x), mlp, rules={"_2": twice})
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"node '_2': call.exact was called again.*retain_graph=True"):
        router(x).sum().backward()

    def kept(call, credit, state):
        call.exact(credit, retain_graph=True)
        return call.exact(credit)

    mlp.zero_grad()
    fxnx.CreditRouter(fxnx.convert(mlp, x), mlp, rules={"_2": kept})(x).sum().backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, mlp.parameters(), strict=True))


def test_the_plan_is_compiled_once(monkeypatch):
    from fxnx._credit import router as engine

    compiled = []
    real = engine.compile_plan
    monkeypatch.setattr(engine, "compile_plan", lambda *a, **k: compiled.append(1) or real(*a, **k))
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    B = None
    for _ in range(3):
        router.backward(router(x).sum())
        B = B if B is not None else router.feedback["_0"]
        assert router.feedback["_0"] is B  # the same feedback weights every step
    assert len(compiled) == 1


def test_a_rule_object_as_rule_is_that_rule_at_every_weighted_layer():
    """``rule=FeedbackAlignment()`` is the "feedback_alignment" preset with that object: the same
    credit bit for bit; another init draws another B; a user's rule reaches the weighted layers
    only, the others staying exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, e = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    G = fxnx.convert(model, x)

    def grads(rule):
        model.zero_grad()
        x_ = x.clone().requires_grad_()
        (fxnx.CreditRouter(G, model, rule=rule, seed=3)(x_) * e).sum().backward()
        return [x_.grad, *(p.grad.clone() for p in model.parameters())]

    preset, obj = grads("feedback_alignment"), grads(fxnx.credit.FeedbackAlignment())
    assert all(torch.equal(a, b) for a, b in zip(preset, obj, strict=True))
    kaiming = grads(fxnx.credit.FeedbackAlignment(init="kaiming"))
    assert not torch.equal(kaiming[0], preset[0])

    seen = []

    class Spy(fxnx.credit.Rule):
        name = "spy"

        def __call__(self, call, credit, state):
            seen.append(call.name)
            return call.exact(credit)

    exact = grads("exact")
    spied = grads(Spy())
    assert sorted(set(seen)) == ["_0", "_2"]  # the two Linear layers, not tanh
    assert all(rel_error(a, b) <= 1e-12 for a, b in zip(spied, exact, strict=True))


class _Defaults(nn.Module):
    """A forward with a keyword convert fixes (``use_cache=False``, as Hugging Face models
    have): a placeholder of the capture past the inputs a call gives."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, use_cache=True):
        return self.fc2(torch.tanh(self.fc(x)) * (1.0 if use_cache else 2.0))


def test_calls_that_leave_a_fixed_keyword_out_route_each_their_own_inputs():
    """The placeholders past a call's inputs are passed on as the first call bound them: each
    call's output is the model's under the fixed keyword, and feedback alignment with B = W is
    autograd's, on every call (new inputs each time)."""
    torch.manual_seed(0)
    model = _Defaults().double()
    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]
    G = fxnx.convert(model, xs[0])
    assert [n for n, kind in G.nodes(data="op") if kind == "placeholder"] == ["x", "use_cache"]
    # captured by torch.export (the keyword decides a Python branch): F.linear nodes
    mirror = {"linear": model.fc.weight.detach().clone(), "linear_1": model.fc2.weight.detach().clone()}
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback=mirror)
    for x in xs:
        x_ = x.clone().requires_grad_()
        out = router(x_)
        assert torch.equal(out, model(x, use_cache=False))
        (out ** 2).sum().backward()
        got = x_.grad
        x_ = x.clone().requires_grad_()
        (model(x_, use_cache=False) ** 2).sum().backward()
        assert rel_error(got, x_.grad) <= 1e-12
    assert router._tail == [False]  # the calls after the first took the unbound path
