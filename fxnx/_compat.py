"""Every private torch name fxnx touches, in one place, each with a fallback.

fxnx relies on public torch APIs wherever one exists. A few things it needs
have no public spelling in the torch versions it supports (see
``pyproject.toml`` and the README's "Supported torch versions"); they are all
here, and no other module of fxnx names a private torch attribute (a test scans
the sources for that). Each one has a fallback that keeps fxnx working with
less detail, or a clear error that says which feature needs which torch, so a
torch release that renames one of them degrades a feature instead of breaking
``import fxnx``.

:data:`PRIVATE_APIS` lists them with what each is for and what happens without it.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from ._errors import FxnxError

__all__ = [
    "ATEN_CAST_AND_VIEW",
    "PRIVATE_APIS",
    "FakeTensorMode",
    "OpOverload",
    "TorchDispatchMode",
    "VALUE_READS",
    "cpu_attention_formulas",
    "decomposes",
    "drop_annotations",
    "extract_tensor_metadata",
    "forward_hooks",
    "global_hooks",
    "has_hooks",
    "in_transform",
    "global_module_hooks",
    "linear_parameters",
    "own_forward",
    "runs_own_forward",
    "own_buffers",
    "own_parameters",
    "own_tables",
    "uncompiled",
    "graph_module",
    "is_fake",
    "make_fx_following_values",
    "mask_helpers",
    "method_schema_signatures",
    "op_schema",
    "pytree",
    "qualified_function_name",
    "schema_signature",
    "sequence_nr",
    "value_reads",
    "version",
    "view_base",
]

#: (private name, what fxnx uses it for, what happens when it is missing)
PRIVATE_APIS: tuple[tuple[str, str, str], ...] = (
    (
        "torch.nn.functional._canonical_mask, torch.nn.functional._none_or_dtype",
        "tracing into torch.nn's transformer layers called with masks: recorded as calls",
        "a torch.nn transformer composite called with masks is kept whole (opaque)",
    ),
    (
        "torch.compile's OptimizedModule._orig_mod (uncompiled)",
        "conversion compares each graph with the model it wraps, not the compiled module, "
        "whose first call compiles it (a resnet18: 27 s)",
        "a torch.compile'd model is compiled when converted, as when first called",
    ),
    (
        "torch.utils._pytree",
        "flattening nested inputs, outputs and credits (tree_flatten, tree_map, keystr)",
        "import fxnx's torch features fails with an error naming the torch versions supported",
    ),
    (
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "fake=True: shapes without real compute",
        "fake=True raises an error; real and meta-device conversion keep working",
    ),
    (
        "torch.fx.passes.shape_prop._extract_tensor_metadata",
        "the tensor_meta ShapeProp records, for fake, sparse and quantised tensors",
        "fxnx builds the same TensorMetadata from the tensor's public attributes",
    ),
    (
        "torch.fx._lazy_graph_module._LazyGraphModule",
        "GraphModules whose Python code is generated when first called or printed, not at "
        "capture (a tenth of converting EfficientNet-B0 or Swin-T)",
        "a plain GraphModule: code generated at capture, a little slower",
    ),
    (
        "torch.fx.node._get_qualified_name",
        "importable names of functions ('torch.flatten')",
        "module and __qualname__ of the function",
    ),
    (
        "torch.fx.operator_schemas._torchscript_schema_to_signature",
        "binding ATen calls to their schema's argument names (node_call_info)",
        "arguments keep their positions as keys ('0', '1')",
    ),
    (
        "torch._C._jit_get_schemas_for_operator",
        "binding x.view(...)-style method calls to the ATen schema's names",
        "arguments keep their positions as keys ('0', '1')",
    ),
    (
        "torch._ops.OpOverload._schema",
        "an ATen operator's argument names (node_call_info at ATen level)",
        "arguments keep their positions as keys ('0', '1')",
    ),
    (
        "torch.ops.aten._local_scalar_dense",
        "telling that a graph read a tensor's value (the graph holds for that input only)",
        "only aten.item is recognised",
    ),
    (
        "torch._ops.OpOverload",
        "recognising ATen operators in a graph",
        "taken as type(torch.ops.aten.add.Tensor), which is public",
    ),
    (
        "make_fx(..., _error_on_data_dependent_ops=False)",
        "make_fx on models whose control flow reads tensor values",
        "make_fx's default: such models fail on that route and the ladder reports it",
    ),
    (
        "nn.Module._forward_hooks, _forward_pre_hooks, _backward_hooks, _backward_pre_hooks",
        "credit over a captured graph refuses hooks the trace never ran (has_hooks)",
        "read with getattr: a torch that keeps them elsewhere shows no hooks, and such a hook "
        "is left out of a credit run",
    ),
    (
        "torch.nn.modules.module._global_forward_hooks, _global_forward_pre_hooks, "
        "_global_backward_hooks, _global_backward_pre_hooks and the other global hook tables",
        "capture reuse: a hook registered for every module since the capture makes fxnx "
        "capture again; credit over a captured graph refuses global hooks",
        "a global hook registered after the capture is not seen by a reused capture, nor a "
        "global hook by a credit run",
    ),
    (
        "nn.Module._buffers, nn.Module._parameters (own_buffers, own_parameters, own_tables)",
        "route_credit and the model's first probe: the buffers to restore afterwards, and "
        "the parameters route_credit's kept router is keyed by, read module by module from "
        "each one's table; runs of the model beside the user's: a "
        "buffer or parameter a forward rebinds, given back (own_tables)",
        "buffers(recurse=False), a generator per module; a buffer rebound is not given back",
    ),
    (
        "nn.Module._parameters, nn.Module._compiled_call_impl, with the hook tables above",
        "a weight-transport node's nn.Linear is called as F.linear on its weight and bias, "
        "without the module's frames, while nothing hooks, patches or compiles it "
        "(linear_parameters)",
        "the module is called as it is (about 2 µs more per layer and call)",
    ),
    (
        "torch.Tensor._version",
        "route_credit: telling which node's value a later node writes into in place, so that "
        "each node's credit is that of the value it computed; capture reuse: a tensor "
        "attribute written in place since the capture",
        "no such writes are told apart: credit at a value written in place later is that of "
        "the written value",
    ),
    (
        "torch.Tensor._base",
        "copies of inputs that share memory, made as views of one copy of the tensor they view "
        "(so a write into one input is seen in the others, and credit reaches that tensor)",
        "such inputs are copied as views of a copy of their memory where none takes credit, "
        "else one by one",
    ),
    (
        "torch.utils._python_dispatch.TorchDispatchMode, "
        "torch._C.DispatchKey.CompositeImplicitAutograd",
        "flops and macs on every node: each node runs again on meta tensors under a mode "
        "that counts as FlopCounterMode does; ATen operators that can count nothing are skipped",
        "flops and macs are None; without the dispatch key every ATen node runs again (slower)",
    ),
    (
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu and its backward",
        "FLOPs of attention in ATen graphs captured on the CPU, with torch's formulas for "
        "flash attention (FlopCounterMode has none for the CPU kernel)",
        "those nodes count no FLOPs, as FlopCounterMode counts none for them",
    ),
    (
        "torch.fx.traceback.current_meta",
        "make_fx captures start with no custom annotations: torch keeps them in this global, "
        "which another thread's calls during torch.export can leave holding some",
        "a make_fx capture after such a thread may take another model's module paths",
    ),
    (
        "torch._C._autograd._push_saved_tensors_default_hooks, "
        "torch._C._autograd._pop_saved_tensors_default_hooks",
        "weight transport: the saved-tensor hooks entered and left once per layer and forward "
        "without the context manager's two Python frames",
        "torch.autograd.graph.saved_tensors_hooks, the context manager (a little slower)",
    ),
    (
        "torch._C._current_graph_task_id",
        "router.backward: a hook on a parameter keeps the credit of its own backward pass, "
        "not another thread's (graph_task); direct feedback alignment keeps each pass's output "
        "credit apart; brSF refuses a forward pass run again inside a backward pass (in_backward)",
        "the thread: right on the CPU, where a backward pass runs on its caller's thread, but "
        "two passes of one thread through one forward (retain_graph), or any two passes on a "
        "GPU (whose backward runs on one device thread), share direct feedback's output credit; "
        "brSF's check is skipped",
    ),
    (
        "torch.autograd.Variable._execution_engine.queue_callback",
        "direct feedback alignment drops a backward pass's output credit when the pass ends "
        "(at_pass_end), as DistributedDataParallel queues its own end-of-pass work",
        "each pass's output credit is kept as long as the forward's graph (one N × D tensor a "
        "pass through a graph kept with retain_graph=True)",
    ),
    (
        "torch._C._functorch.peek_interpreter_stack",
        "CreditRouter refuses to run a rule under a torch.func transform (vmap, grad, jvp, "
        "jacrev, jacfwd), which does not carry the rule's autograd functions and hooks "
        "(in_transform)",
        "the router is not refused there: direct feedback alignment may drop credit under vmap",
    ),
    (
        "torch._foreach_norm",
        "route_credit's credit norms: the norm of every node's credit in one call",
        "torch.linalg.vector_norm once per node (the same values)",
    ),
    (
        "torch.autograd.graph.Node._sequence_nr",
        "joint graphs: the module scope of each backward op",
        "backward ops take the scope their inputs share",
    ),
    (
        "torch.ops.aten._to_copy, torch.ops.aten._unsafe_view",
        "feedback rules find a weight cast or viewed in a torch.export graph (weight_inputs)",
        "such a weight counts as computed from parameters, and feedback rules refuse its node",
    ),
    (
        "torch.export.ExportedProgram._report",
        "draft_export's record of control flow that read a tensor's value (value_reads), which "
        "its graph does not keep when the value was used only to branch",
        "such a branch is seen only where the graph keeps the read (.item() used as a number)",
    ),
)


def _pytree_module() -> Any:
    try:
        from torch.utils import _pytree
    except ImportError as err:  # pragma: no cover - every supported torch has it
        raise ImportError(
            f"fxnx needs torch.utils._pytree, which torch {torch.__version__} lacks; "
            "install a torch version fxnx supports (see its pyproject.toml)"
        ) from err
    return _pytree


#: torch's pytree module (flatten, unflatten, map over nested containers).
pytree = _pytree_module()

_FakeTensor: type[Any] | None
_FakeTensorMode: type[Any] | None
try:
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
    from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode
except ImportError:  # pragma: no cover - every supported torch has it
    _FakeTensor = _FakeTensorMode = None


def FakeTensorMode(**kwargs: Any) -> Any:  # noqa: N802 - stands for the class
    """torch's ``FakeTensorMode``, or an error saying ``fake=True`` needs it."""
    if _FakeTensorMode is None:  # pragma: no cover
        raise FxnxError(
            f"fake=True needs torch._subclasses.fake_tensor.FakeTensorMode, which torch "
            f"{torch.__version__} lacks; convert with real inputs or on the meta device"
        )
    return _FakeTensorMode(**kwargs)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (from ``FakeTensorMode`` or a tracer)."""
    return _FakeTensor is not None and isinstance(value, _FakeTensor)


def extract_tensor_metadata(tensor: torch.Tensor) -> TensorMetadata:
    """What ShapeProp records for ``tensor``.

    A plain dense tensor's metadata is read from its public attributes, a tenth of the
    time torch's helper takes (which works through sizes symbolically); fake, sparse and
    quantised tensors go through torch's helper.
    """
    if type(tensor) in _PLAIN and tensor.layout is torch.strided and not tensor.is_quantized:
        return _own_tensor_metadata(tensor)
    try:
        from torch.fx.passes.shape_prop import _extract_tensor_metadata
    except ImportError:  # pragma: no cover
        return _own_tensor_metadata(tensor)
    return _extract_tensor_metadata(tensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _own_tensor_metadata(tensor: torch.Tensor) -> TensorMetadata:
    """TensorMetadata from public attributes: ShapeProp's fields, without quantisation details."""
    memory_format = None
    for fmt in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        try:
            if tensor.is_contiguous(memory_format=fmt):
                memory_format = fmt
                break
        except RuntimeError:  # channels_last on a tensor of the wrong rank
            continue
    return TensorMetadata(
        tensor.shape, tensor.dtype, tensor.requires_grad, tensor.stride(), memory_format,
        tensor.is_quantized, {},
    )


def graph_module(root: torch.nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """A GraphModule over ``graph`` whose Python code is generated when first needed.

    Converting and drawing read only the graph; the code, which takes torch.fx as
    long as tracing a small model, is generated when the module is called, printed
    or pickled (and codegen errors surface then).
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover
        return fx.GraphModule(root, graph, name)
    return _LazyGraphModule(root, graph, name)


def qualified_function_name(target: Callable[..., Any]) -> str:
    """torch.fx's importable name of a function, such as ``"torch.flatten"``."""
    try:
        from torch.fx.node import _get_qualified_name
    except ImportError:  # pragma: no cover
        module = getattr(target, "__module__", None) or "?"
        return f"{module}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    return _get_qualified_name(target)


#: The class of ATen operator overloads (``torch.ops.aten.add.Tensor``).
if TYPE_CHECKING:
    from torch._ops import OpOverload
else:
    OpOverload = type(torch.ops.aten.add.Tensor)


#: ATen operators that read a tensor's value into Python (``.item()``, ``if x.sum() > 0``).
VALUE_READS: tuple[Any, ...] = tuple(
    op.default
    for op in (getattr(torch.ops.aten, "_local_scalar_dense", None), torch.ops.aten.item)
    if op is not None
)


def op_schema(op: OpOverload) -> Any:
    """The TorchScript schema of an ATen operator overload, or None when torch hides it."""
    return getattr(op, "_schema", None)


def schema_signature(schema: Any) -> inspect.Signature | None:
    """A Python signature for a TorchScript schema, or None when torch cannot express one."""
    try:
        from torch.fx.operator_schemas import _torchscript_schema_to_signature
    except ImportError:  # pragma: no cover
        return None
    try:
        return _torchscript_schema_to_signature(schema)
    except Exception:  # a schema torch itself cannot express as a signature
        return None


def method_schema_signatures(name: str) -> list[Any]:
    """The ATen schemas of ``aten::name`` (for ``x.name(...)`` calls); empty when unknown."""
    lookup = getattr(torch._C, "_jit_get_schemas_for_operator", None)
    if lookup is None:  # pragma: no cover
        return []
    try:
        return list(lookup(f"aten::{name}"))
    except RuntimeError:
        return []


def make_fx_following_values(
    fn: Callable[..., Any], tracing_mode: Literal["real", "fake", "symbolic"]
) -> Callable[..., fx.GraphModule]:
    """``make_fx`` that follows control flow on tensor values instead of failing on it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if "_error_on_data_dependent_ops" in inspect.signature(make_fx).parameters:
        return make_fx(fn, tracing_mode=tracing_mode, _error_on_data_dependent_ops=False)
    return make_fx(fn, tracing_mode=tracing_mode)  # pragma: no cover


def sequence_nr(grad_fn: Any) -> int | None:
    """The sequence number an autograd node shares with the forward op that made it."""
    method = getattr(grad_fn, "_sequence_nr", None)
    return method() if method is not None else None


def mask_helpers() -> list[tuple[Any, str]]:
    """(module, name) of the helpers torch.nn's transformer layers call on their masks,
    which check ``isinstance(mask, torch.Tensor)`` and so cannot take a tracer's proxy."""
    functional = torch.nn.functional
    return [(functional, name) for name in ("_canonical_mask", "_none_or_dtype")
            if callable(getattr(functional, name, None))]


def version(tensor: torch.Tensor) -> int:
    """How many times ``tensor``'s data has been written in place (autograd's counter)."""
    return int(getattr(tensor, "_version", 0))


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` is a view of (autograd's ``_base``), or ``tensor`` itself where it
    is none (or this torch does not say)."""
    base = getattr(tensor, "_base", None)
    return base if isinstance(base, torch.Tensor) else tensor


def saved_tensors_hooks_calls() -> tuple[Callable[..., Any], Callable[[], Any]] | None:
    """``push(pack, unpack)`` and ``pop()`` of autograd's default saved-tensor hooks: what
    ``torch.autograd.graph.saved_tensors_hooks`` enters and leaves with, called without its
    two Python frames (the router enters them once per weighted node of every forward);
    None where this torch names them otherwise (use the context manager)."""
    autograd = getattr(torch._C, "_autograd", None)
    push = getattr(autograd, "_push_saved_tensors_default_hooks", None)
    pop = getattr(autograd, "_pop_saved_tensors_default_hooks", None)
    return (push, pop) if callable(push) and callable(pop) else None


#: Autograd's id of the backward pass running on this thread (-1 outside one), or None.
_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
if not callable(_GRAPH_TASK_ID):
    _GRAPH_TASK_ID = None


def graph_task() -> Callable[[], Any]:
    """A function naming the backward pass (autograd's graph task) that calls it: a hook on
    a parameter, which every thread's backward pass runs, tells its own pass from another's,
    and direct feedback alignment keeps each pass's output credit apart by it. Without it,
    the thread (a backward pass on the CPU runs on the thread that started it)."""
    return _GRAPH_TASK_ID if _GRAPH_TASK_ID is not None else threading.get_ident


def at_pass_end(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the backward pass running now ends (autograd's engine runs it after
    the pass's last node, as ``DistributedDataParallel`` waits for its reductions); where this
    torch names the engine otherwise, never."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if callable(queue):
        queue(fn)


def in_backward() -> bool:
    """Whether a backward pass is running on this thread (a checkpoint recomputing a forward
    pass inside it); False where this torch cannot tell."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


_INTERPRETERS: Callable[[], Any] | None = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``, …) is
    running on this thread: its interpreter stack is not empty. False where this torch
    cannot tell."""
    return _INTERPRETERS is not None and _INTERPRETERS() is not None


def vector_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``torch.linalg.vector_norm`` of each tensor (of one dtype and device), in one call
    where this torch has it (``clip_grad_norm_``'s own)."""
    foreach = getattr(torch, "_foreach_norm", None)
    if callable(foreach):
        return list(foreach(tensors))
    return [torch.linalg.vector_norm(t) for t in tensors]


#: ATen's ``_to_copy`` (a cast) and ``_unsafe_view`` (a view), as torch.export records a
#: weight's ``.to(dtype)`` and ``.view(...)``.
ATEN_CAST_AND_VIEW = tuple(
    getattr(getattr(torch.ops.aten, name, None), "default", None) for name in ("_to_copy", "_unsafe_view")
)


def value_reads(program: Any) -> list[str]:
    """The conditions on tensor values that ``torch.export.draft_export`` met (``u0 > 1``),
    each answered for the example input; empty where it met none or keeps no report."""
    report = getattr(program, "_report", None)
    failures = getattr(report, "failures", ()) or ()
    return [
        str((f.data or {}).get("expr", "")) if isinstance(f.data, dict) else ""
        for f in failures if getattr(f.failure_type, "name", "") == "DATA_DEPENDENT_ERROR"
    ]


def has_hooks(module: Any, *, forward: bool) -> bool:
    """Whether ``module`` has forward hooks of its own (``forward``) or backward hooks
    (``register_forward_hook``, ``register_full_backward_hook`` and their pre-hook kin)."""
    tables = ("_forward_hooks", "_forward_pre_hooks") if forward else ("_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, name, None) for name in tables)


def forward_hooks(module: Any) -> list[Any]:
    """``module``'s own forward pre-hooks and forward hooks, in that order."""
    return [hook for name in ("_forward_pre_hooks", "_forward_hooks") for hook in (getattr(module, name, None) or {}).values()]


def global_hooks() -> tuple[bool, bool]:
    """Whether a backward hook, and whether a forward hook, is registered for every module
    (``register_module_full_backward_hook``, ``register_module_forward_hook`` and their
    pre-hook kin); False where this torch keeps them elsewhere."""
    from torch.nn.modules import module

    def any_of(*names: str) -> bool:
        return any(getattr(module, name, None) for name in names)

    return (any_of("_global_backward_pre_hooks", "_global_backward_hooks"),
            any_of("_global_forward_pre_hooks", "_global_forward_hooks"))


def runs_own_forward(module: Any, forward: Any) -> bool:
    """Whether calling ``module`` runs ``forward`` (torch's own, from :func:`own_forward`) and
    nothing else: its class's ``forward`` is that function, patched neither on the class nor
    on the instance, not compiled in place, and no hook of its own or for every module. (The
    hook tables are read here as :func:`has_hooks` and :func:`global_hooks` read them, inline:
    the router asks this for every such layer at every call.)"""
    table = _MODULE_TABLES
    try:
        return not (forward is None or type(module).forward is not forward
                    or "forward" in module.__dict__ or getattr(module, "_compiled_call_impl", None) is not None
                    or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                    or module._backward_pre_hooks or table._global_forward_hooks
                    or table._global_forward_pre_hooks or table._global_backward_hooks
                    or table._global_backward_pre_hooks)
    except AttributeError:  # a torch that keeps them elsewhere: call the module
        return False


def linear_parameters(module: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """An ``nn.Linear``'s weight and bias where calling it would run ``F.linear`` on them
    and nothing else (:func:`runs_own_forward`); None otherwise. The router calls such a
    layer's ``F.linear`` itself, without the module's frames."""
    if not runs_own_forward(module, _LINEAR_FORWARD):
        return None
    try:
        params = module._parameters
        return params["weight"], params["bias"]
    except (AttributeError, KeyError):  # a torch that keeps them elsewhere: call the module
        return None


def own_forward(cls: type) -> Any:
    """``cls.forward`` where it is torch's own function, defined in the module that defines
    ``cls`` (not one patched on the class before fxnx was imported, which a later identity
    check would take for torch's); else None, and such layers are called as modules."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    source = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return forward if code is not None and code.co_filename == source and code.co_name == "forward" else None


_LINEAR_FORWARD = own_forward(torch.nn.Linear)
#: Where torch keeps the hook tables for every module.
_MODULE_TABLES = torch.nn.modules.module


def uncompiled(model: Any) -> Any:
    """The module a ``torch.compile``'d one wraps (it computes what that module computes), or
    ``model`` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def own_tables(module: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tables of the buffers and parameters ``module`` registers itself, by name: where a
    forward rebinds one (``self.ema = ...``), the entry changes. Empty where this torch keeps
    them elsewhere."""
    own = vars(module)
    return own.get("_buffers", {}), own.get("_parameters", {})


def own_parameters(module: Any) -> list[torch.Tensor]:
    """The parameters ``module`` registers itself (``parameters(recurse=False)``, read from
    its table, as :func:`own_buffers` reads buffers)."""
    try:
        return [p for p in module._parameters.values() if p is not None]
    except AttributeError:  # a torch that keeps them elsewhere
        return list(module.parameters(recurse=False))


def own_buffers(module: Any) -> list[torch.Tensor]:
    """The buffers ``module`` registers itself (``buffers(recurse=False)``, read from its
    table: a model's every module is read at each ``route_credit``)."""
    try:
        return [b for b in module._buffers.values() if b is not None]
    except AttributeError:  # a torch that keeps them elsewhere
        return list(module.buffers(recurse=False))


def global_module_hooks() -> tuple[Any, ...]:
    """The hooks registered for every module (``register_module_forward_hook`` and its
    kin), which run inside any forward; empty where this torch keeps them elsewhere."""
    from torch.nn.modules import module

    return tuple(
        getattr(module, name) for name in (
            "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
            "_global_backward_hooks", "_global_forward_hooks_always_called",
            "_global_forward_hooks_with_kwargs", "_global_is_full_backward_hook",
        ) if hasattr(module, name)
    )


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - every supported torch has it
    TorchDispatchMode = None  # type: ignore[assignment,misc]


def decomposes(op: Any) -> bool:
    """Whether FlopCounterMode would decompose the ATen operator ``op`` (it has a
    CompositeImplicitAutograd kernel); True where this torch cannot say, so it is run."""
    key = getattr(getattr(torch._C, "DispatchKey", None), "CompositeImplicitAutograd", None)
    if key is None:  # pragma: no cover
        return True
    return key in op.py_kernels or op.has_kernel_for_dispatch_key(key)


def cpu_attention_formulas(registry: dict[Any, Any]) -> dict[Any, Any]:
    """FLOP formulas for the CPU flash-attention kernels: torch's own for flash attention
    (same arguments), which ``registry`` (FlopCounterMode's) lacks for the CPU kernels."""
    aten = torch.ops.aten
    same = {
        "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu_backward":
            "_scaled_dot_product_flash_attention_backward",
    }
    formulas = {}
    for cpu, other in same.items():
        cpu_op, other_op = getattr(aten, cpu, None), getattr(aten, other, None)
        if cpu_op is not None and cpu_op not in registry and other_op in registry:
            formulas[cpu_op] = registry[other_op]
    return formulas


def drop_annotations() -> None:
    """Empty torch.fx.traceback's custom annotations (what ``fx_traceback.annotate`` adds to
    every node traced meanwhile); call it inside ``fx_traceback.preserve_node_meta()``, which
    puts them back when it ends."""
    from torch.fx import traceback as fx_traceback

    meta = getattr(fx_traceback, "current_meta", None)
    if isinstance(meta, dict):
        meta.pop("custom", None)
