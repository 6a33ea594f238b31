"""The capture package: the route registry, and the options stored with a graph.

Oracles: torch.autograd on the eager model (credit routed over a graph captured
again from its stored options), json and a torch-free interpreter (the stored
options are plain data), and the route modules themselves (the registry).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import pickle
import pkgutil

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxnx
from fxnx import _capture as capturing
from fxnx._capture import reuse
from fxnx._capture.common import Route
from fxnx._capture.registry import ROUTES

from blocktorch import run_without_torch
from conftest import rel_error


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class Net(nn.Module):
    """Two blocks and a flag that selects a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()
        self.head = nn.Linear(4, 3)

    def forward(self, x, double=False):
        y = self.b(self.a(x))
        if double:
            y = y * 2
        return self.head(y)


class Gate(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.a(x)) + x


def _autograd(model, x, **kwargs):
    ref = copy.deepcopy(model)
    x_ = x.clone().requires_grad_()
    out = ref(x_, **kwargs)
    grads = torch.autograd.grad(out.sum(), [x_, *ref.parameters()])
    return grads[0], dict(zip([n for n, _ in ref.named_parameters()], grads[1:], strict=True))


def test_the_registry_is_a_dict_of_every_route_module_in_auto_order():
    modules = {
        name: importlib.import_module(f"fxnx._capture.{name}")
        for _, name, _ in pkgutil.iter_modules(capturing.__path__)
    }
    with_route = {name: mod.ROUTE for name, mod in modules.items() if hasattr(mod, "ROUTE")}
    assert type(ROUTES) is dict
    assert set(ROUTES) == set(with_route)  # one module per route, each registered by its name
    assert all(isinstance(r, Route) and ROUTES[r.name] is r for r in with_route.values())
    assert list(ROUTES) == ["symbolic_trace", "export", "draft_export", "make_fx"]
    G = fxnx.convert(Net(), torch.randn(2, 4))
    assert G.graph["capture_options"]["routes"] == list(ROUTES)


@pytest.mark.parametrize(
    ("options", "want"),
    [
        ({"leaf_modules": [Block]}, {"leaf_modules": [f"class:{__name__}.Block"]}),
        ({"leaf_modules": ["a"]}, {"leaf_modules": ["a"]}),
        ({"concrete_args": {"double": True}}, {"concrete_args": {"double": True}}),
        ({"routes": "export"}, {"routes": ["export"], "route": "export"}),
        ({"routes": ["export", "make_fx"]}, {"routes": ["export", "make_fx"], "route": "export"}),
    ],
    ids=["leaf-class", "leaf-path", "concrete", "export", "two-routes"],
)
def test_graph_keeps_its_options_and_credit_recaptures_with_them(options, want, monkeypatch):
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, **options)
    stored = G.graph["capture_options"]
    assert {k: stored[k] for k in want} == want
    # Plain data: JSON round trip gives the same value.
    assert json.loads(json.dumps(stored)) == stored
    seen = []
    real = reuse.capture
    monkeypatch.setattr(reuse, "capture", lambda *a, **k: seen.append(k) or real(*a, **k))
    G2 = pickle.loads(pickle.dumps(G))  # options travel with the graph, not with a cache
    # No options given, but concrete_args: those change what the model computes, so the
    # caller gives them again; the stored ones are only checked.
    res = fxnx.route_credit(G2, model, x, concrete_args=options.get("concrete_args"))
    want_x, want_p = _autograd(model, x, double=bool(dict(options.get("concrete_args", {}))))
    assert rel_error(res.node_credit[G.graph["inputs"][0]["name"]], want_x) <= 1e-12
    for name, g in want_p.items():
        assert rel_error(res.param_credit[name], g) <= 1e-12, name
    # It captured again once, with exactly the stored options (the winning route only).
    assert len(seen) == 1
    assert seen[0]["routes"] == (stored["route"],)
    assert list(seen[0]["leaf_modules"]) == stored["leaf_modules"]
    assert seen[0]["concrete_args"] == stored["concrete_args"]
    assert seen[0]["level"] == stored["level"]


def test_without_the_stored_options_the_graph_would_not_match():
    """The counterfactual: the stored options are what makes the re-capture right."""
    model, x = Net().double(), torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, leaf_modules=[Block])
    G.graph["capture_options"]["leaf_modules"] = []
    with pytest.raises(fxnx.errors.FxnxValueError, match="G lacks nodes the model computes"):
        fxnx.route_credit(G, model, x)


def test_modules_kept_whole_on_failure_are_leaves_when_captured_again(monkeypatch):
    torch.manual_seed(0)
    model = Gated().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x, leaf_on_failure=True)
    stored = G.graph["capture_options"]
    assert stored["opaque"] == ["gate"] and stored["leaf_on_failure"] is True
    seen = []
    real = reuse.capture
    monkeypatch.setattr(reuse, "capture", lambda *a, **k: seen.append(k) or real(*a, **k))
    res = fxnx.route_credit(G, model, x)
    assert list(seen[0]["leaf_modules"]) == ["gate"] and seen[0]["leaf_on_failure"] is False
    want_x, _ = _autograd(model, x)
    assert rel_error(res.node_credit["x"], want_x) <= 1e-12


def test_a_concrete_arg_a_graph_cannot_hold_must_be_passed_again():
    class Scaled(nn.Module):
        def forward(self, x, scale):
            return x * scale

    x, scale = torch.randn(2, 3, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)
    G = fxnx.convert(Scaled(), x, concrete_args={"scale": scale})
    assert G.graph["capture_options"]["concrete_args"] == {"scale": {"fxnx_unstored": "torch.Tensor"}}
    fxnx.validate(G)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"concrete_args 'scale' fixed to a value a graph cannot store"):
        fxnx.route_credit(G, Scaled(), x)
    res = fxnx.route_credit(G, Scaled(), x, concrete_args={"scale": scale})
    assert torch.equal(res.node_credit["x"], torch.full_like(x, 3.0))


def test_capture_options_round_trip_and_load_without_torch(tmp_path):
    G = fxnx.convert(Net(), torch.randn(2, 4), leaf_modules=[Block, "head"],
                     concrete_args={"double": True})
    opts = fxnx.CaptureOptions.from_plain(G.graph["capture_options"])
    assert opts.to_plain() == G.graph["capture_options"]
    assert opts.replay().routes == ("symbolic_trace",)
    path = tmp_path / "g.pkl"
    path.write_bytes(pickle.dumps(G.graph["capture_options"]))
    proc = run_without_torch(
        "import json, pickle, sys; print(json.dumps(pickle.load(open(sys.argv[1], 'rb'))))",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == G.graph["capture_options"]


def test_a_broken_capture_options_value_is_refused():
    G = fxnx.convert(Net(), torch.randn(2, 4))
    G.graph["capture_options"]["level"] = "deep"
    with pytest.raises(fxnx.errors.GraphContractError, match="capture_options"):
        fxnx.validate(G)
    del G.graph["capture_options"]
    with pytest.raises(fxnx.errors.GraphContractError, match="lacks attribute 'capture_options'"):
        fxnx.validate(G)


class _CachedBias(nn.Module):
    """Caches a value computed from a parameter in a dict on its first call in eval mode,
    keyed by device, as timm's LeViT caches its attention biases."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))
        self.cache: dict[str, torch.Tensor] = {}
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if self.training:
            return self.linear(x) + self.bias * 2
        key = str(x.device)
        if key not in self.cache:
            self.cache[key] = self.bias * 2
        return self.linear(x) + self.cache[key]


def test_what_a_model_caches_while_traced_is_not_kept():
    torch.manual_seed(0)
    model, x = _CachedBias().double().eval(), torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    assert model.cache == {}  # no torch.fx Proxy left where the model's next call reads it
    expected = model.train()(x).detach()
    model.eval()
    assert torch.equal(model(x), expected)  # the eager model still runs
    model.cache.clear()  # what the eager call above cached
    res = fxnx.route_credit(G, model, x)
    assert model.cache == {}  # its runs of the model (a probe under no_grad) leave none either
    x_ = x.clone().requires_grad_()
    out = model(x_)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(out.sum(), [x_, *params])
    assert torch.equal(res.output, out)
    got = [res.node_credit["x"], *(res.param_credit[n] for n in names)]
    for g, want in zip(got, grads, strict=True):
        assert torch.allclose(g, want, rtol=1e-12, atol=0)


class _CachedAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        self.last = self.linear(x)  # kept on the module, as some models keep a state
        return self.last.relu()


def test_an_attribute_a_model_sets_while_traced_is_given_back():
    model, x = _CachedAttribute(), torch.randn(2, 4)
    fxnx.convert(model, x)
    assert model.last is None
    del model.last
    fxnx.convert(model, x)
    assert not hasattr(model, "last")


def test_preserved_gives_back_every_dict_and_list_a_module_holds():
    """Caches on any module (a dict, a list, nested or at the top) get their contents back,
    the same objects; modules holding none are passed over."""
    from fxnx._state import preserved

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), _CachedBias()))
    model[0].seen = []
    model.top = {"kept": 1}
    inner, seen, top = model[1][1].cache, model[0].seen, model.top
    with preserved(model):
        inner["cpu"] = torch.ones(1)
        seen.append(3)
        top["added"] = 2
        del top["kept"]
    assert model[1][1].cache is inner and inner == {}
    assert model[0].seen is seen and seen == []
    assert model.top is top and top == {"kept": 1}


def test_capture_takes_one_tensor_as_the_one_input_and_refuses_other_args_by_name():
    """``capture(model, x)`` is ``capture(model, (x,))`` (not a sequence of ``x``'s rows, which
    failed on ``bool`` of a tensor); arguments of another kind get one error naming them."""
    model, x = nn.Linear(2, 3), torch.randn(4, 2)
    one, tupled = fxnx.capture(model, x), fxnx.capture(model, (x,))
    shapes = [n.meta["tensor_meta"].shape for n in one.gm.graph.nodes if n.op != "output"]
    assert shapes[0] == (4, 2) and shapes[-1] == (4, 3)
    assert str(one.gm.graph) == str(tupled.gm.graph)
    with pytest.raises(fxnx.errors.FxnxTypeError, match="args must be a tuple or list of example inputs.*got dict"):
        fxnx.capture(model, {"input": x})
    with pytest.raises(fxnx.errors.FxnxTypeError, match="kwargs must be a mapping.*got list"):
        fxnx.capture(model, (x,), [x])


class _WriteDropped(nn.Module):
    """A value written in place, the write's result dropped, the value read again."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.l, self.l2, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(inplace=True)
        self.register_buffer("seen", torch.zeros(()))
        self.kind = kind

    def forward(self, x):
        h = self.l(x)
        if self.kind == "add_":  # a residual added in place: h is the sum
            h.add_(torch.tanh(self.l2(x)))
            return h * 2
        if self.kind == "module":  # nn.ReLU(inplace=True), its result dropped
            self.act(h)
            return self.l2(h)
        if self.kind == "function":  # torch.relu_, its result dropped
            torch.relu_(h)
            return self.l2(h)
        self.seen.add_(1)  # a buffer written in place: read as it is
        h.relu_()
        return self.l2(h) + self.seen


@pytest.mark.parametrize(("kind", "edges", "paths"), [
    ("add_", {("add_", "mul"), ("tanh", "add_"), ("l", "add_")}, 2),
    ("module", {("l", "act"), ("act", "l2")}, 1),
    ("function", {("l", "relu_"), ("relu_", "l2")}, 1),
    ("method", {("l", "relu_"), ("relu_", "l2")}, 1),
])
def test_a_value_written_in_place_is_read_from_the_write(kind, edges, paths):
    """A trace records ``h.add_(y)`` with its result dropped, then a read of ``h``, as a read
    of ``h`` before the write: the graph showed the write leading nowhere (a residual merge
    as a dead end, its branch off every input-to-output path). The read comes from the
    write's node now. Oracle: the edges and the number of input-to-output paths counted by
    hand, and the graph's output equal to the model's."""
    import networkx as nx

    torch.manual_seed(0)
    model, x = _WriteDropped(kind).eval(), torch.randn(3, 4)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "symbolic_trace"
    assert edges <= set(G.edges())
    assert not {("l", "l2"), ("l", "mul")} & set(G.edges())
    count = {}
    for node in nx.topological_sort(G):
        count[node] = 1 if node == "x" else sum(count[u] for u, _ in G.in_edges(node))
    assert count["output"] == paths
    cap = reuse.recapture(G, model, (x,), None)
    model.seen.zero_()
    got = cap.gm(x.clone())
    model.seen.zero_()
    assert torch.equal(got, model(x.clone()))


class _AddedIntoAnAlias(nn.Module):
    """``h += y`` with the value before it kept under another name and read afterwards: the
    model writes into the tensor both names hold; a trace rebinds ``h`` to ``h + y`` (torch.fx's
    proxies have no ``__iadd__``) and has the alias read the value before the write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.g = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        kept = h
        h += self.b(x)
        return self.g(kept)


def test_a_graph_computing_another_output_than_the_model_is_not_taken():
    """The trace of ``_AddedIntoAnAlias`` computes another output than the model without
    failing: ``G`` showed ``b``'s sum leading nowhere and ``g`` reading ``a``, though the
    model's ``g`` reads the sum. A route whose graph's output differs from the model's on the
    example inputs fails now, saying so, and the next route (torch.export, which records the
    write) is taken. Oracle: the model's output, the edges by hand, autograd's gradients."""
    torch.manual_seed(0)
    model, x = _AddedIntoAnAlias().double(), torch.randn(3, 4, dtype=torch.float64)
    traced = fx.symbolic_trace(model)
    assert not torch.allclose(traced(x), model(x))  # the trace alone computes another output
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "export"
    assert "does not compute what the model computes" in G.graph["capture_failures"]["symbolic_trace"]
    assert {("linear", "add_"), ("linear_1", "add_"), ("add_", "linear_2")} <= set(G.edges())
    assert ("linear", "linear_2") not in set(G.edges())
    res = fxnx.route_credit(G, model, x)
    out = model(x)
    out.sum().backward()
    assert torch.equal(res.output, out.detach())
    assert all(torch.equal(res.param_credit[n], p.grad) for n, p in model.named_parameters())


def test_a_models_random_draws_are_the_same_for_the_graph_it_is_compared_with():
    """The comparison of a graph's output with the model's runs both from one random state:
    dropout in training mode converts with symbolic tracing, as before."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    G = fxnx.convert(model, torch.randn(16, 4))
    assert G.graph["capture"] == "symbolic_trace" and not G.graph["capture_failures"]


class _RebindsABuffer(nn.Module):
    """A forward that rebinds a buffer to a new tensor (``self.ema = ...``), as an exponential
    moving average kept out of place does."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 7)
        self.register_buffer("ema", torch.zeros(7))

    def forward(self, x):
        h = self.l1(x)
        self.ema = (0.9 * self.ema + 0.1 * h.mean(0)).detach()
        return h - self.ema


def test_a_buffer_the_forward_rebinds_is_given_back_and_read_as_it_was():
    """Tracing rebinds such a buffer to a torch.fx ``Proxy``: conversion failed with a raw
    torch.fx error and left the user's model holding the Proxy (in ``state_dict()``, too),
    and a graph made before the buffer was given back read the Proxy. The model keeps its
    own tensor, and the graph reads it as it was before the call. Oracle: the model's output
    on a copy, and the buffer's identity."""
    torch.manual_seed(0)
    model, x = _RebindsABuffer(), torch.randn(4, 5)
    model.ema.normal_()
    buffer = model.ema
    twin = copy.deepcopy(model)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "symbolic_trace"
    assert model.ema is buffer and model.state_dict(keep_vars=True)["ema"] is buffer
    assert torch.equal(buffer, twin.ema)  # not written either
    cap = reuse.recapture(G, model, (x,), None)
    assert torch.equal(cap.gm(x), twin(x))
    assert model.ema is buffer


class _AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.l(x)
        return self.l2(h.float()) + h


def test_autocast_in_the_forward_is_captured_by_a_route_that_records_it():
    """Symbolic tracing drops a ``torch.autocast`` block of the forward: G said float32 where
    the model computes bfloat16 (edge bytes doubled), and the graph ran the block in float32.
    Such a trace fails now, naming the node, and the next route (torch.export) records the
    block. Oracle: a forward hook's dtype, the model's output, autograd's gradients."""
    torch.manual_seed(0)
    model, x = _AutocastInside(), torch.randn(3, 4)
    dtypes = []
    handle = model.l.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    model(x)
    handle.remove()
    G = fxnx.convert(model, x)
    assert G.graph["capture"] == "export"
    assert "torch.autocast" in G.graph["capture_failures"]["symbolic_trace"]
    # the block is one node (torch.export's wrap_with_autocast), its result taken out by getitem
    assert dtypes == [torch.bfloat16] and G.nodes["getitem"]["out_dtype"] == "torch.bfloat16"
    assert G.nodes["linear_1"]["out_dtype"] == "torch.float32"
    res = fxnx.route_credit(G, model, x)
    out = model(x)
    out.sum().backward()
    assert torch.equal(res.output, out.detach())
    assert all(torch.equal(res.param_credit[n], p.grad) for n, p in model.named_parameters())
    # autocast around the conversion is the caller's: symbolic tracing records under it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        G2 = fxnx.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), x)
    assert G2.graph["capture"] == "symbolic_trace" and G2.nodes["_0"]["out_dtype"] == "torch.bfloat16"


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.mean = torch.zeros(4)  # a plain tensor attribute, updated in place

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        x.sub_(0.5).div_(0.5)  # normalises its input in place
        return self.l(x) - self.mean


class _GradModeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        if torch.is_grad_enabled():  # the path model(x) takes when called
            h = h + 0.1 * torch.tanh(h)
        return h


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, mask):
        return self.enc(x, src_key_padding_mask=mask)


def test_a_faithful_graph_is_taken_however_the_model_runs():
    """The comparison of each graph with the model must run the model as the graph was made
    and propagated: on the inputs as given (a forward that writes into its input had written
    into them already), with gradients on as a call runs (a branch on
    ``torch.is_grad_enabled()``), with the fused attention fast path off (eval-mode
    ``TransformerEncoder`` with a padding mask), its plain tensor attributes as they were. A
    first version of it rejected each of these faithful symbolic traces (0.97, 0.072, 0.5,
    0.07 off) and left ``model.mean`` written six times. Oracle: the model's own output."""
    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    for model, inputs in ((_WritesItsInput().eval(), (torch.randn(3, 4),)), (_GradModeBranch(), (torch.randn(3, 4),)),
                          (_Encoder().eval(), (x, mask))):
        given = [t.clone() for t in inputs]
        state = {n: v.clone() for n, v in vars(model).items() if isinstance(v, torch.Tensor)}
        G = fxnx.convert(model, *inputs)
        assert G.graph["capture"] == "symbolic_trace" and not G.graph["capture_failures"], type(model).__name__
        assert all(torch.equal(a, b) for a, b in zip(inputs, given, strict=True))
        assert all(torch.equal(getattr(model, n), v) for n, v in state.items())
        cap = reuse.recapture(G, model, inputs, None)
        got = cap.gm(*[t.clone() for t in given])
        for n, v in state.items():  # as before the graph's run
            getattr(model, n).copy_(v)
        assert torch.allclose(got, model(*[t.clone() for t in given]), atol=1e-6)


def test_a_propagation_of_ones_own_is_kept_as_it_returns_it():
    """``capture(propagate=fn)``: what ``fn`` returns is ``Capture.propagation`` (a first version
    of the comparison with the model took a pair from it, and a dict became its first key)."""
    found = {"nodes": 4, "calls": 2}
    cap = fxnx.capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),), propagate=lambda gm, model, values, fake: found)
    assert cap.propagation is found


class _AliasIntoDataclass(_AddedIntoAnAlias):
    def forward(self, x):
        return _Out(super().forward(x))


@dataclasses.dataclass
class _Out:
    y: torch.Tensor


@dataclasses.dataclass
class _In:
    x: torch.Tensor
    unset: int = dataclasses.field(init=False)


class _ReadsIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, batch):
        return self.l(batch.x)


def test_an_output_in_a_container_pytree_does_not_open_is_compared_too():
    """A dataclass output holds no tensor pytree sees: the comparison of the graph with the
    model compared nothing, and the trace of ``h += y`` with an alias was taken (the wrong
    edge in G, a feedback router 0.69 off the model). Its fields are compared. (A dataclass
    input with a field left unset is described without it, not a bare AttributeError.)"""
    torch.manual_seed(0)
    model, x = _AliasIntoDataclass(), torch.randn(3, 4)
    G = fxnx.convert(model, x)
    assert G.graph["capture"] != "symbolic_trace"
    assert "does not compute what the model computes" in G.graph["capture_failures"]["symbolic_trace"]
    G = fxnx.convert(_ReadsIn(), _In(x))
    assert G.graph["inputs"][0]["shape"] == {"x": (3, 4)}
