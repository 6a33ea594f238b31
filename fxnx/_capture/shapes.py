"""Tensor metadata on fx nodes: shape propagation, and metadata from a tracer's values.

:class:`_ShapeProp` records what :class:`torch.fx.passes.shape_prop.ShapeProp`
records (``meta["tensor_meta"]`` and ``meta["type"]``) by running example
inputs, real, fake or on the ``meta`` device. Graphs from ``torch.export`` and
``make_fx`` already hold the fake value of every node in ``meta["val"]``;
:func:`metadata_from_values` turns those into the same two entries, so the
converter reads one kind of metadata whatever captured the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import TensorMetadata

from .._compat import (
    FakeTensorMode,
    OpOverload,
    extract_tensor_metadata,
    is_fake,
    op_schema,
    pytree,
)
from .._errors import ShapePropagationError
from .._state import preserved, tensor_values_kept
from .inputs import device_of

__all__ = [
    "container_items",
    "metadata_from_values",
    "mutable",
    "node_failure",
    "propagate",
    "runtime_check",
    "shape_source",
]


class _ShapeProp(fx.Interpreter):
    """torch.fx's ShapeProp, recording the same ``tensor_meta`` and ``type`` metadata.

    Unlike ShapeProp it prints nothing on failure: it raises one error that names
    the node, its target and the shapes the node received.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our message already names the node

    def run_node(self, n: fx.Node) -> Any:
        # torch.fx's run_node without its per-node context for tracebacks and metadata
        # (nothing here traces or records node metadata): a fifth of the interpreter's time.
        args, kwargs = mutable(self.fetch_args_kwargs_from_env(n))
        try:
            result = self.call(n, args, kwargs)
        except Exception as err:
            raise node_failure("shape propagation", n, args, kwargs, err) from err
        _record(n, result)
        return result

    def call(self, n: fx.Node, args: Any, kwargs: Any) -> Any:
        """Run one node on its values: what a subclass extends to do more per node (the
        FLOP count, :mod:`fxnx._costs`). An error raised here names the node."""
        return getattr(self, n.op)(n.target, args, kwargs)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        # The module by its path in one lookup; a path that named_modules() skipped (a
        # module registered twice) is walked as torch.fx does.
        module = self.submodules.get(target)
        return (self.fetch_attr(target) if module is None else module)(*args, **kwargs)


def mutable(value: Any) -> Any:
    """``value`` with torch.fx's read-only lists and dicts (a node's arguments, as an
    Interpreter passes them) copied into plain ones, as the graph's own code passes them: a
    list literal there is a new list each call, which a function may change (torchvision's
    ``_get_window_and_shift_size`` does)."""
    if isinstance(value, (list, tuple)):
        items = [mutable(v) for v in value]
        if isinstance(value, immutable_list):
            return items
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(items) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        items_ = {k: mutable(v) for k, v in value.items()}
        if isinstance(value, immutable_dict):
            return items_
        return items_ if any(items_[k] is not value[k] for k in value) and type(value) is dict else value
    return value


def node_failure(
    doing: str, n: fx.Node, args: Any, kwargs: Any, err: Exception
) -> ShapePropagationError:
    """The error for a node that failed on the values it was given: it names the node, its
    target and the shapes it received."""
    got = pytree.tree_map(_describe_value, (args, kwargs))
    check = runtime_check(n)
    advice = (
        "The graph checks here that a value the model's control flow read is what it was "
        "when the graph was captured, and it is not: the graph holds for inputs that take the "
        "same branches. If the model draws random numbers for its control flow (such as "
        "skipping layers at random in training mode, as wav2vec2 and HuBERT do), no single "
        "graph is its forward: call model.eval() and convert it again."
        if check else
        "What to do: check the example inputs' shapes and dtypes against what the model expects."
    )
    error = ShapePropagationError(
        f"{doing} failed at fx node {n.name!r} ({n.op} {_target_str(n)}): "
        f"{type(err).__name__}: {err}\n"
        f"  node: {n.format_node()}\n"
        f"  input shapes: args={got[0]} kwargs={got[1]}\n"
        f"{advice}"
    )
    error.runtime_check = check  # type: ignore[attr-defined]
    return error


#: ATen operators with which torch.export checks, at run time, what it assumed about a value
#: read while tracing (a data-dependent branch).
_RUNTIME_CHECKS = frozenset({
    "aten::_assert_scalar", "aten::_assert_async", "aten::sym_constrain_range",
    "aten::sym_constrain_range_for_size",
})


def runtime_check(n: fx.Node) -> bool:
    """Whether ``n`` is a check torch.export put in the graph on a value read while tracing."""
    target = n.target
    return isinstance(target, OpOverload) and getattr(op_schema(target), "name", "") in _RUNTIME_CHECKS


def _target_str(node: fx.Node) -> str:
    if node.op == "call_module":
        try:
            mod = node.graph.owning_module.get_submodule(cast(str, node.target))  # type: ignore[union-attr]
        except AttributeError:  # the graph calls a submodule its module lacks
            return f"{node.target} (missing)"
        return f"{node.target} ({type(mod).__qualname__})"
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "?")


def _describe_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return value


def propagate(
    gm: fx.GraphModule, model: Any, inputs: list[Any], fake: bool,
    interpreter: _ShapeProp | None = None,
) -> Any:
    """Run the inputs through the graph without leaving a trace on the model, buffers or RNG,
    and return the graph's output.

    ``interpreter``, a :class:`_ShapeProp` (or subclass) over ``gm``, runs the nodes
    (a fresh one by default); with ``fake`` it runs fake tensors.
    """
    interpreter = interpreter or _ShapeProp(gm)
    with preserved(model), tensor_values_kept(model), torch.no_grad():
        if fake and device_of(model).type != "meta":
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
                return interpreter.run(*fakes)
        return interpreter.run(*inputs)


def shape_source(model: Any, fake: bool) -> str:
    if device_of(model).type == "meta":
        return "meta"
    return "FakeTensor" if fake else "ShapeProp"


def metadata_from_values(gm: fx.GraphModule) -> None:
    """Record ``tensor_meta`` and ``type`` from the values a tracer left in ``meta["val"]``.

    ``make_fx`` and ``torch.export`` keep the (fake) value of every node; this
    gives the converter the same metadata :class:`_ShapeProp` would, without
    running anything again. Symbolic sizes that have no concrete value become
    their expression as a string (``"u0"``).
    """
    for node in gm.graph.nodes:
        if node.op == "output":
            node.meta["type"] = type(node.args[0])
            metas = map_aggregate(node.args[0], lambda n: n.meta.get("tensor_meta") if isinstance(n, fx.Node) else None)
            if any(m is not None for m in pytree.tree_leaves(metas)):
                node.meta["tensor_meta"] = metas
            continue
        if "val" in node.meta:
            _record(node, node.meta["val"])


def _record(node: fx.Node, value: Any) -> None:
    """Store what ShapeProp stores: ``tensor_meta`` of the tensors in ``value``, and its ``type``."""
    tensors = []

    def extract(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return _metadata_of(obj)
        contents = container_items(obj)
        if contents is not None:  # described as the dict of what it holds
            return {k: map_aggregate(v, extract) for k, v in contents.items()}
        return obj

    meta = map_aggregate(value, extract)
    if tensors:
        node.meta["tensor_meta"] = meta
    node.meta["type"] = torch.Tensor if is_fake(value) else type(value)


def container_items(obj: Any) -> dict[str, Any] | None:
    """What a container torch.fx does not look into holds, by name: a mapping that is not a
    dict (a Hugging Face ``BatchEncoding``, a ``UserDict``) or a dataclass instance; None for
    anything else."""
    if isinstance(obj, Mapping) and not isinstance(obj, dict):
        return {str(k): v for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # fields set, that is
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if hasattr(obj, f.name)}
    return None


def _metadata_of(tensor: torch.Tensor) -> TensorMetadata:
    if all(type(d) is int for d in tensor.shape):
        return extract_tensor_metadata(tensor)
    # symbolic sizes from a tracer, as strings: not the torch.Size TensorMetadata declares
    shape: Any = tuple(_concrete(d) for d in tensor.shape)
    try:
        return extract_tensor_metadata(tensor)._replace(shape=shape)
    except Exception:  # strides of data-dependent sizes cannot be evaluated
        no_stride: Any = None  # TensorMetadata declares a tuple
        return TensorMetadata(shape, tensor.dtype, tensor.requires_grad, no_stride, None, False, {})


def _concrete(dim: Any) -> int | str:
    if isinstance(dim, int):
        return dim
    try:
        return int(dim)
    except Exception:  # an unbacked size such as u0: data-dependent, no value known
        return str(dim)
