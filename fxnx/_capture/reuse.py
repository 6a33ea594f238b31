"""Reusing a capture across credit runs on the same model.

Capturing a model (tracing it, or running ``torch.export``) costs far more than
one forward pass, and a training loop routes credit thousands of times over
one model. :func:`recapture` captures it again with the options ``G`` stores
(``G.graph["capture_options"]``), and keeps the captured graph on the graph object ``G``
itself, outside its data (``vars(G)``, never ``G.graph``: files do not hold
it, and it lives exactly as long as ``G`` does, with no global table that
could keep a model alive), keyed by
everything it depends on: the model, the capture options, the model's
structure (module classes and identities, parameter and buffer names, shapes, dtypes
and devices, and every attribute any module holds, by value: see
:mod:`~fxnx._capture.fingerprint`) and
the inputs' structure (dtypes of tensors and, unless the graph was specialised
to the example's shapes, their shapes; other values as they are). Parameter *values* may change between calls, as an optimizer changes
them in place; the graph reads them from the model's own modules and
parameters at run time. When the structure changes (a module replaced, a
parameter frozen, the training mode switched), the key changes and the model
is captured again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
import torch
from torch import nn

from .._compat import pytree
from .._errors import FxnxValueError
from .fingerprint import fingerprint
from .inputs import bind_inputs, placeholder_values
from .ladder import Capture, capture
from .options import CaptureOptions, LeafSpec, concrete_items, leaf_names, plain_equal
from .registry import ROUTES

__all__ = ["inputs_key", "kept_on", "options_of", "placeholders_for", "recapture", "snapshot", "traced_through"]

#: Where on ``G`` (as a Python attribute, not graph data) the captures are kept.
_SLOT = "_fxnx_captures"
#: Captures kept per graph (other models, input shapes or options); the oldest goes first.
_PER_GRAPH = 4


def recapture(
    G: nx.MultiDiGraph,
    model: nn.Module | Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    leaf_modules: Iterable[LeafSpec] | LeafSpec = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> Capture:
    """The capture behind ``G``, without shapes: captured again with the options stored in
    ``G.graph["capture_options"]``, or reused from an earlier call for ``G`` with the same
    model structure, inputs and options.

    ``leaf_modules``, when given, replace the stored ones. ``concrete_args`` change what
    the model computes, so the stored ones are a record, never applied: the caller's must
    name the same inputs with the same values (see :func:`_callers`).
    """
    options = options_of(G)
    if leaf_modules:
        options = dataclasses.replace(options, leaf_modules=leaf_names(leaf_modules))
    options = dataclasses.replace(options, concrete_args=_callers(options, concrete_items(concrete_args)))
    keywords = options.replay().keywords()
    if not isinstance(model, nn.Module):
        return capture(model, args, kwargs, propagate=False, **keywords)
    base = (id(model), _options_key(keywords), _structure(model))
    exact = (*base, inputs_key(args, kwargs, shapes=True))
    any_shape = (*base, inputs_key(args, kwargs, shapes=False))
    kept = kept_on(G, _SLOT)
    cached = kept.get(exact) or kept.get(any_shape)
    if cached is None:
        cap = capture(model, args, kwargs, propagate=False, **keywords)
        # The entry must not hold the model itself, or the weak key would never be freed.
        kept[exact if cap.shape_specialised else any_shape] = dataclasses.replace(
            cap, model=None, inputs=None
        )
        while len(kept) > _PER_GRAPH:
            del kept[next(iter(kept))]
        return cap
    return dataclasses.replace(cached, model=model, inputs=placeholders_for(cached, model, args, kwargs))


def _callers(stored: CaptureOptions, given: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """The caller's ``concrete_args``, checked against those ``G`` records.

    A graph file is data from anywhere: what it says was fixed while tracing must not
    fix anything in the caller's model. The caller passes the values; they must be
    the ones the graph was made with, or the graph is not this computation's.
    """
    recorded = dict(stored.concrete_args)
    values = dict(given)
    for name in sorted(recorded.keys() - values.keys()):
        shown = "a value a graph cannot store" if name in stored.unstored else f"{recorded[name]!r}"
        raise FxnxValueError(
            f"G was converted with concrete_args {name!r} fixed to {shown}; fxnx never applies "
            "a graph's stored concrete_args to your model: pass them yourself, "
            f"concrete_args={{{name!r}: ...}}, with the value you converted with"
        )
    for name in sorted(values.keys() - recorded.keys()):
        raise FxnxValueError(
            f"concrete_args {name!r} was not fixed when G was converted; convert the model "
            f"again with concrete_args={{{name!r}: {values[name]!r}}} to route with it fixed"
        )
    for name, value in sorted(values.items()):
        if name not in stored.unstored and not plain_equal(value, recorded[name]):
            raise FxnxValueError(
                f"concrete_args {name!r} is {value!r} here, but G was converted with "
                f"{recorded[name]!r}: G is the graph of another computation; convert the "
                f"model again with concrete_args={{{name!r}: {value!r}}}"
            )
    return given


def placeholders_for(
    cap: Capture, model: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None, *, copy: bool = True
) -> list[Any] | None:
    """The values of ``cap``'s placeholders for a call of ``model`` with these inputs (the
    tensors copied, unless ``copy`` is false); None where the inputs do not bind."""
    inputs = bind_inputs(model, args, kwargs, dict(cap.options.concrete_args), copy=copy)
    return placeholder_values(inputs, cap.gm, cap.level)


def traced_through(gm: torch.fx.GraphModule, model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose code a capture ran (and so baked into ``gm``): all but
    the modules ``gm`` calls as whole modules and what lies inside them."""
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    return [
        m for path, m in model.named_modules(remove_duplicate=False)
        if not any(path == c or path.startswith(c + ".") for c in called)
    ]


def options_of(G: nx.MultiDiGraph) -> CaptureOptions:
    """The capture options stored in ``G`` (``G.graph["capture_options"]``).

    Examples
    --------
    >>> import torch, fxnx
    >>> G = fxnx.convert(torch.nn.ReLU(), torch.zeros(2), routes="export")
    >>> options_of(G).replay().routes
    ('export',)
    """
    if "capture_options" in G.graph:
        try:
            options = CaptureOptions.from_plain(G.graph["capture_options"])
        except (KeyError, TypeError, AttributeError) as err:
            raise FxnxValueError(
                f"G.graph['capture_options'] is not a record fxnx wrote ({type(err).__name__}: "
                f"{err}); convert the model again"
            ) from None
        if options.route != G.graph.get("capture"):
            raise FxnxValueError(
                f"G.graph['capture_options'] says route {options.route!r} made the graph, but "
                f"G.graph['capture'] says {G.graph.get('capture')!r}: the graph's record "
                "contradicts itself; convert the model again"
            )
        return options
    # A graph of format 1 (before capture_options): its route, and what it kept whole.
    route = G.graph.get("capture")
    return CaptureOptions(
        routes=(route,) if route in ROUTES else (), level=G.graph.get("level", "module"),
        leaf_on_failure=bool(G.graph.get("opaque_modules")),
    )


def snapshot(G: nx.MultiDiGraph, *slots: str) -> nx.MultiDiGraph:
    """``G`` as it is now (its nodes, edges and their data: a copy of each attribute dict,
    the values shared), sharing with ``G`` the captures kept on it and the other ``slots``
    (:func:`kept_on`): what a router routes over, so that an edit of ``G`` after the router
    was built never changes its routing at some later step."""
    H = G.copy()
    for slot in (_SLOT, *slots):
        vars(H)[slot] = kept_on(G, slot)
    return H


def kept_on(G: nx.MultiDiGraph, slot: str) -> dict[Any, Any]:
    """The dict kept on ``G`` under the Python attribute ``slot``, outside the graph's data.

    What it holds (captures, routers) is not part of the graph: a copy or a pickle of ``G``
    starts with it empty.
    """
    kept = vars(G).get(slot)
    if type(kept) is not _Kept:  # first use, or a graph unpickled with an empty plain dict
        kept = vars(G)[slot] = _Kept()
    return kept


class _Kept(dict):  # type: ignore[type-arg]
    """A dict that a copy or a pickle of its graph does not carry (a pickle holds an empty
    plain dict, so it loads without fxnx or torch)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, ()

    def __deepcopy__(self, memo: Any) -> _Kept:
        return _Kept()


def _structure(model: nn.Module) -> tuple[Any, ...]:
    """What a captured graph of ``model`` depends on, besides the inputs."""
    # Identities too: a graph calls the very modules and reads the very parameters it was
    # captured with (the cached graph keeps them alive, so their ids are not reused).
    # Every attribute by value too (fingerprint): a trace bakes in what the forward read.
    named = list(model.named_modules())
    return (
        tuple((path, id(m), type(m)) for path, m in named),
        tuple((n, id(p), p.shape, p.dtype, p.device, p.requires_grad)
              for n, p in model.named_parameters()),
        tuple((n, id(b), b.shape, b.dtype, b.device) for n, b in model.named_buffers()),
        fingerprint(m for _, m in named),
    )


def inputs_key(args: Sequence[Any], kwargs: Mapping[str, Any] | None, shapes: bool) -> Any:
    """What a capture depends on in the inputs: their structure, tensors' dtypes, devices and
    (where the capture is specialised to them) shapes and whether they require gradients (a
    branch on ``x.requires_grad`` is fixed in such a graph), other values as they are."""
    if not kwargs and all(type(x) is torch.Tensor for x in args):  # the common case, cheaply
        return len(args), tuple(
            ((tuple(x.shape), x.requires_grad) if shapes else x.dim(), x.dtype, x.device.type) for x in args
        )
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    return str(spec), tuple(
        ("tensor", (tuple(x.shape), x.requires_grad) if shapes else x.dim(), x.dtype, x.device.type)
        if isinstance(x, torch.Tensor)
        else (type(x), x if _hashable(x) else repr(x))
        for x in leaves
    )


def _options_key(options: Mapping[str, Any]) -> Any:
    return tuple(
        (name, tuple(value) if isinstance(value, list) else value
         if _hashable(value) else repr(value))
        for name, value in sorted(options.items())
    )


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
