"""Which nodes a rule's key matches: module classes on every capture, kinds that match no node,
rules given by name, and the one edge per argument the routing relies on.

Every number is checked against an oracle of its own: autograd on a deep copy of the model
for the exact parts, feedback alignment's formula written out (input credit ``g @ B``, weight
credit exact given the credit at the layer's output) for the rest.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxnx
from fxnx.credit import PRESETS, Exact, FeedbackAlignment

from conftest import rel_error

f64 = torch.float64
aten = torch.ops.aten


class ConvNet(nn.Module):
    """Two convolutions and a linear layer, the README's ``nn.Conv2d: Exact()`` example."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 16, 4)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        return self.fc(h.flatten(1))


class MyLin(nn.Linear):
    """A subclass with a forward of its own: a symbolic trace goes through it (``F.linear``)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class SubclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 5), MyLin(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _grads(router, x, e):
    """Each parameter's credit from one routed backward of ``router(x)`` with output credit ``e``."""
    router.model.zero_grad()
    (router(x) * e).sum().backward()
    return {n: p.grad.clone() for n, p in router.model.named_parameters()}


def _close(got, want):
    for name, g in want.items():
        assert rel_error(got[name], g) <= 1e-12, name


@pytest.mark.parametrize(
    "how",
    [
        {"rule": PRESETS["feedback_alignment"] | {nn.Conv2d: Exact()}},
        {"rule": "feedback_alignment", "rules": {nn.Conv2d: Exact()}},
        # an entry added later wins even where the preset keys the node's module class
        {"rule": PRESETS["feedback_alignment"] | {aten.conv2d.default: Exact()}},
    ],
    ids=["preset_merge", "rules", "preset_merge_by_function"],
)
def test_a_module_class_key_matches_an_exported_layer(how):
    torch.manual_seed(0)
    model = ConvNet().double()
    x, e = torch.randn(2, 2, 4, 4, dtype=f64), torch.randn(2, 4, dtype=f64)
    G = fxnx.convert(model, x, routes="export")
    assert G.graph["capture"] == "export" and model.c1.weight.abs().min() > 0
    router = fxnx.CreditRouter(G, model, seed=0, **how)
    got = _grads(router, x, e)
    assert sorted(router.feedback) == ["linear"]  # the convolutions are exact
    B = router.feedback["linear"]
    # oracle: autograd through the convolutions, feedback alignment at the linear layer
    o = copy.deepcopy(model)
    f = torch.tanh(o.c2(torch.tanh(o.c1(x)))).flatten(1)
    want = {"fc.weight": e.T @ f.detach(), "fc.bias": e.sum(0)}
    f.backward(e @ B)
    want |= {n: p.grad for n, p in o.named_parameters() if n.startswith("c")}
    _close(got, want)


@pytest.mark.parametrize(
    ("key", "feedback"),
    [(nn.Linear, ["l1", "l3", "linear"]), (MyLin, ["linear"])],
    ids=["base_class", "subclass"],
)
def test_a_module_class_key_matches_a_subclass_traced_through(key, feedback):
    torch.manual_seed(0)
    model = SubclassNet().double()
    x, e = torch.randn(7, 4, dtype=f64), torch.randn(7, 3, dtype=f64)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "symbolic_trace" and G.nodes["linear"]["op"] == "call_function"
    router = fxnx.CreditRouter(G, model, rule="exact", rules={key: FeedbackAlignment()}, seed=0)
    got = _grads(router, x, e)
    assert sorted(router.feedback) == feedback
    # oracle: feedback alignment written out where it applies, W where the layer is exact
    m = {"l1": model.l1, "linear": model.l2, "l3": model.l3}
    back = {n: router.feedback.get(n, m[n].weight).detach() for n in m}
    W1, b1, W2, b2 = (t.detach() for t in (model.l1.weight, model.l1.bias, model.l2.weight, model.l2.bias))
    h1 = torch.tanh(x @ W1.T + b1)
    h2 = torch.tanh(h1 @ W2.T + b2)
    d2 = (e @ back["l3"]) * (1 - h2**2)
    d1 = (d2 @ back["linear"]) * (1 - h1**2)
    want = {"l3.weight": e.T @ h2, "l3.bias": e.sum(0), "l2.weight": d2.T @ h1, "l2.bias": d2.sum(0),
            "l1.weight": d1.T @ x, "l1.bias": d1.sum(0)}
    _close(got, want)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def test_a_kind_the_user_gave_that_matches_no_node_warns():
    model = _mlp()
    x = torch.randn(6, 4, dtype=f64)
    G = fxnx.convert(model, x)
    with pytest.warns(UserWarning, match=r"no node of this graph is nn\.Conv2d.*kinds with weights are nn\.Linear"):
        fxnx.route_credit(G, model, x, rules={nn.Conv2d: FeedbackAlignment()})
    with pytest.warns(UserWarning, match=r"rule for torch\.relu.*node kinds are nn\.Linear, nn\.Tanh"):
        fxnx.route_credit(G, model, x, rule=PRESETS["feedback_alignment"] | {torch.relu: Exact()})
    router = fxnx.CreditRouter(G, model, rules={nn.Conv2d: Exact()})
    with pytest.warns(UserWarning, match=r"no node of this graph is nn\.Conv2d") as record:
        router(x)
    # pointing at the user's line, not at torch's nn.Module.__call__ nor at fxnx
    assert [w.filename for w in record] == [__file__]
    act = nn.Sequential(nn.Tanh())
    router = fxnx.CreditRouter(fxnx.convert(act, x), act, rule="feedback_alignment")
    with pytest.warns(UserWarning, match="'feedback_alignment' applies to no node") as record:
        router(x)
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a preset's own kinds, and kinds that match, are quiet
        fxnx.route_credit(G, model, x, rule="feedback_alignment")
        fxnx.route_credit(G, model, x, rule=PRESETS["feedback_alignment"] | {nn.Tanh: Exact()})
        fxnx.route_credit(G, model, x, rules={nn.Linear: Exact()})


class TanhNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.act, self.l2 = nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.act(self.l1(x))))


def test_a_feedback_rule_by_name_needs_weights_at_function_nodes_too():
    torch.manual_seed(0)
    model = TanhNet().double()
    x = torch.randn(6, 4, dtype=f64)
    G = fxnx.convert(model, x)
    assert G.nodes["tanh"]["op"] == "call_function"
    for name, kind in [("act", "Tanh"), ("tanh", "torch.tanh")]:
        with pytest.raises(fxnx.errors.FxnxTypeError, match=rf"node '{name}' \({kind}\) has no weight"):
            fxnx.route_credit(G, model, x, rules={name: FeedbackAlignment()})
    # by kind, a function node without weights stays exact, as documented
    res = fxnx.route_credit(G, model, x, rules={torch.tanh: FeedbackAlignment()})
    o = copy.deepcopy(model)
    o(x).sum().backward()
    _close(res.param_credit, {n: p.grad for n, p in o.named_parameters()})


@pytest.mark.parametrize("name", ["act", "tanh"])
def test_direct_feedback_alignment_by_name_runs_at_a_weightless_node_of_either_op(name):
    # DFA needs no weight of the node's own: given by name to nn.Tanh or to torch.tanh, the
    # node's input gets e·B (e the credit at the output), as the rule says.
    from fxnx.credit import DirectFeedbackAlignment

    torch.manual_seed(0)
    model = TanhNet().double()
    x = torch.randn(6, 4, dtype=f64)
    e = torch.randn(6, 3, dtype=f64)
    B = torch.randn(3, 5, dtype=f64)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, rules={name: DirectFeedbackAlignment()}, feedback={name: B},
                            output_credit=e)
    # by hand: l2 and (for "tanh") act are exact below the output; the DFA node's input gets e @ B
    W2 = model.l2.weight.detach()
    h1 = model.l1(x).detach()
    a = torch.tanh(h1)
    t = torch.tanh(a)
    assert rel_error(res.param_credit["l2.weight"], e.T @ t) <= 1e-12
    credit_in = e @ B  # at the DFA node's input
    if name == "tanh":  # act is exact: through tanh's derivative at h1
        credit_in = credit_in * (1 - a**2)
    assert rel_error(res.param_credit["l1.weight"], credit_in.T @ x) <= 1e-12
    assert rel_error(res.param_credit["l1.bias"], credit_in.sum(0)) <= 1e-12
    assert not torch.allclose(e @ W2, e @ B)  # B is not W2: the check tells DFA from exact


def test_two_edges_claiming_one_argument_are_refused():
    model = _mlp()
    x = torch.randn(6, 4, dtype=f64)
    G = fxnx.convert(model, x)
    copied = G.copy()
    copied.add_edge("_1", "_2", **G.edges["_1", "_2", 0])  # a parallel edge copied
    with pytest.raises(fxnx.errors.FxnxValueError,
                       match=r"'_1' -> '_2' \(keys 0 and 1\) both claim argument 0 of node '_2'.*remove_edge\('_1', '_2', 1\)"):
        fxnx.CreditRouter(copied, model)

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    G = fxnx.convert(Square(), x)
    assert sorted(a for *_, a in G.in_edges("mul", data="arg")) == [0, 1]
    moved = G.copy()
    moved.edges["x", "mul", 1]["arg"] = 0  # an arg changed to the other occurrence's
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"both claim argument 0 of node 'mul'"):
        fxnx.route_credit(moved, Square(), x)


class _Recurrent(nn.Module):
    """Token ids, an embedding, an LSTM, a bilinear mix and a linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.rnn = nn.LSTM(6, 8, batch_first=True)
        self.mix = nn.Bilinear(8, 8, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        last = h[:, -1]
        return self.fc(self.mix(last, last))


@pytest.mark.parametrize("rule", ["feedback_alignment", "direct_feedback_alignment", "kolen_pollack"])
def test_a_feedback_preset_says_which_layers_with_weights_it_leaves_exact(rule):
    """An nn.LSTM or nn.Bilinear has no rule in the feedback presets, so it is routed exactly:
    backprop's credit through its own weights, under a rule whose point is that there is none.
    The router says so once, naming the nodes; an embedding (token ids take no credit) is not
    named, and a rule given for those nodes, or exact by name, silences it."""
    model, ids = _Recurrent().double(), torch.randint(0, 10, (4, 5))
    G = fxnx.convert(model, ids)
    with pytest.warns(UserWarning, match=rf"rule '{rule}' has no rule for nn.LSTM, nn.Bilinear, so nodes 'rnn', 'mix' are routed exactly") as caught:
        fxnx.CreditRouter(G, model, rule=rule)(ids).sum().backward()
    assert not any("'emb'" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given = {nn.LSTM: fxnx.credit.Exact(), "mix": fxnx.credit.Exact()}
        fxnx.CreditRouter(G, model, rule=rule, rules=given)(ids).sum().backward()
        fxnx.CreditRouter(G, model, rule="exact")(ids).sum().backward()


def test_an_lstm_given_feedback_alignment_sends_its_input_credit_through_b():
    """rules={nn.LSTM: FeedbackAlignment()}, as the warning above offers: the LSTM is computed
    again with B in place of each of its weight matrices, its input gets that computation's
    credit, its parameters their exact credit. Oracle: torch.func.functional_call with B."""
    torch.manual_seed(0)
    rnn, fc = nn.LSTM(6, 8, batch_first=True).double(), nn.Linear(8, 3).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = rnn, fc

        def forward(self, x):
            return self.fc(self.rnn(x)[0][:, -1])

    model, x = Model(), torch.randn(4, 5, 6, dtype=torch.float64)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="exact", rules={nn.LSTM: FeedbackAlignment()}, seed=0)
    xr = x.clone().requires_grad_()
    router(xr).pow(2).sum().backward()
    B = router.feedback["rnn"]
    assert sorted(B) == ["weight_hh_l0", "weight_ih_l0"]
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    h = rnn(x)[0][:, -1]
    (credit,) = torch.autograd.grad(fc(h).pow(2).sum(), h, retain_graph=True)
    xo = x.clone().requires_grad_()
    swapped = {**{k: v.detach() for k, v in rnn.named_parameters()}, **B}
    (want_x,) = torch.autograd.grad(torch.func.functional_call(rnn, swapped, (xo,))[0][:, -1], xo, credit)
    assert rel_error(xr.grad, want_x) <= 1e-12
    fc(rnn(x)[0][:, -1]).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert rel_error(got[name], p.grad) <= 1e-12, name


class _Mixed(nn.Module):
    """A 2-D LayerNorm (an elementwise gain: exact is what a feedback rule means there), a
    product with a parameter matrix the presets do not route (tensordot), and a positional
    table added."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm((5, 8))
        self.W = nn.Parameter(torch.randn(8, 8) / 3)
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(x + self.pos)
        return self.fc(torch.tensordot(h, self.W, dims=1))


def test_the_warning_names_weight_matrices_however_captured_and_not_elementwise_weights():
    """An LSTM captured by torch.export is a function node (aten.lstm.input) and is named too,
    with the only way out a node has there; a product with a weight as torch.tensordot is named; a 2-D
    LayerNorm and a positional table added to the input are not (naming them offered a rule
    that would put a random matrix in place of an elementwise gain)."""
    torch.manual_seed(0)
    model, x = _Mixed().double(), torch.randn(4, 5, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"has no rule for torch.functional.tensordot in _Mixed, so node 'tensordot' is routed exactly") as caught:
        fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment")(x).sum().backward()
    named = [str(w.message) for w in caught if "routed exactly" in str(w.message)]
    assert len(named) == 1 and "'norm'" not in named[0] and "pos" not in named[0]

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.r, self.b = nn.Linear(6, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 5)

        def forward(self, x):
            return self.b(self.r(self.a(x))[0])

    model, x = Recurrent().double(), torch.randn(4, 3, 6, dtype=torch.float64)
    G = fxnx.convert(model, x, routes="export")
    with pytest.warns(UserWarning, match=r"no rule for aten.lstm.input in nn.LSTM, so node 'lstm' is routed exactly.*"
                      r"Route them by a rule of your own by name, or name them exact .*rules=\{'lstm': fxnx.credit.Exact\(\)\}"):
        fxnx.CreditRouter(G, model, rule="feedback_alignment")(x).sum().backward()


class _Product(nn.Module):
    """A product with a weight matrix written as ``h @ W``, ``h.matmul(W)`` or ``h.mm(W)``."""

    def __init__(self, how):
        super().__init__()
        self.fc, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.W = nn.Parameter(torch.randn(8, 8) / 3)
        self.how = how

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = {"op": lambda: h @ self.W, "matmul": lambda: h.matmul(self.W), "mm": lambda: h.mm(self.W)}[self.how]()
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("rule", ["feedback_alignment", "usf", "frsf", "kolen_pollack", "direct_feedback_alignment"])
@pytest.mark.parametrize("how", ["matmul", "mm"])
def test_a_product_written_as_a_method_follows_the_rule_as_the_operator_does(rule, how):
    """h.matmul(W) and h.mm(W) were routed exactly under every feedback preset, where h @ W
    follows the rule (3.2 apart under feedback alignment, silently). They follow it now: the
    same credit as h @ W with the same feedback weights."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, dtype=torch.float64)
    grads = {}
    feedback = None
    for form in ("op", how):
        torch.manual_seed(1)
        model = _Product(form).double()
        router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule=rule, seed=0, feedback=feedback)
        router(x).pow(2).sum().backward()
        grads[form] = {name: p.grad for name, p in model.named_parameters()}
        feedback = {(how if name == "matmul" else name): B for name, B in router.feedback.items()} or None
    for name, want in grads["op"].items():
        assert rel_error(grads[how][name], want) <= 1e-12, name
    torch.manual_seed(1)
    model = _Product(how).double()
    fxnx.CreditRouter(fxnx.convert(model, x), model, rule="exact")(x).pow(2).sum().backward()
    assert rel_error(model.fc.weight.grad, grads["op"]["fc.weight"]) > 1e-3  # the rule makes a difference
