"""Credit rules: how one node sends the credit at its output back to its inputs.

Rules are data. A *preset* (``"exact"``, ``"feedback_alignment"``,
``"sign_symmetry"``, or one you register) maps node kinds to rule functions;
any node whose kind has no entry uses :func:`exact`. A node kind is a module
class (matched along its MRO, so subclasses count), a function such as
``torch.add``, or ``method("view")`` for ``x.view(...)`` calls.

Every rule has the same signature::

    def rule(call: NodeCall, credit, state: RoutingState) -> tuple[list, dict]

and returns the credit for each input occurrence of the node (``call.inputs``)
and for each parameter it owns (``call.params``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import FxnxValueError
from .record import Credit, NodeCall

__all__ = [
    "PRESETS",
    "RoutingState",
    "Rule",
    "exact",
    "feedback_alignment",
    "method",
    "register_rule",
    "sign_symmetry",
]

Rule = Callable[[NodeCall, Credit, "RoutingState"], tuple[list[Credit], dict[str, Tensor]]]

#: Preset name to {node kind: rule}. Kinds missing from a preset use :func:`exact`.
PRESETS: dict[str, dict[Any, Rule]] = {"exact": {}}


@dataclass
class RoutingState:
    """What rules may keep across the nodes of one routing run.

    Attributes
    ----------
    seed : int
        Seeds the random feedback weights, per node.
    feedback : dict
        Node name to its feedback weight; filled on first use and returned in
        :attr:`CreditResult.feedback`, so a later run can reuse the same ones.
    """

    seed: int = 0
    feedback: dict[str, Tensor] = field(default_factory=dict)

    def feedback_weight(self, call: NodeCall) -> Tensor:
        """The fixed random feedback weight of ``call``'s module, made once per node.

        Drawn like a fresh layer's weight (PyTorch's default Kaiming-uniform
        init), from a generator seeded by ``seed`` and the node's name.
        """
        weight = call.module.weight  # type: ignore[union-attr]
        B = self.feedback.get(call.name)
        if B is None:
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + zlib.crc32(call.name.encode())) % 2**63
            )
            B = torch.empty(weight.shape, dtype=weight.dtype)
            nn.init.kaiming_uniform_(B, a=math.sqrt(5), generator=gen)
            B = B.to(weight.device)
            self.feedback[call.name] = B
        elif B.shape != weight.shape:
            raise FxnxValueError(
                f"feedback weight for node {call.name!r} has shape {tuple(B.shape)}, "
                f"but its weight has shape {tuple(weight.shape)}"
            )
        return B


def method(name: str) -> tuple[str, str]:
    """The node kind of ``tensor.name(...)`` calls, for registering a rule.

    Examples
    --------
    >>> method("view")
    ('call_method', 'view')
    """
    return ("call_method", name)


def register_rule(preset: str, *kinds: Any) -> Callable[[Rule], Rule]:
    """Register the decorated function as ``preset``'s rule for each of ``kinds``.

    Returns the function unchanged. A new preset name creates the preset; use
    it with ``route_credit(..., rule=preset)``.

    Examples
    --------
    >>> @register_rule("no_skip_credit", method("relu"))
    ... def relu_blocks(call, credit, state):
    ...     return [None] * len(call.inputs), {}
    >>> PRESETS["no_skip_credit"][method("relu")] is relu_blocks
    True
    >>> del PRESETS["no_skip_credit"]
    """
    if not kinds:
        raise FxnxValueError("register_rule needs at least one node kind")

    def decorate(fn: Rule) -> Rule:
        table = PRESETS.setdefault(preset, {})
        for kind in kinds:
            table[kind] = fn
        return fn

    return decorate


def lookup(call: NodeCall, table: dict[Any, Rule]) -> Rule | None:
    """The rule in ``table`` for ``call``'s node kind, or None."""
    if call.module is not None:
        for cls in type(call.module).__mro__:
            if cls in table:
                return table[cls]
        return None
    if call.op == "call_method":
        return table.get(method(call.target))
    if call.op == "call_function":
        try:
            return table.get(call.target)
        except TypeError:  # an unhashable callable
            return None
    return None


def exact(call: NodeCall, credit: Credit, state: RoutingState) -> tuple[list[Credit], dict[str, Tensor]]:
    """The node's exact vector-Jacobian product: what backpropagation sends."""
    return call.exact(credit)


_TRANSPORT_KINDS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@register_rule("feedback_alignment", *_TRANSPORT_KINDS)
def feedback_alignment(
    call: NodeCall, credit: Credit, state: RoutingState
) -> tuple[list[Credit], dict[str, Tensor]]:
    """Feedback alignment (Lillicrap et al., 2016): a fixed random ``B`` carries credit
    back to the input in place of ``W``; the layer's own parameters get their exact
    credit given the credit at its output."""
    return _transported(call, credit, state.feedback_weight(call))


@register_rule("sign_symmetry", *_TRANSPORT_KINDS)
def sign_symmetry(
    call: NodeCall, credit: Credit, state: RoutingState
) -> tuple[list[Credit], dict[str, Tensor]]:
    """Sign symmetry (Liao et al., 2016): ``sign(W)`` carries credit back in place of ``W``."""
    return _transported(call, credit, call.module.weight.detach().sign())  # type: ignore[union-attr]


def _transported(
    call: NodeCall, credit: Tensor, B: Tensor
) -> tuple[list[Credit], dict[str, Tensor]]:
    """Credit to the input through ``B`` in the place of the weight; exact parameter credit."""
    _, param_credit = call.exact(credit, inputs=False)
    inputs: list[Credit] = [None] * len(call.inputs)
    if call.inputs and (not call.wanted or call.wanted[0]):
        inputs[0] = _input_credit(call.module, call.inputs[0], credit, B.to(credit.dtype))
    return inputs, param_credit


def _input_credit(module: Any, x: Tensor, credit: Tensor, B: Tensor) -> Tensor:
    if isinstance(module, nn.Linear):
        return credit @ B
    dims = B.dim() - 2
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        # Padding the layer does itself: differentiate its forward with B as the weight (the
        # bias does not reach the input's credit).
        _, vjp = torch.func.vjp(
            lambda inp: torch.func.functional_call(module, {"weight": B}, (inp,)), x.detach()
        )
        return vjp(credit)[0]
    return torch.ops.aten.convolution_backward(
        credit, x.detach(), B, None, module.stride, module.padding, module.dilation,
        False, [0] * dims, module.groups, [True, False, False],
    )[0]
