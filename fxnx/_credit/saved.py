"""What a router's ``state_dict`` holds beside the model's: each node's rule and what it drew
or learned, so that training resumes where it stopped.

``router.state_dict()`` holds the model's parameters and buffers (under ``model.``) and, as
the module's extra state (``_extra_state``), the router's seed and, for each node of its plan:
the rule's name; its feedback (``B``; frSF's magnitudes ``M``; direct feedback's projections;
not brSF's, drawn afresh at each step); and what the rule's ``get_extra_state`` keeps (brSF's
count of draws, a weight mirror's noise generator; a rule of one's own may keep its own).
That state is one ``uint8`` tensor, the bytes ``torch.save`` writes, so that the state dict
holds tensors only, as checkpoint formats that take nothing else require (safetensors,
which Hugging Face's ``Trainer`` writes); ``torch.load(io.BytesIO(bytes(t.numpy())),
weights_only=True)`` reads it. ``router.load_state_dict(sd)`` checks it and binds every rule
again with it at the next call, as ``CreditRouter(..., feedback=...)`` binds given feedback,
each node's feedback on its weights' device: a Kolen–Pollack ``B`` goes on learning from where
it was, brSF draws what the saved router would have drawn next. A state saved under another
rule at any node is refused.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch
from torch import Tensor

from .._compat import pytree
from .._errors import FxnxTypeError, FxnxValueError
from .plan import Plan
from .rules import Rule, rule_name

#: Tells a router's state from anything else loaded in its place; the number counts changes
#: of its layout.
FORMAT = "fxnx.CreditRouter/1"


def router_state(plan: Plan | None, given: Mapping[str, Any], loaded: Mapping[str, dict[str, Any]],
                 seed: int) -> dict[str, Any]:
    """The router's extra state: from its rules once it has run; before that, the feedback
    it was given and the state it was loaded with, which its first call will bind."""
    if plan is None:
        nodes = {name: {"feedback": feedback} for name, feedback in given.items()} | dict(loaded)
    else:
        nodes = {}
        for entry in plan.entries:
            rule = entry.rule
            if rule is None:  # a placeholder or attribute: no rule
                continue
            kept: dict[str, Any] = {"rule": rule_name(rule)}
            if isinstance(rule, Rule):
                if not rule.stateful and rule.feedback is not None:
                    kept["feedback"] = rule.feedback
                extra = rule.get_extra_state()
                if extra:
                    kept["extra"] = extra
            nodes[entry.call.name] = kept
    return {"format": FORMAT, "seed": seed, "nodes": nodes}


def encoded(state: dict[str, Any]) -> Tensor:
    """``state`` as the bytes ``torch.save`` writes, in a ``uint8`` tensor."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decoded(state: Any) -> Any:
    """What :func:`encoded` holds, its tensors on the CPU, read afresh (the router's own, as
    ``load_state_dict`` copies parameters); None for anything else."""
    if not (isinstance(state, Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
        return None
    data = state.detach().cpu().contiguous()
    raw = ctypes.string_at(data.data_ptr(), data.numel())  # its bytes (numpy is no dependency)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:  # not bytes torch.save wrote, or not only tensors and plain values
        return None


def on_device(feedback: Any, device: torch.device) -> Any:
    """A node's loaded feedback on ``device`` (its weights')."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, feedback)


def loaded_state(state: Any, G: nx.MultiDiGraph, plan: Plan | None) -> tuple[int, dict[str, dict[str, Any]]]:
    """The seed and the nodes' states of ``state`` (what :func:`router_state` made), checked
    against ``G`` and, for a router that has run, against the rules it routes by. ``state``
    is :func:`decoded`'s: None where it was not a router's."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise FxnxValueError(
            "router.load_state_dict: its '_extra_state' is not a CreditRouter's state "
            f"(format {FORMAT!r}); load a state_dict saved from router.state_dict(), or load a "
            "model's own state_dict into router.model"
        )
    seed, nodes = state.get("seed"), state.get("nodes")
    if type(seed) is not int or not isinstance(nodes, Mapping):
        raise FxnxTypeError("router.load_state_dict: its '_extra_state' needs an int 'seed' and a dict 'nodes'")
    unknown = sorted(set(nodes) - set(G))
    if unknown:
        raise FxnxValueError(
            f"router.load_state_dict: the state holds nodes {unknown} that this router's G does not "
            "have; load it into a router over the graph it was saved from"
        )
    checked = {}
    for name, kept in nodes.items():
        _check_node(name, kept)
        if plan is not None and "rule" in kept:
            check_rule_name(name, kept, plan.rules.get(name))
        checked[name] = dict(kept)  # tensors read afresh from the bytes: the router's own
    return seed, checked


def check_rule_name(name: str, kept: Mapping[str, Any], rule: Any) -> None:
    """Refuse a node's saved state where this router routes the node by another rule."""
    now = rule_name(rule) if rule is not None else "exact"
    if "rule" in kept and kept["rule"] != now:
        raise FxnxValueError(
            f"router.load_state_dict: node {name!r} was saved routed by {kept['rule']!r}, and "
            f"this router routes it by {now!r}; build the router with the rules the state was "
            "saved with (rule=, rules=)"
        )


def _check_node(name: str, kept: Any) -> None:
    if not isinstance(kept, Mapping):
        raise FxnxTypeError(f"router.load_state_dict: node {name!r}'s state must be a dict, got {type(kept).__qualname__}")
    unknown = sorted(set(kept) - {"rule", "feedback", "extra"})
    if unknown:
        raise FxnxValueError(f"router.load_state_dict: node {name!r}'s state has keys {unknown} a router does not keep")
    kinds = {"rule": str, "extra": dict}
    for key, kind in kinds.items():
        if key in kept and not isinstance(kept[key], kind):
            raise FxnxTypeError(
                f"router.load_state_dict: node {name!r}'s {key!r} must be a {kind.__name__}, got "
                f"{type(kept[key]).__qualname__}"
            )
