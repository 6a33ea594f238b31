"""Receptive fields against autograd's: the input pixels whose gradient is not zero.

The oracle runs a copy of the model in which every value is positive (positive
weights and inputs, no bias, BatchNorm at the identity), so no gradient cancels
and no ReLU cuts one, and each max-pool is an average pool over the same window
(a max-pool's gradient reaches one pixel per window). The gradient of one output
position, summed over channels, is then non-zero exactly on the pixels that
position reads: its bounding box must be the predicted field, clipped to the image.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxnx
from fxnx._receptive import ReceptiveField, receptive_fields

#: Positive sums cannot cancel, only underflow: the smallest non-zero gradient in these tests
#: (ResNet-18's last convolution, at the corner of its 435-pixel field) is about 6e-16, far
#: above float32's smallest normal number (1e-38), so float32 is exact enough and 2.5x faster.
DTYPE = torch.float32


def positive(model: nn.Module) -> nn.Module:
    """A copy of ``model`` computing with positive values only, average pools for max."""
    model = copy.deepcopy(model).to(DTYPE).eval()
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            w = torch.rand(m.weight.shape, generator=gen, dtype=DTYPE) + 0.5
            m.weight.data = w / w[0].sum()  # each output about the mean of what it reads
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, nn.BatchNorm2d):
            m.reset_parameters()  # weight 1, bias 0, running mean 0, running variance 1
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.MaxPool2d):
            assert m.dilation == 1
            parent, _, attr = name.rpartition(".")
            pool = nn.AvgPool2d(m.kernel_size, m.stride, m.padding, ceil_mode=m.ceil_mode)
            setattr(model.get_submodule(parent), attr, pool)
    return model


def support(grad: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The bounding box (half open, per spatial dimension) of a (1, C, H, W) gradient's
    non-zeros."""
    nonzero = grad[0].abs().sum(0) > 0
    rows = nonzero.any(1).nonzero().flatten()
    cols = nonzero.any(0).nonzero().flatten()
    return ((rows.min().item(), rows.max().item() + 1), (cols.min().item(), cols.max().item() + 1))


def outputs_of(
    model: nn.Module, x: torch.Tensor, wanted: dict[str, tuple[str, int]]
) -> dict[str, torch.Tensor]:
    """Each wanted node's value: the output of the ``call``-th call of the module at ``path``."""
    calls: dict[str, list[torch.Tensor]] = {}
    handles = [
        model.get_submodule(path).register_forward_hook(
            lambda m, args, out, path=path: calls.setdefault(path, []).append(out))
        for path in {path for path, _ in wanted.values()}
    ]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return {node: calls[path][call] for node, (path, call) in wanted.items()}


def check_against_autograd(fields, values, x):
    """For every node: a central position (field inside the image) and a corner one (clipped)."""
    within = tuple(x.shape[2:])
    for node, value in values.items():
        rf = fields[node]
        if value.dim() == 2:  # no grid left: the node as a whole
            (grad,) = torch.autograd.grad(value[0].sum(), x, retain_graph=True)
            assert support(grad) == rf.box(within=within), node
            continue
        H, W = value.shape[2:]
        central = (H // 2, W // 2)
        assert rf.box(*central) == rf.box(*central, within=within), f"{node}: central, clipped"
        for i, j in (central, (0, W - 1)):
            (grad,) = torch.autograd.grad(value[0, :, i, j].sum(), x, retain_graph=True)
            assert support(grad) == rf.box(i, j, within=within), (node, i, j, rf)


#: Nodes across the depth of ResNet-18: node name -> (module path, which call of it).
RESNET18 = {
    "conv1": ("conv1", 0),
    "maxpool": ("maxpool", 0),
    "layer1_0_relu_1": ("layer1.0.relu", 1),  # after the first residual add
    "layer2_0_downsample_0": ("layer2.0.downsample.0", 0),  # the 1x1 stride-2 skip
    "layer2_1_conv2": ("layer2.1.conv2", 0),
    "layer3_0_relu_1": ("layer3.0.relu", 1),
    "layer4_1_conv2": ("layer4.1.conv2", 0),  # the last convolution: 435 pixels
    "layer4_1_relu_1": ("layer4.1.relu", 1),
    "fc": ("fc", 0),  # after global pooling: the whole image
}


def test_resnet18_fields_are_autograds(torchvision_model):
    model = torchvision_model("resnet18")
    # 448 pixels: the last stage's 435-pixel field fits around a central position
    G = fxnx.convert(model, torch.zeros(1, 3, 448, 448))
    fields = receptive_fields(G, model)
    assert fields["layer4_1_conv2"] == ReceptiveField((435, 435), (32, 32), (-217, -217))
    x = (torch.rand(1, 3, 448, 448, dtype=DTYPE) + 0.5).requires_grad_()
    check_against_autograd(fields, outputs_of(positive(model), x, RESNET18), x)


VGG11_FEATURES = {
    "features_0": ("0", 0),
    "features_2": ("2", 0),  # the first max-pool
    "features_8": ("8", 0),
    "features_10": ("10", 0),
    "features_16": ("16", 0),
    "features_18": ("18", 0),  # the last convolution
    "features_20": ("20", 0),  # the last max-pool: 150 pixels
}


def test_vgg11_fields_are_autograds(torchvision_model):
    model = torchvision_model("vgg11")
    G = fxnx.convert(model, torch.zeros(1, 3, 160, 160))
    fields = receptive_fields(G, model)
    assert fields["features_20"] == ReceptiveField(size=(150, 150), jump=(32, 32), start=(-59, -59))
    # the classifier sees the whole image (a 5x5 grid pooled to 7x7 is an unknown op: a union)
    assert fields["classifier_6"].jump == (0, 0)
    assert fields["classifier_6"].box(within=(160, 160)) == ((0, 160), (0, 160))
    x = (torch.rand(1, 3, 160, 160, dtype=DTYPE) + 0.5).requires_grad_()
    features = positive(model.features)  # the classifier's 120M weights are not needed
    check_against_autograd(fields, outputs_of(features, x, VGG11_FEATURES), x)


class Functional(nn.Module):
    """Functional convolutions and pools, with every intermediate value returned.

    ``oracle=True`` averages where the graph's model takes maxima (same windows).
    """

    def __init__(self, oracle: bool = False) -> None:
        super().__init__()
        self.oracle = oracle
        self.w1 = nn.Parameter(torch.rand(4, 3, 3, 3) + 0.5)
        self.w2 = nn.Parameter(torch.rand(4, 4, 3, 3) + 0.5)
        self.w3 = nn.Parameter(torch.rand(4, 4, 1, 1) + 0.5)

    def forward(self, x):
        a = F.conv2d(x, self.w1, stride=2, padding=1)
        b = F.avg_pool2d(a, 3, 2, 1) if self.oracle else F.max_pool2d(a, 3, 2, 1)
        c = F.conv2d(b, self.w2, padding="same", dilation=2)
        d = F.conv2d(b, self.w3)
        e = torch.relu(c + d)  # fields of two sizes on one grid: their union
        f = torch.cat([e, d], 1)
        g = F.avg_pool2d(f, 2)
        h = F.avg_pool2d(g, 2) if self.oracle else torch.max_pool2d(g, 2)
        return a, b, c, d, e, f, g, h


def test_functional_calls_by_hand_and_by_autograd():
    model = Functional()
    G = fxnx.convert(model, torch.zeros(1, 3, 64, 64))
    fields = receptive_fields(G)  # no model needed: every setting is in node_call_info
    names = ["conv2d", "max_pool2d", "conv2d_1", "conv2d_2", "relu", "cat", "avg_pool2d",
             "max_pool2d_1"]
    # by hand: (size, jump, start) along each dimension
    expected = [
        (3, 2, -1),  # 3x3 conv, stride 2, padding 1
        (7, 4, -3),  # 3x3 pool, stride 2, padding 1: 3 + 2*2, start -1 - 1*2
        (23, 4, -11),  # 3x3 conv, dilation 2, "same" padding 2: 7 + 2*2*4, start -3 - 2*4
        (7, 4, -3),  # 1x1 conv
        (23, 4, -11),  # union of the two
        (23, 4, -11),
        (27, 8, -11),  # 2x2 pool, stride 2
        (35, 16, -11),
    ]
    for name, (size, jump, start) in zip(names, expected, strict=True):
        assert fields[name] == ReceptiveField((size,) * 2, (jump,) * 2, (start,) * 2), name
    assert fields["w1"] is None  # a parameter does not depend on the input
    oracle = Functional(oracle=True).double()
    oracle.load_state_dict(model.state_dict())
    x = (torch.rand(1, 3, 64, 64, dtype=torch.float64) + 0.5).requires_grad_()
    values = dict(zip(names, oracle(x), strict=True))
    check_against_autograd(fields, values, x)


def test_aten_graph_gives_the_module_graphs_fields(torchvision_model):
    model = torchvision_model("resnet18")
    x = torch.zeros(1, 3, 64, 64)
    G, A = fxnx.convert(model, x), fxnx.convert(model, x, level="aten")
    module_fields, aten_fields = receptive_fields(G, model), receptive_fields(A)
    convs = [module_fields[n] for n in G
             if G.nodes[n]["module_type"] == "torch.nn.modules.conv.Conv2d"]
    aten_convs = [aten_fields[n] for n in A
                  if A.nodes[n]["target"] == "torch.ops.aten.convolution.default"]
    assert len(convs) == 20
    assert aten_convs == convs


def test_module_nodes_need_the_model(torchvision_model):
    model = torchvision_model("resnet18")
    G = fxnx.convert(model, torch.zeros(1, 3, 32, 32))
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"node 'conv1' calls .*Conv2d.*pass the model"):
        receptive_fields(G)


def test_refusals_name_what_is_missing():
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    missing = r"no input of shape \(N, C, \*spatial\).*example inputs"
    with pytest.raises(fxnx.errors.FxnxValueError, match=missing):
        receptive_fields(fxnx.convert(model), model)
    G = fxnx.convert(model, torch.zeros(1, 3, 8, 8))
    with pytest.raises(fxnx.errors.FxnxValueError, match="input='y' is not an input of G"):
        receptive_fields(G, model, input="y")
    with pytest.raises(fxnx.errors.FxnxValueError, match="one index per spatial dimension"):
        receptive_fields(G, model)["_0"].box(1)
