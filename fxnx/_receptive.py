"""Receptive fields: which input pixels each node of a convolutional network can see.

Pure graph logic over a converted ``MultiDiGraph`` (with shapes), plus the
model's modules when it is given to read their kernel sizes, strides, padding
and dilation; nothing here imports torch.

Each node's field follows Araujo, Norris and Sim (2019), "Computing receptive
fields of convolutional neural networks", Distill: per spatial dimension, a
convolution or pooling with kernel ``k``, stride ``s``, padding ``p`` and
dilation ``d`` maps the field of its input (``size r``, ``jump j``,
``start u``) to

    r' = r + (k - 1) * d * j,    j' = j * s,    u' = u - p * j,

so the centre moves by ``((k - 1) / 2 * d - p) * j``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import networkx as nx

from ._analysis import topological_order
from ._contract import explained
from ._errors import FxnxValueError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ReceptiveField", "receptive_fields"]


@dataclass(frozen=True)
class ReceptiveField:
    """The input pixels one node's values depend on, per spatial dimension of the input.

    The output position ``i`` (along one dimension) of the node sees the input
    pixels ``start + i * jump`` to ``start + i * jump + size - 1``, both
    included, in the input's own coordinates (pixel 0 is the first). Padding
    makes ``start`` negative and lets a field reach past the input's end; the
    pixels there do not exist (zero padding), so :meth:`box` with ``within``
    clips them.

    Attributes
    ----------
    size : tuple of int
        The field's extent in input pixels.
    jump : tuple of int
        How far the field moves, in input pixels, from one output position to
        the next (the product of the strides so far). ``0`` means the node has
        no spatial grid along that dimension any more (after ``flatten``, a
        ``Linear`` layer, an op fxnx does not know, or broadcasting a
        globally pooled tensor): ``size`` and ``start`` then describe the
        node as a whole, the union of everything it reads.
    start : tuple of int
        The first input pixel of output position 0's field: Araujo et al.'s
        ``u``. The field's centre is :attr:`center`.

    Examples
    --------
    A 3×3 convolution with padding 1, then a 2×2 max-pool with stride 2:

    >>> rf = ReceptiveField(size=(4, 4), jump=(2, 2), start=(-1, -1))
    >>> rf.center
    (0.5, 0.5)
    >>> rf.box(3, 0)
    ((5, 9), (-1, 3))
    >>> rf.box(3, 0, within=(8, 8))
    ((5, 8), (0, 3))
    """

    size: tuple[int, ...]
    jump: tuple[int, ...]
    start: tuple[int, ...]

    @property
    def center(self) -> tuple[float, ...]:
        """The centre of output position 0's field, in input pixels (``start + (size - 1) / 2``)."""
        return tuple(u + (r - 1) / 2 for u, r in zip(self.start, self.size, strict=True))

    def box(self, *index: int, within: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
        """The input pixels output position ``index`` sees: ``(first, stop)`` per dimension,
        half open, as Python slices count.

        The box is the field's extent: a dilated field has gaps inside it that the position
        does not see, and ``within`` clips the extent to the input, so at the input's edge
        a dilated field's box can begin or end on such a gap (a 3×3 convolution with
        dilation 2 and padding 2 sees rows 1 and 3 for output row 1; its box is rows 0 to
        3). It never leaves out a pixel the position sees.

        Parameters
        ----------
        *index : int
            The output position, one index per spatial dimension (none needed
            where every ``jump`` is 0).
        within : sequence of int, optional
            The input's spatial size: the box is clipped to the pixels that exist.

        Raises
        ------
        FxnxValueError
            ``index`` or ``within`` does not have one entry per spatial dimension.
        """
        rank = len(self.size)
        if not index and not any(self.jump):
            index = (0,) * rank
        if len(index) != rank or (within is not None and len(within) != rank):
            raise FxnxValueError(
                f"box() takes one index per spatial dimension ({rank}) and within= of the same "
                f"length; got index {index!r}, within={within!r}"
            )
        spans = []
        for d in range(rank):
            first = self.start[d] + index[d] * self.jump[d]
            stop = first + self.size[d]
            if within is not None:
                first, stop = max(first, 0), min(stop, within[d])
            spans.append((first, stop))
        return tuple(spans)


# What each kind of node does to a field. Module types are matched exactly: a subclass may
# compute something else (timm's Conv2dSame pads in its forward), so it counts as unknown.
_NN = "torch.nn.modules."
_F = "torch.nn.functional."
_ATEN = "torch.ops.aten."
_DIMS = (1, 2, 3)
_CONV_MODULES = {f"{_NN}conv.Conv{d}d" for d in _DIMS}
_POOL_MODULES = {f"{_NN}pooling.{kind}Pool{d}d" for kind in ("Max", "Avg") for d in _DIMS}
_ADAPTIVE_MODULES = {
    f"{_NN}pooling.Adaptive{kind}Pool{d}d" for kind in ("Max", "Avg") for d in _DIMS}
_POINTWISE_MODULES = {
    *(f"{_NN}batchnorm.{name}"
      for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")),
    *(f"{_NN}activation.{name}" for name in (
        "CELU", "ELU", "GELU", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU", "LogSigmoid",
        "Mish", "PReLU", "ReLU", "ReLU6", "RReLU", "SELU", "SiLU", "Sigmoid", "Softplus",
        "Softsign", "Tanh", "Tanhshrink", "Threshold")),
    *(f"{_NN}dropout.{name}" for name in (
        "AlphaDropout", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "FeatureAlphaDropout")),
    f"{_NN}linear.Identity",
    "torchvision.ops.misc.FrozenBatchNorm2d",
}
#: Positional parameter names of the calls, for calls that fxnx could not bind
#: (``F.max_pool2d`` is dispatched on a flag, so its ``node_call_info`` holds ``args``).
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation")
_MAXPOOL_ARGS = ("input", "kernel_size", "stride", "padding", "dilation")
_AVGPOOL_ARGS = ("input", "kernel_size", "stride", "padding")
_CONV_FUNCTIONS = {
    *(f"{prefix}conv{d}d" for prefix in ("torch.", _F) for d in _DIMS),
    *(f"{_ATEN}conv{d}d.default" for d in _DIMS),
    f"{_ATEN}convolution.default",  # then transposed, output_padding, groups
}
_POOL_FUNCTIONS = {
    **{f"{prefix}max_pool{d}d": _MAXPOOL_ARGS for prefix in ("torch.", _F) for d in _DIMS},
    **{f"{prefix}avg_pool{d}d": _AVGPOOL_ARGS
       for prefix in ("torch.", _F, "torch._C._nn.") for d in _DIMS},
    **{f"{_ATEN}max_pool{d}d{suffix}.default": _MAXPOOL_ARGS
       for d in _DIMS for suffix in ("", "_with_indices")},
    **{f"{_ATEN}avg_pool{d}d.default": _AVGPOOL_ARGS for d in _DIMS},
}
_ADAPTIVE_FUNCTIONS = {
    f"{prefix}adaptive_{kind}_pool{d}d"
    for prefix in ("torch.", _F, "torch._C._nn.") for kind in ("avg", "max") for d in _DIMS
} | {f"{_ATEN}{lead}adaptive_avg_pool{d}d.default" for lead in ("", "_") for d in _DIMS}
_ACTIVATIONS = (
    "celu", "elu", "gelu", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "mish",
    "relu", "relu6", "selu", "sigmoid", "silu", "softplus", "tanh",
)
_POINTWISE_FUNCTIONS = {
    *(f"operator.{op}"
      for op in ("add", "iadd", "sub", "isub", "mul", "imul", "truediv", "itruediv", "neg")),
    *(f"torch.{op}"
      for op in ("add", "sub", "mul", "div", "neg", "relu", "relu_", "sigmoid", "tanh")),
    *(f"{_F}{op}" for op in (
        *_ACTIVATIONS, "batch_norm", "dropout", "dropout1d", "dropout2d", "dropout3d")),
    *(f"{_ATEN}{op}" for op in (
        "add.Tensor", "add_.Tensor", "sub.Tensor", "mul.Tensor", "mul_.Tensor", "div.Tensor",
        "relu.default", "relu_.default", "hardtanh.default", "hardtanh_.default",
        "sigmoid.default", "silu.default", "gelu.default", "clone.default", "dropout.default",
        "native_batch_norm.default", "_native_batch_norm_legit_no_training.default",
        "_native_batch_norm_legit.default")),
}
_POINTWISE_METHODS = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "relu", "relu_",
    "sigmoid", "sigmoid_", "tanh", "tanh_", "clone", "contiguous", "float", "double", "half", "to",
    "__add__", "__radd__", "__iadd__", "__mul__", "__rmul__", "__sub__", "__truediv__",
}
#: Concatenations: they keep the grid when they join along a dimension that is not spatial.
_CAT = {"torch.cat", "torch.concat", "torch.concatenate", f"{_ATEN}cat.default"}


@explained
def receptive_fields(
    G: nx.MultiDiGraph, model: nn.Module | None = None, *, input: str | None = None
) -> dict[str, ReceptiveField | None]:
    """The receptive field of every node with respect to one input, from ``G`` alone.

    Convolutions and poolings (``nn.ConvNd``, ``nn.MaxPoolNd``, ``nn.AvgPoolNd``,
    their adaptive forms, and the ``F.*`` and ATen calls) apply the recurrence in
    the module's docstring, their kernel size, stride, padding and dilation read
    from the model's module (``model``) or from the call's arguments
    (``node_call_info``; a functional convolution's kernel from its weight's
    shape). Pointwise nodes (normalisation, activations, dropout, arithmetic,
    ``cat`` along channels) keep their input's field; where they join several
    fields on the same grid (a residual ``add``), each position's field is the
    smallest box holding all of them (their union, as a bounding box). A global
    or adaptive pooling whose output size divides its input's is a pooling
    with kernel and stride ``input // output``, so a global pool's field is the
    union of its input's. Any other node (``flatten``, ``Linear``, attention,
    reshapes, upsampling, inputs on different grids) gets the union of every
    field it reads, for the node as a whole, with ``jump`` 0: an upper bound.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert` with example inputs (shapes are needed).
    model : nn.Module, optional
        The model ``G`` was converted from, to read its convolution and pooling
        modules' settings. Needed where ``G`` has ``call_module`` nodes for them.
    input : str, optional
        The input node the fields are measured in; default the first input
        (placeholder) with at least three dimensions ``(N, C, *spatial)``.

    Returns
    -------
    dict
        Every node of ``G`` to its :class:`ReceptiveField`, or to None where
        the node does not depend on the input's values (parameters, constants,
        other inputs, shapes read from tensors).

    Raises
    ------
    FxnxValueError
        No such input, no input with spatial dimensions (or ``G`` has no shapes),
        a convolution or pooling module when ``model`` was not given, or a
        ``model`` without the modules ``G`` calls.

    Notes
    -----
    Fields assume zero padding: a padded pixel sees nothing. A reflecting or
    replicating pad reads pixels inside the clipped box; a circular pad reads
    the far side, outside it. Padding ``"same"`` puts the smaller half first,
    as torch does. A normalisation is counted as pointwise: BatchNorm in eval
    mode is; its batch statistics in training mode, and GroupNorm's or
    InstanceNorm's at any time, depend on every position (those are unknown
    ops here, so their fields are unions). A convolution's ``groups`` do not
    change its field.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    ...     torch.nn.Conv2d(8, 8, 3, dilation=2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    >>> G = fxnx.convert(model, torch.zeros(1, 3, 32, 32))
    >>> fields = receptive_fields(G, model)
    >>> fields["_2"]
    ReceptiveField(size=(4, 4), jump=(2, 2), start=(-1, -1))
    >>> fields["_3"]
    ReceptiveField(size=(12, 12), jump=(2, 2), start=(-1, -1))
    >>> fields["_5"].jump, fields["_5"].box(within=(32, 32))
    ((0, 0), ((0, 32), (0, 32)))
    """
    source = _input_node(G, input)
    rank = len(G.nodes[source]["out_shape"]) - 2
    fields: dict[str, ReceptiveField | None] = {}
    for node in topological_order(G):
        if node == source:
            fields[node] = ReceptiveField((1,) * rank, (1,) * rank, (0,) * rank)
            continue
        reads = [
            (data.get("arg"), cast(ReceptiveField, fields[u]), data.get("shape"))  # not None: filtered below
            for u, _, data in G.in_edges(node, data=True)
            # shapes and other plain values read from a tensor carry no dtype: not data
            if fields.get(u) is not None and data.get("dtype") is not None
        ]
        fields[node] = _field(G, node, reads, rank, model) if reads else None
    return fields


def _input_node(G: nx.MultiDiGraph, name: str | None) -> str:
    primals = G.graph.get("primals", {})
    inputs = [
        n for n in topological_order(G)
        if G.nodes[n].get("op") == "placeholder"
        and primals.get(n, {}).get("kind", "input") == "input"
    ]
    shapes = {n: G.nodes[n].get("out_shape") for n in inputs}
    if name is not None and name not in inputs:
        raise FxnxValueError(
            f"receptive_fields: input={name!r} is not an input of G; its inputs are {inputs}")
    for n in [name] if name is not None else inputs:
        if isinstance(shapes[n], tuple) and len(shapes[n]) >= 3:
            return n
    raise FxnxValueError(
        f"receptive_fields: G has no input of shape (N, C, *spatial) (its inputs: {shapes}); "
        "convert the model with example inputs, or name one with input="
    )


def _field(
    G: nx.MultiDiGraph, node: str, reads: list[tuple[Any, ReceptiveField, Any]], rank: int,
    model: Any,
) -> ReceptiveField | None:
    data = G.nodes[node]
    op, target = data.get("op"), data.get("target")
    main = next((rf for arg, rf, _ in reads if arg in (0, "input", "self")), None)
    if main is not None:
        geometry = _geometry(G, node, model)
        if geometry is not None:
            return _apply(main, *(_per_dim(v, rank) for v in geometry)) or _union(reads, rank)
        if (data.get("module_type") in _ADAPTIVE_MODULES if op == "call_module"
                else target in _ADAPTIVE_FUNCTIONS):
            return _adaptive(G, node, main, reads, rank)
    if _pointwise(data, rank) or op == "output":
        return _grid_union(G, node, reads, rank) or _union(reads, rank)
    if target == "operator.getitem" and _tuple_element(G, node):
        return reads[0][1]  # the value of a tuple-valued op (ATen batch norm, max-pool, indices)
    return _union(reads, rank)


def _geometry(G: nx.MultiDiGraph, node: str, model: Any) -> tuple[Any, ...] | None:
    """A convolution's or pooling's kernel size, stride, padding and dilation; else None."""
    data = G.nodes[node]
    op, target, kind = data.get("op"), data.get("target"), data.get("module_type")
    if op == "call_module" and kind in _CONV_MODULES | _POOL_MODULES:
        if model is not None:
            try:
                module = model.get_submodule(target)
            except AttributeError as err:
                raise FxnxValueError(
                    f"receptive_fields: node {node!r} calls module {target!r}, which the model "
                    "does not have: pass the model G was converted from"
                ) from err
            settings = [getattr(module, key, None) for key in _SETTINGS]
        elif "kernel_size" in data:
            settings = [data.get(key) for key in _SETTINGS]
        else:
            raise FxnxValueError(
                f"receptive_fields: node {node!r} calls {kind} ({target!r}), whose kernel size, "
                "stride and padding G does not hold; pass the model: receptive_fields(G, model)"
            )
        return (_conv_geometry if kind in _CONV_MODULES else _pool_geometry)(*settings)
    if op != "call_function":
        return None
    if target in _CONV_FUNCTIONS:
        args = _bound(data.get("node_call_info", {}), _CONV_ARGS)
        kernel = next((edge["shape"][2:] for *_, edge in G.in_edges(node, data=True)
                       if edge.get("arg") in ("weight", 1) and edge.get("shape")), None)
        if args.get("transposed") or kernel is None:
            return None
        return _conv_geometry(kernel, *(args.get(key) for key in _SETTINGS[1:]))
    if target in _POOL_FUNCTIONS:
        args = _bound(data.get("node_call_info", {}), _POOL_FUNCTIONS[target])
        return _pool_geometry(*(args.get(key) for key in _SETTINGS))
    return None


#: What :func:`_geometry` reads, in the order the recurrence takes it.
_SETTINGS = ("kernel_size", "stride", "padding", "dilation")


def _conv_geometry(kernel: Any, stride: Any, padding: Any, dilation: Any) -> tuple[Any, ...]:
    kernel = tuple(kernel) if isinstance(kernel, (list, tuple)) else kernel
    dilation = 1 if dilation in (None, [], ()) else dilation
    if padding == "valid":
        padding = 0
    elif padding == "same":
        ks, ds = _broadcast(kernel, dilation)
        padding = tuple(d * (k - 1) // 2 for k, d in zip(ks, ds, strict=True))
    return kernel, 1 if stride in (None, [], ()) else stride, padding or 0, dilation


def _pool_geometry(kernel: Any, stride: Any, padding: Any, dilation: Any) -> tuple[Any, ...]:
    stride = kernel if stride in (None, [], ()) else stride  # a pooling's defaults to its kernel
    return kernel, stride, padding or 0, 1 if dilation in (None, [], ()) else dilation


def _broadcast(*values: Any) -> list[tuple[int, ...]]:
    """Ints and tuples to tuples of one length (the longest)."""
    rank = max((len(v) for v in values if isinstance(v, (list, tuple))), default=1)
    return [tuple(v) if isinstance(v, (list, tuple)) else (v,) * rank for v in values]


def _per_dim(value: Any, rank: int) -> tuple[int, ...] | None:
    """An int or a sequence as one int per spatial dimension, or None when it does not fit."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return (value,) * rank
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        if len(value) == rank:
            return tuple(value)
        if len(value) == 1:
            return tuple(value) * rank
    return None


def _apply(
    rf: ReceptiveField, kernel: Any, stride: Any, padding: Any, dilation: Any
) -> ReceptiveField | None:
    """Araujo et al.'s recurrence, or None where a setting has the wrong number of dimensions."""
    if None in (kernel, stride, padding, dilation):
        return None
    per_dim = zip(rf.size, rf.jump, rf.start, kernel, stride, padding, dilation, strict=True)
    size, jump, start = zip(*((r + (k - 1) * d * j, j * s, u - p * j)
                              for r, j, u, k, s, p, d in per_dim), strict=True)
    return ReceptiveField(size=size, jump=jump, start=start)


def _adaptive(
    G: nx.MultiDiGraph, node: str, main: ReceptiveField, reads: list[Any], rank: int
) -> ReceptiveField | None:
    """An adaptive pooling whose output divides its input is a plain one; otherwise, a union."""
    extents = _spatial(next(shape for _, rf, shape in reads if rf is main), rank)
    out = _spatial(G.nodes[node].get("out_shape"), rank)
    if extents is None or out is None or any(n % o for n, o in zip(extents, out, strict=True)):
        return _union(reads, rank)
    kernel = tuple(n // o for n, o in zip(extents, out, strict=True))
    return _apply(main, kernel, kernel, (0,) * rank, (1,) * rank) or _union(reads, rank)


def _pointwise(data: dict[str, Any], rank: int) -> bool:
    op, target = data.get("op"), data.get("target")
    if op == "call_module":
        return data.get("module_type") in _POINTWISE_MODULES
    if op == "call_method":
        return target in _POINTWISE_METHODS
    if target in _CAT:
        dim = _bound(data.get("node_call_info", {}), ("tensors", "dim")).get("dim", 0)
        shape = _spatial_shape(data.get("out_shape"))
        if shape is None or not isinstance(dim, int):
            return False
        return dim % len(shape) < len(shape) - rank  # along channels, not a spatial dimension
    return op == "call_function" and target in _POINTWISE_FUNCTIONS


def _grid_union(
    G: nx.MultiDiGraph, node: str, reads: list[Any], rank: int
) -> ReceptiveField | None:
    """The per-position union of fields on the node's own grid; None where an input is on
    another grid (another jump, or broadcast along a spatial dimension)."""
    out = _spatial(G.nodes[node].get("out_shape"), rank)
    fields = [rf for _, rf, shape in reads if out is not None and _spatial(shape, rank) == out]
    if len(fields) != len(reads) or len({rf.jump for rf in fields}) != 1:
        return None
    return _bounding(fields, fields[0].jump)


def _union(reads: list[Any], rank: int) -> ReceptiveField | None:
    """Everything the node reads, as one field for the node as a whole (jump 0)."""
    wholes = []
    for _, rf, shape in reads:
        extents = _spatial(shape, rank) if any(rf.jump) else (1,) * rank
        if extents is None:
            return None
        wholes.append(ReceptiveField(
            size=tuple(r + (n - 1) * j for r, n, j in zip(rf.size, extents, rf.jump, strict=True)),
            jump=(0,) * rank,
            start=rf.start,
        ))
    return _bounding(wholes, (0,) * rank)


def _bounding(fields: Iterable[ReceptiveField], jump: tuple[int, ...]) -> ReceptiveField:
    fields = list(fields)
    first = tuple(map(min, zip(*(rf.start for rf in fields), strict=True)))
    stops = (map(operator.add, rf.start, rf.size) for rf in fields)
    stop = tuple(map(max, zip(*stops, strict=True)))
    return ReceptiveField(size=tuple(map(operator.sub, stop, first)), jump=jump, start=first)


def _spatial_shape(shape: Any) -> tuple[int, ...] | None:
    """A tensor's shape; for a tuple-valued op, its first element's."""
    if isinstance(shape, list) and shape and isinstance(shape[0], tuple):
        shape = shape[0]
    if isinstance(shape, tuple) and all(isinstance(v, int) for v in shape):
        return shape
    return None


def _spatial(shape: Any, rank: int) -> tuple[int, ...] | None:
    shape = _spatial_shape(shape)
    return shape[len(shape) - rank:] if shape is not None and len(shape) >= rank else None


def _tuple_element(G: nx.MultiDiGraph, node: str) -> bool:
    """Whether ``node`` takes from a tuple-valued op an element shaped like its first."""
    sources = list(G.predecessors(node))
    if len(sources) != 1 or not isinstance(G.nodes[sources[0]].get("out_shape"), list):
        return False
    element = _spatial_shape(G.nodes[node].get("out_shape"))
    return element == _spatial_shape(G.nodes[sources[0]]["out_shape"])


def _bound(info: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A call's arguments by name: ``node_call_info`` as bound, or its ``args`` and
    ``kwargs`` where fxnx could not bind the call (the positional names are then ``names``)."""
    if set(info) == {"args", "kwargs"}:
        return {**dict(zip(names, info["args"], strict=False)), **info["kwargs"]}
    if all(k.isdigit() for k in info) and info:  # ATen arguments keyed by position
        return {name: info[str(i)] for i, name in enumerate(names) if str(i) in info}
    return info
