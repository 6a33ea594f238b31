"""Memory over a pass: the bytes of live activations at each step of ``G``'s order.

Read from the graph alone, without running the model (a graph loaded from a
file works, without torch). What is counted:

* **Storages, not values.** A node that makes new memory (a convolution, an
  addition) makes one storage per tensor it returns, of ``numel × itemsize``
  bytes from its ``out_shape`` and ``out_dtype``. Views (``view``,
  ``transpose``, ``expand``, ``chunk``, ``x[0]`` …, :data:`VIEW_NAMES`; at
  ATen level :data:`ATEN_VIEWS`), in-place ops (``relu_``, ``add_``,
  ``x += y``, ``F.relu(x, inplace=True)``, ``out=``), ``getitem`` of one
  output of several, ``nn.Identity``, ``nn.Flatten`` and a dropout outside
  training make none: their output shares their input's storage. ``reshape``,
  ``flatten`` and ``contiguous`` share it unless their input went through a
  transposing view (``transpose``, ``permute``, ``expand`` …), when they copy;
  ``to``, ``float`` and the like share it when shape and dtype stay. Indexing
  with a tensor copies.
* **Liveness.** A storage is live from the step of the node that makes it to
  the step of the last node that reads it or any view of it, in ``order``; the
  ``output`` node reads the outputs, so they live to the end. At each step what
  the node reads and what it makes are both live; a value nobody reads is live
  at its own step only. With ``eager=True``, a tensor passed to a module also
  stays live until that module returns (its ``forward`` holds it), as when the
  model runs eagerly; Python locals beyond that are not in the graph.
* **Apart.** Graph inputs (``placeholder`` nodes: at ATen level the
  ``primals_*`` of kind ``input`` and the ``tangents_*``) are ``input_bytes``;
  parameters and buffers (``get_attr`` nodes, ``primals_*`` of kind
  ``parameter`` or ``buffer``) are ``param_bytes``. Views of them and writes
  into them cost nothing. What an op allocates inside itself (a workspace; at
  module level, whatever a leaf module such as ``nn.MultiheadAttention``
  makes inside) is not in the graph and not counted: ``level="aten"`` shows
  a leaf module's inside.

On a ``level="joint"`` graph (forward and backward of a training step in one
graph) the same rule gives the step: a forward value that a backward node reads
is live until that read, gradients (of parameters too) are storages the
backward pass makes, ``peak_bytes`` is the step's peak and ``saved_bytes`` what
the forward pass keeps for the backward pass.

Module-level graphs do not show everything: ``out += x`` in a module's code is
traced as ``operator.add`` and counts as a new storage (one tensor too many at
that step). A ``level="aten"`` graph records it as ``add_``. A module that
writes into its input (``nn.ReLU(inplace=True)``) is marked ``writes_input``,
and one that returns its input itself (a dropout layer in eval mode)
``returns_input``: each shares its input's storage; a graph converted before those
marks counts it as a new storage.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx

from ._contract import explained
from ._errors import FxnxTypeError, GraphContractError

__all__ = ["MemoryProfile", "memory_profile"]

#: Bytes per element of each dtype as fxnx graphs write it (``str(torch.float32)``).
ITEMSIZE: dict[str, int] = {
    f"torch.{name}": size
    for size, names in {
        1: "bool int8 uint8 qint8 quint8 quint4x2 quint2x4 float8_e4m3fn float8_e4m3fnuz "
           "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 bits8 bits1x8 bits2x4 "
           "bits4x2",
        2: "float16 bfloat16 int16 uint16 bits16",
        4: "float32 int32 uint32 qint32 complex32 bcomplex32",
        8: "float64 int64 uint64 complex64",
        16: "complex128",
    }.items()
    for name in names.split()
}

#: Tensor methods and ``torch`` functions (module level) that return a view of their first
#: argument: no new storage. (``reshape``, ``flatten`` and ``contiguous`` are views only of a
#: contiguous input; ``to`` and the like return their input only when nothing changes.)
VIEW_NAMES = frozenset(
    "view view_as unflatten squeeze unsqueeze transpose swapaxes swapdims permute movedim "
    "moveaxis t adjoint expand expand_as broadcast_to narrow select unfold chunk split "
    "tensor_split hsplit vsplit dsplit unbind as_strided detach diagonal real imag view_as_real "
    "view_as_complex conj positive".split()
)

#: ATen operators (the name between ``aten.`` and the overload) whose outputs share their
#: first argument's storage: those whose schema returns ``Tensor(a)``, and ``_unsafe_view``,
#: ``unsafe_split`` and ``unsafe_chunk``, which share it without saying so.
ATEN_VIEWS = frozenset(
    "view _unsafe_view alias as_strided t transpose permute expand expand_as broadcast_to squeeze "
    "unsqueeze slice slice_inverse select narrow split split_with_sizes unsafe_split "
    "unsafe_split_with_sizes chunk unsafe_chunk tensor_split hsplit vsplit dsplit unbind diagonal "
    "linalg_diagonal unfold view_as detach _reshape_alias unflatten movedim moveaxis swapaxes "
    "swapdims real imag view_as_real view_as_complex conj _conj _neg_view positive lift_fresh "
    "numpy_T mT mH matrix_H adjoint indices values _indices _values crow_indices col_indices "
    "ccol_indices row_indices _fw_primal _make_dual _unpack_dual _ncf_view _ncf_unsqueeze "
    "_sparse_broadcast_to _nested_view_from_buffer _nested_view_from_jagged "
    "_nested_get_values".split()
)

#: Views that can leave their output non-contiguous, so that a later ``reshape`` copies.
_STRIDED = frozenset(
    "transpose swapaxes swapdims permute movedim moveaxis t expand expand_as broadcast_to "
    "as_strided diagonal unfold adjoint numpy_T mT mH matrix_H".split()
)
#: Views only if their input is contiguous; else they copy.
_RESHAPES = frozenset("reshape reshape_as flatten ravel contiguous".split())
#: Calls that return their input when it already is what they make (same shape and dtype),
#: else a new tensor. The graph does not record devices: ``cpu``, ``cuda`` and ``to`` count as
#: returning their input whenever the dtype stays.
_MAYBE_SELF = frozenset(
    "to type type_as float double half bfloat16 int long short bool byte char cpu cuda pin_memory "
    "resolve_conj resolve_neg coalesce _grad_sum_to_size _autocast_to_full_precision "
    "_autocast_to_reduced_precision".split()
)
#: Augmented assignments (``x += y``), as ``operator`` functions and as methods: they write
#: into their first argument.
_IN_PLACE_OPERATORS = frozenset(
    spelling
    for name in operator.__all__ if name.startswith("i") and name[1:] in operator.__all__
    for spelling in (f"operator.{name}", f"__{name}__")
)
_CALLS = frozenset({"call_module", "call_function", "call_method"})
#: Modules that return their input, or a view of it.
_VIEW_MODULES = frozenset({
    "torch.nn.modules.linear.Identity",
    "torch.nn.modules.flatten.Flatten",
    "torch.nn.modules.flatten.Unflatten",
})


@dataclass(frozen=True)
class MemoryProfile:
    """The bytes of live activations at each step of a pass over ``G``.

    Attributes
    ----------
    live_bytes : dict of str to int
        Node name to the bytes of activation storages live while it runs (what
        it reads and what it makes included), in ``G``'s ``order``.
    peak_bytes : int
        The largest of ``live_bytes``.
    peak_node : str
        The first node at which ``peak_bytes`` is reached.
    input_bytes : int
        Bytes of the graph's inputs (tangents included), not in ``live_bytes``.
    param_bytes : int
        Bytes of parameters and buffers, not in ``live_bytes``.
    saved_bytes : int or None
        On a joint graph, the bytes of forward values that backward nodes read:
        what a training step keeps for its backward pass. None on other graphs.
    saved : tuple of str
        The nodes that make those values, in order (empty on other graphs).
    unknown : tuple of str
        Nodes whose output size the graph does not know (no shape, a symbolic
        size or an unknown dtype): counted as 0 bytes.
    """

    live_bytes: dict[str, int]
    peak_bytes: int
    peak_node: str
    input_bytes: int
    param_bytes: int
    saved_bytes: int | None
    saved: tuple[str, ...]
    unknown: tuple[str, ...]


@dataclass
class _Storage:
    nbytes: int
    kind: str  # "activation", "input" or "param"
    maker: str
    first: int
    last: int
    saved: bool = False


@explained
def memory_profile(G: nx.MultiDiGraph, *, eager: bool = False) -> MemoryProfile:
    """The bytes of live activations at each step of ``G``'s order, and the peak.

    See the module documentation (``fxnx._memory``) for what is counted: every
    storage an op makes, from the node that makes it to its last reader, views
    and in-place ops sharing their source's storage; inputs, parameters and
    buffers apart. On a ``level="joint"`` graph this is a training step, and
    ``saved_bytes`` is what the forward pass keeps for the backward pass.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert` (any level), or read from a file.
    eager : bool
        Also keep each tensor passed to a module alive until that module's
        ``forward`` returns, as eager PyTorch does (``Module.__call__`` holds
        its arguments), using each node's ``scope``. By default a value dies at
        its last use, as when the captured graph itself runs.

    Returns
    -------
    MemoryProfile

    Raises
    ------
    FxnxTypeError
        ``G`` is not a networkx graph.
    GraphContractError
        A node lacks its int ``order``, or reads a node that comes later.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Flatten())
    >>> profile = memory_profile(fxnx.convert(model, torch.zeros(4, 8)))
    >>> profile.live_bytes
    {'input_1': 0, '_0': 256, '_1': 512, '_2': 256, 'output': 256}
    >>> profile.peak_bytes, profile.peak_node, profile.input_bytes
    (512, '_1', 128)
    """
    if not isinstance(G, nx.Graph):
        raise FxnxTypeError(f"memory_profile needs a networkx graph, got {type(G).__qualname__}")
    steps = _in_order(G)
    weights = {name for name, p in G.graph.get("primals", {}).items() if p.get("kind") != "input"}
    storages: list[_Storage] = []
    values: dict[str, dict[Any, tuple[int, ...]]] = {}  # node -> output element -> storage ids
    strided: set[str] = set()  # views that may be non-contiguous: a reshape of them copies
    unknown = []
    returns = _returns(G, steps) if eager else [{}] * len(steps)
    for step, node in enumerate(steps):
        data = G.nodes[node]
        backward = data.get("phase") == "backward" and data.get("op") != "output"
        for u in G.predecessors(node):
            if u not in values:
                raise GraphContractError(
                    f"node {node!r} (order {data['order']}) reads {u!r}, which comes later "
                    f"(order {G.nodes[u]['order']}): 'order' must be an order the graph can run in"
                )
            last = _held_until(returns[step], _path(G.nodes[u]), step)
            for sid in _all(values[u]):
                storages[sid].last = max(storages[sid].last, last)
                storages[sid].saved |= backward
        if data.get("op") == "output":
            values[node] = {}
            continue
        source = _storage_source(G, node, strided)
        if source is not None:
            values[node] = _shared(G, node, values[source])
            if source in strided or _name(data) in _STRIDED:
                strided.add(node)
            continue
        kind = "activation"
        if data.get("op") == "get_attr" or node in weights:
            kind = "param"
        elif data.get("op") == "placeholder":
            kind = "input"
        values[node] = {}
        for key, nbytes in _elements(data):
            if nbytes is None:
                unknown.append(node)
            values[node][key] = (len(storages),)
            storages.append(_Storage(nbytes or 0, kind, node, step, step))
    return _profile(G, steps, storages, tuple(dict.fromkeys(unknown)))


def _path(data: dict[str, Any]) -> str:
    """The module a node runs in: a ``call_module`` node's own module, else its ``scope``."""
    path = data.get("target") if data.get("op") == "call_module" else data.get("scope")
    return path if isinstance(path, str) else ""


def _returns(G: nx.MultiDiGraph, steps: list[str]) -> list[dict[str, int]]:
    """For each forward call at each step, the step at which each module around it returns:
    ``{"layer1": 40, "layer1.0": 12, "layer1.0.conv1": 5}``. A module's call is a run of
    consecutive forward calls inside it; other steps do not interrupt it."""
    returns: list[dict[str, int]] = [{} for _ in steps]
    after: dict[str, int] = {}  # the calls of the next forward call, and where they return
    for step in reversed(range(len(steps))):
        data = G.nodes[steps[step]]
        if data.get("op") in _CALLS and data.get("phase", "forward") == "forward":
            parts = _path(data).split(".") if _path(data) else []
            after = {p: after.get(p, step) for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1))}
            returns[step] = after
    return returns


def _held_until(returns: dict[str, int], source: str, step: int) -> int:
    """Until when a value made in module ``source`` and read at ``step`` is held: until the
    outermost module around the reader that the value came into as an argument returns."""
    for module, end in returns.items():  # outermost first
        if source != module and not source.startswith(module + "."):
            return end
    return step


def _in_order(G: nx.MultiDiGraph) -> list[str]:
    for node, order in G.nodes(data="order"):
        if type(order) is not int:
            raise GraphContractError(
                f"node {node!r} has order {order!r}: memory_profile follows each node's int "
                "'order' (fxnx.validate(G) checks a graph built or edited by hand)"
            )
    return sorted(G, key=lambda n: G.nodes[n]["order"])


def _profile(
    G: nx.MultiDiGraph, steps: list[str], storages: list[_Storage], unknown: tuple[str, ...]
) -> MemoryProfile:
    change = [0] * (len(steps) + 1)
    for s in storages:
        if s.kind == "activation":
            change[s.first] += s.nbytes
            change[s.last + 1] -= s.nbytes
    live, now = {}, 0
    for node, delta in zip(steps, change[:-1], strict=True):
        now += delta
        live[node] = now
    peak_node = max(steps, key=lambda n: (live[n], -G.nodes[n]["order"]))
    joint = G.graph.get("level") == "joint"
    saved = [
        s for s in storages
        if joint and s.saved and s.kind == "activation" and G.nodes[s.maker].get("phase") == "forward"
    ]
    return MemoryProfile(
        live_bytes=live,
        peak_bytes=live[peak_node],
        peak_node=peak_node,
        input_bytes=sum(s.nbytes for s in storages if s.kind == "input"),
        param_bytes=sum(s.nbytes for s in storages if s.kind == "param"),
        saved_bytes=sum(s.nbytes for s in saved) if joint else None,
        saved=tuple(dict.fromkeys(s.maker for s in saved)),
        unknown=unknown,
    )


def _all(elements: dict[Any, tuple[int, ...]]) -> Iterator[int]:
    for sids in elements.values():
        yield from sids


# --- which nodes make storage ---------------------------------------------------------------


def _name(data: dict[str, Any]) -> str | None:
    """What a call is, without its namespace: ``relu_`` for ``torch.ops.aten.relu_.default``,
    ``flatten`` for ``torch.flatten`` or the method ``flatten``; None for anything else."""
    target, op = data.get("target"), data.get("op")
    if not isinstance(target, str):
        return None
    if op == "call_method":
        return target
    if op == "call_function":
        if target.startswith("torch.ops."):
            parts = target.split(".")
            return parts[3] if len(parts) >= 4 else None
        for prefix in ("torch.Tensor.", "torch.functional.", "torch."):
            if target.startswith(prefix) and target[len(prefix):].isidentifier():
                return target[len(prefix):]
    return None


def _storage_source(G: nx.MultiDiGraph, node: str, strided: set[str]) -> str | None:
    """The input whose storage ``node``'s output shares; None where it makes new storage."""
    data = G.nodes[node]
    op, target = data.get("op"), data.get("target")
    if op not in ("call_function", "call_method", "call_module"):
        return None
    first = _first_input(G, node)
    if first is None:
        return None
    name = _name(data)
    aten = isinstance(target, str) and target.startswith("torch.ops.")
    info = data.get("node_call_info") or {}
    if target == "operator.getitem":
        return None if _indexes_with_tensor(G, node) else first
    if info.get("inplace") is True or data.get("writes_input") is True or target in _IN_PLACE_OPERATORS:
        return first  # F.relu(x, inplace=True), nn.ReLU(inplace=True), x += y
    if name is not None and name.endswith("_") and not name.startswith("__"):
        return first  # relu_, add_, copy_: written in place
    out = _input_at(G, node, "out")
    if out is not None:
        return out  # torch.add(a, b, out=c), aten.add.out: c
    if data.get("returns_input") is True:
        return first  # nn.Dropout in eval mode
    dropping = info.get("training", info.get("train"))  # F.dropout's flag, and ATen's
    if "dropout" in str(target) and name != "native_dropout" and dropping is False:
        return first  # F.dropout(x, training=False), aten.dropout(x, p, False): x itself
    if name in _RESHAPES:
        return None if first in strided else first
    if name in _MAYBE_SELF:
        made = G.nodes[first]
        same = (data.get("out_shape"), data.get("out_dtype")) == (made.get("out_shape"), made.get("out_dtype"))
        return first if same else None
    if name in (ATEN_VIEWS if aten else VIEW_NAMES):
        return first
    if op == "call_module" and data.get("module_type") in _VIEW_MODULES:
        return first
    return None


def _first_input(G: nx.MultiDiGraph, node: str) -> str | None:
    """The node passed as the call's first argument (``self``, ``input``, ``a``), if a node."""
    info = G.nodes[node].get("node_call_info") or {}
    return _input_at(G, node, 0, next(iter(info), 0))


def _input_at(G: nx.MultiDiGraph, node: str, *args: Any) -> str | None:
    """The input passed at position or keyword ``args``, if any is a node."""
    return next((u for u, _, arg in G.in_edges(node, data="arg") if arg in args), None)


def _indexes_with_tensor(G: nx.MultiDiGraph, node: str) -> bool:
    """Whether ``x[i]`` indexes with a tensor (advanced indexing, which copies)."""
    return any(arg not in (0, "a") and dtype is not None for *_, arg, dtype in _in_args(G, node))


def _in_args(G: nx.MultiDiGraph, node: str) -> Iterator[tuple[str, Any, Any]]:
    for u, _, data in G.in_edges(node, data=True):
        yield u, data.get("arg"), data.get("dtype")


def _shared(G: nx.MultiDiGraph, node: str, source: dict[Any, tuple[int, ...]]) -> dict[Any, tuple[int, ...]]:
    """The storages of an output that shares ``source``'s: ``getitem`` of a tuple or dict of
    outputs picks one element; anything else shares them all."""
    data = G.nodes[node]
    if data.get("target") == "operator.getitem" and None not in source:
        info = list((data.get("node_call_info") or {}).values())
        index = info[1] if len(info) > 1 else None
        if type(index) in (int, str) and index in source:
            return {None: source[index]}
    return {None: tuple(_all(source))}


# --- bytes of a node's outputs ----------------------------------------------------------------


def _elements(data: dict[str, Any]) -> Iterator[tuple[Any, int | None]]:
    """(element, bytes) for each output: one for a tensor (element None), one per item of a
    list or dict of outputs (its index or key); bytes None where the size is unknown. Nothing
    for a value that is not a tensor."""
    shape, dtype = data.get("out_shape"), data.get("out_dtype")
    if isinstance(shape, (list, dict)):
        for key in range(len(shape)) if isinstance(shape, list) else shape:
            if shape[key] is not None:
                yield key, _nbytes(shape[key], _item(dtype, key))
    elif shape is not None:
        yield None, _nbytes(shape, dtype)
    elif _is_tensor(data.get("out_type")):
        yield None, None


def _item(nested: Any, key: Any) -> Any:
    """``nested[key]`` of a list or dict (of dtypes), None where it has no such item."""
    if isinstance(nested, list) and type(key) is int and 0 <= key < len(nested):
        return nested[key]
    return nested.get(key) if isinstance(nested, dict) else None


def _is_tensor(out_type: Any) -> bool:
    return isinstance(out_type, str) and (out_type == "torch.Tensor" or out_type.endswith("Parameter"))


def _nbytes(shape: Any, dtype: Any) -> int | None:
    """Bytes of a tensor, or of every tensor in a nested output; None if a size is unknown."""
    if isinstance(shape, tuple):
        if dtype not in ITEMSIZE or not all(type(d) is int for d in shape):
            return None
        return math.prod(shape) * ITEMSIZE[dtype]
    items = shape.items() if isinstance(shape, dict) else enumerate(shape)
    sizes = [_nbytes(s, _item(dtype, key)) for key, s in items if s is not None]
    return None if None in sizes else sum(sizes)  # type: ignore[arg-type]
