"""What a module's forward can read, as one value: :func:`fingerprint`.

A capture bakes in whatever the forward read while it was traced: ``self.pad``
passed to ``F.conv2d``, a NumPy scalar, a private flag, ``self.config.output_hidden_states``,
the hooks registered on a module the trace ran through, a ``forward`` patched on the
instance. A capture may be reused only while all of it is unchanged, so the
fingerprint holds every attribute of every module *by value*, all the way down:

- plain values (numbers, strings, ``torch.dtype``) as they are; containers and
  objects with a ``__dict__`` or ``__slots__`` (configs) item by item;
- NumPy arrays and scalars by their bytes;
- parameters, buffers, submodules, tensors, classes and functions by identity
  (held, so no other object can take their identity while the key lives), another
  tensor with its in-place write count, a function with its defaults and the
  values its closure holds;
- anything else (an object none of these describe) as a value equal to nothing, so
  the model is captured again every time rather than reused on a guess;
- the module-level globals each ``forward`` names (``SCALE`` in ``x * SCALE``, or
  ``CONFIG["scale"]``, which a trace bakes in as a constant): by value as above, so a
  global dict, list or namespace (``argparse``'s too) changed in place is seen, and so are
  the attributes the forward names of a module of one's own (``cfg.SCALE``), and the
  globals of the functions of one's own it names (a helper it calls). One whose walk meets what
  cannot be compared, or more than :data:`_GLOBAL_BUDGET` values (a registry), and an
  object of a standard library class (a logger), by identity alone (rebound to another
  object is seen, changed in place is not).

The walk is bounded: past :data:`_BUDGET` values the fingerprint is again equal
to nothing.
"""

from __future__ import annotations

import argparse
import collections
import enum
import functools
import sys
import types
from collections.abc import Iterable
from itertools import chain
from operator import is_
from typing import Any

import torch
from torch import nn

from .._compat import global_module_hooks, version

__all__ = ["Fingerprints", "fingerprint", "structure"]

#: Values visited per fingerprint before giving up (BERT-base reads about 10,000).
_BUDGET = 1_000_000
#: Values visited per global a forward names before comparing it by identity alone.
_GLOBAL_BUDGET = 10_000

_PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                    torch.layout, torch.memory_format, torch.Size, range, slice, type(Ellipsis)))
_CONTAINERS = (tuple, list, set, frozenset)
#: Containers whose emptiness says all there is to say of them.
_EMPTIABLE = frozenset((dict, collections.OrderedDict, *_CONTAINERS))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
              types.WrapperDescriptorType, types.MethodWrapperType, types.ModuleType)


class _Same:
    """An object compared by identity, and kept alive so its identity is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class _Unknown:
    """A value fxnx cannot compare: equal to nothing, itself included."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


def fingerprint(modules: Iterable[nn.Module]) -> tuple[Any, ...]:
    """Everything ``modules``' forwards can read on themselves, and the global module hooks.

    Two fingerprints are equal only if no attribute reachable from these modules changed
    (values compared by value, tensors, modules and functions by identity).

    Examples
    --------
    >>> conv = nn.Conv2d(1, 1, 3)
    >>> before = fingerprint([conv])
    >>> before == fingerprint([conv])
    True
    >>> conv.padding = (1, 1)
    >>> before == fingerprint([conv])
    False
    """
    return _fingerprint(list(modules))[0]


def _fingerprint(modules: list[nn.Module]) -> tuple[tuple[Any, ...], Watch]:
    """:func:`fingerprint`, and a :class:`Watch` of what it read."""
    walk = _Walk()
    # Parameters and buffers by identity alone: an optimizer step or BatchNorm's running
    # statistics write them in place, and the graph reads their values at run time.
    # Submodules by identity too: each has a fingerprint of its own where it matters.
    registered = [walk.registered(vars(m)[table]) for m in modules for table in _REGISTERED]
    for m in modules:
        walk.watch.attributes_of(m, ("__class__", "__dict__"))
        walk.watch.dict(vars(m))
    own = [walk.fields({k: v for k, v in vars(m).items() if k not in _REGISTERED}) for m in modules]
    hooks = walk.watch.hooks = global_module_hooks()
    key = (tuple(registered), tuple(own), walk.value(hooks), _globals_read(modules, walk.watch), _Held(walk.held))
    return key, walk.watch


class Watch:
    """What one fingerprint's walk read, by identity: each dict, list, set and object it
    walked (its keys and values, the same objects), each tensor's write count, each NumPy
    array's bytes, each function's defaults and closure, each global a ``forward`` names.
    While all of it is the same, the walk would read the same things and give the same
    fingerprint. :meth:`unchanged` checks that in a few C calls in all (each kind of read is
    kept flat, in one list), where the walk takes a Python call per value. It keeps every
    object it compares alive, so that none other takes its identity."""

    def __init__(self) -> None:
        self.sized: list[Any] = []  # dicts, lists, sets: each of them, its length, its items
        self.lengths: list[int] = []
        self.items: list[Any] = []  # a dict's keys, then its values
        self.owners: list[Any] = []  # an object, a function, a globals dict: where read, what
        self.names: list[str] = []
        self.found: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.arrays: list[tuple[Any, tuple[Any, ...]]] = []
        self.empty: list[Any] = []  # containers that were empty (a module's hook tables)
        self.hooks: tuple[Any, ...] = ()
        #: the walk met what it cannot compare: the fingerprint is equal to nothing
        self.unknown = False

    def dict(self, d: dict[Any, Any]) -> None:
        self.sized.append(d)
        self.lengths.append(len(d))
        self.items += d
        self.items += d.values()

    def sequence(self, seq: Any) -> None:
        """A list or set, or a function's closure cells (:class:`_Cells`)."""
        self.sized.append(seq)
        self.lengths.append(len(seq))
        self.items += seq

    def attributes_of(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            self.owners.append(obj)
            self.names.append(name)
            self.found.append(_read(obj, name))

    def tensor(self, t: torch.Tensor) -> int:
        self.tensors.append(t)
        self.versions.append(version(t))
        return self.versions[-1]

    def extend(self, other: Watch) -> None:
        """Watch what ``other`` read too (one global's walk of its own): each of its lists."""
        for name, read in vars(other).items():
            if isinstance(read, list):
                getattr(self, name).extend(read)

    def unchanged(self) -> bool:
        """Whether everything the walk read is still the same objects (tensors unwritten,
        arrays' bytes alike): if so the fingerprint would be the same, if not it may not be."""
        return not (
            self.unknown or any(self.empty)
            or not all(map(is_, global_module_hooks(), self.hooks))
            or list(map(len, self.sized)) != self.lengths
            or not all(map(is_, chain.from_iterable(map(_contents, self.sized)), self.items))
            or not all(map(is_, map(_read, self.owners, self.names), self.found))
            or list(map(version, self.tensors)) != self.versions
            or any(_array(a) != b for a, b in self.arrays)
        )


def _contents(sized: Any) -> Any:
    """What :meth:`Watch.dict` and :meth:`Watch.sequence` kept of ``sized``, in order."""
    if isinstance(sized, dict):
        return chain(sized, sized.values())
    return sized


def _read(owner: Any, name: str) -> Any:
    """``owner``'s attribute ``name`` (a globals dict's entry), or a marker where it has none."""
    if isinstance(owner, dict):  # a forward's globals (objects read here are never dicts)
        return owner.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


class Fingerprints:
    """:func:`fingerprint` of one list of modules at each call, walked again only where the
    last walk's :class:`Watch` sees a change (the router's guard, at every call)."""

    def __init__(self) -> None:
        self._last: tuple[Any, tuple[Any, ...], Watch] | None = None

    def __call__(self, modules: list[nn.Module]) -> tuple[Any, ...]:
        last = self._last
        if last is not None and last[0] is modules and last[2].unchanged():
            return last[1]
        key, watch = _fingerprint(modules)
        self._last = (modules, key, watch)
        return key


_MISSING = object()


def _globals_read(modules: list[nn.Module], watch: Watch) -> tuple[Any, ...]:
    """Each of ``modules``' ``forward`` by identity, and the module-level globals each names
    (:func:`_read_by`), each distinct function once."""
    seen: set[int] = set()
    names: list[tuple[str, Any]] = []
    held: list[Any] = []
    for m in modules:
        watch.attributes_of(type(m), ("forward",))
        forward = vars(m).get("forward") or type(m).forward
        fn = getattr(forward, "__func__", forward)
        names.append(("forward", id(fn)))  # which forward (one patched on the class is another)
        held.append(fn)
        _read_by(fn, watch, names, held, seen)
    return tuple(names), _Held(held)


def _read_by(fn: Any, watch: Watch, names: list[tuple[str, Any]], held: list[Any], seen: set[int]) -> None:
    """The globals ``fn``'s code names (:func:`_global_value`), the attributes it names of a
    config module of one's own (``cfg.SCALE``), and those of the functions of one's own it
    names (a helper the forward calls), each function once."""
    code, table = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or not isinstance(table, dict) or id(code) in seen:
        return
    seen.add(id(code))
    watch.attributes_of(fn, ("__code__", "__globals__"))
    watch.attributes_of(table, _global_names(code))
    for name in _global_names(code):
        if name not in table:
            continue
        value = table[name]
        names.append((name, _global_value(value, watch, held)))
        held.append(value)
        if isinstance(value, types.ModuleType) and not _of_a_library(value):
            read = tuple(a for a in _global_names(code) if hasattr(value, a))
            watch.attributes_of(value, read)
            names += [(f"{name}.{a}", _global_value(getattr(value, a), watch, held)) for a in read]
        elif isinstance(value, types.FunctionType) and not _of_a_library(value):
            _read_by(value, watch, names, held, seen)


#: Top-level packages whose modules a forward names for their functions (torch.relu), not
#: for settings: their attributes are not compared.
_LIBRARIES = frozenset(("torch", "torchvision", "numpy", "transformers", "timm", "einops", "fxnx"))


def _of_a_library(value: types.ModuleType | types.FunctionType) -> bool:
    """Whether a module or function is a library's (:data:`_LIBRARIES`, the standard library)."""
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None) or ""
    root = name.partition(".")[0]
    return root in _LIBRARIES or root in sys.stdlib_module_names


def _global_value(value: Any, watch: Watch, held: list[Any]) -> Any:
    """A global's value as a fingerprint holds it: by value where its walk of its own can
    compare all it meets within :data:`_GLOBAL_BUDGET` values (what it read then watched
    with the rest), else by identity."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, (type, *_FUNCTIONS)) or _of_the_standard_library(value):
        return id(value)  # classes, modules, builtins, a logger: by identity
    walk = _Walk()
    walk.left = _GLOBAL_BUDGET
    found = walk.value(value)
    if walk.watch.unknown:
        return id(value)
    watch.extend(walk.watch)
    held.append(walk.held)
    return found


def _of_the_standard_library(value: Any) -> bool:
    """Whether ``value`` is an object of a standard library class other than a container or a
    namespace (a ``logging.Logger``, a lock): what a forward's arithmetic does not read, and
    whose walk reaches far (a logger reaches every logger)."""
    if isinstance(value, (dict, *_CONTAINERS, types.SimpleNamespace, argparse.Namespace)):
        return False
    return type(value).__module__.partition(".")[0] in sys.stdlib_module_names


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` (and the functions and comprehensions inside it) may load."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


class _Held:
    """Objects a fingerprint compares by ``id`` elsewhere, kept alive so that no other object
    takes an ``id`` while the fingerprint lives; equal to any other."""

    __slots__ = ("objs",)

    def __init__(self, objs: list[Any]) -> None:
        self.objs = objs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held)

    def __hash__(self) -> int:
        return 0


def structure(modules: Iterable[nn.Module]) -> tuple[Any, ...]:
    """What ``modules`` register, by identity: their parameters, buffers, submodules and
    hooks, and the global module hooks; no attribute's value. Equal fingerprints give equal
    structures, at a small part of :func:`fingerprint`'s cost: enough to tell a module
    added, removed, replaced or hooked, where attribute values cannot change a result (a
    router whose forward is the model's own).

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> before = structure([net])
    >>> net[0].weight.data.zero_()  # doctest: +ELLIPSIS
    tensor(...)
    >>> before == structure([net])
    True
    >>> _ = net.register_forward_hook(lambda *args: None)
    >>> before == structure([net])
    False
    """
    key: list[tuple[Any, ...]] = []
    for m in modules:
        own = vars(m)
        for table in _REGISTERED:
            values = own[table]
            key.append((tuple(values), tuple(map(id, values.values()))))
        key.append(tuple((name, tuple(own[name])) for name in _HOOK_TABLES if own.get(name)))
    key.append(tuple(tuple(t) if isinstance(t, dict) else t for t in global_module_hooks()))
    return tuple(key)


#: Where a module keeps what it registers, and its hooks (nn.Module's own attributes).
_REGISTERED = ("_parameters", "_buffers", "_modules")
_HOOK_TABLES = tuple(k for k, v in vars(nn.Module()).items() if "hook" in k and isinstance(v, dict))


class _Walk:
    """One fingerprint's walk: values seen (shared references and cycles become
    ``("ref", n)``) and the budget left."""

    def __init__(self) -> None:
        #: id to what a later reference becomes: ``("ref", n)``, n the order first seen, or
        #: for what a module registers, its id (held, so no other object takes it)
        self.seen: dict[int, int] = {}
        self.held: list[Any] = []
        self.left = _BUDGET
        self.watch = Watch()

    def registered(self, table: dict[str, Any]) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """A module's table of parameters, buffers or submodules: names, and values by
        identity, in C (a sequence of a thousand layers is walked at every call)."""
        ids = tuple(map(id, table.values()))
        self.held.append(table.copy())
        self.watch.dict(table)
        self.seen.update(zip(ids, ids, strict=True))
        return tuple(table), ids

    def value(self, v: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            return self.unknown()
        if type(v) in _PLAIN or isinstance(v, enum.Enum):
            return v
        if id(v) in self.seen:
            return ("ref", self.seen[id(v)])
        self.seen[id(v)] = len(self.seen)
        if isinstance(v, (nn.Module, torch.Tensor, type)):
            if isinstance(v, torch.Tensor):
                return _Same(v), self.watch.tensor(v)
            return _Same(v), None
        if isinstance(v, dict):
            self.watch.dict(v)
            return self.fields(v)
        if isinstance(v, _CONTAINERS):
            if not isinstance(v, (tuple, frozenset)):  # those cannot change; their items are watched
                self.watch.sequence(v)
            self.left -= len(v)
            return type(v), self.items(sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v)
        if type(v).__module__ == "numpy" and hasattr(v, "tobytes"):
            data = _array(v)
            self.watch.arrays.append((v, data))
            return type(v), *data
        if isinstance(v, types.MethodType):
            return types.MethodType, _Same(v.__func__), self.value(v.__self__)
        if isinstance(v, functools.partial):
            self.watch.attributes_of(v, ("func", "args", "keywords"))
            return functools.partial, self.value(v.func), self.value(v.args), self.value(v.keywords)
        if isinstance(v, types.FunctionType):
            cells = tuple(_cell(c) for c in v.__closure__ or ())
            self.watch.attributes_of(v, ("__defaults__", "__kwdefaults__", "__closure__"))
            self.watch.sequence(_Cells(v.__closure__ or ()))
            made = (v.__defaults__, v.__kwdefaults__, cells)
            self.held.append(made)  # in seen by its id: kept, lest another object take it
            return _Same(v), self.value(made)
        if isinstance(v, _FUNCTIONS):
            return _Same(v)
        return self.object(v)

    def unknown(self) -> _Unknown:
        self.watch.unknown = True
        return _Unknown()

    def fields(self, d: dict[Any, Any]) -> Any:
        """A dict's items by value (the dict itself watched by the caller, where it is not a
        copy)."""
        self.left -= len(d)
        return type(d), self.items(d), self.items(d.values())

    def items(self, values: Iterable[Any]) -> tuple[Any, ...]:
        """:meth:`item` of each value, in order; plain values alone are taken as they are,
        in C."""
        values = tuple(values)
        if all(map(_PLAIN.__contains__, map(type, values))):
            return values
        return tuple(map(self.item, values))

    def item(self, v: Any) -> Any:
        """:meth:`value` of a container's item; a plain one, or an empty container (a
        module's hook tables), taken at once."""
        kind = type(v)
        if kind in _PLAIN:
            return v
        if kind in _EMPTIABLE and not v:
            self.watch.empty.append(v)
            return kind
        return self.value(v)

    def object(self, v: Any) -> Any:
        """An object of another class: its attributes, by value."""
        has_dict = hasattr(v, "__dict__")
        fields = dict(vars(v)) if has_dict else {}
        slots = tuple(
            slot for cls in type(v).__mro__ for slot in getattr(cls, "__slots__", ())
            if slot not in ("__dict__", "__weakref__")
        )
        for slot in slots:
            if hasattr(v, slot):
                fields[slot] = getattr(v, slot)
        if not fields and not has_dict:
            return self.unknown()  # no attributes to compare: a C object fxnx knows nothing of
        self.watch.attributes_of(v, ("__class__", "__dict__", *slots) if has_dict else ("__class__", *slots))
        if has_dict:
            self.watch.dict(vars(v))
        return type(v), self.fields(fields)  # a copy: not in seen, whose ids must stay taken


def _array(v: Any) -> tuple[Any, ...]:
    """A NumPy array or scalar by value: its dtype, shape and bytes."""
    return str(v.dtype), getattr(v, "shape", ()), v.tobytes()


class _Cells:
    """A closure's cells' contents, read afresh each time (as a sequence for :class:`Watch`)."""

    __slots__ = ("cells",)

    def __init__(self, cells: tuple[Any, ...]) -> None:
        self.cells = cells

    def __len__(self) -> int:
        return len(self.cells)

    def __iter__(self) -> Any:
        return map(_cell, self.cells)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
