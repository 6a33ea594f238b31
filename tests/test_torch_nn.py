"""torch.nn's composites are traced into; its primitive layers stay whole.

Oracles: forward hooks on the model's own submodules (which modules ran and
the shapes they returned), torch.autograd on the eager model (exact credit,
float64), and torch.fx's own default tracer for the ``leaf_modules="torch.nn"``
rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxnx


def _encoder(num_layers=16, norm_first=False):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False).double().eval()


def _hooked_shapes(model, *args, **kwargs):
    """Each submodule that ran, with the shape of its (first) output."""
    shapes, handles = {}, []
    for path, module in model.named_modules():
        if path:
            def hook(m, a, out, path=path):
                first = out[0] if isinstance(out, tuple) else out
                shapes[path] = tuple(first.shape)
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return shapes


def _module_nodes(G):
    return {d["target"]: d for _, d in G.nodes(data=True) if d["op"] == "call_module"}


def _check_against_hooks(G, model, *args, **kwargs):
    hooks = _hooked_shapes(model, *args, **kwargs)
    nodes = _module_nodes(G)
    assert nodes, "no module nodes"
    for target, data in nodes.items():
        shape = data["out_shape"][0] if isinstance(data["out_shape"], list) else data["out_shape"]
        assert shape == hooks[target], target
    # Every primitive layer that ran is a node of its own.
    primitives = {p for p in hooks if next(iter(model.get_submodule(p).children()), None) is None}
    assert primitives <= set(nodes)


def _check_exact_credit(G, model, inputs, kwargs=None):
    kwargs = kwargs or {}
    ref = copy.deepcopy(model)
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = ref(*leaves, **kwargs)
    # Random credit at the output: a plain sum through a final LayerNorm has no gradient.
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [*leaves, *ref.parameters()], weights)
    res = fxnx.route_credit(G, model, *inputs, kwargs=kwargs, output_credit=weights)
    names = [i["name"] for i in G.graph["inputs"]]
    for name, g in zip(names, grads[: len(inputs)], strict=False):
        assert (res.node_credit[name] - g).norm() <= 1e-12 * g.norm(), name
    for (pname, _), g in zip(ref.named_parameters(), grads[len(inputs):], strict=True):
        assert (res.param_credit[pname] - g).norm() <= 1e-12 * g.norm(), pname


def test_a_16_layer_transformer_encoder_shows_every_layer():
    model = _encoder()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "symbolic_trace" and "opaque_modules" not in G.graph
    nodes = _module_nodes(G)
    for i in range(16):
        for sub in ("self_attn", "norm1", "linear1", "linear2", "norm2"):
            assert f"layers.{i}.{sub}" in nodes
    assert nodes["layers.3.self_attn"]["module_type"].endswith("MultiheadAttention")  # kept whole
    assert len(G) > 16 * 8
    _check_against_hooks(G, model, x)
    _check_exact_credit(G, model, (x,))
    # Both residuals of every layer.
    assert len(fxnx.skip_connections(G)) == 2 * 16
    assert torch.backends.mha.get_fastpath_enabled()  # the fast-path switch is restored


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_with_a_padding_mask_and_a_causal_mask(norm_first):
    model = _encoder(num_layers=3, norm_first=norm_first)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    kwargs = {"mask": causal, "src_key_padding_mask": pad}
    G = fxnx.convert(model, x, kwargs=kwargs)
    assert "opaque_modules" not in G.graph
    assert {f"layers.{i}.linear1" for i in range(3)} <= set(_module_nodes(G))
    _check_against_hooks(G, model, x, **kwargs)
    _check_exact_credit(G, model, (x,), kwargs)


@pytest.mark.parametrize("batch_first", [True, False])
def test_nn_transformer_shows_encoder_and_decoder_layers(batch_first):
    torch.manual_seed(0)
    model = nn.Transformer(16, 2, 2, 2, 32, dropout=0.0, batch_first=batch_first).double().eval()
    src = torch.randn(2, 5, 16, dtype=torch.float64)
    tgt = torch.randn(2, 4, 16, dtype=torch.float64)
    if not batch_first:
        src, tgt = src.transpose(0, 1).contiguous(), tgt.transpose(0, 1).contiguous()
    G = fxnx.convert(model, src, tgt)
    assert G.graph["capture"] == "symbolic_trace" and "opaque_modules" not in G.graph
    nodes = _module_nodes(G)
    for i in range(2):
        assert f"encoder.layers.{i}.linear2" in nodes
        assert f"decoder.layers.{i}.multihead_attn" in nodes and f"decoder.layers.{i}.norm3" in nodes
    _check_against_hooks(G, model, src, tgt)
    _check_exact_credit(G, model, (src, tgt))


def test_transformer_decoder_alone():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerDecoder(layer, num_layers=2).double().eval()
    tgt = torch.randn(2, 4, 16, dtype=torch.float64)
    memory = torch.randn(2, 6, 16, dtype=torch.float64)
    G = fxnx.convert(model, tgt, memory)
    assert {"layers.1.multihead_attn", "layers.1.linear1"} <= set(_module_nodes(G))
    _check_against_hooks(G, model, tgt, memory)
    _check_exact_credit(G, model, (tgt, memory))


def test_a_different_input_shape_is_captured_again_and_stays_exact():
    """Checks answered from the example fix the graph to its shapes; credit on another
    length captures again rather than reuse a graph made for other shapes."""
    model = _encoder(num_layers=2)
    G = fxnx.convert(model, torch.randn(2, 5, 16, dtype=torch.float64))
    _check_exact_credit(G, model, (torch.randn(3, 7, 16, dtype=torch.float64),))


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.enc = _encoder(num_layers=2).float()

    def forward(self, x):
        return self.enc(self.proj(x))


def test_the_torch_nn_rule_is_torch_fx_s_own():
    model = Wrapper().eval()
    x = torch.randn(2, 5, 8)
    G = fxnx.convert(model, x, leaf_modules="torch.nn")
    want = fx.symbolic_trace(model)  # torch.fx's default leaf rule
    assert sorted(G) == sorted(n.name for n in want.graph.nodes)
    assert _module_nodes(G)["enc"]["module_type"] == "torch.nn.modules.transformer.TransformerEncoder"
    assert G.graph["capture_options"]["leaf_modules"] == ["torch.nn"]
    res = fxnx.route_credit(G, model, x)  # captured again with the stored rule
    assert res.node_credit["x"] is not None


def test_a_composite_that_cannot_be_traced_is_kept_whole():
    """Without example inputs the encoder's checks on its input cannot be answered."""
    model = Wrapper().eval()
    G = fxnx.convert(model)
    assert G.graph["opaque_modules"] == ["enc"] and G.nodes["enc"]["opaque"] is True
    assert G.graph["capture_options"]["opaque"] == ["enc"]
    # With inputs, it is traced into.
    G = fxnx.convert(model, torch.randn(2, 5, 8))
    assert "opaque_modules" not in G.graph and "enc.layers.1.linear1" in _module_nodes(G)


def test_user_subclasses_of_torch_nn_layers_are_traced_as_before():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    G = fxnx.convert(nn.Sequential(MyLinear(3, 3), nn.ReLU()), torch.randn(2, 3))
    assert fx.symbolic_trace(nn.Sequential(MyLinear(3, 3), nn.ReLU())).graph.__str__().count(
        "call_module") == sum(d["op"] == "call_module" for _, d in G.nodes(data=True))
