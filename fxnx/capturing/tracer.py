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
Inside a composite the tracer answers such a check by running the part of the
graph it depends on with the example inputs, so the graph follows the
example's shapes (``shape_specialised``). Without example inputs, or outside
``torch.nn``'s own code, it does what torch.fx does: the trace fails, and the
ladder keeps a failing composite whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .options import CLASS_PREFIX, TORCH_NN, qualified_class_name

__all__ = ["KEPT_WHOLE", "Tracer", "fastpath_disabled", "is_torch_nn"]

#: ``torch.nn`` modules with submodules that stay whole anyway: ``nn.MultiheadAttention``'s
#: forward is one functional call with much control flow (and its own fast path).
KEPT_WHOLE: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def is_torch_nn(module: nn.Module) -> bool:
    """Whether ``module``'s class is torch's own (torch.fx's test for its leaf rule)."""
    name = type(module).__module__
    return name.startswith(("torch.nn", "torch.ao.nn"))


class _Proxy(fx.Proxy):
    """A proxy whose ``len()`` the tracer may answer (``len(src.size())`` in torch.nn)."""

    def __len__(self) -> int:
        tracer = self.tracer
        if isinstance(tracer, Tracer) and tracer.can_evaluate():
            return len(tracer.evaluate(self.node))
        return super().__len__()


class Tracer(fx.Tracer):
    """torch.fx's tracer with fxnx's leaf rule and checks answered inside torch.nn composites.

    Parameters
    ----------
    leaf_modules : tuple of str
        Paths, ``"class:<qualified name>"`` entries and ``"torch.nn"``.
    values : mapping or None
        Each ``forward`` parameter's example value, to answer checks; None: never answer.
    """

    def __init__(self, leaf_modules: tuple[str, ...], values: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.leaf_paths = frozenset(s for s in leaf_modules if not s.startswith(CLASS_PREFIX))
        self.leaf_classes = frozenset(
            s[len(CLASS_PREFIX) :] for s in leaf_modules if s.startswith(CLASS_PREFIX)
        )
        self.torch_nn_whole = TORCH_NN in leaf_modules
        self.values = values
        #: Whether a check was answered from the example: the graph holds for its shapes.
        self.evaluated = False

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths:
            return True
        if self.leaf_classes and any(
            qualified_class_name(c) in self.leaf_classes for c in type(m).__mro__
        ):
            return True
        if self.torch_nn_whole:
            return super().is_leaf_module(m, module_qualified_name)
        return is_torch_nn(m) and not self.traced_into(m)

    def traced_into(self, m: nn.Module) -> bool:
        """Whether a torch.nn module is a composite the default rule traces into."""
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
        if self.can_evaluate():
            return bool(self.evaluate(obj.node))
        return super().to_bool(obj)

    def can_evaluate(self) -> bool:
        """Whether the code running now is a torch.nn composite's own, and inputs are known."""
        if self.values is None:
            return False
        stack = list(self.module_stack.values())
        if stack and stack[-1]:
            innermost = stack[-1][1]
            cls = innermost if isinstance(innermost, type) else type(innermost)
            return cls.__module__.startswith(("torch.nn", "torch.ao.nn"))
        return isinstance(self.root, nn.Module) and is_torch_nn(self.root)

    def evaluate(self, node: fx.Node) -> Any:
        """Run the part of the graph traced so far that ``node`` depends on, on the example."""
        needed: set[fx.Node] = set()
        todo = [node]
        while todo:
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(n.all_input_nodes)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            if n in needed:
                env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(env[node])
        assert self.values is not None
        args = [self._value_of(str(n.target)) for n in graph.nodes if n.op == "placeholder"]
        with torch.no_grad():
            result = fx.Interpreter(fx.GraphModule(self.root, graph)).run(*args)
        self.evaluated = True
        return result

    def _value_of(self, target: str) -> Any:
        assert self.values is not None
        name = target.lstrip("*")
        if name not in self.values:  # torch.fx renames a placeholder that clashes: x_1
            name = name.rpartition("_")[0]
        return self.values[name]


@contextlib.contextmanager
def fastpath_disabled() -> Iterator[None]:
    """Turn off torch's fused transformer fast path while tracing, so that composites take
    the path made of their submodules (the fast path is one fused operator)."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
