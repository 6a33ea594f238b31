"""What one node did in a recorded forward pass, and how a node is run there.

Each node runs on *fresh leaf tensors*, one per occurrence of an input in its
arguments (``x * x`` gets two), detached from the nodes that produced them.
The autograd graph of a node therefore ends at its own inputs: a backward
through it yields that node's vector-Jacobian product for each incoming edge
separately, and nothing upstream. That is what lets credit follow the edges of
the NetworkX graph rather than torch's autograd graph, at the cost of one
``torch.autograd.grad`` call per node instead of any recomputation.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from .._capture.inputs import memory_of, whole_memory
from .._compat import OpOverload, op_schema, pytree
from .._errors import FxnxValueError

__all__ = ["NodeCall", "out_of_place_twin", "run_node", "runs_out_of_place", "written_input"]

#: Credit for one input occurrence or one output: a tensor, None (no credit), or a tuple/list
#: of those for nodes that take or produce several tensors.
Credit = Any


@dataclass
class NodeCall:
    """What one node did in the recorded forward pass; what a credit rule works from.

    Attributes
    ----------
    name, op : str
        The fx node's name and op (``call_module``, ``call_function``, …).
    target : Any
        The fx target: module path, function, or method name.
    module : nn.Module or None
        The module a ``call_module`` node called.
    sources, labels : list of str
        For each input occurrence, the node it came from and its edge ``arg`` label.
    inputs : list
        For each input occurrence, the leaf tensor(s) the node was run on.
    output : Any
        What the node returned (its autograd graph ends at ``inputs``).
    params : dict
        Qualified parameter name to parameter, for parameters the node's module owns.
    wanted : list of bool
        Which input occurrences need credit: edges of the graph being routed
        (and, when training, leading to a trainable parameter); a rule may skip
        the others (their credit is discarded).
    args, kwargs : tuple, dict
        The arguments the node was called with, ``inputs`` in their places.
    param_inputs : dict
        Input occurrence to ``(qualified name, parameter)`` for the occurrences
        that are a parameter of the model, frozen or not (a ``get_attr`` node): the
        weight of ``F.linear(x, self.weight)`` or of an exported ``aten.linear``, or a
        chain of views, reshapes, casts and scales of one (``x @ self.weight.T``,
        ``self.weight.to(x.dtype)``).
    param_views : dict
        For the occurrences of ``param_inputs`` that are such a chain, the same chain taken
        of a tensor laid out like the parameter (:class:`.weight_inputs.Chain`, ``B.T``):
        what a rule that puts ``B`` in the parameter's place passes there.
    computed_weights : dict
        Input occurrence to what it is, for the occurrences computed from parameters alone
        but not a parameter's chain of views, reshapes, casts and scales (``weight_norm``'s
        ``g · v / ‖v‖``): weights no feedback weight can stand in for
        (:mod:`.weight_inputs`).
    owner : type or None
        The class of the module whose own ``forward`` ran this node: a ``call_module``
        node's module's; for another node, that of the innermost module of its module
        stack (``node.meta["nn_module_stack"]``: a layer ``torch.export`` recorded as ATen
        calls, a subclass a symbolic trace went through), the model's at its top level.
        None where unknown. A preset's module classes match it (:mod:`.presets`).
    """

    name: str
    op: str
    target: Any
    module: nn.Module | None
    sources: list[str]
    labels: list[int | str]
    inputs: list[Any]
    output: Any
    params: dict[str, Tensor]
    wanted: list[bool] = field(default_factory=list)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    param_inputs: dict[int, tuple[str, Tensor]] = field(default_factory=dict)
    param_views: dict[int, Callable[[Tensor], Tensor]] = field(default_factory=dict)
    owner: type | None = None
    computed_weights: dict[int, str] = field(default_factory=dict)

    def own_parameters(self) -> list[Tensor]:
        """The node's parameters: its input occurrences that are one, frozen or not (a function
        node's weight), then the trainable ones its module owns."""
        return [p for _, p in self.param_inputs.values()] + list(self.params.values())

    def wants(self, i: int) -> bool:
        """Whether input occurrence ``i`` is a tensor that needs credit."""
        x = self.inputs[i]
        return isinstance(x, Tensor) and x.requires_grad and (not self.wanted or self.wanted[i])

    def exact(
        self, credit: Credit, *, inputs: bool = True, params: bool = True, retain_graph: bool = False
    ) -> tuple[list[Credit], dict[str, Tensor]]:
        """The exact vector-Jacobian product of this node: what autograd would send back.

        Parameters
        ----------
        credit : tensor or structure like ``output``
            Credit with respect to this node's output (None entries carry nothing).
        inputs, params : bool
            Whether to compute credit for the input occurrences, for the parameters.
        retain_graph : bool
            Keep the node's graph for a second call (a rule that calls twice needs it).

        Returns
        -------
        (list, dict)
            Credit for each input occurrence (None where not wanted or not
            reachable) and for each parameter that received some.
        """
        outs, grads = pairs(self.output, credit)
        count = len(self.inputs)
        if not outs:
            return [None] * count, {}
        leaves: list[Tensor] = []
        slots: list[tuple[Any, list[int]] | None] = []  # per occurrence: (pytree spec, positions)
        for i, value in enumerate(self.inputs):
            if not inputs or (self.wanted and not self.wanted[i]):
                slots.append(None)
                continue
            flat, spec = pytree.tree_flatten(value)
            slots.append((spec, list(range(len(leaves), len(leaves) + len(flat)))))
            leaves.extend(flat)
        names = list(self.params) if params else []
        wrt = leaves + [self.params[n] for n in names]
        index = [k for k, t in enumerate(wrt) if isinstance(t, Tensor) and t.requires_grad]
        if not index:
            return [None] * count, {}
        try:
            got = torch.autograd.grad(
                outs, [wrt[k] for k in index], grads, allow_unused=True, retain_graph=retain_graph
            )
        except RuntimeError as err:
            if "second time" not in str(err):
                raise
            raise FxnxValueError(
                f"node {self.name!r}: call.exact was called again after a call that freed the "
                "node's graph; pass retain_graph=True to every call of call.exact but the last"
            ) from err
        result: list[Any] = [None] * len(wrt)
        for k, g in zip(index, got, strict=True):
            result[k] = g
        input_credit: list[Credit] = []
        for slot in slots:
            parts = [result[k] for k in slot[1]] if slot else []
            found = any(p is not None for p in parts)
            input_credit.append(pytree.tree_unflatten(parts, slot[0]) if slot and found else None)
        offset = len(leaves)
        param_credit = {
            n: result[offset + j] for j, n in enumerate(names) if result[offset + j] is not None
        }
        return input_credit, param_credit


def pairs(output: Any, credit: Credit) -> tuple[list[Tensor], list[Tensor]]:
    """Output tensors that have credit and depend on something, with that credit.

    ``credit`` mirrors ``output``'s structure (None is a leaf in torch's pytree).
    """
    outs, grads = [], []
    for out, g in zip(pytree.tree_flatten(output)[0], pytree.tree_flatten(credit)[0], strict=False):
        if isinstance(out, Tensor) and isinstance(g, Tensor) and out.requires_grad:
            outs.append(out)
            grads.append(g)
    return outs, grads


def fresh_leaf(value: Any) -> Any:
    """A fresh leaf for each floating-point tensor in ``value``; other values pass through.
    Where tensors share memory (one tensor given twice, or its views), each is a view of one
    leaf on that memory, so that a write into one is seen in the others, as in the model's
    call."""
    floats = [t for t in pytree.tree_leaves(value) if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())]
    memory = {id(t): memory_of(t) for t in floats}
    shared = collections.Counter(memory[id(t)] for t in floats if memory[id(t)] is not None)
    leaves: dict[Any, Tensor] = {}

    def one(t: Any) -> Any:
        if not (isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())):
            return t
        key = memory[id(t)]
        if key is None or shared[key] < 2:
            return t.detach().requires_grad_(True)
        if key not in leaves:
            leaves[key] = whole_memory(t).requires_grad_(True)
        return leaves[key].as_strided(t.size(), t.stride(), t.storage_offset())

    return pytree.tree_map(one, value)


def _clone_tensors(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, value)


@contextlib.contextmanager
def _out_of_place(module: nn.Module | None) -> Iterator[None]:
    """Switch a module's ``inplace`` flag off for one call (the leaves must stay intact)."""
    if module is None or getattr(module, "inplace", None) is not True:
        yield
        return
    module.inplace = False  # type: ignore[assignment]
    try:
        yield
    finally:
        module.inplace = True  # type: ignore[assignment]


def run_node(node: fx.Node, module: nn.Module | None, args: Any, kwargs: Any) -> Any:
    """Call the node's target, out of place: ``ReLU(inplace=True)``, ``F.relu(x, inplace=True)``,
    ``x.relu_()``, ``x += y`` and ATen's ``aten.add_`` run as their out-of-place forms
    (:func:`out_of_place_twin`), so the leaves stay intact and credit is that of in-place off
    (the values are the same)."""
    op, target = node.op, node.target
    if kwargs.get("inplace") is True:
        kwargs = {**kwargs, "inplace": False}
    first = args[0] if args else None
    twin = out_of_place_twin(node) if isinstance(first, Tensor) and first.requires_grad else None
    if twin is not None:
        # Only a leaf of ours is written out of place: a buffer (``self.count.add_(1)``,
        # timm's ``num_batches_tracked``) must change as it does in ``model(x)``.
        op, target = twin
    with torch.enable_grad(), _out_of_place(module):
        try:
            out = call_target(op, target, module, args, kwargs)
        except RuntimeError as err:
            if "in-place" not in str(err):
                raise
            # An in-place write we could not see coming (inside a custom leaf module): the
            # caller runs a node here only where no later node reads what it writes.
            return call_target(op, target, module, _clone_tensors(args), _clone_tensors(kwargs))
    if twin is not None and isinstance(first, Tensor) and isinstance(out, Tensor) and out.dtype != first.dtype:
        out = out.to(first.dtype)  # an in-place op keeps its tensor's dtype; its twin promotes
    return out


def out_of_place_twin(node: fx.Node) -> tuple[str, Any] | None:
    """The ``(op, target)`` computing what ``node`` writes in place, out of place, or None.

    ``x.add_(y)`` has ``x.add(y)``, ``x += y`` has ``x + y``, ``aten.add_.Tensor`` has
    ``aten.add.Tensor`` (``aten.copy_`` has ``aten.copy``); ``operator.setitem``, wrapped
    functions and modules have none.
    """
    target = node.target
    if _is_inplace_method(node):
        return "call_method", target[:-1]  # type: ignore[index]
    if node.op != "call_function":
        return None
    binary = _AUGMENTED.get(target) if isinstance(target, type(operator.iadd)) else None
    if binary is not None:
        return "call_function", binary
    if isinstance(target, OpOverload) and _writes_first_argument(target):
        return ("call_function", _functional(target)) if _functional(target) is not None else None
    return None


@functools.cache
def _functional(op: Any) -> Any:
    """The functional overload of an in-place ATen overload (``aten.add.Tensor`` for
    ``aten.add_.Tensor``), or None."""
    schema = op_schema(op)
    name = getattr(schema, "name", "")
    namespace, _, base = name.partition("::")
    if not base.endswith("_") or base.startswith("_"):
        return None
    packet = getattr(getattr(torch.ops, namespace, None), base[:-1], None)
    return getattr(packet, getattr(schema, "overload_name", "") or "default", None)


#: Augmented assignment, as torch.fx records ``x += y``, and its out-of-place twin.
_AUGMENTED = {
    operator.iadd: operator.add, operator.iand: operator.and_, operator.ifloordiv: operator.floordiv,
    operator.ilshift: operator.lshift, operator.imatmul: operator.matmul, operator.imod: operator.mod,
    operator.imul: operator.mul, operator.ior: operator.or_, operator.ipow: operator.pow,
    operator.irshift: operator.rshift, operator.isub: operator.sub,
    operator.itruediv: operator.truediv, operator.ixor: operator.xor,
}


def _is_inplace_method(node: fx.Node) -> bool:
    """``x.relu_()``: a tensor method writing into ``x``, with an out-of-place twin."""
    target = node.target
    return (
        node.op == "call_method" and isinstance(target, str) and target.endswith("_")
        and not target.startswith("__") and hasattr(torch.Tensor, target[:-1])
    )


def written_input(node: fx.Node) -> fx.Node | None:
    """The node whose value ``node`` writes into in place, or None.

    In-place methods (``x.relu_()``), modules and functions called with
    ``inplace=True`` (``nn.ReLU(inplace=True)``), augmented assignment
    (``operator.iadd``) and ATen's in-place overloads (``aten.add_``) write into
    their first argument.
    """
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    target = node.target
    module = node.graph.owning_module.get_submodule(target) if node.op == "call_module" else None  # type: ignore[arg-type, union-attr]
    inplace = (
        _is_inplace_method(node)
        or node.kwargs.get("inplace") is True
        or getattr(module, "inplace", None) is True
        or (node.op == "call_function" and target in _AUGMENTED)
        or _writes_first_argument(target)
    )
    return first if inplace else None


def runs_out_of_place(node: fx.Node) -> bool:
    """Whether :func:`run_node` can run ``node``'s write out of place: it writes into its first
    argument (:func:`written_input`) in a form that has an out-of-place twin or flag."""
    target = node.target
    if written_input(node) is None:
        return False
    return not isinstance(target, OpOverload) or _functional(target) is not None


def _writes_first_argument(target: Any) -> bool:
    """An ATen overload whose schema marks its first argument written (``aten.add_``)."""
    schema = op_schema(target) if isinstance(target, OpOverload) else None
    arguments: Any = getattr(schema, "arguments", None)
    return bool(arguments) and bool(getattr(arguments[0], "is_write", False))


def call_target(op: str, target: Any, module: nn.Module | None, args: Any, kwargs: Any) -> Any:
    if module is not None:
        return module(*args, **kwargs)
    if op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, target)(*rest, **kwargs)
    return target(*args, **kwargs)
