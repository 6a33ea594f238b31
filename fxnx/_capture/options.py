"""The options that produce a graph, as one value: :class:`CaptureOptions`.

A graph remembers how it was captured (``G.graph["capture_options"]``, plain
data), so that :func:`fxnx.route_credit` and later tools capture the same
model again exactly, without being told the options a second time. Module
classes in ``leaf_modules`` are kept by qualified name (``"class:pkg.mod.Block"``)
and matched against the classes of the model's own submodules, so the stored
value needs neither torch nor the user's code to load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._contract import class_name
from .._errors import FxnxTypeError, FxnxValueError

__all__ = [
    "CLASS_PREFIX",
    "CaptureOptions",
    "LEVELS",
    "LeafSpec",
    "TORCH_NN",
    "UNSTORED",
    "check_level",
    "concrete_items",
    "leaf_names",
    "plain_equal",
]

#: A ``leaf_modules`` entry: a module class, a qualified submodule name, ``"torch.nn"`` or
#: ``"class:<qualified class name>"``.
LeafSpec = type | str

LEVELS = ("module", "aten", "joint")

#: The ``leaf_modules`` entry that keeps every ``torch.nn`` module whole, torch.fx's own rule.
TORCH_NN = "torch.nn"
#: How a module class is spelt in ``leaf_modules`` as plain data.
CLASS_PREFIX = "class:"
#: The key that marks a ``concrete_args`` value a graph cannot hold (a tensor).
UNSTORED = "fxnx_unstored"

_PLAIN = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class CaptureOptions:
    """How a graph was (or is to be) captured.

    Attributes
    ----------
    routes : tuple of str
        The routes to try, in order (``"auto"`` is all of them).
    leaf_modules : tuple of str
        Submodule paths, ``"class:<qualified class name>"`` entries and
        ``"torch.nn"`` (every ``torch.nn`` module whole), kept as single nodes.
    concrete_args : tuple of (name, value)
        Inputs fixed to constants while tracing, sorted by name.
    level : str
        ``"module"``, ``"aten"`` or ``"joint"``.
    leaf_on_failure : bool
        Whether a submodule that symbolic tracing fails in is kept whole.
    route : str or None
        The route that made the graph (``"graph_module"`` for a given
        ``GraphModule``); None before capture.
    opaque : tuple of str
        Submodules kept whole because tracing failed in them.

    Examples
    --------
    >>> opts = CaptureOptions(routes=("export",), concrete_args=(("flag", True),))
    >>> CaptureOptions.from_plain(opts.to_plain()) == opts
    True
    >>> opts.to_plain()["concrete_args"]
    {'flag': True}
    """

    routes: tuple[str, ...] = ()
    leaf_modules: tuple[str, ...] = ()
    concrete_args: tuple[tuple[str, Any], ...] = ()
    level: str = "module"
    leaf_on_failure: bool = False
    route: str | None = None
    opaque: tuple[str, ...] = ()

    def to_plain(self) -> dict[str, Any]:
        """The options as plain data (str, int, float, bool, None, list, dict) for ``G.graph``.

        A ``concrete_args`` value that is not plain data (a tensor) becomes
        ``{"fxnx_unstored": "<its type>"}``; re-capturing then needs it passed again.
        """
        return {
            "routes": list(self.routes),
            "route": self.route,
            "leaf_modules": list(self.leaf_modules),
            "concrete_args": {name: _plain_or_marker(v) for name, v in self.concrete_args},
            "level": self.level,
            "leaf_on_failure": self.leaf_on_failure,
            "opaque": list(self.opaque),
        }

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> CaptureOptions:
        """The options :meth:`to_plain` wrote."""
        return cls(
            routes=tuple(data["routes"]),
            leaf_modules=tuple(data["leaf_modules"]),
            concrete_args=tuple(sorted((k, _from_plain(v)) for k, v in data["concrete_args"].items())),
            level=data["level"],
            leaf_on_failure=data["leaf_on_failure"],
            route=data["route"],
            opaque=tuple(data["opaque"]),
        )

    def captured(self, route: str, opaque: Sequence[str]) -> CaptureOptions:
        """These options with the route that made the graph and what it kept whole."""
        return dataclasses.replace(self, route=route, opaque=tuple(opaque))

    def replay(self) -> CaptureOptions:
        """The options that capture the same graph again directly: only the winning route,
        and the submodules it had to keep whole listed as leaves up front."""
        if self.route is None:
            return self
        return dataclasses.replace(
            self,
            routes=(self.route,) if self.route in self.routes else self.routes,
            leaf_modules=self.leaf_modules + tuple(p for p in self.opaque if p not in self.leaf_modules),
            leaf_on_failure=False,
            route=None,
            opaque=(),
        )

    @property
    def unstored(self) -> list[str]:
        """Names of ``concrete_args`` whose value a graph could not hold."""
        return [name for name, v in self.concrete_args if isinstance(v, _Unstored)]

    def keywords(self) -> dict[str, Any]:
        """The options as :func:`fxnx.capture`'s keyword arguments."""
        return {
            "routes": self.routes,
            "leaf_modules": self.leaf_modules,
            "concrete_args": dict(self.concrete_args),
            "level": self.level,
            "leaf_on_failure": self.leaf_on_failure,
        }


def leaf_names(leaf_modules: Iterable[LeafSpec] | LeafSpec) -> tuple[str, ...]:
    """``leaf_modules`` as plain strings: classes become ``"class:<qualified name>"``.

    Examples
    --------
    >>> import torch
    >>> leaf_names([torch.nn.Linear, "block.0"])
    ('class:torch.nn.modules.linear.Linear', 'block.0')
    >>> leaf_names("torch.nn")
    ('torch.nn',)
    """
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = [leaf_modules]
    names: list[str] = []
    for spec in leaf_modules:
        if isinstance(spec, type) and _is_module_class(spec):
            names.append(CLASS_PREFIX + class_name(spec))
        elif isinstance(spec, str):
            names.append(spec)
        else:
            raise FxnxTypeError(
                "leaf_modules entries must be nn.Module subclasses, qualified submodule names "
                f"(str) or 'torch.nn', got {spec!r} of type {type(spec).__qualname__}"
            )
    return tuple(names)


def concrete_items(concrete_args: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """``concrete_args`` as sorted pairs; names must be strings."""
    items = dict(concrete_args or {})
    bad = [k for k in items if not isinstance(k, str)]
    if bad:
        raise FxnxTypeError(f"concrete_args keys must be parameter names (str), got {bad[0]!r}")
    return tuple(sorted(items.items()))


def plain_equal(value: Any, recorded: Any) -> bool:
    """Whether ``value`` is the value a graph records as ``recorded`` (as plain data: a tuple
    is recorded as a list)."""
    plain = _plain_or_marker(value)
    return type(plain) is type(recorded) and plain == recorded


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise FxnxValueError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")


class _Unstored:
    """A ``concrete_args`` value read back from a graph that could not hold it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unstored) and other.kind == self.kind

    def __hash__(self) -> int:
        return hash(self.kind)

    def __repr__(self) -> str:
        return f"<{self.kind} not stored in the graph>"


def _is_plain(value: Any) -> bool:
    if isinstance(value, bool) or type(value) in _PLAIN:
        return True
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items()) and UNSTORED not in value
    return False


def _plain_or_marker(value: Any) -> Any:
    if isinstance(value, _Unstored):
        return {UNSTORED: value.kind}
    if _is_plain(value):
        return list(value) if type(value) is tuple else value
    return {UNSTORED: class_name(type(value))}


def _from_plain(value: Any) -> Any:
    if type(value) is dict and set(value) == {UNSTORED}:
        return _Unstored(str(value[UNSTORED]))
    return value


def _is_module_class(cls: type) -> bool:
    return any(class_name(c) == "torch.nn.modules.module.Module" for c in cls.__mro__)
