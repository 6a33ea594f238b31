"""Feedback rules on layers that are no nn.Linear/nn.ConvNd module: function nodes of
exported graphs (aten.linear, aten.addmm), functional calls in symbolic traces
(F.linear with a tied weight, x @ self.W), and modules without a dedicated transport
(transformers' Conv1D). Oracles: the rules' formulas written out by hand from the
feedback weights the router reports, and autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxnx

D = torch.float64


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(7, 3, generator=gen, dtype=D), torch.randn(7, 2, generator=gen, dtype=D)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", ["feedback_alignment", "usf", "direct_feedback_alignment"])
def test_exported_mlp_matches_hand_formulas(rule):
    model = _mlp()
    x, e = _data()
    G = fxnx.convert(model, x, routes="export")
    assert G.graph["capture"] == "export"
    res = fxnx.route_credit(G, model, x, output_credit=e, rule=rule)
    assert res.rules["linear"] == res.rules["linear_1"] != "exact"
    W1, b1, W2 = model[0].weight, model[0].bias, model[2].weight
    h = torch.tanh(x @ W1.T + b1).detach()
    if rule == "feedback_alignment":
        B2 = res.feedback["linear_1"]
        assert B2.shape == W2.shape and not torch.allclose(B2, W2)
        back = e @ B2
    elif rule == "usf":
        back = e @ (W2.detach().sign() * math.sqrt(2 / sum(W2.shape)))  # Xavier-scaled, as BioTorch
    else:  # DFA: the output credit projected straight to the last layer's input
        B2 = res.feedback["linear_1"]
        assert B2.shape == (2, 5)
        back = e @ B2
    _close(res.node_credit["tanh"], back)
    delta = back * (1 - h**2)
    _close(res.node_credit["linear"], delta)
    # Each layer's own parameters: exact given the credit at its output.
    _close(res.param_credit["2.weight"], e.T @ h)
    _close(res.param_credit["2.bias"], e.sum(0))
    _close(res.param_credit["0.weight"], delta.T @ x)
    _close(res.param_credit["0.bias"], delta.sum(0))


class TiedLM(nn.Module):
    """An embedding, one hidden layer, and a head that reuses the embedding matrix."""

    def __init__(self, vocab: int = 11, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)

    def forward(self, idx):
        h = torch.tanh(self.hidden(self.emb(idx)))
        return F.linear(h, self.emb.weight)


def test_tied_functional_head_in_a_symbolic_trace():
    torch.manual_seed(0)
    model = TiedLM().to(D)
    idx = torch.tensor([[1, 4, 4], [0, 10, 3]])
    e = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(2), dtype=D)
    G = fxnx.convert(model, idx)
    assert G.graph["capture"] == "symbolic_trace"
    res = fxnx.route_credit(G, model, idx, output_credit=e, rule="feedback_alignment")
    head = next(n for n, r in res.rules.items() if r == "feedback_alignment" and n != "hidden")
    B_head, B_hid = res.feedback[head], res.feedback["hidden"]
    E, Wh, bh = model.emb.weight.detach(), model.hidden.weight.detach(), model.hidden.bias.detach()
    a = E[idx]
    h = torch.tanh(a @ Wh.T + bh)
    dz = (e @ B_head) * (1 - h**2)
    da = dz @ B_hid
    _close(res.node_credit["hidden"], dz)
    _close(res.param_credit["hidden.weight"], dz.reshape(-1, 4).T @ a.reshape(-1, 4))
    # The tied matrix: the head's exact weight credit plus what reaches the embedding.
    dE = e.reshape(-1, 11).T @ h.reshape(-1, 4)
    dE = dE.index_add(0, idx.reshape(-1), da.reshape(-1, 4))
    _close(res.param_credit["emb.weight"], dE)


class MatmulModel(nn.Module):
    """``x @ W`` with a parameter W, and ``q @ k.T`` of two activations."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(3, 4, dtype=D))

    def forward(self, x):
        y = x @ self.W
        return y @ y.transpose(0, 1)


def test_matmul_with_a_parameter_uses_feedback_and_of_activations_stays_exact():
    torch.manual_seed(0)
    model = MatmulModel()
    x, _ = _data()
    e = torch.randn(7, 7, generator=torch.Generator().manual_seed(3), dtype=D)
    G = fxnx.convert(model, x)
    res = fxnx.route_credit(G, model, x, output_credit=e, rule="feedback_alignment")
    weighted = [n for n, r in res.rules.items() if r == "feedback_alignment"]
    assert weighted == ["matmul"]
    assert res.rules["matmul_1"] == "exact"
    y = (x @ model.W).detach()
    dy = (e + e.T) @ y  # exact through y @ yᵀ
    B = res.feedback["matmul"]
    assert B.shape == model.W.shape
    _close(res.node_credit["x"], dy @ B.T)
    _close(res.param_credit["W"], x.T @ dy)


def test_module_without_dedicated_transport_uses_functional_call():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(5, 3), nn.Tanh(), Conv1D(2, 5)).to(D)  # weights (in, out)
    x, e = _data()
    G = fxnx.convert(model, x, leaf_modules=[Conv1D])
    res = fxnx.route_credit(G, model, x, output_credit=e, rule={Conv1D: fxnx.credit.FeedbackAlignment()})
    assert res.rules["_0"] == res.rules["_2"] == "feedback_alignment"
    B2 = res.feedback["_2"]
    assert B2.shape == model[2].weight.shape == (5, 2)
    h = torch.tanh(x @ model[0].weight + model[0].bias).detach()
    _close(res.node_credit["_1"], e @ B2.T)
    delta = (e @ B2.T) * (1 - h**2)
    _close(res.param_credit["0.weight"], x.T @ delta)
    _close(res.param_credit["2.weight"], h.T @ e)
    (inp,) = [n for n, d in G.nodes(data=True) if d["op"] == "placeholder"]
    _close(res.node_credit[inp], delta @ res.feedback["_0"].T)


def _gpt2(tie: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=tie,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(D).eval()


def _autograd_grads(model, ids, e):
    model.zero_grad()
    model(ids).logits.backward(e)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_gpt2_feedback_alignment_reaches_conv1d_and_head(tie):
    model = _gpt2(tie)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    e = torch.randn(2, 8, 100, generator=torch.Generator().manual_seed(1), dtype=D)
    G = fxnx.convert(model, ids)
    assert G.graph["capture"] == "export"
    res = fxnx.route_credit(G, model, ids, output_credit=(e,), rule="feedback_alignment")
    targets = {n: str(d.get("target")) for n, d in G.nodes(data=True)}
    addmm = [n for n, t in targets.items() if t == "torch.ops.aten.addmm.default"]
    linear = [n for n, t in targets.items() if t == "torch.ops.aten.linear.default"]
    assert len(addmm) == 8 and len(linear) == 1  # c_attn, c_proj, c_fc, mlp.c_proj per block; lm_head
    assert {res.rules[n] for n in addmm + linear} == {"feedback_alignment"}
    assert set(res.feedback) == set(addmm + linear)
    auto = _autograd_grads(model, ids, e)
    wte = "transformer.wte.weight"
    if not tie:
        _close(res.param_credit["lm_head.weight"], auto["lm_head.weight"])
    assert not torch.allclose(res.param_credit[wte], auto[wte], rtol=1e-3, atol=1e-6)
    # Feedback weights equal to the weights themselves: autograd's credit everywhere.
    weights = {}
    for n in addmm + linear:
        (src,) = [u for u, _ in G.in_edges(n) if G.nodes[u]["op"] == "get_attr"
                  and len(G.nodes[u]["out_shape"]) == 2]
        weights[n] = model.get_parameter(G.nodes[src]["target"])
    same = fxnx.route_credit(
        G, model, ids, output_credit=(e,), rule="feedback_alignment", feedback=weights
    )
    for name, g in auto.items():
        _close(same.param_credit[name], g)


@pytest.mark.slow
def test_bert_export_feedback_alignment_reaches_linear_nodes():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).to(D).eval()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    G = fxnx.convert(model, ids, routes="export")
    res = fxnx.route_credit(G, model, ids, rule="feedback_alignment")
    linear = [n for n, d in G.nodes(data=True) if str(d.get("target")) == "torch.ops.aten.linear.default"]
    # q, k, v, attention output, intermediate, output per layer; the pooler; the classifier.
    assert len(linear) == 6 * 2 + 2
    assert {res.rules[n] for n in linear} == {"feedback_alignment"}
    exact = fxnx.route_credit(G, model, ids)
    w = "bert.embeddings.word_embeddings.weight"
    assert not torch.allclose(res.param_credit[w], exact.param_credit[w], rtol=1e-3, atol=1e-6)
    _close(res.param_credit["classifier.weight"], exact.param_credit["classifier.weight"])
