"""Costs convert records: FLOPs and multiply-adds, trainable parameters, kernel windows.

Oracles: ``torch.utils.flop_counter.FlopCounterMode`` run on the eager model with real
inputs (its total, and its per-module counts); multiply-adds counted by hand; the
modules' own attributes for kernel windows; ``requires_grad`` counted by hand.
"""

from __future__ import annotations

import pickle

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import fxnx
import fxnx._convert
from fxnx import _costs
from fxnx._capture import capture
from fxnx.frames import cost_summary, module_costs

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def _oracle(model, *inputs, backward=False):
    """FlopCounterMode on the eager model, attention on torch's math kernel (see docs/graph.md:
    FlopCounterMode counts no FLOPs for the CPU's flash-attention kernel)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        if backward:
            outs = [v for v in (out if isinstance(out, tuple) else out.values()
                                if isinstance(out, dict) else [out])
                    if isinstance(v, torch.Tensor) and v.is_floating_point()]
            torch.autograd.backward(outs, [torch.ones_like(v) for v in outs])
    return counter


def _tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=100)
    return transformers.BertModel(config).eval(), (torch.randint(0, 100, (2, 16)),)


def _model(name, torchvision_model):
    torch.manual_seed(0)
    if name == "timm_resnet18":
        return timm.create_model("resnet18", pretrained=False).eval(), (torch.randn(2, 3, 64, 64),)
    if name == "timm_vit_tiny":
        return (timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64).eval(),
                (torch.randn(2, 3, 64, 64),))
    if name == "hf_bert":
        return _tiny_bert()
    size = 224 if name == "vit_b_16" else 64
    return torchvision_model(name), (torch.randn(1, 3, size, size),)


CAPTURES = [{}, {"level": "aten"}, {"level": "joint"}, {"routes": "export"}]
MODELS = ["resnet18", "mobilenet_v3_small", "vit_b_16", "timm_resnet18", "timm_vit_tiny", "hf_bert"]


@pytest.mark.parametrize("name", MODELS)
def test_flops_equal_flop_counter_mode_in_total_and_per_module(name, torchvision_model):
    model, inputs = _model(name, torchvision_model)
    G = fxnx.convert(model, *inputs)
    counter = _oracle(model, *inputs)
    assert G.graph["flops"] == counter.get_total_flops() > 0
    assert G.graph["flops"] == sum(flops for _, flops in G.nodes(data="flops"))
    # Every module FlopCounterMode saw, and no other, counts the same FLOPs.
    root = type(model).__name__
    theirs = {
        "" if path == root else path.removeprefix(root + "."): sum(ops.values())
        for path, ops in counter.get_flop_counts().items() if path != "Global"
    }
    ours = {row["module"]: row["flops"] for row in module_costs(G) if row["flops"]}
    # A container no node calls (BERT's encoder.layer, an nn.ModuleList) is no call
    # FlopCounterMode sees: its row holds what its members' rows hold.
    containers = {path for path in ours if path not in theirs}
    for path in containers:
        assert type(model.get_submodule(path)).forward is torch.nn.Module.forward  # no forward of its own
        members = [flops for child, flops in theirs.items() if child.rpartition(".")[0] == path]
        assert ours[path] == sum(members)
    assert {p: f for p, f in ours.items() if p not in containers} == {path: flops for path, flops in theirs.items() if flops}


@pytest.mark.parametrize("level", ["aten", "joint"])
def test_aten_and_joint_graphs_count_forward_and_backward(level, torchvision_model):
    model, x = torchvision_model("resnet18"), torch.randn(2, 3, 32, 32)
    G = fxnx.convert(model, x, level=level)
    forward = _oracle(model, x).get_total_flops()
    both = _oracle(model, x.clone().requires_grad_(), backward=True).get_total_flops()
    summary = cost_summary(G)
    assert summary["forward_flops"] == forward
    assert summary["flops"] == G.graph["flops"] == (both if level == "joint" else forward)
    assert summary["backward_flops"] == (both - forward if level == "joint" else 0)
    assert both > 2 * forward  # the backward pass counts: input and weight gradients


def test_joint_transformer_graph_counts_its_backward():
    """Captured with attention on the math kernel, the joint graph holds its matrix products."""
    model, (ids,) = _tiny_bert()
    with sdpa_kernel(SDPBackend.MATH):
        G = fxnx.convert(model, ids, level="joint")
    assert G.graph["flops"] == _oracle(model, ids, backward=True).get_total_flops()


def test_cpu_flash_attention_counts_as_its_matrix_products():
    """An ATen graph captured on the CPU holds torch's CPU flash-attention kernel, which
    FlopCounterMode has no formula for: fxnx counts it as the math kernel's matmuls."""
    model, (ids,) = _tiny_bert()
    G = fxnx.convert(model, ids, level="aten")
    attention = [n for n, target in G.nodes(data="target") if "flash_attention_for_cpu" in target]
    assert len(attention) == 2
    assert G.graph["flops"] == _oracle(model, ids).get_total_flops()
    # Two batched products of (2*4 heads) x 16 x 16 by 16 x 16, two FLOPs per multiply-add.
    assert all(G.nodes[n]["flops"] == 2 * (2 * 2 * 4 * 16 * 16 * 16) for n in attention)
    with FlopCounterMode(display=False) as plain:  # what FlopCounterMode counts for it
        model(ids)
    assert plain.get_total_flops() == G.graph["flops"] - sum(G.nodes[n]["flops"] for n in attention)
    # Backward, torch's flash formula: five such products (the scores are computed again).
    J = fxnx.convert(model, ids, level="joint")
    backward = [n for n, target in J.nodes(data="target") if "flash_attention_for_cpu_backward" in target]
    assert len(backward) == 2
    assert all(J.nodes[n]["flops"] == 5 * (2 * 2 * 4 * 16 * 16 * 16) for n in backward)


def test_a_count_that_fails_while_propagating_is_made_again_on_meta_tensors(monkeypatch):
    def fails(self, func, types, args=(), kwargs=None):
        raise RuntimeError("this dispatch mode cannot run here")

    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.randn(1, 3, 8, 8)
    monkeypatch.setattr(_costs._Counter, "__torch_dispatch__", fails)
    G = fxnx.convert(model, x)
    assert G.graph["shape_source"] == "ShapeProp" and G.nodes["_0"]["out_shape"] == (1, 4, 6, 6)
    assert G.graph["flops"] == _oracle(model, x).get_total_flops() == 2 * (4 * 6 * 6) * (3 * 9)


@pytest.mark.parametrize("how", ["fake", "input_shape", "meta_model"])
def test_fake_and_meta_graphs_count_the_same(how, torchvision_model):
    model, x = torchvision_model("resnet18"), torch.randn(2, 3, 32, 32)
    expected = _oracle(model, x).get_total_flops()
    if how == "fake":
        G = fxnx.convert(model, x, fake=True)
    elif how == "input_shape":
        G = fxnx.convert(model, input_shape=(2, 3, 32, 32))
    else:
        G = fxnx.convert(_meta_resnet18(), input_shape=(2, 3, 32, 32))
        assert G.graph["shape_source"] == "meta"
    assert G.graph["flops"] == expected


def _meta_resnet18():
    import torchvision

    with torch.device("meta"):
        return torchvision.models.resnet18(weights=None).eval()


def test_without_example_inputs_flops_are_none():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    G = fxnx.convert(model)
    assert G.graph["flops"] is None and G.graph["macs"] is None
    assert all(d["flops"] is None and d["macs"] is None for _, d in G.nodes(data=True))
    assert G.graph["trainable_params"] == 3 * 4 * 9 + 4
    assert G.nodes["_0"]["kernel"]["kernel_size"] == (3, 3)  # read from the layer, no shapes needed
    fxnx.validate(G)


class _ReadsAValue(nn.Module):
    def forward(self, x):
        return x.mm(x.t()) * x.sum().item()  # a value read into Python


def test_a_value_read_into_python_is_counted_where_shapes_are_propagated():
    G = fxnx.convert(_ReadsAValue(), torch.ones(3, 4))
    assert G.graph["capture"] == "symbolic_trace"
    assert G.nodes["mm"]["flops"] == G.graph["flops"] == 2 * 3 * 4 * 3


def test_a_node_the_metadata_cannot_replay_is_none_and_so_is_the_total():
    """graph_from_capture counts an already propagated capture on meta tensors, which hold
    no values: .item() has none to give."""
    cap = capture(_ReadsAValue(), (torch.ones(3, 4),))
    G = fxnx._convert.graph_from_capture(cap)
    flops = dict(G.nodes(data="flops"))
    assert flops["mm"] == 2 * 3 * 4 * 3  # still counted: its inputs are tensors of known shape
    assert flops["item"] is None and flops["mul"] is None
    assert G.graph["flops"] is None and G.graph["macs"] is None
    fxnx.validate(G)


@pytest.mark.parametrize("name", ["resnet18", "hf_bert"])
def test_counting_a_capture_on_meta_tensors_agrees_with_counting_its_propagation(
    name, torchvision_model
):
    model, inputs = _model(name, torchvision_model)
    H = fxnx._convert.graph_from_capture(capture(model, inputs))
    G = fxnx.convert(model, *inputs)
    assert dict(H.nodes(data="flops")) == dict(G.nodes(data="flops"))
    assert H.graph["flops"] == G.graph["flops"] == _oracle(model, *inputs).get_total_flops()


def test_macs_are_multiply_adds_counted_by_hand():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, groups=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, groups=4), nn.Flatten(), nn.LazyLinear(5))
    x = torch.randn(2, 3, 10, 10)
    model(x)  # materialise the lazy layer
    G = fxnx.convert(model, x)
    # output elements x (input channels per group x kernel area)
    conv0 = (2 * 8 * 10 * 10) * (3 * 3 * 3)
    conv2 = (2 * 8 * 4 * 4) * (2 * 3 * 3)
    linear = 2 * (8 * 4 * 4) * 5
    assert [G.nodes[n]["macs"] for n in ("_0", "_1", "_2", "_4")] == [conv0, 0, conv2, linear]
    assert G.graph["macs"] == conv0 + conv2 + linear
    assert all(d["flops"] == 2 * d["macs"] for _, d in G.nodes(data=True))


@pytest.mark.parametrize("capture", CAPTURES, ids=["module", "aten", "joint", "export"])
def test_trainable_parameters_after_freezing(capture):
    torch.manual_seed(0)
    import torchvision

    model = torchvision.models.resnet18(weights=None).eval()
    for p in [*model.conv1.parameters(), *model.layer1.parameters(), model.fc.bias]:
        p.requires_grad_(False)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < total
    G = fxnx.convert(model, torch.randn(1, 3, 32, 32), **capture)
    assert G.graph["num_params"] == total
    assert G.graph["trainable_params"] == trainable
    assert sum(d["trainable_params"] for _, d in G.nodes(data=True)) == trainable
    rows = {row["module"]: row for row in module_costs(G)}
    assert rows["layer1"]["trainable_params"] == 0
    assert rows["layer1"]["params"] == sum(p.numel() for p in model.layer1.parameters())
    assert rows["fc"]["trainable_params"] == model.fc.weight.numel()


def _window(module, dims):
    """A layer's window, from its own attributes (ints spelt out per dimension)."""
    def per_dim(value):
        return tuple(value) if isinstance(value, tuple) else (value,) * dims

    conv = hasattr(module, "transposed")
    return {
        "kernel_size": per_dim(module.kernel_size),
        "stride": per_dim(module.stride if module.stride is not None else module.kernel_size),
        "padding": module.padding if isinstance(module.padding, str) else per_dim(module.padding),
        "dilation": per_dim(getattr(module, "dilation", 1)),
        "groups": module.groups if conv else None,
        "transposed": conv and module.transposed,
    }


class _Windows(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=3)
        self.same = nn.Conv1d(6, 6, 3, padding="same", dilation=2)
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.max = nn.MaxPool2d(3, stride=2, padding=1, dilation=1)
        self.avg = nn.AvgPool2d(2)
        self.deep = nn.Conv3d(4, 2, 1)
        self.avg3 = nn.AvgPool3d((1, 2, 2))

    def forward(self, x):
        y = self.conv(x)
        b, c, h, w = y.shape
        y = self.same(y.flatten(2)).view(b, c, h, w)
        y = self.avg(self.max(self.up(y)))
        return self.avg3(self.deep(y.unsqueeze(2)))


@pytest.mark.parametrize("capture", CAPTURES, ids=["module", "aten", "joint", "export"])
def test_kernel_windows_are_the_layers_own(capture):
    model = _Windows().eval()
    G = fxnx.convert(model, torch.randn(1, 3, 12, 12), **capture)
    layers = {name: m for name, m in model.named_modules() if name}
    windows = [(n, d) for n, d in G.nodes(data=True) if d["kernel"] is not None]
    assert len(windows) == len(layers)
    for node, data in windows:
        # module level: the node calls the layer; ATen level: the operator runs in its scope
        path = data["target"] if data["op"] == "call_module" else data["scope"]
        dims = {"same": 1, "deep": 3, "avg3": 3}.get(path, 2)
        expected = _window(layers[path], dims)
        if path == "same" and capture.get("level"):  # make_fx gives the padding it works out
            expected["padding"] = (2,)  # dilation 2 x (3 - 1) / 2 on each side
        assert data["kernel"] == expected, node
        assert data["phase"] == "forward"
    assert {d["scope"] for _, d in windows if d["op"] != "call_module"} <= set(layers)


def test_kernel_windows_of_functions_are_their_arguments():
    class Functional(nn.Module):
        def forward(self, x, w):
            y = F.conv2d(x, w, stride=2, padding=1, dilation=1, groups=1)
            y = F.max_pool2d(y, 2, 1)
            return F.avg_pool2d(y, kernel_size=(2, 1), padding=(1, 0)), F.conv_transpose2d(y, w)

    x, w = torch.randn(1, 3, 9, 9), torch.randn(4, 3, 3, 3)
    G = fxnx.convert(Functional(), x, w)
    kernels = {n: d["kernel"] for n, d in G.nodes(data=True) if d["kernel"]}
    assert kernels == {
        "conv2d": {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1), "dilation": (1, 1),
                   "groups": 1, "transposed": False},
        "max_pool2d": {"kernel_size": (2, 2), "stride": (1, 1), "padding": (0, 0),
                       "dilation": (1, 1), "groups": None, "transposed": False},
        "avg_pool2d": {"kernel_size": (2, 1), "stride": (2, 1), "padding": (1, 0),
                       "dilation": (1, 1), "groups": None, "transposed": False},
        "conv_transpose2d": {"kernel_size": (3, 3), "stride": (1, 1), "padding": (0, 0),
                             "dilation": (1, 1), "groups": 1, "transposed": True},
    }


class _Caches(nn.Module):
    """A layer that keeps state from its forward: the FLOP count must not leave meta tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.last = x
        self.register_buffer("seen", x.detach())
        return self.lin(x)


def test_counting_leaves_the_model_and_random_state_alone():
    model = nn.Sequential(_Caches(), nn.Dropout(0.5)).train()
    x = torch.randn(2, 4)
    state = torch.get_rng_state()
    G = fxnx.convert(model, x, leaf_modules=[_Caches])
    assert G.nodes["_0"]["flops"] == 2 * 2 * 4 * 4
    assert torch.equal(torch.get_rng_state(), state)
    leaf = model[0]
    assert not leaf.last.is_meta and not leaf.seen.is_meta and not leaf.lin.weight.is_meta
    model(x)  # still runs on real tensors


def test_graphs_with_costs_load_and_older_graphs_without_them_validate(tmp_path):
    G = fxnx.convert(nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2)), torch.randn(1, 1, 8, 8))
    fxnx.write_json(G, tmp_path / "g.json")
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    for H in (fxnx.read_json(tmp_path / "g.json"), fxnx.read_pickle(tmp_path / "g.pkl")):
        assert dict(H.nodes(data=True)) == dict(G.nodes(data=True))
        assert H.graph["flops"] == G.graph["flops"]
    old = pickle.loads(pickle.dumps(G))
    for attribute in ("flops", "macs", "trainable_params"):
        del old.graph[attribute]
    for _, data in old.nodes(data=True):
        for attribute in ("flops", "macs", "trainable_params", "kernel"):
            del data[attribute]
    fxnx.validate(old)  # made before costs: none of them required


BROKEN = {
    "node without flops": (lambda G: G.nodes["_0"].pop("flops"),
                           r"node '_0' lacks attribute 'flops' \(when G.graph has flops"),
    "negative flops": (lambda G: G.nodes["_0"].__setitem__("flops", -1),
                       r"'flops' must be an int >= 0 or None, got int -1"),
    "float macs": (lambda G: G.graph.__setitem__("macs", 1.5), r"'macs' must be an int >= 0 or None"),
    "kernel as a list": (lambda G: G.nodes["_0"]["kernel"].__setitem__("stride", [1, 1]),
                         r"'kernel' must be None or a \{kernel_size, stride.*got list \[1, 1\] at \['stride'\]"),
    "kernel missing groups": (lambda G: G.nodes["_0"]["kernel"].pop("groups"), r"'kernel' must be None or a"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_costs_are_named(case):
    G = fxnx.convert(nn.Sequential(nn.Conv2d(1, 2, 3)), torch.randn(1, 1, 5, 5))
    edit, message = BROKEN[case]
    edit(G)
    with pytest.raises(fxnx.errors.GraphContractError, match=message):
        fxnx.validate(G)


def test_costs_are_plain_data_and_on_every_node(torchvision_model):
    G = fxnx.convert(torchvision_model("mobilenet_v3_small"), torch.randn(1, 3, 32, 32))
    for _, data in G.nodes(data=True):
        assert {"flops", "macs", "trainable_params", "kernel"} <= set(data)
    assert nx.is_directed_acyclic_graph(G)
    fxnx.validate(G)


class _TiedHead(nn.Module):
    """An embedding and an output layer sharing one weight, inside a block of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleDict({"e": nn.Embedding(50, 8), "mid": nn.Linear(8, 8)})
        self.h = nn.Linear(8, 50, bias=False)
        self.h.weight = self.body["e"].weight

    def forward(self, x):
        return self.h(torch.tanh(self.body["mid"](self.body["e"](x))))


@pytest.mark.parametrize("routes", ["symbolic_trace", "export"])
def test_a_tied_weight_counts_once_in_every_module_around_both_owners(routes):
    """Tied weights (an embedding and the output layer): each module row summed its owners'
    parameters, so the model's row counted the shared weight twice (800 for 400 on a tied
    embedding; GPT-2's root row 32,896 for 29,696), disagreeing with the table's own total.
    G records the tie (``tied_parameters``) and each row counts it once. Oracle: torch's own
    ``module.parameters()``, which counts a tensor once, for every module of the table."""
    torch.manual_seed(0)
    model, x = _TiedHead(), torch.randint(0, 50, (2, 5))
    model.body["mid"].weight.requires_grad_(False)
    G = fxnx.convert(model, x, routes=routes)
    assert G.graph["tied_parameters"] == {"h.weight": {"same_as": "body.e.weight", "numel": 400, "trainable": True}}
    fxnx.validate(G)
    for row in module_costs(G):
        params = list(model.get_submodule(row["module"]).parameters())
        assert row["params"] == sum(p.numel() for p in params), row["module"]
        assert row["trainable_params"] == sum(p.numel() for p in params if p.requires_grad), row["module"]
    assert module_costs(G)[0]["params"] == G.graph["num_params"] == 400 + 72


def test_gpt2s_tied_head_counts_once():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    G = fxnx.convert(model, torch.randint(0, 100, (2, 8)))
    rows = {row["module"]: row["params"] for row in module_costs(G, depth=1)}
    assert rows == {path: sum(p.numel() for p in model.get_submodule(path).parameters()) for path in rows}
    assert rows[""] == G.graph["num_params"]


class _WeightReadAgain(nn.Module):
    """An embedding called whole whose weight the output reads again (``h @ emb.weight.T``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l = nn.Embedding(10, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.l(self.emb(x)) @ self.emb.weight.T


def test_a_weight_of_a_module_the_graph_calls_counts_once_where_it_is_read_again():
    """The embedding's node and the ``get_attr`` of its weight each counted the weight for
    the module (the model's row 100 for 60). Oracle: ``module.parameters()`` for every row."""
    model = _WeightReadAgain()
    G = fxnx.convert(model, torch.randint(0, 10, (2, 3)))
    for row in module_costs(G):
        assert row["params"] == sum(p.numel() for p in model.get_submodule(row["module"]).parameters()), row["module"]
