"""Memory over a pass: fxnx.memory_profile, read from G alone, against storage bytes measured
while the model really runs.

The oracle, :class:`StorageTracker`, shares nothing with fxnx: it runs the model (eagerly, or
a GraphModule torch's own tracers make: symbolic_trace, make_fx) under a TorchDispatchMode that
follows the
storage of every tensor an op returns, counts a storage as live until torch frees it
(a weak reference to the storage itself: ``StorageWeakRef.expired``), and records the live
bytes after each op. Storages that existed before the run (inputs, parameters, buffers) are
left out, as memory_profile leaves them out. What autograd keeps for the backward pass is
measured with ``saved_tensors_hooks``.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fxnx
import fxnx._memory
from fxnx._memory import ATEN_VIEWS, ITEMSIZE, VIEW_NAMES, memory_profile

# --- the oracle -------------------------------------------------------------------------------


class StorageTracker(TorchDispatchMode):
    """Live storage bytes after every op that runs under it, and their peak."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.trace: list[tuple[str, int]] = []  # (op, live bytes after it)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if storage.nbytes() == 0 or ptr in self.existing:
                    continue
                known = self.live.get(ptr)
                if known is None or known[0].expired():  # new, or a freed address used again
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {ptr: ref for ptr, ref in self.live.items() if not ref[0].expired()}
        now = sum(nbytes for _, nbytes in self.live.values())
        self.trace.append((func.__name__, now))  # e.g. "convolution.default"
        self.peak = max(self.peak, now)
        return out


def inference_run(model: nn.Module, x: torch.Tensor) -> StorageTracker:
    with torch.no_grad(), StorageTracker([x, *model.parameters(), *model.buffers()]) as run:
        model(x)
    return run


def training_step(model: nn.Module, x: torch.Tensor) -> StorageTracker:
    """Forward and backward, with the input's gradient too (as fxnx's joint graphs have it)."""
    x = x.clone().requires_grad_(True)
    with torch.no_grad():
        tangent = torch.ones_like(model(x))
    model.zero_grad(set_to_none=True)
    with StorageTracker([x, tangent, *model.parameters(), *model.buffers()]) as run:
        model(x).backward(tangent)
    return run


def saved_by_autograd(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages autograd saves for the backward pass (inputs and weights apart)."""
    x = x.clone().requires_grad_(True)
    existing = {t.untyped_storage().data_ptr() for t in [x, *model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in existing:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


def within(value: int, reference: int, rel: float = 0.10) -> bool:
    return reference > 0 and abs(value - reference) <= rel * reference


# --- models -----------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    )


#: name -> (model, example input); torchvision models come from conftest (eval, no weights).
FORWARD = {
    "resnet18": ("resnet18", (2, 3, 224, 224)),
    "mobilenet_v3_small": ("mobilenet_v3_small", (2, 3, 224, 224)),
    "mlp": (mlp, (32, 64)),
}


def _forward_case(name, torchvision_model):
    build, shape = FORWARD[name]
    torch.manual_seed(0)
    model = torchvision_model(build) if isinstance(build, str) else build().eval()
    return model, torch.randn(shape)


# --- the peak of a forward pass ---------------------------------------------------------------


@pytest.mark.parametrize("level", ["module", "aten"])
@pytest.mark.parametrize("name", FORWARD)
def test_forward_peak_is_within_10_percent_of_the_eager_run(name, level, torchvision_model):
    model, x = _forward_case(name, torchvision_model)
    profile = memory_profile(fxnx.convert(model, x, level=level), eager=True)
    measured = inference_run(model, x).peak
    assert within(profile.peak_bytes, measured), (profile.peak_bytes, measured)
    assert profile.live_bytes[profile.peak_node] == profile.peak_bytes
    assert profile.unknown == ()


@pytest.mark.parametrize("name", FORWARD)
def test_forward_peak_is_within_10_percent_of_the_traced_graph_run(name, torchvision_model):
    # By default a value dies at its last use in G's order: what running the graph itself does
    # (fx code drops each value after its last use), whatever Python frames hold in eager mode.
    model, x = _forward_case(name, torchvision_model)
    profile = memory_profile(fxnx.convert(model, x))
    measured = inference_run(torch.fx.symbolic_trace(model), x).peak
    assert within(profile.peak_bytes, measured), (profile.peak_bytes, measured)


def test_eager_mode_keeps_a_module_s_input_until_it_returns(torchvision_model):
    # mobilenet_v3_small's second block reads its input in its first convolution only, but
    # Module.__call__ holds it until the block returns: an 11% higher peak, which eager=True sees.
    model, x = _forward_case("mobilenet_v3_small", torchvision_model)
    G = fxnx.convert(model, x)
    graph, eager = memory_profile(G), memory_profile(G, eager=True)
    assert eager.peak_bytes - graph.peak_bytes == 2 * 16 * 56 * 56 * 4  # the block's input
    assert eager.peak_bytes == inference_run(model, x).peak
    assert graph.peak_bytes == inference_run(torch.fx.symbolic_trace(model), x).peak


def test_every_step_of_an_aten_graph_matches_the_measured_run(torchvision_model):
    # Each call of the ATen graph is one op of the run (getitem is no op), in the same order:
    # live bytes must agree op by op, not just at the peak.
    model, x = _forward_case("mobilenet_v3_small", torchvision_model)
    G = fxnx.convert(model, x, level="aten")
    profile = memory_profile(G, eager=True)
    calls = [
        n for n in sorted(G, key=lambda n: G.nodes[n]["order"])
        if G.nodes[n]["op"] == "call_function" and G.nodes[n]["target"] != "operator.getitem"
    ]
    run = inference_run(model, x)
    assert [G.nodes[n]["target"].removeprefix("torch.ops.aten.") for n in calls] == [
        op for op, _ in run.trace
    ]
    assert [profile.live_bytes[n] for n in calls] == [live for _, live in run.trace]


# --- a training step --------------------------------------------------------------------------


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("build, shape", [(small_cnn, (8, 3, 32, 32)), (mlp, (32, 64))],
                         ids=["small_cnn", "mlp"])
def test_training_step_peak_and_saved_bytes_match_the_measured_step(build, shape, eager):
    torch.manual_seed(0)
    model, x = build().train(), torch.randn(shape)
    G = fxnx.convert(model, x, level="joint")
    profile = memory_profile(G, eager=eager)
    measured = training_step(model, x).peak
    assert within(profile.peak_bytes, measured), (profile.peak_bytes, measured)
    assert within(profile.saved_bytes, saved_by_autograd(model, x))
    assert profile.saved and all(G.nodes[n]["phase"] == "forward" for n in profile.saved)


def test_a_forward_graph_has_no_saved_bytes():
    G = fxnx.convert(mlp(), torch.randn(4, 64))
    assert memory_profile(G).saved_bytes is None and memory_profile(G).saved == ()


# --- storage sharing, model by model ----------------------------------------------------------


# Each model ends in a small value, so that its peak is where the rule under test decides it.


class ViewChain(nn.Module):
    def forward(self, x):
        return x.relu().view(-1).unsqueeze(0).expand(3, -1).sum()


class ReshapeOfTransposed(nn.Module):
    def forward(self, x):  # the transposed view is not contiguous: reshape copies it
        y = x.relu()
        return y.t().reshape(-1).sum() + y.sum()


class ReshapeOfContiguous(nn.Module):
    def forward(self, x):  # contiguous: reshape, flatten and contiguous are views
        return x.relu().reshape(-1).flatten().contiguous().sum()


class InPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        y.relu_()
        return F.relu(y, inplace=True).sum()


class InPlaceModules(nn.Module):
    """Modules that write into their input (its values the peak): they share its storage."""

    def __init__(self):
        super().__init__()
        self.act, self.clip, self.drop = nn.ReLU(inplace=True), nn.Hardtanh(inplace=True), nn.Dropout(0.0, inplace=True)

    def forward(self, x):
        return self.drop(self.clip(self.act(x * 2))).sum()


class AugmentedAssignment(nn.Module):
    def forward(self, x):  # torch.fx traces += as operator.add (a new tensor); ATen as add_
        y = x * 2
        y += 1
        return y.sum()


class ChunkThenMultiply(nn.Module):
    def forward(self, x):
        a, b = (x * 2).chunk(2, dim=0)
        return (a * b).sum()


class SortThenUseOne(nn.Module):
    def forward(self, x):  # getitem picks one output: the indices die at their sum
        values, indices = torch.sort(x * 2, dim=1)
        s = indices.sum()
        return values.exp().sum() + s


class TensorIndex(nn.Module):
    def forward(self, x, idx):  # advanced indexing copies; x[0] is a view
        y = x.relu()
        return y[idx].sum() + y[0].sum()


class SameDtypeCast(nn.Module):
    def forward(self, x):
        return x.relu().float().to(torch.float32).sum()


class NewDtypeCast(nn.Module):
    def forward(self, x):
        return x.relu().double().sum()


class ViewModulesAndEvalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), nn.Identity(), nn.Flatten(0), nn.Unflatten(0, (16, 32)))

    def forward(self, x):  # dropout outside training returns its input
        return F.dropout(self.body(x), 0.5, training=False).sum()


class EvalDropoutModules(nn.Module):
    """Dropout layers in eval mode return their input itself."""

    def __init__(self) -> None:
        super().__init__()
        self.drop, self.drop1d = nn.Dropout(0.5), nn.Dropout1d(0.5)

    def forward(self, x):
        return self.drop1d(self.drop(x.relu())).sum()


class HookedEvalDropout(nn.Module):
    """An eval-mode dropout whose forward hook returns a new tensor: not its input."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.drop.register_forward_hook(lambda module, args, out: out * 2)

    def forward(self, x):
        return self.drop(x.relu()).sum()


class TupleOutput(nn.Module):
    def forward(self, x):
        return x.relu(), (x * 2).transpose(0, 1)


def hand_built_iadd() -> torch.fx.GraphModule:
    """``operator.iadd`` as a node, which torch.fx's tracer never writes but a graph may hold."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(operator.iadd, (graph.call_function(operator.mul, (x, 2)), 1))
    graph.output(graph.call_method("sum", (y,)))
    return torch.fx.GraphModule(nn.Module(), graph)


def _one(*shape):
    return lambda: (torch.randn(*shape),)


EDGE_CASES = {
    "view_chain": (ViewChain, _one(16, 32)),
    "reshape_of_transposed": (ReshapeOfTransposed, _one(16, 32)),
    "reshape_of_contiguous": (ReshapeOfContiguous, _one(16, 32)),
    "in_place": (InPlace, _one(16, 32)),
    "in_place_modules": (lambda: InPlaceModules().eval(), _one(16, 32)),
    "augmented_assignment": (AugmentedAssignment, _one(16, 32)),
    "hand_built_iadd": (hand_built_iadd, _one(16, 32)),
    "chunk_then_multiply": (ChunkThenMultiply, _one(16, 32)),
    "sort_then_use_one": (SortThenUseOne, _one(16, 32)),
    "tensor_index": (TensorIndex, lambda: (torch.randn(16, 32), torch.tensor([0, 3, 3, 5]))),
    "same_dtype_cast": (SameDtypeCast, _one(16, 32)),
    "new_dtype_cast": (NewDtypeCast, _one(16, 32)),
    "view_modules_and_eval_dropout": (ViewModulesAndEvalDropout, _one(16, 32)),
    "tuple_output": (TupleOutput, _one(16, 32)),
    "eval_dropout_modules": (lambda: EvalDropoutModules().eval(), _one(16, 32)),
    "hooked_eval_dropout": (lambda: HookedEvalDropout().eval(), _one(16, 32)),
}


@pytest.mark.parametrize("level", ["module", "aten"])
@pytest.mark.parametrize("name", EDGE_CASES)
def test_views_in_place_ops_and_copies_match_the_measured_run(name, level):
    # The run measured is the graph torch's own tracer makes at that level (symbolic_trace;
    # make_fx for ATen), so that Python locals of the model's forward do not hold values.
    build, inputs = EDGE_CASES[name]
    model, args = build(), inputs()
    profile = memory_profile(fxnx.convert(model, *args, level=level))
    if level == "aten":
        traced = make_fx(model)(*args)
    else:
        traced = model if isinstance(model, torch.fx.GraphModule) else torch.fx.symbolic_trace(model)
    with torch.no_grad(), StorageTracker(list(args)) as run:
        traced(*args)
    assert profile.peak_bytes == run.peak, (profile.live_bytes, run.trace)


# --- the tables against torch -----------------------------------------------------------------


def _schema_kind(schema) -> str:
    aliases = [r.alias_info for r in schema.returns]
    if any(a is not None and a.is_write for a in aliases):
        return "write"
    return "view" if any(a is not None for a in aliases) else "new"


def test_eval_dropout_in_an_exported_graph_returns_its_input():
    """torch.export records an eval-mode dropout layer as aten.dropout(x, p, train=False),
    which returns x itself. Oracle: the symbolically traced model's measured run."""
    model, (x,) = EvalDropoutModules().eval(), _one(16, 32)()
    G = fxnx.convert(model, x, routes=("export",))
    assert any(d["target"] == "torch.ops.aten.dropout.default" for _, d in G.nodes(data=True))
    with torch.no_grad(), StorageTracker([x]) as run:
        torch.fx.symbolic_trace(model)(x)
    assert memory_profile(G).peak_bytes == run.peak


def test_aten_views_are_the_operators_whose_schema_returns_an_alias():
    kinds: dict[str, set[str]] = {}
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            kinds.setdefault(schema.name.removeprefix("aten::"), set()).add(_schema_kind(schema))
    views = {name for name, kind in kinds.items() if kind == {"view"}}
    conditional = fxnx._memory._RESHAPES | fxnx._memory._MAYBE_SELF
    not_tensors = {"get", "keys", "pop", "setdefault", "to_here", "local_value", "_unwrap_optional",
                   "_test_autograd_multiple_dispatch_view"}  # dicts, RPC, optionals, a test op
    assert views - ATEN_VIEWS - conditional - not_tensors == set()
    # Beyond the schema: ops that share storage without an alias annotation, and ops with a
    # view overload (slice.Tensor, split.Tensor) beside one on strings.
    assert ATEN_VIEWS - views == {
        "_unsafe_view", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk", "slice", "split",
    }
    assert ATEN_VIEWS <= set(kinds)  # every name is an ATen operator


def test_module_level_views_share_their_input_s_storage_in_torch():
    x, z, pairs = torch.randn(4, 6, 8), torch.randn(4, 6, 8, dtype=torch.complex64), torch.randn(4, 2)
    calls = {  # name -> (input, the call)
        "view": (x, lambda t: t.view(-1)), "view_as": (x, lambda t: t.view_as(t)),
        "unflatten": (x, lambda t: t.unflatten(2, (2, 4))), "squeeze": (x, lambda t: t.squeeze()),
        "unsqueeze": (x, lambda t: t.unsqueeze(0)), "transpose": (x, lambda t: t.transpose(0, 1)),
        "swapaxes": (x, lambda t: t.swapaxes(0, 1)), "swapdims": (x, lambda t: t.swapdims(0, 1)),
        "permute": (x, lambda t: t.permute(2, 1, 0)), "movedim": (x, lambda t: t.movedim(0, 1)),
        "moveaxis": (x, lambda t: t.moveaxis(0, 1)), "t": (pairs, lambda t: t.t()),
        "adjoint": (x, lambda t: t.adjoint()), "expand": (x, lambda t: t.expand(2, 4, 6, 8)),
        "expand_as": (x, lambda t: t.expand_as(torch.empty(2, 4, 6, 8))),
        "broadcast_to": (x, lambda t: torch.broadcast_to(t, (2, 4, 6, 8))),
        "narrow": (x, lambda t: t.narrow(1, 0, 2)), "select": (x, lambda t: t.select(1, 0)),
        "unfold": (x, lambda t: t.unfold(2, 2, 2)), "chunk": (x, lambda t: t.chunk(2)),
        "split": (x, lambda t: t.split(2)), "tensor_split": (x, lambda t: t.tensor_split(2)),
        "hsplit": (x, lambda t: t.hsplit(2)), "vsplit": (x, lambda t: t.vsplit(2)),
        "dsplit": (x, lambda t: t.dsplit(2)), "unbind": (x, lambda t: t.unbind()),
        "as_strided": (x, lambda t: t.as_strided((2, 2), (1, 1))), "detach": (x, lambda t: t.detach()),
        "diagonal": (x, lambda t: t.diagonal()), "real": (z, torch.real), "imag": (z, torch.imag),
        "view_as_real": (z, torch.view_as_real), "view_as_complex": (pairs, torch.view_as_complex),
        "conj": (x, lambda t: t.conj()), "positive": (x, lambda t: t.positive()),
    }
    assert set(calls) == VIEW_NAMES
    for name, (source, call) in calls.items():
        for out in tree_leaves(call(source)):
            assert out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr(), name


def test_itemsizes_are_torch_s():
    sub_byte = {f"torch.{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)}
    dtypes = {str(v): v.itemsize for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert ITEMSIZE == {name: size for name, size in dtypes.items() if name not in sub_byte}


# --- graphs from files, and what the profile cannot know --------------------------------------


def test_a_graph_read_from_a_file_gives_the_same_profile(tmp_path, torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    fxnx.write_json(G, tmp_path / "g.json")
    assert memory_profile(fxnx.read_json(tmp_path / "g.json")) == memory_profile(G)


def test_unknown_sizes_are_named_and_count_zero():
    G = fxnx.convert(mlp(), torch.randn(4, 64))
    before = memory_profile(G)
    G.nodes["_1"]["out_shape"] = None
    G.nodes["_2"]["out_shape"] = ("s0", 256)
    profile = memory_profile(G)
    assert profile.unknown == ("_1", "_2")
    assert profile.live_bytes["_1"] == before.live_bytes["_1"] - 4 * 256 * 4


def test_errors_name_the_problem():
    with pytest.raises(fxnx.errors.FxnxTypeError, match="needs a networkx graph, got dict"):
        memory_profile({})
    G = fxnx.convert(mlp(), torch.randn(4, 64))
    del G.nodes["_1"]["order"]
    with pytest.raises(fxnx.errors.GraphContractError, match="node '_1' has order None"):
        memory_profile(G)
    G = fxnx.convert(mlp(), torch.randn(4, 64))
    G.nodes["_1"]["order"], G.nodes["_2"]["order"] = G.nodes["_2"]["order"], G.nodes["_1"]["order"]
    with pytest.raises(fxnx.errors.GraphContractError, match=r"node '_2' \(order 2\) reads '_1', which comes later"):
        memory_profile(G)
