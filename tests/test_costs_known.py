"""FLOPs counted without a dispatch mode: the layers, functions, methods and ATen operators
whose count ``convert`` takes from shapes (torch's formula, or 0), and the nodes it leaves
to the counting mode.

Oracle: ``torch.utils.flop_counter.FlopCounterMode`` around the same call made eagerly on the
same tensors. Which way a node was counted is seen by watching the counting mode's dispatch:
a node counted from shapes dispatches nothing to it.
"""

from __future__ import annotations

import contextlib
import operator
from unittest import mock

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxnx
from fxnx import _costs

aten = torch.ops.aten


def _flop_counter_mode(fn, *args, **kwargs):
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


@contextlib.contextmanager
def _watched():
    """The operators that reach the counting mode meanwhile."""
    seen = []
    original = _costs._Counter.__torch_dispatch__

    def watched(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    with mock.patch.object(_costs._Counter, "__torch_dispatch__", watched):
        yield seen


@pytest.fixture
def dispatched():
    """The operators that reach the counting mode during the test."""
    with _watched() as seen:
        yield seen


def _one_call(op, target, inputs, build):
    """A graph module of one ``op`` node calling ``target`` on ``build(*placeholders)``."""
    graph = fx.Graph()
    placeholders = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    args, kwargs = build(*placeholders)
    graph.output(graph.create_node(op, target, tuple(args), kwargs, name="call"))
    return fx.GraphModule(nn.Module(), graph)


def _eager(op, target, inputs, build):
    args, kwargs = build(*inputs)
    if op == "call_method":
        return lambda: getattr(args[0], target)(*args[1:], **kwargs)
    return lambda: target(*args, **kwargs)


def _check(op, target, inputs, build, dispatched, known=True):
    expected = _flop_counter_mode(_eager(op, target, [t.clone() for t in inputs], build))
    G = fxnx.convert(_one_call(op, target, inputs, build), *inputs)
    assert G.nodes["call"]["flops"] == G.graph["flops"] == expected
    assert G.nodes["call"]["macs"] == expected // 2
    assert (dispatched == []) is known, dispatched
    return expected


# --- layers -------------------------------------------------------------------------------------

X4 = (2, 4, 6, 6)
#: Every layer convert counts without a mode: how to make one, and an input.
LAYERS = {
    nn.Conv1d: (lambda: nn.Conv1d(4, 6, 3, stride=2), (2, 4, 9)),
    nn.Conv2d: (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), X4),
    nn.Conv3d: (lambda: nn.Conv3d(4, 2, 2), (1, 4, 3, 4, 5)),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(4, 2, 3, stride=2), (2, 4, 5)),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2), X4),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(4, 2, 2), (1, 4, 3, 3, 3)),
    nn.Linear: (lambda: nn.Linear(6, 3), X4),
    nn.ReLU: (nn.ReLU, X4), nn.ReLU6: (nn.ReLU6, X4), nn.LeakyReLU: (nn.LeakyReLU, X4),
    nn.PReLU: (lambda: nn.PReLU(4), X4), nn.ELU: (nn.ELU, X4), nn.SELU: (nn.SELU, X4),
    nn.CELU: (nn.CELU, X4), nn.GELU: (nn.GELU, X4), nn.SiLU: (nn.SiLU, X4),
    nn.Mish: (nn.Mish, X4), nn.Sigmoid: (nn.Sigmoid, X4), nn.Tanh: (nn.Tanh, X4),
    nn.Hardswish: (nn.Hardswish, X4), nn.Hardsigmoid: (nn.Hardsigmoid, X4),
    nn.Hardtanh: (nn.Hardtanh, X4), nn.Softplus: (nn.Softplus, X4),
    nn.Softmax: (lambda: nn.Softmax(1), X4), nn.LogSoftmax: (lambda: nn.LogSoftmax(1), X4),
    nn.GLU: (nn.GLU, X4),
    nn.Dropout: (nn.Dropout, X4), nn.Dropout1d: (nn.Dropout1d, (2, 4, 6)),
    nn.Dropout2d: (nn.Dropout2d, X4), nn.Dropout3d: (nn.Dropout3d, (1, 2, 3, 4, 5)),
    nn.AlphaDropout: (nn.AlphaDropout, X4),
    nn.Identity: (nn.Identity, X4), nn.Flatten: (nn.Flatten, X4),
    nn.Unflatten: (lambda: nn.Unflatten(1, (2, 2)), X4),
    nn.PixelShuffle: (lambda: nn.PixelShuffle(2), X4),
    nn.PixelUnshuffle: (lambda: nn.PixelUnshuffle(2), X4),
    nn.BatchNorm1d: (lambda: nn.BatchNorm1d(4), (2, 4, 6)), nn.BatchNorm2d: (lambda: nn.BatchNorm2d(4), X4),
    nn.BatchNorm3d: (lambda: nn.BatchNorm3d(2), (2, 2, 3, 4, 5)),
    nn.LayerNorm: (lambda: nn.LayerNorm(6), X4), nn.GroupNorm: (lambda: nn.GroupNorm(2, 4), X4),
    nn.InstanceNorm1d: (lambda: nn.InstanceNorm1d(4, affine=True), (2, 4, 6)),
    nn.InstanceNorm2d: (lambda: nn.InstanceNorm2d(4), X4),
    nn.InstanceNorm3d: (lambda: nn.InstanceNorm3d(2), (2, 2, 3, 4, 5)),
    nn.LocalResponseNorm: (lambda: nn.LocalResponseNorm(2), X4),
    nn.MaxPool1d: (lambda: nn.MaxPool1d(2), (2, 4, 6)), nn.MaxPool2d: (lambda: nn.MaxPool2d(3, 2, 1), X4),
    nn.MaxPool3d: (lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4)),
    nn.AvgPool1d: (lambda: nn.AvgPool1d(2), (2, 4, 6)), nn.AvgPool2d: (lambda: nn.AvgPool2d(2), X4),
    nn.AvgPool3d: (lambda: nn.AvgPool3d(2), (1, 2, 4, 4, 4)),
    nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(2), (2, 4, 6)),
    nn.AdaptiveAvgPool2d: (lambda: nn.AdaptiveAvgPool2d(1), X4),
    nn.AdaptiveAvgPool3d: (lambda: nn.AdaptiveAvgPool3d(2), (1, 2, 4, 4, 4)),
    nn.AdaptiveMaxPool1d: (lambda: nn.AdaptiveMaxPool1d(2), (2, 4, 6)),
    nn.AdaptiveMaxPool2d: (lambda: nn.AdaptiveMaxPool2d(3), X4),
    nn.AdaptiveMaxPool3d: (lambda: nn.AdaptiveMaxPool3d(2), (1, 2, 4, 4, 4)),
    nn.ZeroPad1d: (lambda: nn.ZeroPad1d(1), (2, 4, 6)), nn.ZeroPad2d: (lambda: nn.ZeroPad2d(1), X4),
    nn.ConstantPad1d: (lambda: nn.ConstantPad1d(1, 0.5), (2, 4, 6)),
    nn.ConstantPad2d: (lambda: nn.ConstantPad2d(1, 0.5), X4),
    nn.ReflectionPad1d: (lambda: nn.ReflectionPad1d(1), (2, 4, 6)),
    nn.ReflectionPad2d: (lambda: nn.ReflectionPad2d(1), X4),
    nn.ReplicationPad1d: (lambda: nn.ReplicationPad1d(1), (2, 4, 6)),
    nn.ReplicationPad2d: (lambda: nn.ReplicationPad2d(1), X4),
    nn.Embedding: (lambda: nn.Embedding(10, 3), None),
}


def test_every_known_layer_has_a_case():
    assert set(LAYERS) == set(_costs._MODULES)


def _input(shape):
    return torch.randint(0, 10, (2, 5)) if shape is None else torch.randn(shape)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_known_layer_counts_what_flop_counter_mode_counts_without_a_mode(cls, mode, dispatched):
    torch.manual_seed(0)
    make, shape = LAYERS[cls]
    layer, x = make().train(mode == "train"), _input(shape)
    expected = _flop_counter_mode(layer, x)
    G = fxnx.convert(nn.Sequential(layer), x)
    assert G.nodes["_0"]["module_type"].endswith(f".{cls.__name__}")
    assert G.nodes["_0"]["flops"] == G.graph["flops"] == expected
    assert (expected > 0) is (cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                      nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear))
    assert dispatched == []


@settings(max_examples=40, deadline=None)
@given(
    dims=st.sampled_from([1, 2, 3]),
    transposed=st.booleans(),
    batch=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same"]),
    padding_mode=st.sampled_from(["zeros", "reflect", "circular"]),
    bias=st.booleans(),
)
def test_convolutions_count_what_flop_counter_mode_counts(
    dims, transposed, batch, groups, kernel, stride, dilation, padding, padding_mode, bias
):
    if padding == "same" and (stride > 1 or transposed):
        padding = 1  # torch allows "same" only for unstrided convolutions
    if transposed:
        padding_mode = "zeros"  # the only one transposed convolutions take
    cls = getattr(nn, f"Conv{'Transpose' if transposed else ''}{dims}d")
    layer = cls(2 * groups, 2 * groups, kernel, stride=stride, dilation=dilation, groups=groups,
                padding=padding, bias=bias, padding_mode=padding_mode)
    x = torch.randn(batch, 2 * groups, *[5 + d for d in range(dims)])
    expected = _flop_counter_mode(layer, x)
    with _watched() as dispatched:
        G = fxnx.convert(nn.Sequential(layer), x)
    assert G.nodes["_0"]["flops"] == expected > 0
    assert dispatched == []
    # the same call as a function, and as its ATen operator
    weight_args = (layer.weight, layer.bias)
    functional = getattr(F, f"conv{'_transpose' if transposed else ''}{dims}d")
    if padding_mode == "zeros":
        options = dict(stride=stride, dilation=dilation, groups=groups, padding=padding)
        build = lambda x, w, b: ((x, w, b), options)  # noqa: E731
        G = fxnx.convert(_one_call("call_function", functional, [x, *weight_args], build),
                         x, *weight_args)
        assert G.nodes["call"]["flops"] == expected


@settings(max_examples=40, deadline=None)
@given(
    leading=st.lists(st.integers(0, 3), max_size=3),
    features=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    bias=st.booleans(),
    transposed=st.booleans(),
)
def test_linear_counts_what_flop_counter_mode_counts(leading, features, bias, transposed):
    """Every rank of input (a vector too), empty ones, and inputs not contiguous."""
    layer = nn.Linear(*features, bias=bias)
    x = torch.randn(*leading, features[0])
    if transposed and len(leading) >= 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    expected = _flop_counter_mode(layer, x)
    with _watched() as dispatched:
        G = fxnx.convert(nn.Sequential(layer), x)
        H = fxnx.convert(_one_call("call_function", F.linear, [x, layer.weight],
                                   lambda x, w: ((x, w), {})), x, layer.weight)
    assert G.nodes["_0"]["flops"] == H.nodes["call"]["flops"] == expected
    assert dispatched == []


def _batch_of(batch, length, ones):
    """The last ``length`` sizes of ``batch``, those marked in ``ones`` made 1 (broadcast)."""
    tail = batch[len(batch) - length:]
    return [1 if one else size for size, one in zip(tail, ones, strict=False)]


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.integers(2, 3), max_size=3),
    lengths=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    ones=st.tuples(st.lists(st.booleans(), min_size=3, max_size=3),
                   st.lists(st.booleans(), min_size=3, max_size=3)),
    mkn=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    vector=st.sampled_from([None, "a", "b"]),
)
def test_matrix_products_count_what_flop_counter_mode_counts(batch, lengths, ones, mkn, vector):
    """Matrices and batches of them, broadcast; a vector operand is left to the counting mode
    (``mv`` and ``dot`` have no formula, a vector times a matrix is an ``mm``)."""
    m, k, n = mkn
    a_batch, b_batch = (_batch_of(batch, min(length, len(batch)), one)
                        for length, one in zip(lengths, ones, strict=True))
    a = torch.randn(k) if vector == "a" else torch.randn(*a_batch, m, k)
    b = torch.randn(k) if vector == "b" else torch.randn(*b_batch, k, n)
    for target in (torch.matmul, operator.matmul):
        expected = _flop_counter_mode(target, a, b)
        with _watched() as dispatched:
            G = fxnx.convert(_one_call("call_function", target, [a, b], lambda a, b: ((a, b), {})),
                             a, b)
        assert G.nodes["call"]["flops"] == expected
        assert (dispatched == []) is (vector is None)


# --- functions, methods and ATen operators ------------------------------------------------------

def _x(*shape):
    return torch.randn(shape or X4)


def _unary(*extra, **kwargs):
    return [_x()], lambda x: ((x, *extra), kwargs)


def _binary():
    return [_x(), _x()], lambda x, y: ((x, y), {})


#: Every function convert counts without a mode, with a call of it.
FUNCTIONS = {
    F.conv1d: ([_x(2, 4, 9), _x(6, 4, 3)], lambda x, w: ((x, w), {"stride": 2})),
    F.conv2d: ([_x(), _x(6, 2, 3, 3)], lambda x, w: ((x, w), {"groups": 2, "padding": "same"})),
    F.conv3d: ([_x(1, 4, 3, 4, 5), _x(2, 4, 2, 2, 2)], lambda x, w: ((x, w), {})),
    F.conv_transpose1d: ([_x(2, 4, 5), _x(4, 2, 3)], lambda x, w: ((x, w), {"stride": 2})),
    F.conv_transpose2d: ([_x(), _x(4, 3, 2, 2)], lambda x, w: ((x, w, None, 2), {})),
    F.conv_transpose3d: ([_x(1, 4, 3, 3, 3), _x(4, 2, 2, 2, 2)], lambda x, w: ((x, w), {})),
    F.linear: ([_x(), _x(3, 6), _x(3)], lambda x, w, b: ((x, w), {"bias": b})),
    torch.matmul: ([_x(), _x(6, 2)], lambda a, b: ((a, b), {})),
    operator.matmul: ([_x(3, 4), _x(2, 4, 5)], lambda a, b: ((a, b), {})),
    torch.mm: ([_x(3, 4), _x(4, 5)], lambda a, b: ((a, b), {})),
    torch.bmm: ([_x(2, 3, 4), _x(2, 4, 5)], lambda a, b: ((a, b), {})),
    **{f: _binary() for f in (
        operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
        operator.mod, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
        operator.iadd, operator.imul, torch.add, torch.sub, torch.mul, torch.div)},
    operator.pow: _unary(2), operator.neg: _unary(),
    operator.getitem: _unary((slice(None), 0, ..., slice(1, None, 2))),
    getattr: _unary("shape"),
    torch.cat: ([_x(), _x()], lambda x, y: (([x, y],), {"dim": 1})),
    torch.stack: ([_x(), _x()], lambda x, y: (([x, y],), {})),
    torch.flatten: _unary(1), torch.reshape: _unary((2, -1)), torch.transpose: _unary(1, 2),
    torch.permute: _unary((0, 2, 3, 1)), torch.unsqueeze: _unary(0), torch.squeeze: _unary(),
    torch.split: _unary(2, 1), torch.chunk: _unary(2), torch.narrow: _unary(1, 0, 2),
    torch.where: ([_x() > 0, _x(), _x()], lambda c, x, y: ((c, x, y), {})),
    torch.relu: _unary(), torch.sigmoid: _unary(), torch.tanh: _unary(), torch.exp: _unary(),
    torch.sqrt: _unary(), torch.rsqrt: _unary(), torch.pow: _unary(3), torch.abs: _unary(),
    torch.clamp: _unary(-1, 1), torch.sum: _unary(1), torch.mean: _unary((2, 3)),
    torch.softmax: _unary(-1), torch.cumsum: _unary(2), torch.argmax: _unary(1),
    torch.tril: _unary(), torch.triu: _unary(1),
    torch.masked_fill: ([_x(), _x() > 0], lambda x, m: ((x, m, 0.0), {})),
    torch.gather: ([_x(), torch.zeros(X4, dtype=torch.long)], lambda x, i: ((x, 1, i), {})),
    torch.roll: _unary(1, 2),
    torch.zeros: ([], lambda: ((2, 3), {})), torch.ones: ([], lambda: ((4,), {"dtype": torch.int64})),
    torch.arange: ([], lambda: ((5,), {})), torch.full: ([], lambda: (((2, 2), 1.5), {})),
    torch.zeros_like: _unary(), torch.ones_like: _unary(),
    **{f: _unary() for f in (
        F.relu, F.relu6, F.gelu, F.silu, F.mish, F.hardswish, F.hardsigmoid, F.hardtanh,
        F.leaky_relu, F.elu, F.normalize, F.adaptive_max_pool2d)},
    F.softmax: _unary(1), F.log_softmax: _unary(-1), F.dropout: _unary(0.5, True),
    F.layer_norm: _unary((6,)), F.group_norm: _unary(2),
    F.batch_norm: ([_x(), torch.zeros(4), torch.ones(4)], lambda x, m, v: ((x, m, v), {})),
    F.pad: _unary((1, 2, 2, 1), "reflect"),
    F.embedding: ([torch.randint(0, 5, (2, 3)), _x(5, 4)], lambda i, w: ((i, w), {})),
    F.max_pool1d: ([_x(2, 4, 6)], lambda x: ((x, 2), {})), F.max_pool2d: _unary(3, 2, 1),
    F.max_pool3d: ([_x(1, 2, 4, 4, 4)], lambda x: ((x, 2), {})),
    F.avg_pool1d: ([_x(2, 4, 6)], lambda x: ((x, 2), {})), F.avg_pool2d: _unary(2),
    F.avg_pool3d: ([_x(1, 2, 4, 4, 4)], lambda x: ((x, 2), {})),
    F.adaptive_avg_pool1d: ([_x(2, 4, 6)], lambda x: ((x, 3), {})),
    F.adaptive_avg_pool2d: _unary(1),
    F.adaptive_avg_pool3d: ([_x(1, 2, 4, 4, 4)], lambda x: ((x, 2), {})),
}
FUNCTIONS[F.adaptive_max_pool2d] = _unary(2)


def test_every_known_function_has_a_case():
    assert set(FUNCTIONS) == set(_costs._FUNCTIONS)


@pytest.mark.parametrize("target", FUNCTIONS, ids=lambda f: getattr(f, "__name__", str(f)))
def test_a_known_function_counts_what_flop_counter_mode_counts_without_a_mode(target, dispatched):
    inputs, build = FUNCTIONS[target]
    expected = _check("call_function", target, inputs, build, dispatched)
    assert (expected > 0) is (_costs._FUNCTIONS[target] not in (_costs._zero,))


#: Every Tensor method convert counts without a mode, with a call of it.
METHODS = {
    "matmul": ([_x(2, 3, 4), _x(4, 5)], lambda a, b: ((a, b), {})),
    "mm": ([_x(3, 4), _x(4, 5)], lambda a, b: ((a, b), {})),
    "bmm": ([_x(2, 3, 4), _x(2, 4, 5)], lambda a, b: ((a, b), {})),
    "view": _unary(2, -1), "reshape": _unary(-1), "permute": _unary(0, 2, 3, 1),
    "transpose": _unary(0, 1), "t": ([_x(3, 4)], lambda x: ((x,), {})), "contiguous": _unary(),
    "size": _unary(1), "dim": _unary(), "flatten": _unary(2), "unsqueeze": _unary(-1),
    "squeeze": _unary(), "expand": ([_x(1, 4)], lambda x: ((x, 3, 4), {})),
    "expand_as": ([_x(1, 6), _x()], lambda x, y: ((x, y), {})),
    "view_as": ([_x(2, 144), _x()], lambda x, y: ((x, y), {})),
    "reshape_as": ([_x(2, 144), _x()], lambda x, y: ((x, y), {})),
    "chunk": _unary(2, 1), "split": _unary(3, 2), "unbind": _unary(1), "narrow": _unary(2, 1, 3),
    "to": _unary(torch.float64), "type_as": ([_x(), _x().double()], lambda x, y: ((x, y), {})),
    "float": _unary(), "half": _unary(), "int": _unary(), "long": _unary(), "bool": _unary(),
    "clone": _unary(), "detach": _unary(), "repeat": _unary(1, 2, 1, 1),
    "add": _binary(), "sub": _binary(), "mul": _binary(), "div": _binary(), "add_": _binary(),
    "mul_": _binary(), "neg": _unary(), "exp": _unary(), "pow": _unary(2), "sqrt": _unary(),
    "rsqrt": _unary(), "abs": _unary(), "clamp": _unary(0), "relu": _unary(), "sigmoid": _unary(),
    "tanh": _unary(), "softmax": _unary(-1), "sum": _unary(), "mean": _unary(-1), "argmax": _unary(),
    "masked_fill": ([_x(), _x() > 0], lambda x, m: ((x, m, 1.0), {})),
    "gather": ([_x(), torch.zeros(X4, dtype=torch.long)], lambda x, i: ((x, 2, i), {})),
    "new_zeros": _unary((2, 3)), "new_ones": _unary(3), "fill_": _unary(0.5), "zero_": _unary(),
}


def test_every_known_method_has_a_case():
    assert set(METHODS) == set(_costs._METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_a_known_method_counts_what_flop_counter_mode_counts_without_a_mode(name, dispatched):
    inputs, build = METHODS[name]
    expected = _check("call_method", name, inputs, build, dispatched)
    assert (expected > 0) is (name in ("matmul", "mm", "bmm"))


#: ATen operators in graphs that torch.export and make_fx give: composites with a rule
#: of their own, operators with a formula, and operators that count 0.
OPERATORS = {
    aten.linear.default: ([_x(2, 3, 6), _x(5, 6), _x(5)], lambda x, w, b: ((x, w, b), {})),
    aten.matmul.default: ([_x(2, 1, 3, 4), _x(5, 4, 2)], lambda a, b: ((a, b), {})),
    aten.conv1d.default: ([_x(2, 4, 9), _x(6, 4, 3)], lambda x, w: ((x, w, None, [2]), {})),
    aten.conv2d.default: ([_x(), _x(6, 4, 3, 3)], lambda x, w: ((x, w), {})),
    aten.conv2d.padding: ([_x(), _x(6, 4, 2, 2)], lambda x, w: ((x, w, None, [1, 1], "same"), {})),
    aten.conv1d.padding: ([_x(2, 4, 9), _x(6, 2, 4)], lambda x, w: ((x, w, None, [1], "same", [2], 2), {})),
    aten.conv3d.default: ([_x(1, 4, 3, 4, 5), _x(2, 4, 2, 2, 2)], lambda x, w: ((x, w), {})),
    aten.conv3d.padding: ([_x(1, 4, 3, 4, 5), _x(2, 4, 2, 2, 2)], lambda x, w: ((x, w, None, [1], "valid"), {})),
    aten.conv_transpose1d.default: ([_x(2, 4, 5), _x(4, 2, 3)], lambda x, w: ((x, w), {})),
    aten.conv_transpose2d.input: ([_x(), _x(4, 2, 3, 3)], lambda x, w: ((x, w, None, [2, 2]), {})),
    aten.conv_transpose3d.input: ([_x(1, 4, 3, 3, 3), _x(4, 2, 2, 2, 2)], lambda x, w: ((x, w), {})),
    aten.mm.default: ([_x(3, 4), _x(4, 5)], lambda a, b: ((a, b), {})),
    aten.addmm.default: ([_x(5), _x(3, 4), _x(4, 5)], lambda c, a, b: ((c, a, b), {"beta": 0.5})),
    aten.bmm.default: ([_x(2, 3, 4), _x(2, 4, 5)], lambda a, b: ((a, b), {})),
    aten.baddbmm.default: ([_x(2, 3, 5), _x(2, 3, 4), _x(2, 4, 5)], lambda c, a, b: ((c, a, b), {})),
    aten.convolution.default: ([_x(), _x(2, 4, 3, 3)], lambda x, w: (
        (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {})),
    aten.relu.default: _unary(), aten.add.Tensor: _binary(),
    aten.native_layer_norm.default: ([_x(), _x(6), _x(6)], lambda x, w, b: ((x, [6], w, b, 1e-5), {})),
}


def test_every_aten_composite_with_a_rule_has_a_case():
    assert set(_costs._COMPOSITES) <= set(OPERATORS)


@pytest.mark.parametrize("op", OPERATORS, ids=str)
def test_an_aten_operator_counts_what_flop_counter_mode_counts_without_a_mode(op, dispatched):
    inputs, build = OPERATORS[op]
    expected = _check("call_function", op, inputs, build, dispatched)
    assert (expected > 0) is (op not in (aten.relu.default, aten.add.Tensor,
                                         aten.native_layer_norm.default))


def test_an_operator_given_by_keyword_is_left_to_the_counting_mode(dispatched):
    """The dispatcher passes positional arguments by position, as torch's formulas read them."""
    a, b = _x(3, 4), _x(4, 5)
    _check("call_function", aten.mm.default, [a, b], lambda a, b: ((a,), {"mat2": b}), dispatched,
           known=False)


# --- what is left to the counting mode ----------------------------------------------------------

class _Own(nn.Module):
    def forward(self, x):
        return x @ x.transpose(-1, -2)


class _Attention(nn.Module):
    """Calls that only running them counts: einsum, attention, recurrent and bilinear layers
    (which FlopCounterMode counts 0) and a layer of the model's own kept whole."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = nn.LSTM(8, 4, batch_first=True)
        self.bilinear = nn.Bilinear(8, 8, 3)
        self.own = _Own()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.einsum("bqd,bkd->bqk", x, x)
        y = F.scaled_dot_product_attention(x, x, x)
        z, _ = self.mha(x, x, x)
        h, _ = self.lstm(x)
        return scores, y + z, h, self.bilinear(x, x), self.own(x), self.lin(x)


def test_calls_fxnx_does_not_know_are_counted_by_running_them(dispatched):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model, x = _Attention().eval(), _x(2, 5, 8)
    with sdpa_kernel(SDPBackend.MATH):  # FlopCounterMode has no formula for the CPU's flash kernel
        expected = _flop_counter_mode(model, x)
        G = fxnx.convert(model, x, leaf_modules=[_Own])
    assert G.graph["flops"] == expected
    flops = dict(G.nodes(data="flops"))
    assert [n for n in flops if flops[n]] == ["einsum", "scaled_dot_product_attention", "mha",
                                              "own", "lin"]
    assert {aten.bmm.default, aten.addmm.default} <= set(dispatched)  # the counting mode ran


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) @ self.weight.T.T.T


def _hooked_forward(module, args, out):
    return out @ torch.eye(out.shape[-1])


def _hooked_pre(module, args):
    return (args[0] @ torch.eye(args[0].shape[-1]),)


def _forward_on_instance(layer):
    layer.forward = lambda x: nn.Linear.forward(layer, x) @ torch.eye(layer.out_features)
    return layer


HOOKED = {
    "subclass": lambda: _Doubled(4, 4),
    "forward_hook": lambda: _hook(nn.Linear(4, 4), "register_forward_hook", _hooked_forward),
    "forward_pre_hook": lambda: _hook(nn.Linear(4, 4), "register_forward_pre_hook", _hooked_pre),
    "forward_on_instance": lambda: _forward_on_instance(nn.Linear(4, 4)),
    "relu_with_a_hook": lambda: _hook(nn.ReLU(), "register_forward_hook", _hooked_forward),
}


def _hook(layer, register, hook):
    getattr(layer, register)(hook)
    return layer


@pytest.mark.parametrize("case", HOOKED)
def test_a_known_layer_that_runs_more_than_its_forward_is_counted_by_running_it(case):
    torch.manual_seed(0)
    layer, x = HOOKED[case](), _x(3, 4)
    model = nn.Sequential(layer, nn.ReLU())
    expected = _flop_counter_mode(model, x)
    plain = 0 if "relu" in case else 2 * 3 * 4 * 4
    assert expected > plain  # the hook, the instance's forward or the subclass multiplies more
    leaves = [type(layer)] if case == "subclass" else ()
    G = fxnx.convert(model, x, leaf_modules=leaves)
    assert G.graph["flops"] == expected


def test_a_hook_on_every_module_is_counted_by_running_it():
    x = _x(3, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out @ torch.eye(4) if module is not model else out)
    try:
        expected = _flop_counter_mode(model, x)
        G = fxnx.convert(model, x)
    finally:
        handle.remove()
    assert expected == 2 * 3 * 4 * 4 * 3  # the layer, and the hook after each of two layers
    assert G.graph["flops"] == expected


def test_a_count_that_fails_while_propagating_an_unknown_call_is_made_again_on_meta_tensors(
    monkeypatch,
):
    """The counting mode's failure (here, made up) leaves the propagation's counts; the
    graph is counted again on meta tensors."""
    def fails(self, func, types, args=(), kwargs=None):
        raise RuntimeError("this dispatch mode cannot run here")

    class Einsum(nn.Module):
        def forward(self, x):
            return torch.einsum("ij,jk->ik", x, x)

    x = _x(3, 3)
    monkeypatch.setattr(_costs._Counter, "__torch_dispatch__", fails)
    G = fxnx.convert(Einsum(), x)
    assert G.graph["flops"] == _flop_counter_mode(Einsum(), x) == 2 * 3 * 3 * 3


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_convolutional_networks_are_counted_without_the_mode(name, torchvision_model, dispatched):
    """Every layer and function of these networks is known: nothing runs in the counting
    mode, and the count is still FlopCounterMode's."""
    model, x = torchvision_model(name), _x(1, 3, 64, 64)
    G = fxnx.convert(model, x)
    assert G.graph["flops"] == _flop_counter_mode(model, x) > 0
    assert dispatched == []


def test_fake_tensors_are_counted_without_the_mode(torchvision_model, dispatched):
    model, x = torchvision_model("resnet18"), _x(2, 3, 32, 32)
    G = fxnx.convert(model, x, fake=True)
    assert G.graph["flops"] == _flop_counter_mode(model, x)
    assert dispatched == []


def test_a_sparse_matrix_product_is_left_to_the_counting_mode(dispatched):
    a, b = torch.eye(4).to_sparse(), _x(4, 3)
    expected = _check("call_function", torch.mm, [a, b], lambda a, b: ((a, b), {}), dispatched,
                      known=False)
    assert expected == 2 * 4 * 4 * 3
