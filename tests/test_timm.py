"""timm models built without weights: functional BatchNorm, tensor constants (issue 11)."""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch
from torch import nn

import fxnx

from conftest import reinit

timm = pytest.importorskip("timm")


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", ["mobilenetv3_small_050", "efficientnet_b0"])
def test_batchnormact_models_route_exact_credit(name, mode):
    torch.manual_seed(0)
    model = getattr(reinit(timm.create_model(name, pretrained=False, num_classes=5)).double(), mode)()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    G = fxnx.convert(model, x)  # tracing runs num_batches_tracked.add_(1) on the real buffer
    res = fxnx.route_credit(G, model, x)
    ref = copy.deepcopy(model)
    x_ = x.clone().requires_grad_()
    names, params = zip(*ref.named_parameters(), strict=True)
    grads = torch.autograd.grad(ref(x_).sum(), [x_, *params])
    assert (res.node_credit["x"] - grads[0]).norm() <= 1e-12 * grads[0].norm()
    for pname, g in zip(names, grads[1:], strict=True):
        assert (res.param_credit[pname] - g).norm() <= 1e-12 * g.norm() + 1e-300, pname
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in stats.items())


def test_swin_keeps_no_tensor_constants_and_converts_the_same_twice():
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32,
                              window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2),
                              num_classes=3).eval()
    x = torch.randn(1, 3, 32, 32)
    before = set(vars(model)), {n for n, _ in model.named_buffers()}
    G1, G2 = fxnx.convert(model, x), fxnx.convert(model, x)
    assert (set(vars(model)), {n for n, _ in model.named_buffers()}) == before
    assert nx.utils.graphs_equal(G1, G2)
    # The relative position index, a buffer, is read where it lives (it was a constant made
    # while tracing): no constant is left to leak onto the model.
    assert any(d.get("target") == "layers.0.blocks.0.attn.relative_position_index" for _, d in G1.nodes(data=True))
    assert not any(n.startswith("_tensor_constant") for n in G1)

    class Made(nn.Module):  # a tensor made in forward from no input is a constant: not vacuous
        def forward(self, x):
            return x * torch.arange(3.0)

    made = Made()
    G3 = fxnx.convert(made, torch.randn(2, 3))
    assert any(n.startswith("_tensor_constant") for n in G3) and not set(vars(made)) - set(vars(Made()))
    res = fxnx.route_credit(G1, model, x)
    x_ = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(x_).sum(), x_)
    assert torch.allclose(res.node_credit["x"], want, rtol=1e-4, atol=1e-6)
