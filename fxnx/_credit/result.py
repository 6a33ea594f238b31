"""What a credit run gives back: the credit at every node and parameter."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._compat import pytree, vector_norms
from .nodecall import Credit

__all__ = ["CreditResult", "credit_norm", "credit_norms", "owned"]


@dataclass
class CreditResult:
    """The credit every node and parameter received in one routing run.

    Attributes
    ----------
    node_credit : dict
        Node name to the credit with respect to that node's output: a tensor of
        the output's shape, a tuple for multi-output nodes, or None (no credit,
        or a node that produces no tensor). Empty after ``CreditRouter.backward``
        unless it was asked for (``node_credit=True``).
    param_credit : dict
        Qualified parameter name (as in ``model.named_parameters()``) to its credit
        in this run (what ``CreditRouter.backward`` added to its ``.grad``).
    rules : dict
        Node name to the name of the rule that routed through it.
    rule : str
        The preset the run used.
    feedback : dict
        Node name to the feedback weights its rule holds (see ``CreditRouter.feedback``).
    output : Any
        The model's output in the recorded forward pass.

    The tensors are the result's own: no ``.grad``, and none of the caller's (the output
    credit given is copied). Credits of nodes that pass a value on as a view (``flatten``,
    ``nn.Identity``) may share memory with each other, as autograd's gradients do.
    """

    node_credit: dict[str, Credit]
    param_credit: dict[str, Tensor]
    rules: dict[str, str]
    rule: str
    feedback: dict[str, Tensor] = field(default_factory=dict)
    output: Any = None

    def __repr__(self) -> str:
        """A summary (rule, counts, the output, the largest credits), never the tensors: a
        ResNet's result would print hundreds of thousands of numbers."""
        with_credit = {n: v for n, v in self.norms().items() if v is not None}
        top = sorted(with_credit.items(), key=lambda item: -item[1])[:3]
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(self.output) if isinstance(t, Tensor)]
        output = shapes[0] if len(shapes) == 1 else f"{len(shapes)} tensors" if shapes else None
        return (
            f"CreditResult(rule={self.rule!r}: {self.describe() or 'no nodes'}; credit at "
            f"{len(with_credit)} of {len(self.node_credit)} nodes, {len(self.param_credit)} "
            f"parameters; output {output}; feedback for {len(self.feedback)} nodes; largest "
            f"credit norms: {', '.join(f'{n} {v:.3g}' for n, v in top) or 'none'})"
        )

    def norms(self) -> dict[str, float | None]:
        """The Euclidean norm of each node's credit (None where it has none)."""
        return {name: credit_norm(c) for name, c in self.node_credit.items()}

    def describe(self) -> str:
        """Which rule routed through how many nodes: say where a preset fell back to exact."""
        counts = Counter(self.rules.values())
        return ", ".join(f"{rule} on {n} node{'s' * (n != 1)}" for rule, n in counts.most_common())


def credit_norm(credit: Credit) -> float | None:
    """The Euclidean norm of a credit, over all its tensors; None if it has none."""
    norms = [torch.linalg.vector_norm(t.detach()) for t in pytree.tree_flatten(credit)[0] if isinstance(t, Tensor)]
    if not norms:
        return None
    return float(torch.linalg.vector_norm(torch.stack(norms).double()))


def credit_norms(node_credit: dict[str, Credit]) -> dict[str, float | None]:
    """:func:`credit_norm` of each node's credit (the credits of one tensor all at once: one
    call for their norms, read back together)."""
    norms: dict[str, float | None] = dict.fromkeys(node_credit)
    names = [name for name, c in node_credit.items() if isinstance(c, Tensor)]
    tensors = [node_credit[name] for name in names]
    groups: dict[Any, tuple[list[str], list[Tensor]]] = {}
    for name, c, kind in zip(names, tensors, map(_KIND, tensors), strict=True):
        group = groups.get(kind) or groups.setdefault(kind, ([], []))
        group[0].append(name)
        group[1].append(c)
    with torch.no_grad():
        for group_names, members in groups.values():
            norms.update(zip(group_names, _norms(members), strict=True))
    for name, c in node_credit.items():
        if not isinstance(c, Tensor):
            norms[name] = credit_norm(c)
    return norms


#: What the norms of one call share: a tensor's dtype and device.
_KIND = operator.attrgetter("dtype", "device")
#: Tensors of at most this many elements, and of one shape, are stacked for their norms: one
#: norm over the stack costs less than a norm each (a deep MLP's hundreds of credits), and
#: copying them costs little.
_SMALL = 1 << 14


def _norms(members: list[Tensor]) -> list[float]:
    """The norm of each of ``members`` (one dtype and device), in order, read back at once."""
    stacks: dict[torch.Size, list[int]] = {}
    rest: list[int] = []
    for i, t in enumerate(members):
        if t.numel() <= _SMALL:
            stacks.setdefault(t.shape, []).append(i)
        else:
            rest.append(i)
    order: list[int] = []
    parts: list[Tensor] = []
    for at in stacks.values():
        if len(at) == 1:
            rest += at
            continue
        order += at
        parts.append(torch.linalg.vector_norm(torch.stack([members[i] for i in at]).reshape(len(at), -1), dim=1))
    if rest:
        order += rest
        parts.append(torch.stack(vector_norms([members[i] for i in rest])))
    found = [0.0] * len(members)
    for i, value in zip(order, torch.cat(parts).tolist(), strict=True):
        found[i] = value
    return found


def owned(node_credit: dict[str, Any], given: Any = None) -> dict[str, Any]:
    """``node_credit`` with no tensor that shares memory with a tensor of ``given`` (the
    caller's output credit, which autograd hands back as the output's own credit): those
    are copied, so that writing into the caller's tensors changes no result. Credits of
    nodes that pass a value on as a view (``flatten``, ``nn.Identity``) may share memory
    with each other, as autograd's gradients of them do."""
    theirs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(given) if isinstance(t, Tensor)}
    if not theirs:
        return node_credit

    def own(t: Any) -> Any:
        return t.clone() if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in theirs else t

    return {name: pytree.tree_map(own, c) for name, c in node_credit.items()}
