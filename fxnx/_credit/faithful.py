"""The credit run computes what the model computes: the writes it must follow, and its output.

A model may write in place into a value that later nodes read: ``x[:, :2] += y``,
``torch.ops.aten.copy_(h[:, :2], y)``, a write through a view, or one inside a wrapped
function or a module the graph calls whole. :func:`probe` runs the captured graph once,
without gradients, and tells from autograd's version counters which node writes into which
earlier nodes' values (every write autograd sees, however it is spelled), and whether a later
node reads what it wrote. :mod:`.graft` then runs such a write in place, as the model does,
and gives every node whose value it overwrites a value of its own for reporting its credit;
a write no later node reads may run out of place.

The same run gives the captured graph's output on these inputs. The credit run is checked
against it the first time it runs (:func:`differs`, once per graft, so later calls pay
nothing), and the captured graph against ``model(...)`` itself once per capture
(:mod:`.router`): a credit run never returns an output the model would not. What a trace
leaves out, hooks it never ran, is refused
(:func:`check_hooks`), and so is a hook the model's forward registers on a tensor it computes
(:class:`TensorHooks`), which no captured graph holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._capture.agree import differs, tensors
from .._capture.shapes import mutable, node_failure
from .._compat import forward_hooks, global_hooks, has_hooks, version
from .._errors import FxnxValueError, warn_user

__all__ = ["Probe", "TensorHooks", "check_hooks", "differs", "probe", "warn_traced_hooks"]


@dataclass(frozen=True)
class Probe:
    """What one run of a captured graph showed.

    Attributes
    ----------
    writers : dict
        Node name to the names of the earlier nodes whose values it wrote into in place
        (they share storage with what it wrote: the written tensor, its views, its base).
    written : dict
        Node name to the input occurrences (``_callinfo.occurrences`` order) whose storage it
        wrote into.
    observed : frozenset of str
        The writers whose write something sees afterwards: a later node reads one of those
        values, the graph returns one, or one is an input or a parameter or buffer of the model.
    shared : frozenset of str
        Nodes that handed back a tensor an earlier node also holds (``nn.Identity``,
        dropout in eval mode, ``getitem`` of a tuple, an in-place op returning its input).
    output : Any
        The graph's output (in the model's structure).
    """

    writers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    written: dict[str, tuple[int, ...]] = field(default_factory=dict)
    observed: frozenset[str] = frozenset()
    shared: frozenset[str] = frozenset()
    output: Any = None


def probe(gm: fx.GraphModule, values: list[Any]) -> Probe:
    """Run ``gm`` on ``values`` node by node (the caller holds ``torch.no_grad()`` and restores
    the model's buffers and random state) and return what it wrote where.

    A node that fails raises the error naming it (:func:`~fxnx._capture.shapes.node_failure`).
    Every value is kept until the end, so no two values share storage by chance.
    """
    run = _Run(gm)
    output = run.run(*values)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    observed = set()
    for writer, victims in run.writes.items():
        if any(
            v.op in ("placeholder", "get_attr")
            or any(position[u] > position[writer] for u in v.users)
            for v in victims
        ):
            observed.add(writer.name)
    return Probe(
        writers={w.name: tuple(v.name for v in victims) for w, victims in run.writes.items()},
        written=run.written,
        observed=frozenset(observed),
        shared=frozenset(run.shared),
        output=output,
    )


class _Run(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False  # node_failure names the node
        self.owners: dict[int, list[fx.Node]] = {}  # storage -> the nodes whose values live there
        self.held: dict[int, Tensor] = {}  # storage -> a tensor on it, for its version counter
        self.writes: dict[fx.Node, list[fx.Node]] = {}
        self.written: dict[str, tuple[int, ...]] = {}
        self.ids: set[int] = set()
        self.shared: set[str] = set()

    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = mutable(self.fetch_args_kwargs_from_env(n))
        # A node writes into what it is given: only its arguments' storages are watched
        # (their views and bases share the storage and autograd's version counter).
        watched = {k: version(self.held[k]) for k in map(_storage, tensors((args, kwargs)))
                   if k in self.held}
        try:
            value = getattr(self, n.op)(n.target, args, kwargs)
        except Exception as err:
            raise node_failure("the credit run's forward pass", n, args, kwargs, err) from err
        changed = {k for k, before in watched.items() if version(self.held[k]) != before}
        k: int | None  # a storage: every one changed, then each of the value's (or None)
        if changed:
            victims: list[fx.Node] = []
            for k in changed:
                victims.extend(v for v in self.owners[k] if v not in victims)
            self.writes[n] = victims
            sources: list[fx.Node] = []
            fx.node.map_arg((n.args, n.kwargs), lambda a: sources.append(a) or a)  # type: ignore[func-returns-value]
            self.written[n.name] = tuple(
                i for i, src in enumerate(sources)
                if any(_storage(t) in changed for t in tensors(self.env.get(src)))
            )
        if n.op == "output":
            return value
        held = tensors(value)
        if any(id(t) in self.ids for t in held):
            self.shared.add(n.name)
        for t in held:
            self.ids.add(id(t))
            k = _storage(t)
            if k is not None:
                owners = self.owners.setdefault(k, [])
                if n not in owners:
                    owners.append(n)
                self.held.setdefault(k, t)
        return value


def _storage(t: Tensor) -> int | None:
    """The address of ``t``'s storage (shared by its views), or None for a tensor without one."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
        return None
    return ptr or None


def backward_differs(
    graph: Callable[[], Any], model: Callable[[], Any], params: Mapping[str, Tensor],
) -> str | None:
    """Where autograd over the captured graph gives the parameters other gradients than
    autograd over the model, for one random output credit, in words, or None.

    ``graph`` and ``model`` run the forward each (from the same state: random draws alike);
    their floating output tensors are paired leaf by leaf. The gradients are compared to a
    relative norm of ``1000·eps`` of their dtype, as :func:`differs` compares values: a
    custom autograd Function's backward that is the derivative of its forward agrees to
    rounding; a straight-through estimator's does not.
    """
    want_out, got_out = tensors(model()), tensors(graph())
    pairs = [(w, g) for w, g in zip(want_out, got_out, strict=False)
             if w.requires_grad and g.requires_grad and w.shape == g.shape]
    if len(want_out) != len(got_out) or not pairs:
        return "their outputs cannot be paired"
    generator = torch.Generator().manual_seed(0)
    credit = [torch.randn(w.shape, generator=generator, dtype=torch.float64).to(w) for w, _ in pairs]
    names, values = list(params), list(params.values())
    want = torch.autograd.grad([w for w, _ in pairs], values, credit, allow_unused=True)
    got = torch.autograd.grad([g for _, g in pairs], values, credit, allow_unused=True)
    for name, p, a, b in zip(names, values, want, got, strict=True):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        scale = float(a.double().norm()) or 1.0
        gap = float((a.double() - b.double()).norm()) / scale
        if gap > min(1000 * torch.finfo(p.dtype).eps, 1e-2):
            return f"the gradient of parameter {name!r} differs by {gap:.3g} (relative norm)"
    return None


def check_hooks(model: nn.Module, traced: list[nn.Module]) -> None:
    """Refuse module hooks that a run of the captured graph would leave out: backward hooks
    of the modules whose code the capture traced through (``traced``, the model itself among
    them), and the model's own forward hooks (a trace calls its ``forward``, not the model),
    each also where registered for every module. Autograd would never run them, and the
    output or credit would silently differ from the model's. A module the graph calls whole
    runs its own hooks, and so does any module traced through on its forward."""
    hooked = [m for m in traced if has_hooks(m, forward=False)]
    backward, forward = global_hooks()
    kind = "backward hook (register_full_backward_hook or its kin)"
    if not hooked and not backward:
        hooked = [model] if has_hooks(model, forward=True) else []
        kind = "forward hook (register_forward_hook or its kin)"
        if not hooked and not forward:
            return
    path = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}.get(id(hooked[0]), "") if hooked else ""
    if not hooked:
        where = f"a {kind} is registered for every module"
    elif hooked[0] is model:
        where = f"the model ({type(model).__name__}) has a {kind}"
    else:
        where = f"module {path!r} ({type(hooked[0]).__name__}) has a {kind}"
    whole = f"keep it whole (convert with leaf_modules=[{path!r}]), " if path else ""
    raise FxnxValueError(
        f"{where}, which a run of the captured graph does not make: that module's forward was "
        "traced, not called as a module, so the result would leave the hook out. Remove the "
        f"hook, {whole}or route with rule='exact' and node_credit=False, whose forward is the "
        "model's own"
    )


def warn_traced_hooks(model: nn.Module, traced: list[nn.Module]) -> None:
    """Warn where a module whose code the capture traced through (not the model itself,
    whose forward hooks :func:`check_hooks` refuses) has forward hooks of one's own (not a
    library's, :data:`_LIBRARIES`): the trace
    ran them once, on its proxies, so the graph holds the tensor operations they made, but a
    run of the graph never calls them, and whatever else they do (collect activations for a
    loss term, log) does not happen at the router's calls."""
    hooked = [(m, hook) for m in traced if m is not model for hook in forward_hooks(m) if not _of_a_library(hook)]
    if not hooked:
        return
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    path = paths.get(id(hooked[0][0]), "")
    name = _hook_name(hooked[0][1])
    others = len({id(m) for m, _ in hooked}) - 1
    more = f" (and {others} other modules)" if others else ""
    warn_user(
        f"module {path!r}{more} has a forward hook ({name}) that a run of the captured graph "
        "does not call: its code was traced, not called as a module, so the hook ran once, "
        "on the trace's proxies. What it computes on the output is in the graph; what else it "
        "does (activations collected for a loss term, a log) does not happen at the router's "
        "calls. Register the hook on a layer the graph calls whole (a torch.nn layer inside "
        f"{path!r}, where symbolic tracing captured the model), or compute the term from the "
        "model's outputs; a router with rule='exact' and node_credit=False runs the model's own "
        "forward, hooks included"
    )


#: Libraries whose hooks work through what the hooked module returns (Hugging Face's output
#: capture for output_attentions), which a trace records: not warned about.
_LIBRARIES = ("torch", "transformers", "timm", "torchvision", "accelerate", "peft")


def _hook_name(hook: Any) -> str:
    """A hook as an error names it: its function's qualified name, else its class's."""
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


def _of_a_library(hook: Any) -> bool:
    module = getattr(hook, "__module__", None) or getattr(getattr(hook, "func", None), "__module__", None) or ""
    return module.partition(".")[0] in _LIBRARIES


class TensorHooks(TorchFunctionMode):
    """Records the hooks a run of the model registers on tensors other than leaves that take
    gradients (``h.register_hook(fn)`` or ``h.retain_grad()`` in ``forward``): no captured
    graph holds them (``torch.export`` drops them), so a credit run over the graph would
    route without them. Each hook is recorded before it is registered, so a run without
    gradients (where registering fails) still shows it."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (Tensor.register_hook, Tensor.retain_grad) and args and not (args[0].is_leaf and args[0].requires_grad):
            self.hooks.append(args[1] if len(args) > 1 else (kwargs or {}).get("hook", func))
        return func(*args, **(kwargs or {}))

    def refusal(self, model: str) -> str | None:
        """The refusal naming the first hook recorded, or None."""
        if not self.hooks:
            return None
        hook = self.hooks[0]
        if hook is Tensor.retain_grad:
            call = "Tensor.retain_grad(), whose .grad a run of the graph would leave unset"
        else:
            call = f"Tensor.register_hook({_hook_name(hook)})"
        return (
            f"the forward of {model} registers a hook on a tensor it computes ({call}), which "
            "the captured graph does not hold, so credit routed over the graph would leave the "
            "hook out. Register it as a module's hook (register_full_backward_hook) or on a "
            "parameter, or route with rule='exact', no edge removed and node_credit=False, "
            "whose forward is the model's own"
        )
