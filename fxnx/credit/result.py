"""What a credit run gives back: the credit at every node and parameter."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._compat import pytree
from .record import Credit

__all__ = ["CreditResult", "credit_norm", "credit_norms"]


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
    """

    node_credit: dict[str, Credit]
    param_credit: dict[str, Tensor]
    rules: dict[str, str]
    rule: str
    feedback: dict[str, Tensor] = field(default_factory=dict)
    output: Any = None

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
    """:func:`credit_norm` of each node's credit."""
    return {name: credit_norm(c) for name, c in node_credit.items()}
