"""A captured fx graph as a ``networkx.MultiDiGraph`` of plain Python data.

:func:`convert` captures the model and propagates the example inputs through the graph,
counting each node's FLOPs on the way (:mod:`fxnx._costs`); building the graph reads the fx
graph and the metadata that :mod:`fxnx._capture` recorded, and runs nothing on real data.
The attributes it writes are the graph contract: see :mod:`fxnx.contract` and docs/graph.md.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from ._callinfo import bind_call, fetch_attr, occurrences, qualified_name
from ._capture import Capture, capture
from ._compat import own_forward, pytree, runs_own_forward, uncompiled
from ._costs import kernel, node_flops, propagate_and_count
from ._errors import FxnxTypeError, warn_user
from ._version import FORMAT_VERSION, __version__

__all__ = ["convert", "graph_from_capture"]

#: torch's dropout layers, each of which returns its input itself in eval mode
_DROPOUTS = frozenset({
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout,
})


def convert(
    model: nn.Module | Callable[..., Any],
    *example_inputs: Any,
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> nx.MultiDiGraph:
    """Convert a PyTorch model into a graph of its dataflow.

    Parameters
    ----------
    model : nn.Module, fx.GraphModule or callable
        The model. An already traced ``GraphModule`` is converted as it is.
    *example_inputs : Any
        Positional inputs of ``model.forward``. Without any, the graph has the
        full structure and ``None`` for every shape and dtype.
    kwargs : mapping, optional
        Keyword inputs of ``model.forward``.
    **options
        How to capture the model: the keyword options of :func:`fxnx.capture`, declared and
        documented there once (``leaf_modules``, ``concrete_args``, ``input_shape``,
        ``dtype``, ``fake``, ``level``, ``routes``, ``leaf_on_failure``). With a model built
        on the ``meta`` device and ``input_shape``, nothing is allocated or computed: models
        too big to run convert in seconds. ``G.graph["capture"]`` names the route that won and
        ``G.graph["capture_options"]`` keeps every option that made the graph, so
        :func:`fxnx.route_credit` captures it again the same way. With ``level="joint"``,
        every node's ``phase`` says ``"forward"`` or ``"backward"`` and
        ``G.graph["gradients"]`` names the node computing each gradient.

    Returns
    -------
    networkx.MultiDiGraph
        One node per fx node keyed by its name; one edge per occurrence of an
        input in a node's arguments. Attributes are plain Python data; see
        docs/graph.md (and :mod:`fxnx.contract`) for the full list.

    Raises
    ------
    FxnxTypeError, FxnxValueError, CaptureError, ShapePropagationError
        See :func:`fxnx.capture`.

    Examples
    --------
    >>> import torch
    >>> class Square(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * x
    >>> G = convert(Square(), torch.zeros(2, 3))
    >>> list(G.edges(keys=True, data="arg"))
    [('x', 'mul', 0, 0), ('x', 'mul', 1, 1), ('mul', 'output', 0, 0)]
    >>> G.nodes["mul"]["target"], G.nodes["mul"]["out_shape"]
    ('operator.mul', (2, 3))
    """
    with _collection_paused():
        cap = capture(  # holds TRACING_LOCK through each route's shape propagation
            model, example_inputs, kwargs,
            propagate=propagate_and_count,  # each route's graph, counting FLOPs on the way
            **_capture_options(options),
        )
        G = _graph(cap, cap.propagation)
    _warn_unread_keywords(G, kwargs or {})
    return G


def _warn_unread_keywords(G: nx.MultiDiGraph, kwargs: Mapping[str, Any]) -> None:
    """Warn of a keyword input holding a tensor that no node of ``G`` reads: the model ignores
    it, as a ``forward`` taking ``**kwargs`` ignores a misspelled name (``attention_masks=``),
    and the graph has none of what it would have done."""
    placeholders = [n for n, data in G.nodes(data=True) if data.get("op") == "placeholder"]
    unread = [
        given["name"] for node, given in zip(placeholders, G.graph.get("inputs", []), strict=False)
        if given["name"] in kwargs and G.out_degree(node) == 0
        and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(kwargs[given["name"]]))
    ]
    if unread:
        warn_user(
            f"keyword input{'s' * (len(unread) > 1)} {', '.join(map(repr, unread))} of "
            f"{G.graph.get('model')} {'is' if len(unread) == 1 else 'are'} read by no node of the "
            "graph: the model ignores it with these inputs (a misspelled keyword, where forward "
            "takes **kwargs?), and so does the graph"
        )


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a graph is built.

    Tracing and conversion allocate several objects per node and free almost
    none; each full collection walks every one of them, so collections made
    conversion time grow faster than the node count (14x for 10x the nodes).
    Anything cyclic left behind is collected once the collector runs again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


#: The options convert passes to capture: capture's keyword options, declared there once, but
#: ``propagate`` (convert propagates the inputs itself, counting costs on the way).
_OPTIONS = tuple(p for p in inspect.signature(capture).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "propagate")

# help(), IDEs and the API docs show capture's options in convert's signature.
convert.__signature__ = inspect.signature(convert).replace(  # type: ignore[attr-defined]
    parameters=[*list(inspect.signature(convert).parameters.values())[:-1], *_OPTIONS])


def _capture_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if each is one of capture's, else TypeError as Python's own names it."""
    names = [p.name for p in _OPTIONS]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise FxnxTypeError(
            f"convert() got an unexpected keyword argument {unknown[0]!r}: its options are "
            f"fxnx.capture's ({', '.join(names)})"
        )
    return options


def graph_from_capture(cap: Capture) -> nx.MultiDiGraph:
    """Build the graph from an already captured model (nothing runs on real data: where
    ``cap`` has shapes, FLOPs are counted by running its nodes on ``meta`` tensors).

    Examples
    --------
    >>> import torch
    >>> from fxnx._capture import capture
    >>> G = graph_from_capture(capture(torch.nn.ReLU()))
    >>> sorted(G.nodes), G.nodes["relu"]["out_shape"] is None
    (['input_1', 'output', 'relu'], True)
    """
    return _graph(cap, None)


def _with_containers(modules: dict[str, str], model: Any) -> dict[str, str]:
    """``modules`` with the containers no node calls (an ``nn.ModuleList``, an
    ``nn.ModuleDict``) that hold a module in it, each placed before its first member, where
    the model has it: GPT-2's ``h`` around its blocks ``h.0``, ``h.1``."""
    model = uncompiled(model)
    if not isinstance(model, nn.Module):
        return modules
    found: dict[str, str] = {}
    for path, name in modules.items():
        parts = path.split(".") if path else []
        for end in range(1, len(parts)):
            outer = ".".join(parts[:end])
            if outer in modules or outer in found:
                continue
            try:
                container = type(model.get_submodule(outer))
            except AttributeError:  # a path the model does not hold (a scope export made)
                continue
            if container.forward is nn.Module.forward:  # no forward: a container, never called
                found[outer] = qualified_name(container)
        found[path] = name
    return found


def _graph(cap: Capture, flops: dict[str, tuple[int | None, int | None]] | None) -> nx.MultiDiGraph:
    """The graph of ``cap``; ``flops`` are its nodes' counts where propagation counted them."""
    if flops is None and cap.shape_source is not None:
        flops = node_flops(cap.gm, cap.inputs)
    flops = flops or {}
    gm = cap.gm
    G = nx.MultiDiGraph()
    modules: dict[str, str] = {"": qualified_name(type(cap.model))}
    primals = cap.aten.primals if cap.aten else {}
    opaque = set(cap.opaque)
    submodules = dict(gm.named_modules(remove_duplicate=False))  # one walk, not one per node
    described: dict[fx.Node, tuple[Any, Any, int | None]] = {}  # each value's, for its edges
    trainable = _trainable(cap.model)
    for order, node in enumerate(gm.graph.nodes):
        module = _called_module(node, gm, submodules)
        info, names = bind_call(node, gm, module)
        out_shape, out_dtype, _ = described[node] = _describe(node.meta.get("tensor_meta"))
        stack = _module_stack(node, module)
        # the root is the model itself: a wrapper torch.export put around it (its stack's "",
        # for a torch.compile'd model) is not
        modules.update((path, name) for path, name in stack.items() if path)
        num_params, trainable_params = _num_params(node, gm, module, primals, trainable)
        node_cost = flops.get(node.name, (None, None))
        G.add_node(
            node.name,
            op=node.op,
            target=_target(node),
            module_type=_module_type(module),
            scope=_scope(node, stack),
            order=order,
            out_shape=out_shape,
            out_dtype=out_dtype,
            out_type=qualified_name(node.meta["type"]) if "type" in node.meta else None,
            num_params=num_params,
            trainable_params=trainable_params,
            flops=node_cost[0],
            macs=node_cost[1],
            kernel=kernel(node, module, info, lambda name: G.nodes[name]["out_shape"]),
            node_call_info=info,
            phase=node.meta.get("fxnx_phase", "forward"),
            opaque=node.op == "call_module" and node.target in opaque,
        )
        if getattr(module, "inplace", None) is True:
            G.nodes[node.name]["writes_input"] = True
        elif (type(module) in _DROPOUTS and not module.training  # type: ignore[union-attr]
              and runs_own_forward(module, own_forward(type(module)))):  # no hook, no forward of its own
            G.nodes[node.name]["returns_input"] = True  # it returns its input itself
        for arg, source in occurrences(node, names):
            shape, dtype, nbytes = described[source]
            if isinstance(shape, (list, dict)):  # nested: each edge gets lists of its own
                shape, dtype, nbytes = _describe(source.meta.get("tensor_meta"))
            G.add_edge(source.name, node.name, arg=arg, shape=shape, dtype=dtype, nbytes=nbytes)

    G.graph.update(
        fxnx_version=__version__,
        format_version=FORMAT_VERSION,
        torch_version=str(torch.__version__),
        model=modules[""],
        capture=cap.method,
        shape_source=cap.shape_source,
        inputs=[
            {"name": node.target, "shape": G.nodes[node.name]["out_shape"],
             "dtype": G.nodes[node.name]["out_dtype"]}
            for node in gm.graph.nodes
            if node.op == "placeholder"
        ],
        modules=_with_containers(modules, cap.model),
        num_params=sum(p.numel() for p in gm.parameters())
        + sum(G.nodes[name]["num_params"] for name in primals),
        trainable_params=sum(p.numel() for p in gm.parameters() if p.requires_grad)
        + sum(G.nodes[name]["trainable_params"] for name in primals),
        flops=_total(G, "flops"),
        macs=_total(G, "macs"),
        level=cap.level,
        capture_failures=dict(cap.failures),
        capture_options=cap.options.to_plain(),
    )
    if isinstance(cap.model, nn.Module):
        G.graph["training"] = cap.model.training
        tied = _tied(cap.model)
        if tied:
            G.graph["tied_parameters"] = tied
    if cap.opaque:  # an empty list breaks torch_geometric's from_networkx: written only when any
        G.graph["opaque_modules"] = list(cap.opaque)
    if cap.fixed_kwargs:
        G.graph["fixed_kwargs"] = dict(cap.fixed_kwargs)
    if cap.aten is not None:
        G.graph.update(
            primals=cap.aten.primals,
            tangents=cap.aten.tangents,
            gradients=cap.aten.gradients,
            specialised=cap.aten.specialised,
        )
    return G


def _describe(meta: Any) -> tuple[Any, Any, int | None]:
    """(shape, dtype, nbytes) of a ShapeProp ``tensor_meta``, mirroring nested outputs."""
    if isinstance(meta, TensorMetadata):
        shape = tuple(d if isinstance(d, str) else int(d) for d in meta.shape)
        numeric = all(isinstance(d, int) for d in shape)
        return shape, str(meta.dtype), math.prod(shape) * meta.dtype.itemsize if numeric else None
    if isinstance(meta, (list, tuple)):
        parts = [_describe(m) for m in meta]
        known = [p[2] for p in parts if p[2] is not None]
        return [p[0] for p in parts], [p[1] for p in parts], sum(known) if known else None
    if isinstance(meta, dict):
        parts_d = {str(k): _describe(m) for k, m in meta.items()}
        known = [p[2] for p in parts_d.values() if p[2] is not None]
        return (
            {k: p[0] for k, p in parts_d.items()},
            {k: p[1] for k, p in parts_d.items()},
            sum(known) if known else None,
        )
    return None, None, None


def _target(node: fx.Node) -> str:
    if node.op in ("call_function",):
        return qualified_name(node.target)
    return str(node.target)


def _called_module(
    node: fx.Node, gm: fx.GraphModule, submodules: dict[str, nn.Module]
) -> nn.Module | None:
    """The submodule a ``call_module`` node calls (None for other nodes)."""
    if node.op != "call_module":
        return None
    module = submodules.get(str(node.target))
    return module if module is not None else gm.get_submodule(str(node.target))


def _module_type(module: nn.Module | None) -> str | None:
    return None if module is None else qualified_name(type(module))


def _module_stack(node: fx.Node, module: nn.Module | None) -> dict[str, str]:
    """Module path to qualified class name, outermost first, as the tracer recorded it."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        return {path: qualified_name(cls) for path, cls in stack.values()}
    if module is not None:  # a call_module node of a graph built without the module stack
        return {str(node.target): _module_type(module) or ""}
    return {}


def _scope(node: fx.Node, stack: dict[str, str]) -> str:
    """The path of the module whose ``forward`` made this call ("" for the model itself)."""
    paths = list(stack)
    if node.op == "call_module":
        if paths and paths[-1] == node.target:
            paths = paths[:-1]
        elif not paths:
            return str(node.target).rpartition(".")[0]
    return paths[-1] if paths else ""


def _num_params(
    node: fx.Node, gm: fx.GraphModule, module: nn.Module | None,
    primals: dict[str, dict[str, str]], trainable: set[str],
) -> tuple[int, int]:
    """Parameters the node owns, and how many of them train (``requires_grad``): its
    module's, the parameter it reads, or the one it stands for (``trainable`` names the
    model's parameters that train)."""
    primal = primals.get(node.name, {})
    if node.op == "placeholder" and primal.get("kind") == "parameter":
        count = math.prod(node.meta["tensor_meta"].shape)
        return count, count if primal["name"] in trainable else 0
    if module is not None:
        params = list(module.parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    if node.op == "get_attr":
        value = fetch_attr(gm, str(node.target))
        if isinstance(value, nn.Parameter):
            return value.numel(), value.numel() if value.requires_grad else 0
    return 0, 0


def _tied(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each name of a parameter the model reaches under several, but the first, to the first
    (``same_as``), its size and whether it trains."""
    first: dict[int, str] = {}
    tied: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = {"same_as": first[id(p)], "numel": p.numel(), "trainable": p.requires_grad}
        else:
            first[id(p)] = name
    return tied


def _trainable(model: Any) -> set[str]:
    """Names of the model's parameters that train (a joint graph's primals lost the flag)."""
    if not isinstance(model, nn.Module):
        return set()
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _total(G: nx.MultiDiGraph, attribute: str) -> int | None:
    """The sum of a count over the nodes; None if any node's is unknown."""
    counts = [count for _, count in G.nodes(data=attribute)]
    return None if None in counts else sum(counts)
