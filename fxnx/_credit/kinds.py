"""The node kinds the learning rules know, spelled once: layers and functions with weights.

A kind is a module class or a function, as presets key rules by them (:mod:`.presets`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import OpOverload

if TYPE_CHECKING:
    from .nodecall import NodeCall

__all__ = ["CONTAINERS", "CONVOLUTIONS", "LAYERS", "MIXING_MODULES", "MIXING_NAMES", "NATIVE_FUNCTIONS",
           "WEIGHTED_FUNCTIONS", "WEIGHTED_METHODS", "WEIGHTED_MODULES", "kind_name", "mixes"]

_aten = torch.ops.aten

#: Convolutions (not transposed): their feedback to the input can be a kernel shared over space.
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Transposed convolutions: their products with a weight are ``F.conv_transposeNd``'s.
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
#: Linear layers and convolutions: the layers whose weights feedback weights stand in for.
LAYERS = (nn.Linear, *CONVOLUTIONS, *TRANSPOSED)
#: torch.nn modules that torch.fx keeps whole (every ``torch.nn`` module is a leaf of a
#: symbolic trace) and that hold linear layers and attention: feedback weights replace theirs.
CONTAINERS = (
    nn.Transformer, nn.TransformerDecoder, nn.TransformerDecoderLayer, nn.TransformerEncoder,
    nn.TransformerEncoderLayer,
)
#: Every module whose weights carry credit back to its input: the layers, attention, and the
#: containers that hold them. Their backward reads the weights only to send credit to their
#: other inputs (attention and transformer layers through ``F.linear``: with gradients on,
#: torch runs their Python path, never a fused kernel), so swapping each saved weight for
#: ``B`` is exactly weight transport.
WEIGHTED_MODULES = (*LAYERS, nn.MultiheadAttention, *CONTAINERS)
#: The functions that multiply an input by a weight: as a symbolic trace records them
#: (``F.linear(x, self.weight)``, ``x @ self.W``) and as ``torch.export`` does.
WEIGHTED_FUNCTIONS = (
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, torch.addmm, torch.baddbmm, torch.bmm, torch.einsum, torch.matmul,
    torch.mm, operator.matmul,
    _aten.linear.default, _aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default,
    _aten.conv1d.padding, _aten.conv2d.padding, _aten.conv3d.padding, _aten.convolution.default,
    _aten.conv_transpose1d.default, _aten.conv_transpose2d.input, _aten.conv_transpose3d.input,
    _aten.addmm.default, _aten.baddbmm.default, _aten.bmm.default, _aten.einsum.default,
    _aten.matmul.default, _aten.mm.default,
)
#: The same products written as tensor methods (``h.matmul(W)``, ``h.mm(W)``), by name.
WEIGHTED_METHODS = ("matmul", "mm", "bmm", "addmm", "baddbmm")
#: ``F.linear`` as a symbolic trace and as ``torch.export`` record it.
LINEAR_FUNCTIONS = frozenset({F.linear, _aten.linear.default})
#: Those whose autograd backward reads the weight only through tensors it saved, so that
#: swapping them for ``B`` is weight transport: all but the batched products and einsum.
NATIVE_FUNCTIONS = frozenset(WEIGHTED_FUNCTIONS) - {
    torch.baddbmm, torch.bmm, torch.einsum,
    _aten.baddbmm.default, _aten.bmm.default, _aten.einsum.default,
}


#: How module paths of functions read in messages.
_MODULES = {"torch.nn.functional": "F", "torch._C._nn": "F", "_operator": "operator"}


def kind_name(kind: Any) -> str:
    """A node kind (a key of a preset) as messages show it.

    Examples
    --------
    >>> [kind_name(k) for k in (nn.Conv2d, F.relu, torch.relu, _aten.linear.default, ("call_method", "view"))]
    ['nn.Conv2d', 'F.relu', 'torch.relu', 'aten.linear.default', "method('view')"]
    """
    if isinstance(kind, type):
        public = kind.__module__.startswith("torch.nn.")
        return f"nn.{kind.__qualname__}" if public else kind.__qualname__
    if isinstance(kind, tuple):
        return f"method({kind[1]!r})"
    if isinstance(kind, OpOverload):
        return str(kind)
    name = getattr(kind, "__name__", None)
    if name is None:
        return repr(kind)
    module = getattr(kind, "__module__", None)
    module = _MODULES.get(module, module) if isinstance(module, str) else None
    return f"{module}.{name}" if module else name


#: Modules that mix their input's features through weight matrices of their own, and for
#: which the feedback presets have no rule (a feedback preset names them where it leaves them
#: exact: :func:`.presets.warn_exact_layers`).
MIXING_MODULES = (nn.RNNBase, nn.RNNCellBase, nn.Bilinear)
#: The same as functions and ATen operators (``torch.lstm_cell``, ``aten.lstm.input``), other
#: products with a weight (``torch.tensordot``), and the products a preset of one's own may
#: leave out (``h @ W`` under ``{nn.Linear: ...}``), by name.
MIXING_NAMES = frozenset({
    "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "bilinear", "_trilinear", "tensordot", "mv", "addmv", "inner", "linalg_multi_dot",
    *WEIGHTED_METHODS, "einsum",
})


def mixes(call: NodeCall) -> bool:
    """Whether ``call``'s node multiplies its input by a weight matrix of its own (a parameter
    of two or more dimensions, frozen or not) in a way that :data:`MIXING_MODULES` or
    :data:`MIXING_NAMES` says, or is a module kept whole that holds such layers."""
    module = call.module
    if module is not None:
        if not any(p.dim() >= 2 for p in module.parameters()):
            return False
        if isinstance(module, MIXING_MODULES):
            return True
        inside = (*WEIGHTED_MODULES, *MIXING_MODULES)
        kept_whole = not type(module).__module__.startswith("torch.")
        return kept_whole and any(isinstance(m, inside) for m in module.modules())
    name = call.target if isinstance(call.target, str) else getattr(call.target, "__name__", "")
    return name.split(".")[0] in MIXING_NAMES and any(p.dim() >= 2 for p in call.own_parameters())
