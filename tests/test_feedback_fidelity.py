"""Feedback weights as BioTorch defines them (issue 22): the laws they are drawn from,
uSF's scale, DFA shared over space and its size limit, Kolen–Pollack and weight mirrors,
and the W–B alignment measures. Oracles: the laws' variances and formulas written out by
hand, autograd on a convolution for the dense equivalent of spatial feedback, and SGD's
update written out by hand."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxnx

from conftest import rel_error

f64 = torch.float64


def _mlp(*sizes: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def _angle(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return math.degrees(math.acos(max(-1.0, min(1.0, float(a @ b / (a.norm() * b.norm()))))))


# -- the laws -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("init", "variance"), [("xavier", 2 / (300 + 200)), ("kaiming", 1 / (3 * 300))])
def test_feedback_alignment_draws_b_with_the_variance_its_law_defines(init, variance):
    model = nn.Sequential(nn.Linear(300, 200))
    x = torch.randn(2, 300)
    rule = fxnx.credit.FeedbackAlignment(init=init)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule={nn.Linear: rule})
    router(x).sum().backward()
    B = router.feedback["_0"]
    assert B.shape == (200, 300)
    # 60,000 uniform draws: the sample variance is within 2% of the law's (about 6 sigma)
    assert abs(float(B.var()) / variance - 1) < 0.02
    assert abs(float(B.mean())) < 0.01 * math.sqrt(variance) * 10


@pytest.mark.parametrize(("init", "bound"), [("xavier", math.sqrt(6 / (300 + 200))), ("kaiming", 1 / math.sqrt(300))])
def test_brsf_draws_magnitudes_uniform_on_the_laws_half_range(init, bound):
    """|U| for U uniform on (-a, a) is uniform on (0, a): mean a/2, variance a²/12, every
    value inside (0, a), and as many distinct values as 60,000 draws from 2**16 equally
    likely ones give: N·(1 - (1 - 1/N)**60000) = 39,302 for N = 2**16 (standard deviation
    about 80; 15 bits would give 27,500)."""
    model = nn.Sequential(nn.Linear(300, 200))
    x = torch.randn(2, 300)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule={nn.Linear: fxnx.credit.SignSymmetry("batch_random", init=init)})
    router(x).sum().backward()
    M = router.feedback["_0"].double()
    assert M.shape == (200, 300)
    # 60,000 draws: the mean within 6 sigma (sigma = a / sqrt(12 * 60000)), the variance within 2%
    assert abs(float(M.mean()) / bound - 0.5) < 6 / math.sqrt(12 * 60_000)
    assert abs(float(M.var()) / (bound**2 / 12) - 1) < 0.02
    assert 0 < float(M.min()) and float(M.max()) < bound
    assert abs(M.unique().numel() - 39_302) < 800


def test_a_convolution_feedback_law_counts_the_kernel_in_its_fans():
    model = nn.Sequential(nn.Conv2d(16, 32, 5))
    x = torch.randn(1, 16, 9, 9)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")
    router(x).sum().backward()
    B = router.feedback["_0"]
    fan_in, fan_out = 16 * 25, 32 * 25
    assert abs(float(B.var()) / (2 / (fan_in + fan_out)) - 1) < 0.03
    assert float(B.abs().max()) <= math.sqrt(6 / (fan_in + fan_out))


def test_draws_are_reproducible_from_the_seed_and_differ_between_seeds():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    one = fxnx.route_credit(G, model, x, rule="feedback_alignment", seed=3).feedback
    two = fxnx.route_credit(G, model, x, rule="feedback_alignment", seed=3).feedback
    other = fxnx.route_credit(G, model, x, rule="feedback_alignment", seed=4).feedback
    assert torch.equal(one["_2"], two["_2"]) and not torch.equal(one["_2"], other["_2"])


def test_an_unknown_law_is_refused():
    with pytest.raises(fxnx.errors.FxnxValueError, match="init must be one of 'xavier', 'kaiming'"):
        fxnx.credit.FeedbackAlignment(init="he")
    with pytest.raises(fxnx.errors.FxnxValueError, match="uSF's literal form"):
        fxnx.credit.SignSymmetry("fixed_random", init="unit")


# -- uSF's scale ----------------------------------------------------------------------------------

_SCALES = {  # a (fan_out, fan_in) weight's uSF scale, by law, as BioTorch defines them
    "xavier": lambda out, in_: math.sqrt(2 / (in_ + out)),
    "kaiming": lambda out, in_: 1 / math.sqrt(3 * in_),
    "unit": lambda out, in_: 1.0,  # Liao et al.'s literal sign(W)
}


@pytest.mark.parametrize("init", list(_SCALES))
def test_usf_credit_is_feedback_alignment_with_b_the_scaled_sign_of_w(init):
    model = _mlp(5, 7, 3)
    x, e = torch.randn(4, 5, dtype=f64), torch.randn(4, 3, dtype=f64)
    G = fxnx.convert(model, x)
    usf = fxnx.route_credit(G, model, x, output_credit=e, rule={nn.Linear: fxnx.credit.SignSymmetry("uniform", init=init)})
    B = {n: model[i].weight.detach().sign() * _SCALES[init](*model[i].weight.shape) for n, i in (("_0", 0), ("_2", 2))}
    fa = fxnx.route_credit(G, model, x, output_credit=e, rule="feedback_alignment", feedback=B)
    for name in ("_1", "_0", "input_1"):
        a, b = usf.node_credit[name], fa.node_credit[name]
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-13, atol=0), name
    assert torch.allclose(usf.node_credit["_1"], e @ B["_2"], rtol=1e-13, atol=0)  # by hand


# -- DFA shared over space ------------------------------------------------------------------------

class SmallCNN(nn.Module):
    def __init__(self, conv2: nn.Conv2d, classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = conv2
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(conv2.out_channels * 4, classes)

    def forward(self, x):
        h = torch.tanh(self.conv1(x))
        h = torch.tanh(self.conv2(h))
        return self.fc(self.pool(h).flatten(1))


def _dense_equivalent(B: torch.Tensor, conv: nn.Conv2d, shape: tuple[int, ...]) -> torch.Tensor:
    """Push a unit error for each output feature d through the spatial feedback, as a
    convolution with weight B and conv's geometry run by autograd: row d of the dense B."""
    rows = []
    for d in range(B.shape[0]):
        z = torch.zeros((1, *shape[1:]), dtype=B.dtype, requires_grad=True)
        y = F.conv2d(z, B, None, conv.stride, conv.padding, conv.dilation)
        unit = torch.zeros_like(y)
        unit[:, d] = 1.0
        (row,) = torch.autograd.grad(y, z, unit)
        rows.append(row[0])
    return torch.stack(rows)


@pytest.mark.parametrize("conv2", [
    dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=2, dilation=2, padding=1), dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, padding="valid", groups=3),
], ids=["pad", "stride", "dilation", "same-odd", "grouped"])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_spatial_dfa_equals_its_dense_equivalent(conv2):
    torch.manual_seed(1)
    model = SmallCNN(nn.Conv2d(3, 6, **conv2)).double()
    x, e = torch.randn(2, 2, 7, 7, dtype=f64), torch.randn(2, 4, dtype=f64)
    G = fxnx.convert(model, x)
    spatial = fxnx.route_credit(G, model, x, output_credit=e, rule="direct_feedback_alignment")
    B = spatial.feedback["conv2"]
    assert tuple(B.shape) == (4, 3, *model.conv2.kernel_size)  # classes x C_in x kernel
    (shape,) = [s for *_, s in G.in_edges("conv2", data="shape")]
    dense_B = _dense_equivalent(B, model.conv2, shape)
    dense = fxnx.credit.DirectFeedbackAlignment(spatial=False)
    fb = {"conv2": dense_B, "fc": spatial.feedback["fc"]}
    ref = fxnx.route_credit(G, model, x, output_credit=e, rule={nn.Conv2d: dense, nn.Linear: dense}, feedback=fb)
    assert torch.allclose(spatial.node_credit["conv1"], ref.node_credit["conv1"], rtol=1e-12, atol=1e-14)
    h1 = torch.tanh(model.conv1(x)).detach()  # conv2's input; its credit is e's projection
    by_hand = (e @ dense_B.reshape(4, -1)).reshape(shape)
    assert torch.allclose(spatial.node_credit["tanh"], by_hand, rtol=1e-12, atol=1e-14)
    assert torch.allclose(spatial.node_credit["conv1"], by_hand * (1 - h1**2), rtol=1e-12, atol=1e-14)
    for p in spatial.param_credit:
        assert torch.allclose(spatial.param_credit[p], ref.param_credit[p], rtol=1e-12, atol=1e-14), p


def test_spatial_dfa_feedback_does_not_grow_with_the_image():
    sizes = []
    for side in (8, 32):
        model = SmallCNN(nn.Conv2d(3, 6, 3, padding=1))
        x = torch.randn(2, 2, side, side)
        router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="direct_feedback_alignment")
        router(x).sum().backward()
        sizes.append({k: tuple(B.shape) for k, B in router.feedback.items()})
    assert sizes[0] == sizes[1] == {"conv2": (4, 3, 3, 3), "fc": (4, 24)}


def test_feedback_over_the_limit_is_refused_before_it_is_drawn():
    model = SmallCNN(nn.Conv2d(3, 6, 3, padding=1))
    x = torch.randn(2, 2, 16, 16)
    G = fxnx.convert(model, x)
    dense = fxnx.credit.DirectFeedbackAlignment(spatial=False, max_bytes=10_000)
    router = fxnx.CreditRouter(G, model, rule={nn.Conv2d: dense, nn.Linear: dense})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # conv2's input: 4 x 3 x 16 x 16 floats = 12,288 bytes; fc's: 4 x 24 = 384 bytes
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"'conv2'.*12\.0 KiB.*would take 12\.4 KiB, over the limit of 9\.8 KiB.*max_bytes=") as err:
        router(x)
    assert "node 'conv2', input 0, shape (4, 3, 16, 16)" in str(err.value)
    assert router.feedback == {} and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    raised = fxnx.credit.DirectFeedbackAlignment(spatial=False, max_bytes=20_000)
    router = fxnx.CreditRouter(G, model, rule={nn.Conv2d: raised, nn.Linear: raised})
    router(x).sum().backward()
    assert tuple(router.feedback["conv2"].shape) == (4, 3, 16, 16)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"feedback_alignment at node '_0' \(shape \(50, 40\), torch.float32\).*7\.8 KiB, over the limit of 1,000 bytes"):
        model = nn.Sequential(nn.Linear(40, 50))
        x = torch.randn(2, 40)
        fxnx.CreditRouter(fxnx.convert(model, x), model, rule={nn.Linear: fxnx.credit.FeedbackAlignment(max_bytes=1000)})(x)


# -- Kolen–Pollack and weight mirrors ----------------------------------------------------------------

def test_kolen_pollack_gives_b_the_sgd_step_of_w_by_hand():
    model = _mlp(5, 7, 3)
    x, y = torch.randn(6, 5, dtype=f64), torch.randint(0, 3, (6,))
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="kolen_pollack")
    lr, wd = 0.3, 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
    loss = F.cross_entropy(router(x), y)
    B1, B2 = (router.feedback[n].clone() for n in ("_0", "_2"))
    W1, b1, W2 = model[0].weight.detach().clone(), model[0].bias.detach(), model[2].weight.detach().clone()
    loss.backward()
    # the FA gradients, by hand: B2 carries the credit back to the hidden layer
    a = torch.tanh(x @ W1.T + b1)
    e = (torch.softmax(a @ W2.T + model[2].bias.detach(), 1) - F.one_hot(y, 3)) / len(y)
    gW2, gW1 = e.T @ a, ((e @ B2) * (1 - a**2)).T @ x
    assert torch.allclose(model[2].weight.grad, gW2, rtol=1e-12, atol=1e-15)
    assert torch.allclose(model[0].weight.grad, gW1, rtol=1e-12, atol=1e-15)
    router.update_feedback(lr=lr, weight_decay=wd)
    opt.step()
    for B_old, W_old, g, name, W in ((B1, W1, gW1, "_0", model[0].weight), (B2, W2, gW2, "_2", model[2].weight)):
        B_new = router.feedback[name]
        assert torch.allclose(B_new, B_old - lr * (g + wd * B_old), rtol=1e-12, atol=1e-15)
        assert torch.allclose(W.detach(), W_old - lr * (g + wd * W_old), rtol=1e-12, atol=1e-15)
        # B received W's update, with the same decay: W - B shrank by (1 - lr * wd)
        assert torch.allclose(W.detach() - B_new, (1 - lr * wd) * (W_old - B_old), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("rule", ["kolen_pollack", "weight_mirror"])
def test_learned_feedback_of_another_dtype_is_used_as_updated(rule):
    """B given in float32 to a float64 model (cast for the backward pass) and updated in place
    by update_feedback: every step routes with the B it holds then, by hand, g @ B at the
    hidden layer's output. The cast copy was made once and kept: from the second step on the
    credit used the first B."""
    model = _mlp(5, 7, 3)
    x, y = torch.randn(6, 5, dtype=f64), torch.randint(0, 3, (6,))
    given = {"_2": torch.randn(3, 7), "_0": torch.randn(7, 5)}
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=rule, feedback=given)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        out = router(x)
        B = router.feedback["_2"].detach().double()
        g = torch.autograd.grad(F.cross_entropy(out, y), out, retain_graph=True)[0]
        F.cross_entropy(out, y).backward()
        h = torch.tanh(model[0](x)).detach()
        want = ((g @ B) * (1 - h**2)).T @ x  # 0.weight's credit: g @ B through tanh, then x
        assert rel_error(model[0].weight.grad, want) < 1e-12
        opt.step()
        router.update_feedback(lr=0.5) if rule == "kolen_pollack" else router.update_feedback()
        assert not torch.equal(router.feedback["_2"].double(), B)  # B moved


def test_kolen_pollack_aligns_b_with_w_on_a_teacher_student_task():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 5))
    student = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))
    x = torch.randn(64, 20)
    router = fxnx.CreditRouter(fxnx.convert(student, x), student, rule="kolen_pollack", seed=0)
    lr, wd = 0.1, 0.05  # W - B shrinks by (1 - lr * wd) per step: to 2% in 800
    opt = torch.optim.SGD(student.parameters(), lr=lr, weight_decay=wd)
    router(x)
    start = router.alignment()
    for _ in range(800):
        x = torch.randn(64, 20)
        opt.zero_grad()
        F.cross_entropy(router(x), teacher(x).argmax(1)).backward()
        router.update_feedback(lr=lr, weight_decay=wd)
        opt.step()
    end = router.alignment()
    assert all(start[n]["angle"] > 60 for n in start)  # random B: far from W at first
    assert all(end[n]["angle"] < 10 for n in end), end


_LAYERS = {
    "linear": lambda: nn.Linear(12, 9),
    "conv2d": lambda: nn.Conv2d(4, 6, 3, padding=1),
    "conv1d-grouped-dilated": lambda: nn.Conv1d(4, 6, 3, dilation=2, groups=2),
}


@pytest.mark.parametrize("kind", list(_LAYERS))
def test_weight_mirrors_bring_b_to_w(kind):
    torch.manual_seed(0)
    layer = _LAYERS[kind]()  # built here, after the seed: the same weights in every run
    model = nn.Sequential(layer)
    x = torch.randn(3, 12) if isinstance(layer, nn.Linear) else torch.randn(3, 4, *[10] * (layer.weight.dim() - 2))
    x.requires_grad_()  # the layer's input needs credit: its rule is weight mirror
    # 256 noise samples per call: the mirror's steady-state noise, about √(rate/2 · fan_in /
    # batch) of W, stays well inside 10° (the default 64 sits near 10° for a 36-input kernel)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule={type(layer): fxnx.credit.WeightMirror(batch=256)})
    router(x).sum().backward()
    assert router.alignment()["_0"]["angle"] > 60
    for _ in range(60):
        router.update_feedback()
    fit = router.alignment()["_0"]
    assert fit["angle"] < 10 and 0.8 < fit["norm_ratio"] < 1.2, fit
    assert _angle(router.feedback["_0"], layer.weight.detach()) == pytest.approx(fit["angle"], abs=1e-9)


def test_weight_mirrors_reach_attention_projections():
    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.att(x, x, x)[0]

    torch.manual_seed(0)
    model = Attend()
    x = torch.randn(2, 3, 8, requires_grad=True)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="weight_mirror")
    router(x).sum().backward()
    for _ in range(60):
        router.update_feedback()
    for name, W in (("in_proj_weight", model.att.in_proj_weight), ("out_proj.weight", model.att.out_proj.weight)):
        assert _angle(router.feedback["att"][name], W.detach()) < 10, name


def test_update_feedback_says_what_is_missing():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    fa = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    fa(x).sum().backward()
    with pytest.raises(fxnx.errors.FxnxValueError, match="no node of this router has feedback that learns"):
        fa.update_feedback(lr=0.1)
    kp = fxnx.CreditRouter(G, model, rule="kolen_pollack")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"none has run since the router was built or loaded \(load_state_dict\)"):
        kp.update_feedback(lr=0.1)
    kp(x).sum().backward()
    with pytest.raises(fxnx.errors.FxnxValueError, match="needs the optimizer's lr="):
        kp.update_feedback()


@pytest.mark.parametrize("missing", ["gradient", "lr"])
def test_update_feedback_refuses_a_kolen_pollack_step_it_cannot_take_and_changes_no_b(missing):
    """After ``opt.zero_grad()`` (``W.grad`` None) Kolen–Pollack's step did nothing, silently;
    without ``lr`` a weight mirror routed beside it had learned before the error. Both are
    refused now before any ``B`` moves, naming the node."""
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    rules = {"_0": fxnx.credit.WeightMirror(), "_2": fxnx.credit.KolenPollack()}
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rules=rules)
    router(x).sum().backward()
    if missing == "gradient":
        model.zero_grad()
    before = {n: B.clone() for n, B in router.feedback.items() if isinstance(B, torch.Tensor)}
    match = "no weight it routes has a gradient" if missing == "gradient" else "needs the optimizer's lr="
    with pytest.raises(fxnx.errors.FxnxValueError, match=f"node '_2'.*{match}"):
        router.update_feedback(lr=0.1 if missing == "gradient" else None)
    assert set(before) == {"_0", "_2"}
    for n, B in before.items():
        assert torch.equal(router.feedback[n], B), n


def test_kolen_pollack_warns_when_b_is_never_updated():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="kolen_pollack")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            router(x).sum().backward()
            opt.step()
    messages = [str(w.message) for w in seen if "update_feedback" in str(w.message)]
    assert len(messages) == 2 and "node '_0'" in messages[0]  # once per node


def test_results_hold_copies_of_learned_feedback():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="kolen_pollack")
    router(x)
    res = router.backward(output_credit=torch.ones(4, 3, dtype=f64))
    kept = res.feedback["_2"].clone()
    router.update_feedback(lr=1.0, weight_decay=0.5)
    assert torch.equal(res.feedback["_2"], kept) and not torch.equal(router.feedback["_2"], kept)


# -- alignment measures ---------------------------------------------------------------------------

def test_alignment_reports_the_angle_and_norm_ratio_of_w_and_b():
    model = _mlp(5, 7, 3)
    x = torch.randn(4, 5, dtype=f64)
    G = fxnx.convert(model, x)
    for rule in ("feedback_alignment", "usf", "brsf", "frsf"):
        router = fxnx.CreditRouter(G, model, rule=rule)
        assert router.alignment() == {}
        router(x).sum().backward()
        got = router.alignment()
        for name, layer in (("_0", model[0]), ("_2", model[2])):
            W = layer.weight.detach()
            if rule == "feedback_alignment":
                B = router.feedback[name]
            elif rule == "usf":
                B = W.sign() * math.sqrt(2 / sum(W.shape))
            else:
                B = W.sign() * router.feedback[name]
            assert got[name]["angle"] == pytest.approx(_angle(W, B), abs=1e-9), (rule, name)
            assert got[name]["norm_ratio"] == pytest.approx(float(B.norm() / W.norm()), rel=1e-12)
    dfa = fxnx.CreditRouter(G, model, rule="direct_feedback_alignment")
    dfa(x).sum().backward()
    assert dfa.alignment() == {}  # B is no stand-in for W: nothing to compare


# -- every preset trains at backprop's learning rate ------------------------------------------------

@pytest.mark.parametrize("rule", list(fxnx.credit.PRESETS))
def test_every_preset_trains_the_digits_mlp_with_plain_sgd(rule):
    """At its defaults and the learning rate backprop uses, no rule diverges (uSF included,
    which at unit magnitude did: 89% test error)."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    for layer in model[::2]:  # as BioTorch initialises its layers
        nn.init.xavier_uniform_(layer.weight)
        nn.init.zeros_(layer.bias)
    router = fxnx.CreditRouter(fxnx.convert(model, x[:32]), model, rule=rule, seed=0)
    lr, wd = 0.1, 1e-3
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
    batches = torch.Generator().manual_seed(1)
    for _ in range(400):
        idx = torch.randint(1400, (32,), generator=batches)
        opt.zero_grad()
        loss = F.cross_entropy(router(x[idx]), y[idx])
        loss.backward()
        if rule in ("kolen_pollack", "weight_mirror"):
            router.update_feedback(lr=lr, weight_decay=wd)
        opt.step()
        assert torch.isfinite(loss), rule
    with torch.no_grad():
        error = float((model(x[1400:]).argmax(1) != y[1400:]).float().mean())
    assert error < 0.12, (rule, error)  # chance: 90%


@pytest.mark.parametrize("dims, kernel, stride, padding, dilation", [
    (1, (3,), (2,), (1,), (1,)), (1, (4,), (1,), "same", (1,)),
    (3, (2, 3, 1), (1, 2, 1), (1, 0, 0), (2, 1, 1)), (3, (3, 3, 3), (1, 1, 1), "valid", (1, 1, 1)),
], ids=["1d-stride", "1d-same-even", "3d-mixed", "3d-valid"])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_spatial_credit_is_a_convolution_with_b_of_the_broadcast_error(dims, kernel, stride, padding, dilation):
    """Geometry.credit against autograd: the input gradient of a convolution with weight B
    whose output gradient is e at every position of the grid (1-D and 3-D, every geometry)."""
    from fxnx._credit.spatial import Geometry

    torch.manual_seed(0)
    size = (9, 7, 5)[:dims] if dims == 3 else (11,)
    n, c, d = 2, 3, 4
    e, B = torch.randn(n, d, dtype=f64), torch.randn(d, c, *kernel, dtype=f64)
    z = torch.zeros((n, c, *size), dtype=f64, requires_grad=True)
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    y = conv(z, B, None, stride, padding, dilation)
    (want,) = torch.autograd.grad(y, z, e.reshape(n, d, *[1] * dims).expand_as(y))
    got = Geometry(kernel, stride, padding, dilation).credit(e, B, (n, c, *size))
    assert got.shape == want.shape and rel_error(got, want) <= 1e-12
