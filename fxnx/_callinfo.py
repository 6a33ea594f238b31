"""A node's call mapped onto the callee's signature, as plain data.

``node_call_info`` answers "what was this call's ``dim``?" without knowing
whether the user wrote ``torch.flatten(x, 1)`` or ``torch.flatten(x, start_dim=1)``:
arguments are bound to the callee's parameter names with defaults filled in,
constants become plain Python values and tensors the name of the node that
produced them.

Signatures come from ``inspect`` (modules' ``forward``, Python functions), from
torch's own operator schemas (builtins such as ``torch.flatten``) and from the
ATen schema of the same name for ``call_method`` nodes (``x.view``), and from
the operator's own schema for ATen-level graphs (``aten.convolution.default``). When no
signature fits, arguments keep their positions as keys (``"0"``, ``"1"``).
"""

from __future__ import annotations

import enum
import inspect
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from functools import cache, lru_cache
from typing import Any, cast

import torch
import torch.fx as fx
from torch.fx.operator_schemas import get_signature_for_torch_op

from ._compat import (
    OpOverload,
    method_schema_signatures,
    op_schema,
    qualified_function_name,
    schema_signature,
)
from ._contract import class_name

__all__ = ["bind_call", "fetch_attr", "occurrences", "qualified_name", "to_plain"]


def bind_call(
    node: fx.Node, gm: fx.GraphModule, module: torch.nn.Module | None = None
) -> tuple[dict[str, Any], list[str | None]]:
    """Bind ``node``'s arguments to its callee's signature.

    ``module`` is the submodule a ``call_module`` node calls, where the caller has already
    looked it up in ``gm``.

    Returns
    -------
    info : dict
        Parameter name to plain value, defaults filled in.
    names : list
        The parameter name of each positional argument, None where unknown.

    Examples
    --------
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(lambda x: torch.flatten(x, 1))
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_function")
    >>> bind_call(node, gm)
    ({'input': 'x', 'start_dim': 1, 'end_dim': -1}, ['input', 'start_dim'])
    """
    if node.op == "placeholder":
        return ({"default": to_plain(node.args[0])} if node.args else {}), []
    if node.op in ("output", "get_attr"):
        return {}, [None] * len(node.args)
    args, kwargs = tuple(node.args), dict(node.kwargs)
    for sig in _signatures(node, gm, module):
        bound = _try_bind(sig, args, kwargs)
        if bound is None and node.op == "call_method" and len(args) > 1:
            # x.view(2, -1) against view(self, size: List[int]): pack the varargs.
            bound = _try_bind(sig, (args[0], list(args[1:])), kwargs)
        if bound is not None:
            bound.apply_defaults()
            info = {name: to_plain(value) for name, value in bound.arguments.items()}
            return info, _positional_names(sig, len(args))
    info = {str(i): to_plain(a) for i, a in enumerate(args)}
    info.update((k, to_plain(v)) for k, v in kwargs.items())
    return info, [None] * len(args)


def occurrences(node: fx.Node, names: list[str | None]) -> Iterator[tuple[int | str, fx.Node]]:
    """Each place an fx node appears in ``node``'s arguments, with a label for it.

    Top-level positional arguments are labelled by position, keyword arguments
    by name, and elements of containers by a path from the parameter's name,
    such as ``"tensors[1]"`` for ``torch.cat([a, b])``. The order is that of
    ``torch.fx.node.map_arg`` over ``(node.args, node.kwargs)``.

    ``names`` is the second result of :func:`bind_call`.
    """
    for i, value in enumerate(node.args):
        if isinstance(value, fx.Node):
            yield i, value
        else:
            name = names[i] if i < len(names) else None
            yield from _walk(value, name or str(i))
    for key, value in node.kwargs.items():
        yield from _walk(value, key)


def _walk(value: Any, label: str) -> Iterator[tuple[str, fx.Node]]:
    if isinstance(value, fx.Node):
        yield label, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{label}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{label}[{key!r}]")
    elif isinstance(value, slice):
        for part in ("start", "stop", "step"):
            yield from _walk(getattr(value, part), f"{label}.{part}")


def fetch_attr(gm: fx.GraphModule, path: str) -> Any:
    """What a ``get_attr`` node with target ``path`` reads: ``gm.a.b.c`` for ``"a.b.c"``."""
    owner, _, name = path.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _try_bind(sig: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return sig.bind(*args, **kwargs)
    except TypeError:
        return None


def _positional_names(sig: inspect.Signature, count: int) -> list[str | None]:
    names: list[str | None] = []
    for param in sig.parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            names.extend(param.name for _ in range(count - len(names)))
        elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names.append(param.name)
    return (names + [None] * count)[:count]


def _signatures(
    node: fx.Node, gm: fx.GraphModule, module: torch.nn.Module | None
) -> Sequence[inspect.Signature]:
    if node.op == "call_module":
        if module is None:
            module = gm.get_submodule(node.target)  # type: ignore[arg-type]
        cls: type = type(module)  # as plain type: mypy refuses type[Module] as Hashable
        return _module_signatures(cls)
    if node.op == "call_method":
        return _method_signatures(node.target)  # type: ignore[arg-type]
    return _function_signatures(cast(Callable[..., Any], node.target))  # call_function: a callable


@cache
def _module_signatures(cls: type[torch.nn.Module]) -> tuple[inspect.Signature, ...]:
    sig = inspect.signature(cls.forward)
    params = list(sig.parameters.values())[1:]  # drop self
    return (sig.replace(parameters=params),)


@cache
def _schema_signatures(op: OpOverload) -> tuple[inspect.Signature, ...]:
    schema = op_schema(op)
    sig = schema_signature(schema) if schema is not None else None
    if sig is None:
        return ()
    # torch.fx renames the schema's ``self`` to ``input``; keep the schema's own names.
    names = [arg.name for arg in schema.arguments]
    params = [p.replace(name=n) for p, n in zip(sig.parameters.values(), names, strict=True)]
    return (sig.replace(parameters=params),)


@cache
def _method_signatures(name: str) -> tuple[inspect.Signature, ...]:
    sigs = []
    for schema in method_schema_signatures(name):
        sig = schema_signature(schema)
        if sig is None:
            continue
        params = list(sig.parameters.values())
        if params:
            params[0] = params[0].replace(name="self")
        sigs.append(sig.replace(parameters=params))
    return tuple(sigs)


def _function_signatures(target: Callable[..., Any]) -> tuple[inspect.Signature, ...]:
    if isinstance(target, OpOverload):  # an ATen operator: its schema has the names
        return _schema_signatures(target)
    try:
        return _cached_function_signatures(target)
    except TypeError:  # unhashable callable
        return _uncached_function_signatures(target)


def _uncached_function_signatures(target: Callable[..., Any]) -> tuple[inspect.Signature, ...]:
    try:
        return (inspect.signature(target),)
    except (TypeError, ValueError):
        pass
    try:
        return tuple(get_signature_for_torch_op(target) or ())
    except Exception:  # torch's schema lookup fails on some callables
        return ()


_cached_function_signatures = lru_cache(maxsize=None)(_uncached_function_signatures)


def qualified_name(target: Any) -> str:
    """The importable dotted name of a function or class, for example ``"operator.add"``.

    Examples
    --------
    >>> import operator, torch
    >>> qualified_name(operator.add), qualified_name(torch.flatten), qualified_name(torch.nn.Conv2d)
    ('operator.add', 'torch.flatten', 'torch.nn.modules.conv.Conv2d')
    >>> qualified_name(int)
    'int'
    """
    if isinstance(target, str):
        return target
    if isinstance(target, type):
        return class_name(target)
    try:
        name = qualified_function_name(target)
    except Exception:  # not something fx knows how to name
        module = getattr(target, "__module__", None) or "?"
        name = f"{module}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    # The operator module's builtins live in _operator; users write operator.add.
    return "operator." + name[len("_operator.") :] if name.startswith("_operator.") else name




_PLAIN_SCALARS = (str, int, bool, type(None))


def to_plain(value: Any) -> Any:
    """``value`` as plain Python data: fx nodes become their names.

    Examples
    --------
    >>> import torch
    >>> to_plain({"dims": torch.Size([2, 3]), "dtype": torch.float16, "s": slice(None, 2)})
    {'dims': (2, 3), 'dtype': 'torch.float16', 's': 'slice(None, 2, None)'}
    """
    if isinstance(value, fx.Node):
        return value.name
    if type(value) in _PLAIN_SCALARS:
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    # Subclasses and look-alikes of the scalars (TorchVersion, numpy.int64) become builtins.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, str):
        return "".join(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, torch.Size):
        return tuple(int(d) for d in value)
    if isinstance(value, tuple):
        return tuple(to_plain(v) for v in value)
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, slice):
        parts = ", ".join(str(to_plain(p)) for p in (value.start, value.stop, value.step))
        return f"slice({parts})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, torch.dtype | torch.device | torch.memory_format | torch.layout):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if callable(value):
        return qualified_name(value)
    return f"<{class_name(type(value))}>"
