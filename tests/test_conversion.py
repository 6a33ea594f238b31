"""fxnx.convert against the oracles: the fx graph itself, ShapeProp, and forward hooks."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torchvision
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

import fxnx

from conftest import TORCHVISION, assert_graph_plain, assert_graphs_equal
from zoo import CASES, NestedSkip, SkipBlock


def _convert_case(name: str):
    case = CASES[name]
    torch.manual_seed(0)
    return fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs()), case


# --- the zoo: exact nodes and edges, written by hand ------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_zoo_nodes_and_edges_are_exact(name):
    G, case = _convert_case(name)
    assert [(n, d["op"], d["target"]) for n, d in G.nodes(data=True)] == case.nodes
    got = Counter((u, v, k, arg) for u, v, k, arg in G.edges(keys=True, data="arg"))
    assert got == Counter(case.edges)
    assert [d["order"] for _, d in G.nodes(data=True)] == list(range(len(case.nodes)))


@pytest.mark.parametrize("name", CASES)
def test_zoo_graphs_are_plain_data(name):
    assert_graph_plain(_convert_case(name)[0])


@pytest.mark.parametrize("name", CASES)
def test_zoo_conversion_is_deterministic(name):
    assert_graphs_equal(_convert_case(name)[0], _convert_case(name)[0])


# --- oracle: an independent symbolic_trace + ShapeProp of the same model ----------------------


def _shape_prop(model, *inputs):
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*inputs)
    return gm


def _occurrence_count(gm: fx.GraphModule) -> int:
    """Occurrences of nodes in every node's args and kwargs, nested containers included."""
    occurrences: list[fx.Node] = []
    for node in gm.graph.nodes:
        fx.node.map_arg((node.args, node.kwargs), occurrences.append)
    return len(occurrences)


def _meta_shape(meta):
    if isinstance(meta, TensorMetadata):
        return tuple(meta.shape), str(meta.dtype)
    if isinstance(meta, (list, tuple)):
        parts = [_meta_shape(m) for m in meta]
        return [p[0] for p in parts], [p[1] for p in parts]
    if isinstance(meta, dict):
        parts_d = {k: _meta_shape(m) for k, m in meta.items()}
        return {k: p[0] for k, p in parts_d.items()}, {k: p[1] for k, p in parts_d.items()}
    return None, None


def _check_against_shape_prop(G, gm):
    nodes = list(gm.graph.nodes)
    assert list(G.nodes) == [n.name for n in nodes]
    assert Counter(d["op"] for _, d in G.nodes(data=True)) == Counter(n.op for n in nodes)
    assert G.number_of_edges() == _occurrence_count(gm)
    by_name = {n.name: n for n in nodes}
    for u, v, data in G.edges(data=True):
        shape, dtype = _meta_shape(by_name[u].meta.get("tensor_meta"))
        assert data["shape"] == shape, (u, v)
        assert data["dtype"] == dtype, (u, v)
        assert by_name[u] in by_name[v].all_input_nodes
    for n in nodes:
        assert (G.nodes[n.name]["out_shape"], G.nodes[n.name]["out_dtype"]) == _meta_shape(
            n.meta.get("tensor_meta")
        )


@pytest.mark.parametrize("name", CASES)
def test_zoo_matches_shape_prop(name):
    G, case = _convert_case(name)
    torch.manual_seed(0)
    model = case.build()
    inputs = case.inputs() + tuple(case.kwargs().values())  # ShapeProp takes positional inputs
    if name == "multi_input_kwargs":  # scale is not passed: the oracle traces a call without it
        model = _Calls(model)
    _check_against_shape_prop(G, _shape_prop(model, *inputs))


class _Calls(nn.Module):
    """Calls the model with positional x and y only, so torch.fx traces scale at its default."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x, y)


def _hook_shapes(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Output shape of every module called exactly once, recorded by forward hooks."""
    seen: dict[str, list[tuple[int, ...]]] = {}
    handles = [
        module.register_forward_hook(
            lambda m, args, out, path=path: seen.setdefault(path, []).append(tuple(out.shape))
            if isinstance(out, torch.Tensor)
            else None
        )
        for path, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return {path: shapes[0] for path, shapes in seen.items() if len(shapes) == 1}


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_matches_fx_shape_prop_and_hooks(name, torchvision_model):
    model = torchvision_model(name)
    x = torch.randn(1, 3, 224, 224)
    G = fxnx.convert(model, x)
    _check_against_shape_prop(G, _shape_prop(model, x))
    hooks = _hook_shapes(model, x)
    checked = 0
    for _, data in G.nodes(data=True):
        if data["op"] == "call_module" and data["target"] in hooks:
            assert data["out_shape"] == hooks[data["target"]], data["target"]
            checked += 1
    assert checked > 10
    assert_graph_plain(G)
    assert G.graph["num_params"] == sum(p.numel() for p in model.parameters())


def test_resnet18_census(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 224, 224))
    assert fxnx.census(G) == {"call_module": 60, "call_function": 9, "output": 1, "placeholder": 1}
    functions = Counter(d["target"] for _, d in G.nodes(data=True) if d["op"] == "call_function")
    assert functions == {"operator.add": 8, "torch.flatten": 1}


def test_resnet18_conversion_is_deterministic(torchvision_model):
    model, x = torchvision_model("resnet18"), torch.randn(1, 3, 224, 224)
    assert_graphs_equal(fxnx.convert(model, x), fxnx.convert(model, x))


def test_resnet18_attributes(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(2, 3, 224, 224))
    assert G.graph["model"] == "torchvision.models.resnet.ResNet"
    assert G.graph["capture"] == "symbolic_trace"
    assert G.graph["format_version"] == fxnx.contract.FORMAT_VERSION == 4
    assert G.graph["torch_version"] == torch.__version__
    assert G.graph["inputs"] == [{"name": "x", "shape": (2, 3, 224, 224), "dtype": "torch.float32"}]
    assert G.graph["modules"]["layer1.0"] == "torchvision.models.resnet.BasicBlock"
    conv = G.nodes["layer1_0_conv1"]
    assert conv["module_type"] == "torch.nn.modules.conv.Conv2d"
    assert conv["scope"] == "layer1.0"
    assert conv["num_params"] == 64 * 64 * 3 * 3
    assert conv["node_call_info"] == {"input": "maxpool"}
    assert G.nodes["add"]["scope"] == "layer1.0"
    assert G.nodes["fc"]["scope"] == ""
    assert G.nodes["flatten"]["node_call_info"] == {
        "input": "avgpool",
        "start_dim": 1,
        "end_dim": -1,
    }
    (edge,) = G.get_edge_data("layer1_0_bn2", "add").values()
    assert edge == {"arg": 0, "shape": (2, 64, 56, 56), "dtype": "torch.float32",
                    "nbytes": 2 * 64 * 56 * 56 * 4}


# --- node_call_info ---------------------------------------------------------------------------


def test_call_info_maps_arguments_to_signature_names_with_defaults():
    G, _ = _convert_case("self_attention")
    info = G.nodes["mha"]["node_call_info"]
    assert (info["query"], info["key"], info["value"]) == ("x", "x", "x")
    assert info["need_weights"] is False
    assert info["key_padding_mask"] is None and info["average_attn_weights"] is True
    G, _ = _convert_case("cat_chunk")
    assert G.nodes["cat"]["node_call_info"] == {"tensors": ["getitem_1", "getitem"], "dim": 1}
    assert G.nodes["chunk"]["node_call_info"] == {"self": "x", "chunks": 2, "dim": 1}
    assert G.nodes["getitem_1"]["node_call_info"] == {"a": "chunk", "b": 1}
    G, _ = _convert_case("functional_and_methods")
    assert G.nodes["view"]["node_call_info"] == {"self": "relu", "size": ["size", -1]}
    assert G.nodes["size"]["node_call_info"] == {"self": "relu", "dim": 0}
    assert G.nodes["relu"]["node_call_info"] == {"input": "x", "inplace": False}


def test_non_tensor_nodes_have_no_shape_but_a_type():
    G, _ = _convert_case("functional_and_methods")
    assert G.nodes["size"]["out_shape"] is None and G.nodes["size"]["out_type"] == "int"
    assert G.nodes["dim"]["out_type"] == "int"
    assert G.nodes["view"]["out_shape"] == (2, 12)
    assert G.nodes["output"]["out_shape"] == [(2, 12), None]
    (edge,) = G.get_edge_data("size", "view").values()
    assert edge["shape"] is None and edge["dtype"] is None and edge["nbytes"] is None


def test_multi_output_nodes_list_their_shapes():
    G, _ = _convert_case("cat_chunk")
    assert G.nodes["chunk"]["out_shape"] == [(2, 2), (2, 2)]
    assert G.nodes["chunk"]["out_dtype"] == ["torch.float32", "torch.float32"]
    G, _ = _convert_case("dict_output")
    assert G.nodes["output"]["out_shape"] == {"act": (2, 4), "raw": (2, 4)}


def test_get_attr_parameter_counts_its_elements():
    G, _ = _convert_case("get_attr_param")
    assert G.nodes["w"]["num_params"] == 12
    assert G.nodes["w"]["out_shape"] == (4, 3)
    assert G.graph["num_params"] == 12


def test_edge_bytes_follow_the_dtype():
    model = nn.Linear(3, 5).double()
    G = fxnx.convert(model, torch.zeros(7, 3, dtype=torch.float64))
    (edge,) = G.get_edge_data("linear", "output").values()
    assert edge["dtype"] == "torch.float64"
    assert edge["nbytes"] == 7 * 5 * 8


def test_keyword_inputs_are_bound_to_their_placeholders():
    G, _ = _convert_case("multi_input_kwargs")
    assert G.graph["inputs"] == [
        {"name": "x", "shape": (2, 4), "dtype": "torch.float32"},
        {"name": "y", "shape": (2, 4), "dtype": "torch.float32"},
    ]
    assert G.nodes["mul"]["node_call_info"] == {"a": "x", "b": 2.0}  # scale at its default


class _OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, mask=None, scale=2.0):
        h = self.lin(x)
        if mask is not None:
            h = h * mask
        return h * scale


def test_inputs_not_passed_stay_at_their_defaults_and_are_not_placeholders():
    """Symbolic tracing took `mask is not None` on a placeholder as true, then failed on None."""
    model, x = _OptionalMask(), torch.randn(2, 3)
    G = fxnx.convert(model, x)
    assert [n for n, op in G.nodes(data="op") if op == "placeholder"] == ["x"]
    assert not any("assert" in str(t) for _, t in G.nodes(data="target"))
    assert G.nodes["output"]["out_shape"] is not None
    mask = torch.rand(2, 3)
    with_mask = fxnx.convert(model, x, mask)
    assert [n for n, op in with_mask.nodes(data="op") if op == "placeholder"] == ["x", "mask"]
    res = fxnx.route_credit(G, model, x)
    x_ = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(x_).sum(), x_)
    assert torch.allclose(res.node_credit["x"], want, rtol=0, atol=1e-6)


# --- without example inputs -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["skip_block", "cat_chunk", "self_attention"])
def test_no_example_input_gives_full_structure_without_shapes(name):
    G, case = _convert_case(name)
    H = fxnx.convert(case.build())
    assert list(H.nodes) == list(G.nodes)
    assert sorted(H.edges(keys=True, data="arg"), key=str) == sorted(
        G.edges(keys=True, data="arg"), key=str
    )
    assert all(d["shape"] is None and d["dtype"] is None for *_, d in H.edges(data=True))
    assert all(d["out_shape"] is None for _, d in H.nodes(data=True))
    assert H.graph["shape_source"] is None
    assert_graph_plain(H)


def test_no_example_input_on_resnet18(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"))
    assert fxnx.census(G)["call_module"] == 60
    assert G.graph["inputs"] == [{"name": "x", "shape": None, "dtype": None}]


# --- torch.fx options -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [SkipBlock, "inner"], ids=["by_type", "by_name"])
def test_leaf_modules_keep_a_submodule_whole(spec):
    G = fxnx.convert(NestedSkip(), torch.randn(2, 4), leaf_modules=[spec])
    assert [n for n in G] == ["x", "inner", "proj", "add", "output"]
    assert G.nodes["inner"]["module_type"] == "zoo.SkipBlock"
    assert G.nodes["inner"]["num_params"] == 20
    assert G.nodes["inner"]["out_shape"] == (2, 4)


def test_concrete_args_fix_a_branch():
    class Gated(nn.Module):
        def forward(self, x, use_relu: bool = True):
            return torch.relu(x) if use_relu else torch.sigmoid(x)

    G = fxnx.convert(Gated(), torch.randn(3), concrete_args={"use_relu": False})
    targets = {d["target"] for _, d in G.nodes(data=True)}
    assert "torch.sigmoid" in targets and "torch.relu" not in targets
    assert G.nodes["sigmoid"]["out_shape"] == (3,)


def test_graph_module_is_converted_as_is_and_left_untouched():
    gm = fx.symbolic_trace(CASES["skip_block"].build())
    metas_before = [dict(n.meta) for n in gm.graph.nodes]
    G = fxnx.convert(gm, torch.randn(2, 4))
    assert G.graph["capture"] == "graph_module"
    assert [n for n in G] == [n.name for n in gm.graph.nodes]
    assert G.nodes["add"]["out_shape"] == (2, 4)
    assert [dict(n.meta) for n in gm.graph.nodes] == metas_before


def test_plain_function_converts():
    def f(x, y):
        return torch.sigmoid(x) * y

    G = fxnx.convert(f, torch.randn(2), torch.randn(2))
    assert G.graph["model"].endswith("function")
    assert [n for n in G] == ["x", "y", "sigmoid", "mul", "output"]
    assert G.graph["num_params"] == 0


def test_float64_model_records_float64():
    G = fxnx.convert(nn.Sequential(nn.Linear(2, 3)).double(), torch.zeros(1, 2, dtype=torch.float64))
    assert {d["dtype"] for *_, d in G.edges(data=True)} == {"torch.float64"}
    assert G.nodes["_0"]["out_shape"] == (1, 3)
    assert G.graph["inputs"][0]["dtype"] == "torch.float64"


# --- without real compute: fake tensors and meta-device models ---------------------------------


def _shapes(G):
    nodes = [(n, d["out_shape"], d["out_dtype"], d["out_type"]) for n, d in G.nodes(data=True)]
    edges = sorted((u, v, k, d["shape"], d["dtype"], d["nbytes"]) for u, v, k, d in G.edges(keys=True, data=True))
    return nodes, edges


def test_fake_tensors_give_the_shapes_of_a_real_run(torchvision_model):
    model = torchvision_model("resnet18")
    real = fxnx.convert(model, torch.randn(2, 3, 64, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake = fxnx.convert(model, input_shape=(2, 3, 64, 64), fake=True)
    assert _shapes(fake) == _shapes(real)
    assert fake.graph["shape_source"] == "FakeTensor" and real.graph["shape_source"] == "ShapeProp"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert_graph_plain(fake)


@pytest.mark.parametrize("name", ["resnet50", "vit_b_16"])
def test_a_meta_device_model_converts_with_real_shapes(name, torchvision_model):
    with torch.device("meta"):
        meta_model = torchvision.models.get_model(name, weights=None).eval()
    assert next(meta_model.parameters()).is_meta
    G = fxnx.convert(meta_model, input_shape=(1, 3, 224, 224))
    real = fxnx.convert(torchvision_model(name), torch.randn(1, 3, 224, 224))
    assert _shapes(G) == _shapes(real)
    assert G.graph["shape_source"] == "meta"
    assert G.graph["num_params"] == real.graph["num_params"]
    assert_graph_plain(G)


def test_input_shape_for_several_inputs_and_its_errors():
    def f(x, y):
        return torch.cat([x, y], dim=1)

    G = fxnx.convert(f, input_shape=[(2, 3), (2, 5)], dtype=torch.float64)
    assert G.nodes["cat"]["out_shape"] == (2, 8) and G.nodes["cat"]["out_dtype"] == "torch.float64"
    with pytest.raises(fxnx.errors.FxnxTypeError, match="example inputs or input_shape, not both"):
        fxnx.convert(f, torch.zeros(2, 3), input_shape=[(2, 3), (2, 5)])


def test_converting_leaves_the_garbage_collector_as_it_was():
    import gc

    assert gc.isenabled()
    fxnx.convert(torch.nn.Linear(3, 2), torch.randn(1, 3))
    assert gc.isenabled()
    with pytest.raises(fxnx.errors.ShapePropagationError):
        fxnx.convert(torch.nn.Linear(3, 2), torch.randn(1, 4))
    assert gc.isenabled()
    gc.disable()
    try:
        fxnx.convert(torch.nn.Linear(3, 2), torch.randn(1, 3))
        assert not gc.isenabled()  # a caller who turned it off keeps it off
    finally:
        gc.enable()


class _Named(nn.Module):
    def forward(self, h_2, h=None):  # h_2 is a real input whose name looks like torch.fx's h_1
        return h_2.sin() if h is None else h_2 + h


class _ContainerDefault(nn.Module):
    def forward(self, x, dims=(1, 0), y=None):
        return x.permute(dims).sin() if y is None else x + y


class _Starred(nn.Module):
    def forward(self, x, *args, scale=2.0, **kw):
        return x * scale + sum(args) if args else x * scale


class _Clash(nn.Module):
    def forward(self, mask_1, mask=None):  # torch.fx would name the fixed mask mask_1 too
        return mask_1 * 2 if mask is None else mask_1


@pytest.mark.parametrize(
    "model, extra",
    [(_Named(), ()), (_ContainerDefault(), ()), (_Starred(), ()), (_Starred(), (1,)), (_Clash(), ())],
    ids=["name like h_1", "tuple default", "*args none", "*args one", "name clash"],
)
def test_forward_signatures_convert_and_route_like_the_eager_model(model, extra):
    x = torch.randn(3, 3, dtype=torch.float64)
    extra = tuple(torch.full((3, 3), float(e), dtype=torch.float64) for e in extra)
    G = fxnx.convert(model, x, *extra)
    name = G.graph["inputs"][0]["name"]
    assert G.nodes[name]["out_shape"] == (3, 3)
    res = fxnx.route_credit(G, model, x, *extra)
    x_ = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(x_, *extra).sum(), x_)
    assert torch.allclose(res.node_credit[name], want, rtol=0, atol=1e-12)


def test_convert_takes_captures_options_declared_once():
    import inspect

    convert = inspect.signature(fxnx.convert).parameters
    capture = inspect.signature(fxnx.capture).parameters
    options = [n for n, p in capture.items() if p.kind is p.KEYWORD_ONLY and n != "propagate"]
    assert [n for n, p in convert.items() if p.kind is p.KEYWORD_ONLY and n != "kwargs"] == options
    assert all(convert[n].default == capture[n].default for n in options)
    with pytest.raises(TypeError, match="unexpected keyword argument 'leaf_module'.*leaf_modules"):
        fxnx.convert(torch.nn.Linear(2, 2), torch.zeros(1, 2), leaf_module=["x"])


@pytest.mark.parametrize("level", ["module", "aten", "joint"])
def test_a_module_registered_under_two_names_keeps_its_parameters(level):
    """At ``level="aten"`` and ``"joint"`` the model runs under ``torch.func.functional_call``,
    which puts a module registered under two names back with its weights swapped for the
    traced tensors: conversion left the user's layer holding detached tensors (no longer
    trained by an optimizer made afterwards) and counted its parameters frozen (18 trainable
    of 90). Oracle: the parameters' identities and ``module.parameters()``."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(8, 2))
    before = dict(model.named_parameters(remove_duplicate=False))
    G = fxnx.convert(model, torch.randn(3, 8), level=level)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in after.values())
    total = sum(p.numel() for p in model.parameters())
    assert G.graph["num_params"] == G.graph["trainable_params"] == total == 90


def test_a_compiled_model_is_named_as_itself():
    """torch.export puts a wrapper of its own around a ``torch.compile``'d model, and its
    module stack named that wrapper as the root: ``G.graph["model"]`` and the cost table's
    first row said ``…_aot_export_non_strict.<locals>.Wrapper``. The root is the model
    converted. Oracle: the model's own class."""
    model = torch.compile(nn.Sequential(nn.Linear(8, 4), nn.ReLU()))
    G = fxnx.convert(model, torch.randn(2, 8))
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    assert G.graph["model"] == G.graph["modules"][""] == name
    assert G.graph["modules"]["_orig_mod.0"] == "torch.nn.modules.linear.Linear"
    assert fxnx.frames.cost_table(G, depth=1).splitlines()[2].split()[0] == type(model).__qualname__


class _TwoResiduals(nn.Module):
    """Two identity residuals on ``batch["x"]`` (``by_key``) or ``batch.x``: by hand, 2 skips,
    paths {0: 1, 1: 2, 2: 1}."""

    def __init__(self, by_key: bool) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.by_key = by_key

    def forward(self, batch):
        x = batch["x"] if self.by_key else batch.x
        x = x + self.f(x)
        x = x + self.g(x)
        return self.h(x)


def test_inputs_in_containers_torch_fx_does_not_look_into_are_described():
    """A dataclass or a mapping that is not a dict (Hugging Face's ``BatchEncoding``, a
    ``UserDict``) as the input: shape propagation described it as None, so its edges were no
    data and the analyses counted nothing (0 skips, paths {0: 0}, 0 input bytes). It is
    described as the dict of what it holds. Oracle: counts by hand, the tensor's bytes."""
    import dataclasses
    from collections import UserDict

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    x = torch.randn(2, 8)
    for batch, by_key in ((Batch(x), False), (UserDict({"x": x}), True)):
        G = fxnx.convert(_TwoResiduals(by_key).eval(), batch)
        assert G.graph["capture"] == "symbolic_trace"
        assert G.graph["inputs"][0]["shape"] == {"x": (2, 8)}
        assert len(fxnx.skip_connections(G, annotate=False)) == 2
        assert fxnx.path_length_counts(G) == {0: 1, 1: 2, 2: 1}
        assert fxnx.memory_profile(G).input_bytes == x.numel() * x.element_size()
    # make_fx, the last route, would fix a UserDict's tensors in the graph as constants
    with pytest.raises(fxnx.errors.CaptureError, match="make_fx cannot take an input of type UserDict"):
        fxnx.convert(_TwoResiduals(True).eval(), UserDict({"x": x}), routes="make_fx")


def test_a_traced_torchscript_module_gets_one_error_saying_what_to_do():
    """``torch.jit.trace``'s module has a compiled forward without a Python signature: conversion
    raised Python's own ``ValueError: no signature found for <torch.ScriptMethod …>``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated
        traced = torch.jit.trace(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(fxnx.errors.CaptureError, match=r"forward has no Python signature: it is compiled.*before it was compiled"):
        fxnx.convert(traced, torch.randn(1, 2))


class _TakesAnyKeyword(nn.Module):
    def forward(self, x, **kwargs):
        mask = kwargs.get("mask")
        return x if mask is None else x * mask


def test_a_keyword_input_no_node_reads_is_named():
    """A misspelled keyword a forward taking **kwargs ignores (Hugging Face's, for one): the
    model runs without it, and so does the graph; the user is told which input went unread."""
    x, mask = torch.randn(2, 3), torch.ones(2, 3)
    with pytest.warns(UserWarning, match="keyword input 'masks' of .*_TakesAnyKeyword is read by no node"):
        G = fxnx.convert(_TakesAnyKeyword(), x, kwargs={"masks": mask})
    assert G.out_degree([n for n, d in G.nodes(data=True) if d["op"] == "placeholder"][-1]) == 0  # the premise
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxnx.convert(_TakesAnyKeyword(), x, kwargs={"mask": mask})  # read: no warning
