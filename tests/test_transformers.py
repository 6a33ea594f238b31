"""Hugging Face models, built from small configs with random weights (never downloaded)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import fxnx

transformers = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
             vocab_size=50)


def _config(name: str):
    if name == "bert":
        return transformers.BertConfig(**SMALL)
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50,
                                       bos_token_id=0, eos_token_id=0)
    if name == "t5":
        return transformers.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32,
                                     d_kv=16, d_ff=64, vocab_size=50, decoder_start_token_id=0)
    if name == "llama":
        return transformers.LlamaConfig(**SMALL, num_key_value_heads=2)
    return transformers.ViTConfig(**SMALL, image_size=16, patch_size=8)


def _model_and_inputs(name: str):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(_config(name)).eval().double()
    for module in model.modules():  # zero-initialised biases and norms would make credit vacuous
        for p in module.parameters(recurse=False):
            if not p.abs().sum():
                torch.nn.init.uniform_(p, -0.5, 0.5)
    ids = torch.randint(1, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    if name == "vit":
        return model, (torch.randn(2, 3, 16, 16, dtype=torch.float64),), {}
    if name == "t5":
        return model, (ids,), {"attention_mask": mask, "decoder_input_ids": ids[:, :4]}
    return model, (ids,), {"attention_mask": mask}


#: Residuals in two layers: per layer, the attention and MLP residuals (T5's decoder has a
#: cross-attention residual too). Llama's rotary embeddings and GPT-2's GELU written out fork
#: and merge too, as parallel branches: not residuals (tests/test_skip_kinds.py counts them).
#: Before index and mask tensors stopped counting as data, BERT showed 2 of its 4.
SKIPS = {"bert": 4, "gpt2": 4, "t5": 10, "llama": 4, "vit": 4}


@pytest.mark.parametrize("name", sorted(SKIPS))
def test_converts_with_defaults_and_routes_exact_credit(name):
    model, args, kwargs = _model_and_inputs(name)
    G = fxnx.convert(model, *args, kwargs=kwargs)
    fxnx.validate(G)
    # Keyword inputs stay keywords; unused optional inputs are not placeholders.
    assert [i["name"] for i in G.graph["inputs"] if i["shape"] is not None] == [
        "pixel_values" if name == "vit" else "input_ids", *kwargs]
    takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    assert G.graph.get("fixed_kwargs") == ({"use_cache": False} if takes_cache else None)
    # The oracle for shapes: the eager model's output.
    with torch.no_grad():
        eager = model(*args, **kwargs, **G.graph.get("fixed_kwargs", {}))
    shapes = {shape for *_, shape in G.in_edges("output", data="shape")}
    assert tuple(eager.last_hidden_state.shape) in shapes

    res = fxnx.route_credit(G, model, *args, kwargs=kwargs)
    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs, **G.graph.get("fixed_kwargs", {}))
    leaves = [t for t in torch.utils._pytree.tree_leaves(dict(out)) if t.is_floating_point()]
    params = [p for _, p in ref.named_parameters()]
    grads = torch.autograd.grad(leaves, params, [torch.ones_like(t) for t in leaves],
                                allow_unused=True)
    assert sorted(res.param_credit) == sorted(n for (n, _), g in zip(ref.named_parameters(), grads,
                                                                     strict=True) if g is not None)
    for (pname, _), g in zip(ref.named_parameters(), grads, strict=True):
        if g is None:
            continue
        got = res.param_credit[pname]
        assert (got - g).norm() <= 1e-12 * g.norm(), pname


@pytest.mark.parametrize("name", sorted(SKIPS))
def test_attention_and_mlp_residuals_are_found(name):
    model, args, kwargs = _model_and_inputs(name)
    assert len(fxnx.skip_connections(fxnx.convert(model, *args, kwargs=kwargs))) == SKIPS[name]


def test_repeated_credit_runs_capture_once(monkeypatch):
    """transformers rebuilds some attributes on every call; they must not defeat the reuse."""
    from fxnx._capture import reuse as _reuse

    model, args, kwargs = _model_and_inputs("bert")
    G = fxnx.convert(model, *args, kwargs=kwargs)
    calls = []
    real = _reuse.capture
    monkeypatch.setattr(_reuse, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(3):
        fxnx.route_credit(G, model, *args, kwargs=kwargs)
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_direct_feedback_alignment_runs_linear_layers_as_one_function_with_the_same_credit(name, monkeypatch):
    """An exported model's ``aten.linear`` nodes under direct feedback alignment run as one
    autograd function each (input projection and layer): the same credit as the layer on its
    input detached followed by the projection (checked against written-out credit in
    tests/test_rules.py), on every parameter."""
    from test_rules import _grad_fns

    from fxnx._credit import graft

    model, args, kwargs = _model_and_inputs(name)
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(graft, "_one_linear", lambda *_: False)
        G = fxnx.convert(model, *args, kwargs=kwargs)  # its own: route_credit keeps its router on G
        out = fxnx.CreditRouter(G, model, rule="direct_feedback_alignment")(*args, **kwargs)
        assert ("_DirectLinearBackward" in {type(fn).__name__ for fn in _grad_fns(out.last_hidden_state)}) is fused
        runs[fused] = fxnx.route_credit(G, model, *args, kwargs=kwargs, rule="direct_feedback_alignment")
    got, want = runs[True], runs[False]
    assert sorted(got.param_credit) == sorted(want.param_credit)
    for pname, g in want.param_credit.items():
        assert (got.param_credit[pname] - g).norm() <= 1e-12 * g.norm(), pname



@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_a_router_s_output_is_the_model_s_without_its_cache_bit_for_bit(name):
    """fxnx passes use_cache=False where the caller does not (G.graph["fixed_kwargs"]), and so
    does a router: its output is model(..., use_cache=False)'s, bit for bit, in train mode
    with dropout on. (The model's default, through its cache, differed from it in the last
    bits: T5's decoder, 2.4e-16 relative, found by a probe; README says so.)"""
    model, args, kwargs = _model_and_inputs(name)
    model.train()
    G = fxnx.convert(model, *args, kwargs=kwargs)
    assert G.graph["fixed_kwargs"] == {"use_cache": False}
    for rule in ("exact", "feedback_alignment"):
        router = fxnx.CreditRouter(G, model, rule=rule)
        torch.manual_seed(3)
        got = router(*args, **kwargs).last_hidden_state
        torch.manual_seed(3)
        want = model(*args, **kwargs, use_cache=False).last_hidden_state
        assert torch.equal(got, want), rule
