"""Skip connections and summaries, against facts about each architecture."""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch
from torch import nn

import fxnx
import fxnx._analysis

from zoo import CASES


def _zoo(name):
    case = CASES[name]
    return fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())


def test_resnet18_has_8_skips_3_with_downsample(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    skips = fxnx.skip_connections(G)
    assert [s.merge for s in skips] == ["add"] + [f"add_{i}" for i in range(1, 8)]
    projections = [s for s in skips if not s.identity]
    assert [s.skip for s in projections] == [
        (f"layer{i}_0_downsample_0", f"layer{i}_0_downsample_1") for i in (2, 3, 4)
    ]
    first = skips[0]
    assert (first.fork, first.skip) == ("maxpool", ())
    assert first.residual == (
        "layer1_0_conv1", "layer1_0_bn1", "layer1_0_relu", "layer1_0_conv2", "layer1_0_bn2",
    )


def test_resnet50_has_16_skips(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet50"), torch.randn(1, 3, 64, 64))
    skips = fxnx.skip_connections(G)
    assert len(skips) == 16
    assert sum(not s.identity for s in skips) == 4  # the first bottleneck of each stage
    assert all(len(s.residual) == 8 for s in skips)  # conv-bn-relu ×2, conv-bn


@pytest.mark.slow
def test_mobilenet_v3_small_finds_its_six_inverted_residuals(torchvision_model):
    # Blocks whose input and output channels match at stride 1: 24→24, 40→40 ×2, 48→48, 96→96 ×2.
    G = fxnx.convert(torchvision_model("mobilenet_v3_small"), torch.randn(1, 3, 64, 64))
    skips = fxnx.skip_connections(G)
    assert len(skips) == 6
    assert all(s.identity for s in skips)
    # torchvision writes `result += input`; an fx Proxy has no __iadd__, so it records an add.
    assert {G.nodes[s.merge]["target"] for s in skips} == {"operator.add"}


@pytest.mark.slow
def test_densenet121_concatenations_are_merges(torchvision_model):
    # Blocks of 6, 12, 24, 16 layers: layer k>1 concatenates k inputs, each block ends in one
    # more cat; the first layer's cat of a single tensor is no merge. 5 + 11 + 23 + 15 + 4 = 58.
    # Concatenations are parallel branches, not residuals: none by default.
    G = fxnx.convert(torchvision_model("densenet121"), torch.randn(1, 3, 64, 64))
    assert fxnx.skip_connections(G) == []
    skips = fxnx.skip_connections(G, "all")
    assert len(skips) == 58
    assert {G.nodes[s.merge]["target"] for s in skips} == {"torch.cat"}
    assert {s.kind for s in skips} == {"parallel"}


@pytest.mark.slow
def test_vit_has_two_residuals_per_layer_and_no_skip_at_the_embedding(torchvision_model):
    G = fxnx.convert(torchvision_model("vit_b_16"), torch.randn(1, 3, 224, 224))
    skips = fxnx.skip_connections(G)
    assert len(skips) == 24
    assert all(G.nodes[s.merge]["scope"].startswith("encoder.layers.") for s in skips)


def test_plain_vgg_has_none():
    import torchvision

    G = fxnx.convert(torchvision.models.vgg11(weights=None), torch.randn(1, 3, 32, 32))
    assert fxnx.skip_connections(G) == []


def test_nested_skips_are_both_found():
    inner, outer = fxnx.skip_connections(_zoo("nested_skip"))
    assert (inner.fork, inner.merge, inner.skip, inner.residual) == (
        "x", "add", (), ("inner_lin", "relu"),
    )
    assert (outer.fork, outer.merge, outer.skip, outer.residual) == (
        "x", "add_1", (), ("inner_lin", "relu", "add", "proj"),
    )


@pytest.mark.parametrize("name", ["add_self", "mul_self", "get_attr_param", "cat_chunk"])
def test_no_skip_where_nothing_forks_and_rejoins_through_an_add(name):
    # x + x adds one tensor to itself; cat_chunk's cat rejoins chunk's halves (a fork at chunk).
    skips = fxnx.skip_connections(_zoo(name), "all")
    if name == "cat_chunk":
        assert [(s.fork, s.merge, s.kind) for s in skips] == [("chunk", "cat", "parallel")]
    else:
        assert skips == []


def test_adding_a_parameter_is_not_a_skip():
    class PosEmbed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return x.relu() + self.pos

    assert fxnx.skip_connections(fxnx.convert(PosEmbed(), torch.randn(2, 4))) == []


def test_skip_connections_without_shapes_match_with_shapes(torchvision_model):
    model = torchvision_model("resnet18")
    with_shapes = fxnx.skip_connections(fxnx.convert(model, torch.randn(1, 3, 64, 64)))
    assert fxnx.skip_connections(fxnx.convert(model)) == with_shapes


def test_summary_of_skip_block():
    info = fxnx.summary(_zoo("skip_block"))
    assert info["nodes"] == 5 and info["edges"] == 5
    assert info["depth"] == 4  # x → lin → relu → add → output
    assert info["num_params"] == 20
    assert info["skip_connections"] == 1 and info["identity_skips"] == 1
    assert info["census"] == {"call_function": 2, "call_module": 1, "output": 1, "placeholder": 1}


def test_summary_of_resnet18(torchvision_model):
    model = torchvision_model("resnet18")
    info = fxnx.summary(fxnx.convert(model, torch.randn(1, 3, 224, 224)))
    assert info["num_params"] == sum(p.numel() for p in model.parameters())
    assert info["largest_activation"] == {
        "node": "conv1", "shape": (1, 64, 112, 112), "nbytes": 64 * 112 * 112 * 4,
    }
    assert info["targets"]["torch.nn.modules.conv.Conv2d"] == 20
    text = fxnx._analysis.format_summary(info)
    assert ("skip connections      8 (5 identity, 3 with a projection; 0 other parallel branches)"
            in text)
    assert "11,689,512" in text


def test_topological_order_breaks_ties_by_fx_order():
    G = nx.MultiDiGraph([("x", "b"), ("x", "a")])
    nx.set_node_attributes(G, {"x": 0, "b": 1, "a": 2}, "order")
    assert fxnx.topological_order(G) == ["x", "b", "a"]


def test_skip_roles_are_written_onto_g_as_plain_data(tmp_path):
    from conftest import assert_graph_plain

    G = _zoo("nested_skip")
    fxnx.skip_connections(G)
    roles = dict(G.nodes(data="branch_role"))
    assert roles == {"x": "fork", "inner_lin": "residual", "relu": "residual", "add": "merge",
                     "proj": "residual", "add_1": "merge", "output": None}
    assert G.nodes["inner_lin"]["branch_merge"] == "add"  # the innermost skip names it
    assert G.nodes["proj"]["branch_merge"] == "add_1"
    edges = {(u, v): (d.get("branch_role"), d.get("branch_merge")) for u, v, d in G.edges(data=True)}
    assert edges[("x", "add")] == ("skip", "add")
    assert edges[("x", "add_1")] == ("skip", "add_1")
    assert edges[("x", "inner_lin")] == ("residual", "add")
    assert edges[("add", "proj")] == ("residual", "add_1")
    assert edges[("add_1", "output")] == (None, None)
    assert G.graph["skip_connections"][1] == {
        "merge": "add_1", "fork": "x", "skip": [], "residual": ["inner_lin", "relu", "add", "proj"],
        "kind": "identity",
    }
    assert_graph_plain(G)
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    H = fxnx.read_pickle(tmp_path / "g.pkl")
    assert [d for *_, d in H.edges(data="branch_role")] == [d for *_, d in G.edges(data="branch_role")]


def test_resnet18_downsample_edges_are_skip_edges(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 32, 32))
    fxnx.skip_connections(G)
    skip_edges = {(u, v) for u, v, r in G.edges(data="branch_role") if r == "skip"}
    assert ("layer1_1_relu_1", "layer2_0_downsample_0") in skip_edges
    assert ("layer2_0_downsample_1", "add_2") in skip_edges
    assert ("maxpool", "add") in skip_edges
    assert len(skip_edges) == 5 + 3 * 3  # one edge per identity skip, three per downsample
    assert sum(r == "merge" for _, r in G.nodes(data="branch_role")) == 8


def test_annotations_are_refreshed_after_an_edit():
    G = _zoo("skip_block")
    fxnx.skip_connections(G)
    G.remove_edge("x", "add")
    assert fxnx.skip_connections(G) == []
    assert all(r is None for _, r in G.nodes(data="branch_role"))
    assert "skip_connections" not in G.graph  # none found: no empty list


def test_scope_subgraph_of_a_densenet_block(torchvision_model):
    G = fxnx.convert(torchvision_model("densenet121"), torch.randn(1, 3, 32, 32))
    block = fxnx.scope_subgraph(G, "features.denseblock1", inputs=False)
    assert {d["scope"].split(".")[1] for _, d in block.nodes(data=True)} == {"denseblock1"}
    assert sum(d["target"] == "torch.cat" for _, d in block.nodes(data=True)) == 7
    with_inputs = fxnx.scope_subgraph(G, "features.denseblock1")
    assert set(with_inputs) - set(block) == {"features_pool0"}
    with pytest.raises(fxnx.errors.FxnxValueError, match="no node of G is inside scope 'features.nope'"):
        fxnx.scope_subgraph(G, "features.nope")


def test_summary_only_reads_g():
    G = _zoo("nested_skip")
    before = copy.deepcopy((G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))))
    assert fxnx.summary(G)["skip_connections"] == 2
    assert (G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))) == before


class _SkipWrittenAnyWay(nn.Module):
    def __init__(self, how: int) -> None:
        super().__init__()
        self.f, self.id, self.how = nn.Linear(4, 4), nn.Identity(), how

    def forward(self, x):
        if self.how == 0:
            return self.f(x) + self.id(x)
        if self.how == 1:
            kept = self.id(x)
            return self.f(x) + kept
        if self.how == 2:
            return self.f(x) + x.float()
        return self.f(x) + x.contiguous().reshape(3, 4)


@pytest.mark.parametrize("how", range(4))
def test_the_identity_branch_is_the_skip_however_the_sum_is_written(how):
    """``f(x) + id(x)`` with ``id`` an ``nn.Identity`` (or a cast, or a reshape): a linear
    layer and the identity made branches of equal length, and graph order picked the skip, so
    written one way the residual was missed ("parallel", no skip drawn, paths {0: 2}) and the
    other way found. Oracle by hand: the identity is the skip, the layer the residual branch,
    one path through no residual branch and one through it."""
    G = fxnx.convert(_SkipWrittenAnyWay(how), torch.randn(3, 4))
    (skip,) = fxnx.skip_connections(G)
    assert skip.kind == "identity" and skip.residual == ("f",)
    assert all(G.nodes[n]["op"] != "call_module" or n.startswith("id") for n in skip.skip)
    assert fxnx.path_length_counts(G) == {0: 1, 1: 1}


def _one_block():
    """x -> conv -> add(x): one identity residual, counted by hand."""
    G = nx.MultiDiGraph([("x", "conv"), ("conv", "add"), ("x", "add"), ("add", "output")])
    nx.set_node_attributes(G, "call_module", "op")
    G.nodes["add"].update(op="call_function", target="operator.add")
    G.nodes["conv"].update(num_params=9, scope="block")
    G.nodes["add"]["scope"] = "block"
    return G


def test_marks_written_before_an_edit_are_not_drawn_nor_kept_by_a_subgraph():
    """``skip_connections(G)`` marks ``G``; an edge removed afterwards (cutting the skip, as the
    README's credit section does) left the marks: drawings and ``scope_subgraph`` trusted
    them and showed a merge where there is none. Both mark afresh, on a copy. Oracle: by
    hand, the block's only skip is the cut edge, so nothing is a merge."""
    G = _one_block()
    fxnx.skip_connections(G)
    assert fxnx.to_pydot(G).get_node("add")[0].get("peripheries") == "2"  # the merge, marked
    G.remove_edge("x", "add")
    before = copy.deepcopy(dict(G.nodes(data=True))), copy.deepcopy(G.graph)
    assert fxnx.to_pydot(G).get_node("add")[0].get("peripheries") is None
    sub = fxnx.scope_subgraph(G, "block")
    assert sub.nodes["add"]["branch_role"] is None and "skip_connections" not in sub.graph
    assert (dict(G.nodes(data=True)), G.graph) == before  # G itself is left as it was


def test_a_view_is_not_annotated_through_to_the_graph_it_views():
    """A subgraph view shares its graph's node and graph attributes: ``skip_connections``
    annotating one wrote its finds into the whole graph (6 of ResNet-18's 8 kept in
    ``G.graph``, silently). It is refused, saying what to do; a copy is annotated."""
    G = _one_block()
    fxnx.skip_connections(G)
    view = G.subgraph(["x", "conv"])
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"view of another graph.*\.copy\(\)"):
        fxnx.skip_connections(view)
    assert len(G.graph["skip_connections"]) == 1
    assert fxnx.skip_connections(view, annotate=False) == []
    copied = view.copy()
    assert fxnx.skip_connections(copied) == [] and len(G.graph["skip_connections"]) == 1


def _numel(shape):
    return int(torch.Size(shape).numel())


@pytest.mark.parametrize("how", [{}, {"routes": ("export",)}, {"level": "aten"}, {"level": "joint"}])
def test_the_largest_activation_is_no_weight_nor_made_from_weights_alone(how):
    """A big embedding table and a weight's transpose (ATen graphs) are not activations.
    Oracle: the biggest output forward hooks see on every module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5000, 8), nn.Linear(8, 16), nn.ReLU())
    ids = torch.randint(0, 5000, (2, 4))
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, out: seen.append(out.nbytes)) for m in model]
    model(ids)
    for hook in hooks:
        hook.remove()
    largest = fxnx.summary(fxnx.convert(model, ids, **how))["largest_activation"]
    assert largest["nbytes"] == max(seen) == 2 * 4 * 16 * 4
    assert _numel(largest["shape"]) == 2 * 4 * 16  # (8, 16) at ATen level: addmm's


class _Masked(nn.Module):
    """A causal-mask buffer (GPT-2's attn.bias) doubled: a value made from a buffer alone."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(64, 64)))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + (self.mask * 2.0)[:4, :8]


@pytest.mark.parametrize("how", [{}, {"routes": ("export",)}, {"level": "aten"}, {"level": "joint"}])
def test_a_value_made_from_a_buffer_alone_is_no_activation(how):
    """Oracle: by hand, the biggest value computed from x is lin's output or the sum, 4×8."""
    largest = fxnx.summary(fxnx.convert(_Masked(), torch.randn(4, 8), **how))["largest_activation"]
    assert largest["nbytes"] == 4 * 8 * 4
