"""What kind of fork and merge each skip connection is (issue 27, item 6).

The oracle is a count made from the model's own structure, not from the graph: the blocks
that torchvision, timm and Hugging Face build with a residual (``use_res_connect``, a
``downsample`` module, one residual per attention and per MLP of every layer), counted
from ``model.modules()`` and the config, and written out in the comments by hand.
"""

from __future__ import annotations

import collections
import warnings

import networkx as nx
import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.googlenet import Inception  # tv.googlenet is the builder

import fxnx
import fxnx._analysis
from fxnx.errors import FxnxValueError

tv = torchvision.models


def _kinds(G) -> dict[str, int]:
    return dict(collections.Counter(s.kind for s in fxnx.skip_connections(G, "all", annotate=False)))


def _blocks(model: nn.Module, *types: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, types)]


# --- torchvision: counted from the blocks ---------------------------------------------------------


def _resnet_counts(model: nn.Module) -> dict[str, int]:
    blocks = _blocks(model, tv.resnet.BasicBlock, tv.resnet.Bottleneck)
    projection = sum(b.downsample is not None for b in blocks)
    return {"identity": len(blocks) - projection, "projection": projection}


def _inverted_counts(model: nn.Module) -> dict[str, int]:
    blocks = _blocks(model, tv.mobilenetv2.InvertedResidual, tv.efficientnet.MBConv)
    return {"identity": sum(b.use_res_connect for b in blocks)}


CASES = {
    # 4 stages x 2 BasicBlocks; stages 2-4 open with a 1x1 conv + BN downsample: 5 + 3
    "resnet18": (lambda: tv.resnet18(), _resnet_counts, {"identity": 5, "projection": 3}),
    # 3 + 4 + 6 + 3 Bottlenecks; every stage opens with a downsample: 12 + 4
    "resnet50": (lambda: tv.resnet50(), _resnet_counts, {"identity": 12, "projection": 4}),
    # stride-1 blocks with equal channels: (2-1) + (3-1) + (4-1) + (3-1) + (3-1) = 10
    "mobilenet_v2": (lambda: tv.mobilenet_v2(), _inverted_counts, {"identity": 10}),
    # MBConv repeats 1, 2, 2, 3, 3, 4, 1; all but each stage's first: 0+1+1+2+2+3+0 = 9
    "efficientnet_b0": (lambda: tv.efficientnet_b0(), _inverted_counts, {"identity": 9}),
    # 6 + 12 + 24 + 16 dense layers, each concatenating its input with its output: no residual
    "densenet121": (lambda: tv.densenet121(),
                    lambda m: {"parallel": len(_blocks(m, tv.densenet._DenseLayer))},
                    {"parallel": 58}),
    # 9 Inception modules, each concatenating four branches
    "googlenet": (lambda: tv.googlenet(aux_logits=False, init_weights=True),
                  lambda m: {"parallel": len(_blocks(m, Inception))},
                  {"parallel": 9}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_torchvision_residuals_equal_the_blocks_that_have_one(name):
    make, count, by_hand = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    assert count(model) == by_hand  # the structural count agrees with the hand count
    G = fxnx.convert(model, torch.randn(1, 3, 64, 64))
    assert _kinds(G) == by_hand
    residuals = fxnx.skip_connections(G)
    assert len(residuals) == by_hand.get("identity", 0) + by_hand.get("projection", 0)
    assert all(s.kind in ("identity", "projection") for s in residuals)


@pytest.mark.slow
@pytest.mark.parametrize("name, make, block, per_block", [
    # depths 3, 3, 9, 3: one residual per CNBlock
    ("convnext_tiny", lambda: tv.convnext_tiny(), tv.convnext.CNBlock, 1),
    # depths 2, 2, 6, 2: an attention and an MLP residual per block
    ("swin_t", lambda: tv.swin_t(), tv.swin_transformer.SwinTransformerBlock, 2),
])
def test_torchvision_transformers_and_convnext(name, make, block, per_block):
    model = make().eval()
    want = per_block * len(_blocks(model, block))
    assert want == {"convnext_tiny": 18, "swin_t": 24}[name]
    assert _kinds(fxnx.convert(model, torch.randn(1, 3, 64, 64))) == {"identity": want}


def test_aten_and_export_graphs_find_the_same_residuals():
    model = tv.resnet18().eval()
    x = torch.randn(1, 3, 32, 32)
    for options in ({"level": "aten"}, {"routes": "export"}):
        assert _kinds(fxnx.convert(model, x, **options)) == {"identity": 5, "projection": 3}


def test_vision_transformer_has_two_residuals_per_layer():
    model = tv.VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2,
                                 hidden_dim=16, mlp_dim=32).eval()
    # class token concatenated and position embedding added: no fork, no skip connection
    assert _kinds(fxnx.convert(model, torch.randn(1, 3, 32, 32))) == {"identity": 2 * 3}


# --- Hugging Face: per layer, the residuals the architecture's paper names ------------------------

transformers = pytest.importorskip("transformers")
T = transformers
SMALL = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
             vocab_size=50)

HF = {
    # attention and feed-forward residual per layer, 2 layers
    "bert": (lambda: T.BertConfig(**SMALL), 2 * 2, 0),
    # and GPT-2's GELU written out, 0.5*x*(1 + tanh(c*(x + 0.044715*x**3))): one x + ... per layer
    "gpt2": (lambda: T.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50,
                                  bos_token_id=0, eos_token_id=0), 2 * 2, 2),
    # and rotary embeddings on q and k, q*cos + rotate_half(q)*sin with rotate_half's cat: 4 a layer
    "llama": (lambda: T.LlamaConfig(**SMALL, num_key_value_heads=2), 2 * 2, 4 * 2),
    # parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) is one residual a layer; attn + mlp and
    # the rotary embeddings (partial: rotated part concatenated with the rest) are parallel
    "gpt_neox": (lambda: T.GPTNeoXConfig(**SMALL), 1 * 2, None),
    "falcon": (lambda: T.FalconConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                      vocab_size=50), 1 * 2, None),
    # one residual around each Mamba mixer; the unrolled scan's adds and D*x are parallel
    "mamba": (lambda: T.MambaConfig(num_hidden_layers=2, hidden_size=32, vocab_size=50,
                                    state_size=4), 1 * 2, None),
    # two residuals a layer; the attention scores' sum (content + position) is parallel
    "xlnet": (lambda: T.XLNetConfig(n_layer=2, n_head=2, d_model=32, d_inner=64, vocab_size=50),
              2 * 2, 1 * 2),
    # encoder 2 a layer, decoder 3 (self-attention, cross-attention, feed-forward), 2 layers each
    "t5": (lambda: T.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32, d_kv=16,
                              d_ff=64, vocab_size=50, decoder_start_token_id=0), 2 * 2 + 3 * 2, 0),
}


@pytest.mark.parametrize("name", sorted(HF))
def test_hugging_face_residuals_are_counted_per_layer(name):
    config, residuals, parallel = HF[name]
    torch.manual_seed(0)
    model = T.AutoModel.from_config(config()).eval()
    ids = torch.randint(1, 50, (2, 6))
    kwargs = {"decoder_input_ids": ids[:, :4]} if name == "t5" else (
        {} if name == "mamba" else {"attention_mask": torch.ones(2, 6, dtype=torch.long)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = fxnx.convert(model, ids, kwargs=kwargs)
    kinds = _kinds(G)
    assert kinds.get("identity", 0) == residuals and "projection" not in kinds
    if parallel is not None:
        assert kinds.get("parallel", 0) == parallel
    assert len(fxnx.skip_connections(G)) == residuals


# --- timm ---------------------------------------------------------------------------------------

timm = pytest.importorskip("timm")


@pytest.mark.parametrize("name, by_hand", [
    # ResNet-D: the downsample is average pooling, then a 1x1 conv and BN: still a projection
    ("resnet18d", {"identity": 5, "projection": 3}),
    # timm writes shortcut = nn.Identity() where torchvision writes nothing: still an identity
    ("convnext_atto", {"identity": 2 + 2 + 6 + 2}),
    # RegNetY-200MF, depths 1, 1, 4, 7, each stage's first block downsampling: 9 + 4
    ("regnety_002", {"identity": 9, "projection": 4}),
])
def test_timm_residuals(name, by_hand):
    model = timm.create_model(name, pretrained=False).eval()
    assert _kinds(fxnx.convert(model, torch.randn(1, 3, 64, 64))) == by_hand


def test_timm_resnet_d_projection_counted_from_its_blocks():
    model = timm.create_model("resnet18d", pretrained=False).eval()
    blocks = [m for m in model.modules() if type(m).__name__ == "BasicBlock"]
    downsample = [b for b in blocks if b.downsample is not None]
    assert isinstance(downsample[0].downsample[0], nn.AvgPool2d)  # the case this pins
    G = fxnx.convert(model, torch.randn(1, 3, 64, 64))
    skips = fxnx.skip_connections(G)
    assert sum(s.kind == "projection" for s in skips) == len(downsample)
    assert sum(s.kind == "identity" for s in skips) == len(blocks) - len(downsample)


# --- small models: one kind each -----------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, skip: nn.Module | None = None) -> None:
        super().__init__()
        self.f, self.skip = nn.Linear(4, 4), skip

    def forward(self, x):
        return self.f(x).relu() + (x if self.skip is None else self.skip(x))


class ToFloat32(nn.Module):  # Mamba: residual kept in float32
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x):
        return x.to(torch.float32) + self.f(x)


class GeluWritten(nn.Module):  # GPT-2's NewGELU: no learned branch, no residual
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * torch.pow(x, 3.0))))


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.register_buffer("cos", torch.rand(4))
        self.register_buffer("sin", torch.rand(4))

    def forward(self, x):
        q = self.q(x)
        rotated = torch.cat((-q[..., 2:], q[..., :2]), dim=-1)
        return q * self.cos + rotated * self.sin


class Positions(nn.Module):  # an integer add: position ids offset by a past length
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]) + ids.shape[1]
        offset = ids + positions  # integer merge of the input with a tensor made from it
        return self.emb(offset % 16) + self.emb(ids)


class TwoLearned(nn.Module):  # two transforms of x summed: neither is a skip
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("model, want", [
    (Residual(), {"identity": 1}),
    (Residual(nn.Linear(4, 4)), {"projection": 1}),
    (Residual(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))), {"projection": 1}),
    (Residual(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), {"parallel": 1}),
    (Residual(nn.Dropout(0.1)), {"identity": 1}),
    (ToFloat32(), {"identity": 1}),
    (GeluWritten(), {"parallel": 1}),
    (Rotary(), {"parallel": 2}),  # the sum, and rotate_half's cat of two slices of q
    (TwoLearned(), {"parallel": 1}),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_each_kind(model, want):
    G = fxnx.convert(model.eval(), torch.randn(2, 4))
    assert _kinds(G) == want
    assert [s.kind for s in fxnx.skip_connections(G)] == [
        k for k in ("identity", "projection") for _ in range(want.get(k, 0))]


def test_integer_merges_are_no_skip_connections():
    G = fxnx.convert(Positions(), torch.randint(0, 16, (2, 5)))
    adds = [n for n, t in G.nodes(data="target") if t in ("operator.add", "torch.add")]
    assert len(adds) == 3  # arange + length, ids + positions, and the float sum of embeddings
    # The integer adds are no merges; the float sum is: two embeddings of ids, parallel branches.
    [found] = fxnx.skip_connections(G, "all")
    assert found.kind == "parallel" and found.fork == "ids"
    assert G.nodes[found.merge]["out_dtype"] == "torch.float32"


def test_kinds_option_and_errors():
    G = fxnx.convert(Rotary(), torch.randn(2, 4))
    assert fxnx.skip_connections(G) == []
    assert [s.kind for s in fxnx.skip_connections(G, "parallel")] == ["parallel"] * 2
    assert len(fxnx.skip_connections(G, ["identity", "parallel"])) == 2
    for bad in ("residual", ["identity", "skip"], []):
        with pytest.raises(FxnxValueError, match="kinds must name some of identity, projection, "
                                                 "parallel or be 'all'"):
            fxnx.skip_connections(G, bad)


def test_annotation_records_kind_and_marks_parallel_branches_as_branch():
    G = fxnx.convert(Residual(), torch.randn(2, 4))
    fxnx.skip_connections(G)
    assert G.graph["skip_connections"] == [
        {"merge": "add", "fork": "x", "skip": [], "residual": ["f", "relu"], "kind": "identity"}]
    assert G.nodes["f"]["branch_role"] == "residual"
    H = fxnx.convert(TwoLearned(), torch.randn(2, 4))
    assert fxnx.skip_connections(H) == [] and "skip_connections" not in H.graph
    fxnx.skip_connections(H, "all")
    assert H.graph["skip_connections"][0]["kind"] == "parallel"
    roles = {n: r for n, r in H.nodes(data="branch_role") if r}
    assert roles == {"x": "fork", "a_0": "branch", "a_1": "branch", "b_0": "branch",
                     "b_1": "branch", "add": "merge"}
    fxnx.validate(H)


def test_format_3_records_without_kind_still_validate():
    G = fxnx.convert(Residual(), torch.randn(2, 4))
    fxnx.skip_connections(G)
    G.graph["format_version"] = 3
    for record in G.graph["skip_connections"]:
        del record["kind"]
    fxnx.validate(G)
    G.graph["skip_connections"][0]["kind"] = "residualish"
    with pytest.raises(fxnx.errors.GraphContractError, match="skip_connections"):
        fxnx.validate(G)


def test_summary_counts_residuals_and_parallel_branches():
    G = fxnx.convert(tv.googlenet(aux_logits=False, init_weights=True).eval(),
                     torch.randn(1, 3, 64, 64))
    info = fxnx.summary(G)
    assert (info["skip_connections"], info["identity_skips"], info["parallel_branches"]) == (0, 0, 9)
    assert "9 other parallel branches" in fxnx._analysis.format_summary(info)
    assert isinstance(G, nx.MultiDiGraph)
