"""The symbolic tracer: which modules stay whole, and checks inside ``torch.nn`` composites.

Leaf rule (what stays one ``call_module`` node):

- the user's ``leaf_modules``: submodule paths and classes (matched by
  qualified name over each module's class hierarchy);
- with ``"torch.nn"`` among them, torch.fx's own rule: every ``torch.nn``
  module except ``nn.Sequential``;
- otherwise, ``torch.nn`` *primitives*: modules without submodules (Linear,
  Conv, norms, activations) and those in :data:`KEPT_WHOLE`. ``torch.nn``
  *composites* (``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer``,
  ``nn.Transformer``, containers) are traced into.

torch's composites check their inputs in Python (``if src.dim() != 3``,
``len(src.size())``, ``src.is_nested``), which a symbolic proxy cannot answer.
Inside a composite such a check is answered by running the part of the graph
it depends on with the example inputs (after the trace, then tracing again
with the answer), so the graph follows the example's shapes
(``shape_specialised``). Without example inputs, or outside
``torch.nn``'s own code, it does what torch.fx does: the trace fails, and the
ladder keeps a failing composite whole.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .._compat import mask_helpers
from .._contract import class_name
from .._state import preserved
from .functions import kept_whole
from .options import CLASS_PREFIX, TORCH_NN

__all__ = [
    "KEPT_WHOLE", "NO_GRAD", "NeedValue", "Tracer", "evaluate", "is_torch_nn", "mha_fast_path_off",
    "torch_nn_traceable",
]

#: The ``meta`` key of a node the model's forward ran with gradients off (inside
#: ``torch.no_grad()``, ``torch.inference_mode()`` or after ``torch.set_grad_enabled(False)``),
#: which a symbolic trace does not record: no credit passes through it in the model.
NO_GRAD = "fxnx_no_grad"

#: ``torch.nn`` modules with submodules that stay whole anyway: ``nn.MultiheadAttention``'s
#: forward is one functional call with much control flow (and its own fast path).
KEPT_WHOLE: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def is_torch_nn(module: nn.Module) -> bool:
    """Whether ``module``'s class is torch's own (torch.fx's test for its leaf rule)."""
    name = type(module).__module__
    return name.startswith(("torch.nn", "torch.ao.nn"))


class NeedValue(Exception):  # noqa: N818 - a request, not an error
    """Raised out of a trace when a check in a torch.nn composite needs a value: the
    tracer's patches on torch are undone once the trace ends, so the value is computed
    then, and the trace restarts with it as an answer."""

    def __init__(self, node: fx.Node, convert: Callable[[Any], Any]) -> None:
        super().__init__(f"fxnx needs the value of {node.name}")
        self.node = node
        self.convert = convert


class _Answering(fx.Proxy):
    """What fxnx's proxies add to torch.fx's: a ``len()`` the tracer may answer
    (``len(src.size())`` in torch.nn), and unpacking (``B, H, W, C = x.shape``) that
    reads each function's bytecode once."""

    def __len__(self) -> int:
        tracer = self.tracer
        if isinstance(tracer, Tracer) and tracer.can_answer():
            return tracer.answer(self.node, len)
        return super().__len__()

    def __iter__(self) -> Iterator[fx.Proxy]:
        # torch.fx disassembles the calling function at every unpacking (a tenth of Swin's
        # trace); whether the caller unpacks into n names is the same each time.
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        count = _unpacked_at(caller.f_code).get(caller.f_lasti) if caller is not None else None
        if count is None:
            return self.tracer.iter(self)
        return (self[i] for i in range(count))  # type: ignore[index]  # torch.fx adds Proxy.__getitem__ at runtime; its stubs lack it

    def __getattr__(self, k: str) -> fx.proxy.Attribute:
        return _Attribute(self, k)


class _Proxy(_Answering):
    """The proxy fxnx's tracer makes for each node."""


class _Attribute(_Answering, fx.proxy.Attribute):
    """An attribute of a proxy (``x.shape``), added to the graph when used as a value."""


#: Arguments torch.fx records as they are.
_PLAIN_ARGS = frozenset({int, float, bool, str, type(None)})


class AutocastInForward(Exception):
    """The forward enters or leaves ``torch.autocast``, which a symbolic trace drops."""


def _autocast_state() -> tuple[Any, ...]:
    """Whether autocast is on, and in which dtype, on the CPU and on CUDA."""
    return tuple(
        (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
    )


class Tracer(fx.Tracer):
    """torch.fx's tracer with fxnx's leaf rule and checks answered inside torch.nn composites.

    Parameters
    ----------
    leaf_modules : tuple of str
        Paths, ``"class:<qualified name>"`` entries and ``"torch.nn"``.
    answers : list or None
        The answers to the checks met so far, in order (see :class:`NeedValue`);
        None: answer none, as torch.fx does.
    """

    def __init__(self, leaf_modules: tuple[str, ...], answers: list[Any] | None) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True
        self.leaf_paths = frozenset(s for s in leaf_modules if not s.startswith(CLASS_PREFIX))
        self.leaf_classes = frozenset(
            s[len(CLASS_PREFIX) :] for s in leaf_modules if s.startswith(CLASS_PREFIX)
        )
        self.torch_nn_whole = TORCH_NN in leaf_modules
        self.answers = answers
        self.asked = 0
        self._tensor_names: tuple[dict[int, str], dict[int, str]] | None = None
        self.thread = threading.get_ident()

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self._tensor_names = None  # the root's parameters and buffers, named afresh per trace
        self._autocast = _autocast_state()
        # Gradients on, so that a node made with them off is the model's doing; a custom
        # autograd Function one node, which keeps its backward (:mod:`.functions`).
        with torch.enable_grad(), kept_whole(self):
            return super().trace(root, concrete_args)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not torch.is_grad_enabled() and kind.startswith("call_"):
            # Under torch.no_grad() (or inference_mode) in the model's forward, which the graph
            # does not record: credit runs replay it (NO_GRAD).
            node.meta[NO_GRAD] = True
        if kind.startswith("call_") and _autocast_state() != self._autocast:
            raise AutocastInForward(
                f"{node.name!r} is called inside a torch.autocast block of the forward, which "
                "symbolic tracing does not record: the graph would run it in another precision"
            )
        return node

    # torch.fx patches nn.Module's __call__ and __getattr__ for every thread while it traces;
    # another thread running a model meanwhile gets plain calls and values, not recorded.
    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self.thread:
            return attr_val
        name = self._tensor_name(attr_val, buffers=self.proxy_buffer_attributes)
        if name is None or self.param_shapes_constant:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):  # torch.fx's answer, without first testing for tensors,
            return a.node  # modules and opaque types (most arguments are proxies)
        if type(a) in _PLAIN_ARGS:
            return a
        if type(a).__module__ == "numpy" and getattr(a, "shape", None) == ():
            # A NumPy scalar (self.gain = np.float64(2.0)): torch takes it as the Python
            # number it holds, and a graph's generated code cannot spell NumPy's repr.
            return a.item()
        name = self._tensor_name(a, buffers=True)
        if name is None:
            return super().create_arg(a)
        return self.create_node("get_attr", name, (), {})

    def _tensor_name(self, value: Any, *, buffers: bool) -> str | None:
        """The root's first name for a parameter (or, with ``buffers``, a buffer), from a table.

        torch.fx's ``getattr`` and ``create_arg`` search all of the root's
        parameters and buffers for each access, which grows with the square of
        the model's size: a third of EfficientNet-B0's trace, whose norms pass
        their buffers to ``F.batch_norm``. The table holds the same first names;
        None (torch.fx's search then) for any other value, or a tensor added to
        the model during the trace.
        """
        if not isinstance(value, torch.Tensor) or not isinstance(self.root, nn.Module):
            return None
        if self._tensor_names is None:
            self._tensor_names = (_first_names(self.root.named_parameters()),
                                  _first_names(self.root.named_buffers()))
        params, named_buffers = self._tensor_names
        if isinstance(value, nn.Parameter):
            return params.get(id(value))
        return named_buffers.get(id(value)) if buffers else None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths:
            return True
        if self.leaf_classes and any(
            class_name(c) in self.leaf_classes for c in type(m).__mro__
        ):
            return True
        if self.torch_nn_whole:
            return super().is_leaf_module(m, module_qualified_name)
        return is_torch_nn(m) and not self.traced_into(m)

    def traced_into(self, m: nn.Module) -> bool:
        """Whether a torch.nn module is a composite the leaf rule traces into."""
        if isinstance(m, nn.Sequential):
            return True
        return (
            not self.torch_nn_whole
            and not isinstance(m, KEPT_WHOLE)
            and next(iter(m.children()), None) is not None
        )

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def to_bool(self, obj: fx.Proxy) -> bool:
        if self.can_answer():
            return self.answer(obj.node, bool)
        return super().to_bool(obj)

    def can_answer(self) -> bool:
        """Whether the code running now is a torch.nn composite's own, and inputs are known."""
        if self.answers is None:
            return False
        stack = list(self.module_stack.values())
        if stack and stack[-1]:
            innermost = stack[-1][1]
            cls = innermost if isinstance(innermost, type) else type(innermost)
            return cls.__module__.startswith(("torch.nn", "torch.ao.nn"))
        return isinstance(self.root, nn.Module) and is_torch_nn(self.root)

    def answer(self, node: fx.Node, convert: Callable[[Any], Any]) -> Any:
        """The next known answer, or :class:`NeedValue` for ``node``'s value."""
        assert self.answers is not None
        if self.asked < len(self.answers):
            self.asked += 1
            return self.answers[self.asked - 1]
        raise NeedValue(node, convert)


@functools.lru_cache(maxsize=4096)
def _unpacked_at(code: types.CodeType) -> dict[int, int]:
    """Bytecode offset to element count of each ``UNPACK_SEQUENCE`` in ``code``."""
    return {i.offset: i.argval for i in dis.get_instructions(code) if i.opname == "UNPACK_SEQUENCE"}


def _first_names(named: Iterator[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """Each tensor's first name, by identity (the tensors live as long as the traced root)."""
    names: dict[int, str] = {}
    for name, tensor in named:
        names.setdefault(id(tensor), name)
    return names


def evaluate(tracer: fx.Tracer, node: fx.Node, values: Mapping[str, Any]) -> Any:
    """Run the part of ``tracer``'s graph that ``node`` depends on, on the example values
    (``values``: each ``forward`` parameter's), after the trace has ended."""
    needed: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in tracer.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[node])
    args = []
    for n in graph.nodes:
        if n.op == "placeholder":
            name = str(n.target).lstrip("*")
            if name not in values:  # torch.fx renames a placeholder that clashes: x_1
                name = name.rpartition("_")[0]
            args.append(values[name])
    # Nothing it draws or updates counts (dropout in training mode draws from torch's
    # generator, which a trace must leave as it found it: see common.drawn).
    with torch.no_grad(), preserved(tracer.root):
        return fx.Interpreter(fx.GraphModule(tracer.root, graph)).run(*args)


@contextlib.contextmanager
def torch_nn_traceable() -> Iterator[None]:
    """While tracing: torch's fused transformer fast path off, so that composites take the
    path made of their submodules, and torch.nn's mask helpers recorded as calls in the
    graph when given a proxy (they check ``isinstance(mask, Tensor)``)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in mask_helpers()]
    for owner, name, fn in saved:
        setattr(owner, name, _recorded(fn))
    try:
        with mha_fast_path_off():
            yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@contextlib.contextmanager
def mha_fast_path_off() -> Iterator[None]:
    """torch's fused transformer fast path off within the block: ``nn.MultiheadAttention``
    and the transformer layers then run the path made of their submodules' operators."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, recorded as one ``call_function`` node when its first argument (the mask) is a
    proxy; called as it is otherwise (``_canonical_mask(None, ...)`` is None whatever else)."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        value = args[0] if args else kwargs.get(first)
        if isinstance(value, fx.Proxy):
            return value.tracer.create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)

    return call
