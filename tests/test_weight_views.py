"""Weight transport through a view of the weight: ``x @ self.weight.T`` (Hugging Face's Falcon,
hand-written layers) and what ``torch.export`` makes of it (``aten.t``, ``aten.numpy_T``).

Oracles: feedback alignment's credit written out by hand (Lillicrap et al.; BioTorch's
``grad_input = grad_output @ B``) in float64, and the same rules on the same network built
from ``nn.Linear``, a path that reads no view.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxnx

from conftest import rel_error


class Viewed(nn.Module):
    """Two weights read through views: ``W1.T`` and ``W2.t()``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(5, 3, dtype=torch.float64) / 2)
        self.w2 = nn.Parameter(torch.randn(4, 5, dtype=torch.float64) / 2)

    def forward(self, x):
        return torch.tanh(x @ self.w1.T) @ self.w2.t()


class Linear(nn.Module):
    """The same network from ``nn.Linear`` layers."""

    def __init__(self, viewed: Viewed) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 5, bias=False, dtype=torch.float64)
        self.l2 = nn.Linear(5, 4, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.l1.weight.copy_(viewed.w1)
            self.l2.weight.copy_(viewed.w2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _weighted(G):
    """The two weighted nodes, in order: the matmuls, the linear layers or their ATen calls."""
    return [n for n, d in G.nodes(data=True)
            if d.get("op") == "call_module" or any(k in str(d.get("target")) for k in ("matmul", "linear"))]


@pytest.mark.parametrize("route", ["symbolic_trace", "export"])
def test_feedback_alignment_through_a_transposed_weight_is_the_rule_by_hand(route):
    torch.manual_seed(0)
    model = Viewed()
    x = torch.randn(6, 3, dtype=torch.float64)
    e = torch.randn(6, 4, dtype=torch.float64)
    B1, B2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=route)
    first, second = _weighted(G)
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback={first: B1, second: B2})
    x_ = x.clone().requires_grad_()
    (router(x_) * e).sum().backward()

    h = torch.tanh(x @ model.w1.detach().T)  # by hand: B in W's place on the way back only
    d_pre = (e @ B2) * (1 - h**2)
    assert rel_error(model.w2.grad, e.T @ h) <= 1e-12
    assert rel_error(model.w1.grad, d_pre.T @ x) <= 1e-12
    assert rel_error(x_.grad, d_pre @ B1) <= 1e-12


@pytest.mark.parametrize("route", ["symbolic_trace", "export"])
@pytest.mark.parametrize("rule", ["usf", "frsf", "kolen_pollack"])
def test_every_weight_transport_rule_sees_through_the_view_as_through_nn_linear(route, rule):
    torch.manual_seed(0)
    viewed = Viewed()
    linear = Linear(viewed)
    x = torch.randn(6, 3, dtype=torch.float64)
    e = torch.randn(6, 4, dtype=torch.float64)
    got = {}
    for name, model in (("viewed", viewed), ("linear", linear)):
        G = fxnx.convert(model, x, routes=route)
        router = fxnx.CreditRouter(G, model, rule=rule, seed=0)
        if rule != "usf":  # random feedback: the same B for both, in each network's node names
            given = [B.abs() if rule == "frsf" else B for B in FEEDBACK]  # frSF's are magnitudes
            feedback = dict(zip(_weighted(G), given, strict=True))
            router = fxnx.CreditRouter(G, model, rule=rule, feedback=feedback)
        x_ = x.clone().requires_grad_()
        (router(x_) * e).sum().backward()
        got[name] = [x_.grad, *(p.grad for p in model.parameters())]
    for a, b in zip(got["viewed"], got["linear"], strict=True):
        assert rel_error(a, b) <= 1e-12


FEEDBACK = [torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
            torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))]


def test_a_part_of_the_weight_gets_the_same_part_of_b():
    """``x @ W[:2].T`` reads part of W: B stands in for W, and the layer's way back reads the
    same part of B (it was routed exactly, under a warning that the rule applied to no node)."""

    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

        def forward(self, x):
            return torch.tanh(x @ self.w[:2].T)

    model = Sliced()
    x = torch.randn(5, 3, dtype=torch.float64)
    G = fxnx.convert(model, x)
    x_ = x.clone().requires_grad_()
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    router(x_).sum().backward()
    (B,) = router.feedback.values()
    assert B.shape == (4, 3)
    h = torch.tanh(x @ model.w.detach()[:2].T)
    d = 1 - h**2  # the credit at the product: ones through tanh
    assert rel_error(x_.grad, d @ B[:2]) <= 1e-12
    want_w = torch.zeros(4, 3, dtype=torch.float64)
    want_w[:2] = d.T @ x
    assert rel_error(model.w.grad, want_w) <= 1e-12


def _weights_of(G, model, node):
    """The parameter a weighted node reads, directly or through a view: found on G's edges."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    for u in G.predecessors(node):
        for v in (u, *G.predecessors(u)):
            target = G.nodes[v].get("target")
            if G.nodes[v].get("op") == "get_attr" and target in params and params[target].dim() >= 2:
                return params[target]
    raise AssertionError(f"no weight found for {node}")


def test_falcon_exported_with_transposed_weights_gets_feedback_and_b_equal_to_w_is_autograd():
    """Falcon's layers compute ``x @ self.weight.T``; torch.export records ``aten.t``. Every
    layer must get feedback, and feedback alignment with B = W is backprop (the oracle)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FalconConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                       vocab_size=50, hidden_dropout=0.0, attention_dropout=0.0)
    model = transformers.FalconForCausalLM(config).double().eval()
    ids = torch.randint(1, 50, (2, 8))
    G = fxnx.convert(model, ids)
    assert G.graph["capture"] == "export"
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    router(ids)  # feedback is drawn at the first forward
    assert len(router.feedback) == 2 * 4 + 1  # qkv, dense, h_to_4h, 4h_to_h per layer; the head
    mirror = {node: _weights_of(G, model, node).detach().clone() for node in router.feedback}
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback=mirror)
    router(ids).logits.pow(2).mean().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).logits.pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert rel_error(ours[name], p.grad) <= 1e-12, name


class _FirstTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W, self.head = nn.Parameter(torch.randn(5, 3)), nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.W.T))


def test_a_transposed_weight_on_an_input_that_needs_no_credit_is_routed_by_the_router():
    """The first layer's input needs no credit, so its backward never reads ``W.T``: nothing
    to swap, and the router must not take that for a backward that ignored its weight.
    Feedback alignment's credit by hand."""
    torch.manual_seed(0)
    model = _FirstTransposed().double()
    x, e = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    (router(x) * e).sum().backward()
    h = torch.tanh(x @ model.W.detach().T)
    d = (e @ router.feedback["head"]) * (1 - h**2)  # the head's B, not its W
    assert rel_error(model.W.grad, d.T @ x) <= 1e-12


_SPELLINGS = {  # the second layer's weight W (5, 5), as models write it
    "view": lambda W: W.view(5, 5),
    "reshape": lambda W: W.reshape(25).reshape(5, 5),
    "slice": lambda W: W[:, :],
    "cast": lambda W: W.float().to(torch.float64),
    "scale": lambda W: W * 0.5,  # an equalised learning rate's scale: B scaled alike
    "contiguous": lambda W: W.t().contiguous().t(),
}


class Spelled(nn.Module):
    def __init__(self, spell) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l3 = nn.Linear(4, 5).double(), nn.Linear(5, 3).double()
        self.W = nn.Parameter(torch.randn(5, 5, dtype=torch.float64) / 3)
        self.spell = spell

    def forward(self, x):
        return self.l3(torch.tanh(F.linear(torch.tanh(self.l1(x)), self.spell(self.W))))


@pytest.mark.parametrize("route", ["symbolic_trace", "export"])
@pytest.mark.parametrize("name", list(_SPELLINGS))
def test_feedback_alignment_reaches_a_weight_through_views_reshapes_casts_and_scales(name, route):
    """B stands in for the parameter, and the layer gets the same chain taken of B (B * 0.5
    where the model scales W by 0.5). These layers were routed exactly, without a word."""
    spell = _SPELLINGS[name]
    model = Spelled(spell)
    x, e = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=route)
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    (router(x) * e).sum().backward()
    (middle,) = [n for n in router.feedback if tuple(router.feedback[n].shape) == (5, 5)]
    B2, B3 = router.feedback[middle], next(B for B in router.feedback.values() if B.shape == (3, 5))
    h1 = torch.tanh(model.l1(x)).detach()
    h2 = torch.tanh(F.linear(h1, spell(model.W.detach())))
    d2 = (e @ B3) * (1 - h2**2)  # at the middle layer's output
    d1 = (d2 @ spell(B2)) * (1 - h1**2)  # B, as the model spells W, on the way back
    assert rel_error(model.W.grad, torch.autograd.functional.vjp(lambda W: F.linear(h1, spell(W)), model.W.detach(), d2)[1]) <= 1e-12
    assert rel_error(model.l1.weight.grad, d1.T @ x) <= 1e-12


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm", "orthogonal"])
def test_a_weight_computed_from_parameters_is_refused_by_feedback_rules(norm):
    """weight_norm's g · v / ‖v‖ has no one parameter for B to stand in for: one error naming
    the node, where the layer was routed exactly (backprop) under feedback alignment."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    getattr(torch.nn.utils.parametrizations, norm)(model[2])
    x = torch.randn(6, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = fxnx.convert(model, x)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"multiplies by a weight computed from parameters .*rules=\{'\w+': fxnx.credit.Exact\(\)\}"):
        fxnx.CreditRouter(G, model, rule="feedback_alignment")(x)
    exact = fxnx.route_credit(G, model, x, rule="exact")  # exact routing is unaffected
    assert set(exact.param_credit) >= {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("route", ["symbolic_trace", "export"])
@pytest.mark.parametrize("spelling", ["viewed", "linear"])
def test_a_frozen_weight_still_has_its_feedback_on_the_way_back(route, spelling):
    """A frozen second layer (``requires_grad=False``) is not trained, but the credit that
    passes through it to the first layer goes through ``B``, however the layer is written:
    ``x @ W.T`` as ``nn.Linear`` (the function spelling was routed exactly, the module one by
    ``B``). By hand, as above."""
    torch.manual_seed(0)
    viewed = Viewed()
    model = viewed if spelling == "viewed" else Linear(viewed)
    frozen = model.w2 if spelling == "viewed" else model.l2.weight
    frozen.requires_grad_(False)
    x = torch.randn(6, 3, dtype=torch.float64)
    e = torch.randn(6, 4, dtype=torch.float64)
    B1, B2 = FEEDBACK
    G = fxnx.convert(model, x, routes=route)
    first, second = _weighted(G)
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback={first: B1, second: B2})
    (router(x) * e).sum().backward()
    W1 = viewed.w1.detach()
    h = torch.tanh(x @ W1.T)
    d_pre = (e @ B2) * (1 - h**2)
    trained = model.w1 if spelling == "viewed" else model.l1.weight
    assert frozen.grad is None
    assert rel_error(trained.grad, d_pre.T @ x) <= 1e-12
    assert not torch.allclose(e @ B2, e @ frozen.detach())  # B2 is not W2: FA tells from exact
