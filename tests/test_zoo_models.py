"""A zoo of timm and Hugging Face architectures, built from configs with random weights.

Marked slow. Oracles: the eager model's output shape, forward hooks (how many
times Conv2d and Linear modules ran), the graph contract, and torch.autograd
(exact credit, float64) on a few.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxnx

from conftest import reinit

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

#: timm families at small sizes: (name, create_model keywords, image size).
TIMM = {
    "resnet": ("resnet10t", {}, 32),
    "vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
    "convnext": ("convnext_atto", {"depths": (1, 1, 1, 1)}, 32),
    "efficientnet": ("efficientnet_b0", {}, 32),
    "swin": ("swin_tiny_patch4_window7_224",
             {"img_size": 32, "window_size": 4, "embed_dim": 16, "depths": (1, 1),
              "num_heads": (1, 2)}, 32),
    "mobilevit": ("mobilevit_xxs", {}, 64),
    "regnet": ("regnetx_002", {}, 32),
}

SMALL = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
             vocab_size=50)


def _hf_config(name):
    t = transformers
    return {
        "bert": lambda: t.BertConfig(**SMALL),
        "roberta": lambda: t.RobertaConfig(**SMALL, pad_token_id=1),
        "distilbert": lambda: t.DistilBertConfig(n_layers=2, n_heads=2, dim=32, hidden_dim=64,
                                                 vocab_size=50),
        "gpt2": lambda: t.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50),
        "llama": lambda: t.LlamaConfig(**SMALL, num_key_value_heads=2),
        "mistral": lambda: t.MistralConfig(**SMALL, num_key_value_heads=1),
        "t5": lambda: t.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32,
                                 d_kv=16, d_ff=64, vocab_size=50, decoder_start_token_id=0),
        "bart": lambda: t.BartConfig(encoder_layers=1, decoder_layers=1, d_model=32,
                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=50),
        "vit": lambda: t.ViTConfig(**SMALL, image_size=16, patch_size=8),
    }[name]()


def _calls(model, kinds, *args, **kwargs):
    """How many times modules of each kind ran (forward hooks)."""
    counts = dict.fromkeys(kinds, 0)
    handles = []
    for module in model.modules():
        for kind in kinds:
            if type(module) is kind:
                handles.append(module.register_forward_hook(
                    lambda *_, kind=kind: counts.__setitem__(kind, counts[kind] + 1)))
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return counts, out


def _graph_calls(G, kinds):
    """Calls of each kind in G: module nodes at module level, their ATen ops otherwise."""
    aten = {nn.Conv2d: ("aten.convolution.", "aten.conv2d."), nn.Linear: ("aten.linear.",)}
    counts = {}
    for kind in kinds:
        name = f"{kind.__module__}.{kind.__qualname__}"
        if G.graph["level"] == "module":
            counts[kind] = sum(d["module_type"] == name for _, d in G.nodes(data=True))
        else:
            counts[kind] = sum(any(op in d["target"] for op in aten[kind])
                               for _, d in G.nodes(data=True))
    return counts


def _check_credit(G, model, args, kwargs):
    """route_credit equals autograd on every parameter (float64, relative 1e-12)."""
    res = fxnx.route_credit(G, model, *args, kwargs=kwargs)
    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs, **G.graph.get("fixed_kwargs", {}))
    leaves = [t for t in torch.utils._pytree.tree_leaves(
        dict(out) if isinstance(out, dict) else out) if t.is_floating_point()]
    named = list(ref.named_parameters())
    grads = torch.autograd.grad(leaves, [p for _, p in named],
                                [torch.ones_like(t) for t in leaves], allow_unused=True)
    for (pname, _), g in zip(named, grads, strict=True):
        if g is not None:
            assert (res.param_credit[pname] - g).norm() <= 1e-12 * g.norm() + 1e-300, pname


@pytest.mark.parametrize("family", sorted(TIMM))
def test_timm_family(family):
    name, options, size = TIMM[family]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, **options).eval()
    x = torch.randn(1, 3, size, size)
    credit = family in ("resnet", "vit")
    if credit:
        model, x = reinit(model).double(), x.double()
    G = fxnx.convert(model, x)
    fxnx.validate(G)
    kinds = (nn.Conv2d, nn.Linear)
    hooks, out = _calls(model, kinds, x)
    assert _graph_calls(G, kinds) == hooks
    assert tuple(out.shape) in {s for *_, s in G.in_edges("output", data="shape")}
    if credit:
        _check_credit(G, model, (x,), {})


@pytest.mark.parametrize("name", ["bart", "bert", "distilbert", "gpt2", "llama", "mistral",
                                  "roberta", "t5", "vit"])
def test_hugging_face_architecture(name):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(_hf_config(name)).eval()
    credit = name in ("roberta", "mistral")  # the others' credit is checked in test_transformers.py
    if credit:
        model = reinit(model).double()
    ids = torch.randint(2, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    if name == "vit":
        args, kwargs = (torch.randn(2, 3, 16, 16, dtype=next(model.parameters()).dtype),), {}
    elif name in ("t5", "bart"):
        args, kwargs = (ids,), {"attention_mask": mask, "decoder_input_ids": ids[:, :4]}
    else:
        args, kwargs = (ids,), {"attention_mask": mask}
    G = fxnx.convert(model, *args, kwargs=kwargs)
    fxnx.validate(G)
    hooks, out = _calls(model, (nn.Linear,), *args, **kwargs, **G.graph.get("fixed_kwargs", {}))
    assert _graph_calls(G, (nn.Linear,)) == hooks
    assert tuple(out.last_hidden_state.shape) in {s for *_, s in G.in_edges("output", data="shape")}
    if credit:
        _check_credit(G, model, args, kwargs)
