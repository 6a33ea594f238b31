"""CreditRouter on the models users have: tied weights, export graphs, timm, Hugging Face.

The oracle throughout is autograd: a deep copy of the model trained with
``loss.backward()`` and the same optimizer; with ``rule="exact"`` the router's
parameters (and buffers) must be bit-equal to it after several steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxnx

from conftest import rel_error


def _train_both(model, batches, loss_fn, *, convert=None, optimizer="sgd", seed=None):
    """Train ``model`` with an exact router and a deep copy with autograd; return both."""
    theirs = copy.deepcopy(model)
    x0, kw0, _ = batches[0]
    G = fxnx.convert(model, x0, kwargs=kw0 or None, **(convert or {}))
    router = fxnx.CreditRouter(G, model)

    def make(m):
        if optimizer == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-2)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    ours_opt, their_opt = make(model), make(theirs)
    for x, kw, y in batches:
        if seed is not None:
            torch.manual_seed(seed)
        ours_opt.zero_grad()
        router.backward(loss_fn(router(x, **kw), y))
        ours_opt.step()
        if seed is not None:
            torch.manual_seed(seed)
        their_opt.zero_grad()
        loss_fn(theirs(x, **kw), y).backward()
        their_opt.step()
    return model, theirs, G


def _assert_bit_equal(ours, theirs, start):
    moved = False
    for (name, p), q, p0 in zip(ours.named_parameters(), theirs.parameters(), start.parameters(), strict=True):
        assert torch.equal(p, q), name
        moved |= not torch.equal(p, p0)
    assert moved  # the oracle is not vacuous: training changed the weights
    for (name, b), c in zip(ours.named_buffers(), theirs.buffers(), strict=True):
        assert torch.equal(b, c), name


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


# -- tied and shared parameters ---------------------------------------------------------------

class _TiedLM(nn.Module):
    """A weight-tied embedding and head (F.linear on the embedding's weight), a layer called
    twice, a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, ids):
        h = self.mix(self.emb(ids))
        h = self.mix(torch.tanh(h))  # the same module, twice
        return F.linear(self.norm(h), self.emb.weight)


def test_tied_and_shared_parameters_train_like_autograd_at_any_batch_size():
    torch.manual_seed(0)
    model = _TiedLM().double()
    start = copy.deepcopy(model)
    gen = _gen()
    # Batch sizes and lengths change between steps: a symbolic trace holds for every shape.
    batches = [(torch.randint(0, 11, (n, t), generator=gen), {}, torch.randint(0, 11, (n, t), generator=gen))
               for n, t in ((3, 5), (2, 7), (4, 5))]

    def loss(out, y):
        return F.cross_entropy(out.reshape(-1, 11), y.reshape(-1))

    ours, theirs, _ = _train_both(model, batches, loss)
    _assert_bit_equal(ours, theirs, start)


# -- other capture routes ---------------------------------------------------------------------

class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("route", ["export", "draft_export"])
def test_export_graphs_train_like_autograd_with_train_mode_batchnorm(route):
    torch.manual_seed(0)
    model = _BNNet().double().train()
    start = copy.deepcopy(model)
    gen = _gen()
    batches = [(torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64), {},
                torch.randint(0, 3, (4,), generator=gen)) for _ in range(3)]
    ours, theirs, G = _train_both(model, batches, F.cross_entropy, convert={"routes": route})
    assert G.graph["capture"] == route
    _assert_bit_equal(ours, theirs, start)  # running stats and num_batches_tracked too
    assert int(ours.bn.num_batches_tracked) == 3


def test_an_export_graph_returns_the_models_output_structure():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 4)

        def forward(self, x):
            return {"small": self.a(x), "big": self.b(x)}

    torch.manual_seed(0)
    model = Pair().double()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=torch.float64)
    router = fxnx.CreditRouter(fxnx.convert(model, x, routes="export"), model)
    out = router(x)
    assert sorted(out) == ["big", "small"]  # not export's flat tuple
    assert torch.equal(out["small"], ref(x)["small"])
    credit = {"small": torch.randn(5, 2, dtype=torch.float64), "big": None}
    router.backward(output_credit=credit)
    ref(x)["small"].backward(credit["small"])
    assert torch.equal(model.a.weight.grad, ref.a.weight.grad)
    assert model.b.weight.grad is None


class _Counting(nn.Module):
    """A buffer written in place by a tensor method that a symbolic trace records."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.total.add_(x.detach().abs().sum())
        return self.lin(x)


def test_in_place_writes_to_buffers_happen_as_in_the_model():
    torch.manual_seed(0)
    model = _Counting().double()
    start = copy.deepcopy(model)
    gen = _gen()
    batches = [(torch.randn(4, 3, generator=gen, dtype=torch.float64), {},
                torch.randint(0, 2, (4,), generator=gen)) for _ in range(3)]
    G = fxnx.convert(model, batches[0][0])
    assert any(G.nodes[n].get("target") == "add_" for n in G)  # the write is in the graph
    ours, theirs, _ = _train_both(model, batches, F.cross_entropy)
    _assert_bit_equal(ours, theirs, start)
    assert float(ours.total) > 0


def test_a_python_batch_norm_counts_its_batches():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    # BatchNormAct2d bumps num_batches_tracked in Python: a symbolic trace cannot record it.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), timm.layers.BatchNormAct2d(4), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 3, 6, 6))
    model = model.double().train()
    start = copy.deepcopy(model)
    gen = _gen()
    batches = [(torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64), {},
                torch.randint(0, 3, (4,), generator=gen)) for _ in range(3)]
    ours, theirs, G = _train_both(model, batches, F.cross_entropy)
    assert G.graph["capture"] == "symbolic_trace"
    _assert_bit_equal(ours, theirs, start)
    assert int(ours[1].num_batches_tracked) == 1 + 3  # the priming call, then three steps


class _WritesThenReads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.l1(x)
        h.relu_()  # the result is dropped: l2 reads h, written
        return self.l2(h)


@pytest.mark.parametrize("routes", ["symbolic_trace", "export"])
def test_a_value_written_in_place_and_read_again_is_routed_as_the_model_computes(routes):
    """``h.relu_()`` with its result dropped, then ``l2(h)``: symbolic tracing recorded
    ``l2`` reading ``h`` as it was, so the router refused it. The trace now has ``l2`` read
    the write's node (the same tensor at run time), as torch.export records it: exact credit
    equals autograd's, feedback alignment's equals its formula by hand, and training with the
    router equals autograd's bit for bit."""
    torch.manual_seed(0)
    model = _WritesThenReads().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, routes=routes)
    assert G.graph["capture"] == routes
    res = fxnx.route_credit(G, model, x)
    model(x).sum().backward()
    assert all(rel_error(res.param_credit[n], p.grad) <= 1e-12 for n, p in model.named_parameters())
    model.zero_grad()
    router = fxnx.CreditRouter(G, model, rule="feedback_alignment")
    router(x).sum().backward()
    (B,) = [b for name, b in router.feedback.items() if "l2" in name or name.endswith("linear_1")]
    h = model.l1(x).detach()
    e = torch.ones(4, 3, dtype=torch.float64)
    back = (e @ B) * (h > 0)
    assert rel_error(model.l2.weight.grad, e.T @ h.relu()) <= 1e-12
    assert rel_error(model.l1.weight.grad, back.T @ x) <= 1e-12
    assert rel_error(model.l1.bias.grad, back.sum(0)) <= 1e-12
    start = copy.deepcopy(model)
    gen = _gen()
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64), {},
                torch.randint(0, 3, (4,), generator=gen)) for _ in range(3)]
    ours, theirs, _ = _train_both(model, batches, F.cross_entropy, convert={"routes": routes})
    _assert_bit_equal(ours, theirs, start)


# -- Hugging Face -----------------------------------------------------------------------------

def _hf_batches(n_batches, labels=None, vocab=50):
    gen = _gen(3)
    out = []
    for n, t in [(2, 6)] * (n_batches - 1) + [(3, 7)]:  # the last batch has another shape
        ids = torch.randint(1, vocab, (n, t), generator=gen)
        mask = torch.ones(n, t, dtype=torch.long)
        mask[1, t - 2:] = 0
        y = torch.randint(0, labels, (n,), generator=gen) if labels else ids
        out.append((ids, {"attention_mask": mask}, y))
    return out


def _nonzero(model):
    """Zero-initialised biases and norms would make parts of the comparison vacuous."""
    for p in model.parameters():
        if not p.abs().sum():
            nn.init.uniform_(p, -0.5, 0.5)
    return model


def test_gpt2_lm_with_an_attention_mask_trains_like_autograd():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, bos_token_id=0,
                                     eos_token_id=0, use_cache=False)
    # Dropout stays on (train mode): the same seed before each forward gives the same masks.
    model = _nonzero(transformers.GPT2LMHeadModel(config)).double().train()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    start = copy.deepcopy(model)

    def loss(out, ids):
        assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))

    ours, theirs, _ = _train_both(model, _hf_batches(3), loss, optimizer="adam", seed=7)
    _assert_bit_equal(ours, theirs, start)


@pytest.mark.slow
def test_bert_classifier_with_an_attention_mask_trains_like_autograd():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                     intermediate_size=64, vocab_size=50, num_labels=3)
    model = _nonzero(transformers.BertForSequenceClassification(config)).double().train()
    start = copy.deepcopy(model)
    ours, theirs, _ = _train_both(
        model, _hf_batches(3, labels=3), lambda out, y: F.cross_entropy(out.logits, y),
        optimizer="adam", seed=7,
    )
    _assert_bit_equal(ours, theirs, start)


# -- timm -------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, options, dtype", [
    ("resnet18", {}, torch.float64),  # timm's own ResNet (each block's last BN starts at zero)
    # efficientnet_b0 in small (BatchNormAct2d, squeeze-excite, depthwise convs); float32, as
    # depthwise convolutions in float64 are slow on CPU. Bit-equal all the same.
    ("test_efficientnet", {}, torch.float32),
    ("vit_tiny_patch16_224", {"img_size": 32, "depth": 3}, torch.float64),
])
def test_timm_models_train_like_autograd(name, options, dtype):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, **options).to(dtype).train()
    start = copy.deepcopy(model)
    gen = _gen(2)
    size = 16 if name == "resnet18" else 32
    batches = [(torch.randn(2, 3, size, size, generator=gen, dtype=dtype), {},
                torch.randint(0, 5, (2,), generator=gen)) for _ in range(2)]
    ours, theirs, _ = _train_both(model, batches, F.cross_entropy)
    _assert_bit_equal(ours, theirs, start)


# -- every preset on skips, attention, transformer layers ------------------------------------

class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.enc(self.inp(x)).mean(1))


def _resnet18():
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=5), torch.randn(2, 3, 16, 16)


def _vit():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32,
                              depth=2)
    return model, torch.randn(2, 3, 32, 32)


def _encoder():
    return _Encoder(), torch.randn(2, 7, 6)


_MODELS = {"resnet18": _resnet18, "vit": _vit, "transformer_encoder": _encoder}


@pytest.mark.parametrize("model_name", [
    pytest.param("resnet18", marks=pytest.mark.slow),
    pytest.param("vit", marks=pytest.mark.slow),
    "transformer_encoder",
])
def test_every_preset_takes_a_step(model_name):
    torch.manual_seed(0)
    model, x = _MODELS[model_name]()
    model.train()
    G = fxnx.convert(model, x)
    y = torch.randint(0, 5, (2,))
    for rule in fxnx.credit.PRESETS:
        mine = copy.deepcopy(model)
        before = [p.detach().clone() for p in mine.parameters()]
        router = fxnx.CreditRouter(G, mine, rule=rule, seed=0)
        res = router.backward(F.cross_entropy(router(x), y))
        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
        opt.step()
        assert all(p.grad is not None for p in mine.parameters()), rule
        assert all(not torch.equal(p, b) for p, b in zip(mine.parameters(), before, strict=True)), rule
        if rule != "exact":
            assert rule in res.rules.values()  # the rule reached some node


def test_feedback_inside_a_transformer_encoder():
    torch.manual_seed(0)
    model, x = _encoder()
    model = model.double()
    x = x.double()
    G = fxnx.convert(model, x, leaf_modules="torch.nn")
    assert G.graph["capture"] == "symbolic_trace" and "enc" in G  # kept whole: torch.fx's rule
    credit = torch.randn(2, 5, dtype=torch.float64)
    # The oracle: autograd's credit at the encoder's input.
    ref = copy.deepcopy(model)
    h = ref.inp(x).detach().requires_grad_()
    exact_in = torch.autograd.grad(ref.head(ref.enc(h).mean(1)), h, credit)[0]

    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", seed=0, node_credit=True)
    router(x)
    res = router.backward(output_credit=credit, node_credit=True)
    assert res.rules["enc"] == "feedback_alignment"
    fb = router.feedback["enc"]
    assert sorted(fb) == sorted(
        f"layers.{i}.{w}" for i in (0, 1)
        for w in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")
    )
    assert (res.node_credit["inp"] - exact_in).norm() > 1e-3 * exact_in.norm()

    # With each feedback weight set to the weight itself, feedback alignment is backprop.
    own = {name: model.enc.get_parameter(name).detach().clone() for name in fb}
    again = fxnx.CreditRouter(G, model, rule="feedback_alignment", feedback={"enc": own, "head": model.head.weight,
                                                                             "inp": model.inp.weight},
                               node_credit=True)
    again(x)
    res = again.backward(output_credit=credit, node_credit=True)
    torch.testing.assert_close(res.node_credit["inp"], exact_in, rtol=1e-12, atol=1e-14)


def test_feedback_alignment_reaches_every_layer_of_a_traced_encoder():
    """By default the encoder is traced into: its linear layers and attention are nodes of G."""
    torch.manual_seed(0)
    model, x = _encoder()
    model, x = model.double(), x.double()
    G = fxnx.convert(model, x)
    assert "enc" not in G
    credit = torch.randn(2, 5, dtype=torch.float64)
    ref = copy.deepcopy(model)
    x_ = x.clone().requires_grad_()
    out = ref(x_)
    grads = dict(zip([n for n, _ in ref.named_parameters()],
                     torch.autograd.grad(out, [*ref.parameters()], credit), strict=True))

    router = fxnx.CreditRouter(G, model, rule="feedback_alignment", seed=0)
    router(x)
    res = router.backward(output_credit=credit)
    fa_nodes = {n for n, r in res.rules.items() if r == "feedback_alignment"}
    assert {f"enc_layers_{i}_{m}" for i in (0, 1) for m in ("linear1", "linear2", "self_attn")} <= fa_nodes
    moved = (res.param_credit["inp.weight"] - grads["inp.weight"]).norm()
    assert moved > 1e-3 * grads["inp.weight"].norm()  # credit crossed feedback weights
    torch.testing.assert_close(res.param_credit["head.weight"], grads["head.weight"], rtol=1e-12, atol=0)


@pytest.mark.slow
def test_dfa_feedback_size_on_resnet18():
    """Spatially shared feedback (the default) is one (classes, C_in, k, k) kernel per
    convolution, whatever the image size; the dense form is (classes, *input shape)."""
    import torchvision

    def feedback(size, rule):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None, num_classes=10).train()
        x = torch.randn(2, 3, size, size)
        G = fxnx.convert(model, x)
        router = fxnx.CreditRouter(G, model, rule=rule)
        router.backward(F.cross_entropy(router(x), torch.randint(0, 10, (2,))))
        return G, model, router.feedback

    G, model, fb = feedback(64, "direct_feedback_alignment")
    assert "conv1" not in fb  # the stem's input is the image, which needs no credit
    convs = {n.replace(".", "_"): m for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and n != "conv1"}
    assert set(fb) == set(convs) | {"fc"}
    for name, m in convs.items():
        assert tuple(fb[name].shape) == (10, m.in_channels, *m.kernel_size), name
    assert tuple(fb["fc"].shape) == (10, 512)
    total = sum(B.numel() for B in fb.values())
    assert total == sum(10 * m.in_channels * m.kernel_size[0] * m.kernel_size[1] for m in convs.values()) + 5120
    assert sum(B.numel() for B in feedback(32, "direct_feedback_alignment")[2].values()) == total
    dense = fxnx.credit.DirectFeedbackAlignment(spatial=False)
    G, _, fb = feedback(64, {nn.Conv2d: dense, nn.Linear: dense})
    for name, B in fb.items():
        (shape,) = [s for *_, s in G.in_edges(name, data="shape")]
        assert tuple(B.shape) == (10, *shape[1:]), name
    assert sum(B.numel() for B in fb.values()) == 1_664_000  # 6.3 MiB in float32


# -- misuse -----------------------------------------------------------------------------------

def test_misuse_says_what_to_do():
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    router = fxnx.CreditRouter(fxnx.convert(model, x), model)
    with torch.no_grad():
        out = router(x)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"ran under torch.no_grad\(\)"):
        router.backward(out.sum())
    first, _ = router(x), router(x)
    with pytest.raises(fxnx.errors.FxnxValueError, match="nor from an earlier call's output"):
        router.backward(first.sum())
    with pytest.raises(fxnx.errors.FxnxValueError, match="not from model"):
        router.backward(model(x).sum())
    router.backward(router(x).sum())
    with pytest.raises(fxnx.errors.FxnxValueError, match="already called on the last forward"):
        router.backward(first.sum())
    router(x).sum().backward()  # the primary path: autograd routes it
    model.append(nn.Tanh())  # the model changed after G was converted
    with pytest.raises(fxnx.errors.FxnxValueError, match="convert it again and build a new router"):
        router(x)
