"""Path counts by length against the binomial coefficients and hand counts; credit by path
length against autograd run once per set of residual branches, the others detached."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torchvision
from torch import nn

import fxnx
from fxnx._paths import path_length_counts, path_length_credit


class Block(nn.Module):
    """``relu(skip(x) + residual(x))``: an identity skip, or a strided 1x1 projection."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1), nn.BatchNorm2d(cout), nn.Tanh(),
            nn.Conv2d(cout, cout, 3, 1, 1), nn.BatchNorm2d(cout))
        self.skip = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x):
        s = x if self.skip is None else self.skip(x)
        return torch.relu(s + self.residual(x))


class Net(nn.Module):
    """An identity block, a downsampling block, an identity block, then a linear read-out."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.blocks = nn.ModuleList([Block(4, 4), Block(4, 6, stride=2), Block(6, 6)])
        self.head = nn.Linear(6 * 4 * 4, 3)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def oracle_forward(net: Net, x: torch.Tensor, carries: tuple[bool, ...]) -> torch.Tensor:
    """``net``'s forward with, in each block, one branch detached: the skip where ``carries``
    is True, the residual branch where it is False. The same values, and credit back along
    the one path that takes exactly the chosen residual branches."""
    h = net.stem(x)
    for block, carry in zip(net.blocks, carries, strict=True):
        s = h if block.skip is None else block.skip(h)
        r = block.residual(h)
        h = torch.relu(s.detach() + r if carry else s + r.detach())
    return net.head(h.flatten(1))


def small_net() -> Net:
    torch.manual_seed(0)
    net = Net().double().eval()
    for m in net.modules():  # BatchNorm away from the identity, so every branch matters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    return net


def test_each_term_is_the_sum_over_sets_of_carrying_branches():
    net = small_net()
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    credit = torch.randn(2, 3, dtype=torch.float64)
    G = fxnx.convert(net, x)
    terms = path_length_credit(G, net, x, output_credit=credit)
    expected = {k: torch.zeros_like(x) for k in range(4)}
    for carries in itertools.product([False, True], repeat=3):
        x_ = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(oracle_forward(net, x_, carries), x_, credit)
        expected[sum(carries)] += grad
    assert sorted(terms) == [0, 1, 2, 3]
    for k in range(4):
        assert expected[k].norm() > 1e-3  # every length carries credit: no term is trivially 0
        atol = 1e-12 * expected[k].abs().max()
        assert torch.allclose(terms[k], expected[k], rtol=1e-10, atol=atol), k


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", ["resnet18", "small"])
def test_terms_sum_to_the_exact_input_credit(name):
    torch.manual_seed(0)
    if name == "small":
        model, x = small_net(), torch.randn(2, 2, 8, 8, dtype=torch.float64)
    else:
        model = torchvision.models.resnet18(weights=None).double().eval()
        x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    G = fxnx.convert(model, x)
    credit = torch.randn_like(model(x))
    terms = path_length_credit(G, model, x, output_credit=credit)
    x_ = x.clone().requires_grad_()
    (exact,) = torch.autograd.grad(model(x_), x_, credit)
    assert relative_error(sum(terms.values()), exact) <= 1e-10


def test_credit_leaves_G_as_it_was():
    net, x = small_net(), torch.randn(1, 2, 8, 8, dtype=torch.float64)
    G = fxnx.convert(net, x)
    fxnx.route_credit(G, net, x)
    before = copy.deepcopy((G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))))
    path_length_credit(G, net, x)
    assert (G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))) == before


def test_a_cut_residual_edge_is_no_longer_a_branch():
    net, x = small_net(), torch.randn(1, 2, 8, 8, dtype=torch.float64)
    G = fxnx.convert(net, x)
    first = fxnx.skip_connections(G, annotate=False)[0]
    residual_end = first.branches[1][-1]
    G.remove_edge(residual_end, first.merge)  # credit no longer flows back through block 0's branch
    assert path_length_counts(G) == {0: 1, 1: 2, 2: 1}
    terms = path_length_credit(G, net, x)
    exact = fxnx.route_credit(G, net, x).node_credit["x"]
    assert relative_error(sum(terms.values()), exact) <= 1e-10


def test_refuses_a_model_in_training_mode():
    net, x = small_net(), torch.randn(1, 2, 8, 8, dtype=torch.float64)
    G = fxnx.convert(net, x)
    net.blocks[1].train()
    with pytest.raises(fxnx.errors.FxnxValueError, match="blocks.1 is in training mode; call model.eval"):
        path_length_credit(G, net, x)


@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("resnet50", 16)])
def test_counts_are_binomial_on_resnets(torchvision_model, name, blocks):
    G = fxnx.convert(torchvision_model(name), torch.zeros(1, 3, 32, 32))
    assert path_length_counts(G) == {k: math.comb(blocks, k) for k in range(blocks + 1)}


def test_counts_are_binomial_on_a_vision_transformer():
    # attention reads its input three times (query, key, value): one step of a path, not three
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    G = fxnx.convert(vit, torch.zeros(1, 3, 32, 32))
    assert path_length_counts(G) == {k: math.comb(6, k) for k in range(7)}


class Nested(nn.Module):
    """An outer skip around two inner residual blocks, then a layer outside every skip."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        y = x + self.f(x)
        y = y + self.g(y)
        return self.h(x + y)


def test_counts_by_hand():
    G = fxnx.convert(small_net(), torch.zeros(1, 2, 8, 8, dtype=torch.float64))
    assert path_length_counts(G) == {0: 1, 1: 3, 2: 3, 3: 1}
    # along the outer skip: 1 path of length 0; through the outer branch (1), then each inner
    # block's skip or branch: lengths 1, 2, 2, 3
    G = fxnx.convert(Nested(), torch.zeros(1, 3))
    assert path_length_counts(G) == {0: 1, 1: 1, 2: 2, 3: 1}
    G = fxnx.convert(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), torch.zeros(1, 3))
    assert path_length_counts(G) == {0: 1}
