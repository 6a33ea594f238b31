"""Credit through what a graph's operations alone do not say: custom autograd Functions
(their own backward), torch's reentrant checkpoint, and branches on a tensor's value.

Oracles: autograd on a deep copy of the model, and feedback alignment written out by hand
(a layer's input credit is ``g @ B``, with ``B`` read from ``router.feedback``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxnx

f64 = torch.float64


class _StraightThrough(torch.autograd.Function):
    """Rounds to quarters; its backward passes the credit on unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _Reversal(torch.autograd.Function):
    """The identity; its backward sends back minus half the credit."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -0.5 * g


class _Net(nn.Module):
    def __init__(self, middle) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.middle = nn.Linear(5, 7), nn.Linear(7, 3), middle

    def forward(self, x):
        return self.b(self.middle(torch.tanh(self.a(x))))


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def _autograd(model, x, e):
    twin = copy.deepcopy(model)
    (twin(x) * e).sum().backward()
    return _grads(twin)


def _fa_by_hand(model, x, e, B, through):
    """Feedback alignment on a -> tanh -> middle -> b: b's input gets e @ B, ``through``
    maps it across the middle as the model's backward does, then tanh' and a's exact credit."""
    h = torch.tanh(model.a(x)).detach()
    g = through(e @ B) * (1 - h**2)
    return {"a.weight": g.T @ x, "a.bias": g.sum(0), "b.weight": e.T @ model.middle(h).detach(), "b.bias": e.sum(0)}


@pytest.mark.parametrize(("function", "through"), [(_StraightThrough, lambda g: g), (_Reversal, lambda g: -0.5 * g)])
def test_a_custom_function_keeps_its_backward(function, through):
    """Its call is one node, which autograd runs with the Function's own backward: exact
    credit is autograd's, and feedback alignment passes through it as the model's backward
    does. Before, the trace held its forward's operations, marked as run without gradients:
    every layer below it got no credit at all."""
    model = _Net(lambda h: function.apply(h)).double()
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    G = fxnx.convert(model, x)
    node = {"_StraightThrough": "_straight_through_apply", "_Reversal": "_reversal_apply"}[function.__name__]
    assert G.nodes[node]["target"] == f"{__name__}.{function.__name__}.apply"
    want = _autograd(model, x, e)
    router = fxnx.CreditRouter(G, model, node_credit=True)
    (router(x) * e).sum().backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=0, msg=name)
    res = fxnx.route_credit(G, model, x, output_credit=e)
    for name in want:
        torch.testing.assert_close(res.param_credit[name], want[name], rtol=1e-12, atol=0, msg=name)
    model.zero_grad()
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    (router(x) * e).sum().backward()
    by_hand = _fa_by_hand(model, x, e, router.feedback["b"], through)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, by_hand[name], rtol=1e-12, atol=1e-15, msg=name)


def test_a_reentrant_checkpoint_inside_the_model_is_traced_through():
    """torch's reentrant checkpoint runs its function without gradients in the forward pass;
    its values are the function's, and rules reach the layers inside it."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(7, 7), nn.Tanh())

        def forward(self, h):
            return checkpoint(self.inner, h, use_reentrant=True)

    model = _Net(Checkpointed()).double()
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: none of the checkpoint's inputs needs grad
        G = fxnx.convert(model, x)
        want = _autograd(model, x, e)
        router = fxnx.CreditRouter(G, model, node_credit=True)
        (router(x) * e).sum().backward()
        for name, grad in _grads(model).items():
            torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=0, msg=name)
        model.zero_grad()
        router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
        (router(x) * e).sum().backward()
    inner = model.middle.inner[0]
    h = torch.tanh(model.a(x)).detach()
    m = torch.tanh(inner(h)).detach()
    g_m = e @ router.feedback["b"]
    g_inner = g_m * (1 - m**2)
    torch.testing.assert_close(inner.weight.grad, g_inner.T @ h, rtol=1e-12, atol=1e-15)
    g_a = (g_inner @ router.feedback["middle_inner_0"]) * (1 - h**2)
    torch.testing.assert_close(model.a.weight.grad, g_a.T @ x, rtol=1e-12, atol=1e-15)


def test_a_graph_that_lost_the_models_backward_is_refused_for_credit():
    """torch.export inlines a custom Function's forward and drops its backward: credit over
    its graph would be another backward than the model's (a straight-through layer's credit
    was zero). Refused, naming the Function, with a warning at conversion; the exact router
    that runs the model's own forward still trains the model."""
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    function = "applies the autograd Function _StraightThrough"
    for model, routes in [
        (_Net(lambda h: _StraightThrough.apply(h)).double(), "export"),
        # apply bound before the trace: symbolic_trace cannot keep it whole, export comes next
        (_Net(_StraightThrough.apply).double(), "auto"),
    ]:
        with pytest.warns(UserWarning, match=function):
            G = fxnx.convert(model, x, routes=routes)
        assert G.graph["capture"] == "export"
        for rule in ("exact", "feedback_alignment"):
            with pytest.raises(fxnx.errors.FxnxValueError, match=f"credit cannot be routed over the graph export.*{function}"):
                fxnx.CreditRouter(G, model, rule=rule, node_credit=True)(x)
        with pytest.raises(fxnx.errors.FxnxValueError, match=function):
            fxnx.route_credit(G, model, x)
        want = _autograd(model, x, e)
        model.zero_grad()
        (fxnx.CreditRouter(G, model)(x) * e).sum().backward()
        for name, grad in _grads(model).items():
            assert torch.equal(grad, want[name]), name


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(1 if x.abs().max().item() > 1.0 else 2):
            x = torch.tanh(self.a(x))
        return x


def test_a_graph_that_follows_the_examples_values_is_checked_at_every_call():
    """draft_export follows the branch a condition on a tensor's value took for the example
    (its graph drops the read). Credit over it on an input that takes another branch was
    credit for another forward (output 0.98 off, no error); each call is now compared with
    the model's output and refused where they differ, naming the condition. Inputs that take
    the example's branch route as before, and the exact router runs the model's own forward
    on any input."""
    model = _Loop().double()
    small, big = torch.full((3, 4), 0.5, dtype=f64), torch.full((3, 4), 2.0, dtype=f64)
    with pytest.warns(UserWarning, match="read tensor values"):
        G = fxnx.convert(model, small)
    assert G.graph["capture"] == "draft_export"
    router = fxnx.CreditRouter(G, model, rule="exact", node_credit=True)
    for x in (small, small * 0.9):
        want = _autograd(model, x, torch.ones(3, 4, dtype=f64))
        model.zero_grad()
        router(x).sum().backward()
        for name, grad in _grads(model).items():
            torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=0, msg=name)
    for run in (lambda: router(big), lambda: fxnx.CreditRouter(G, model, rule="feedback_alignment")(big)):
        with pytest.raises(fxnx.errors.FxnxValueError, match=r"read tensor values \(.*> 1\.0\), and the graph follows the branches"):
            run()
    # route_credit's inputs require grad: captured for them, on big's branch, which G lacks
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"G lacks nodes .*follows its inputs, and a branch"):
        fxnx.route_credit(G, model, big)
    plain = fxnx.CreditRouter(G, model)
    want = _autograd(model, big, torch.ones(3, 4, dtype=f64))
    model.zero_grad()
    plain(big).sum().backward()
    for name, grad in _grads(model).items():
        assert torch.equal(grad, want[name]), name


class _Tanh(torch.autograd.Function):
    """tanh with its derivative written out: as memory-efficient activations are."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


def test_an_inlined_function_whose_backward_is_its_derivative_is_routed():
    """torch.export inlines the Function; autograd over its forward operations is checked
    against the model's own gradients once, agrees to rounding, and credit is routed."""
    model = _Net(lambda h: _Tanh.apply(h)).double()
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    with pytest.warns(UserWarning, match="applies the autograd Function _Tanh.*checked against the model's own gradients"):
        G = fxnx.convert(model, x, routes="export")
    want = _autograd(model, x, e)
    res = fxnx.route_credit(G, model, x, output_credit=e)
    for name in want:
        torch.testing.assert_close(res.param_credit[name], want[name], rtol=1e-12, atol=0, msg=name)
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    (router(x) * e).sum().backward()
    by_hand = _fa_by_hand(model, x, e, router.feedback["linear_1"], lambda g: g * (1 - torch.tanh(torch.tanh(model.a(x))) ** 2).detach())
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, by_hand[name], rtol=1e-12, atol=1e-15, msg=name)
