"""What a router's ``state_dict`` holds beside the model's: each node's rule and what it drew
or learned, so that training resumes where it stopped.

``router.state_dict()`` holds the model's parameters and buffers (under ``model.``) and, as
the module's extra state (``_extra_state``), the router's seed and, per node whose rule keeps
anything: the rule's name, its feedback (``B``; frSF's magnitudes ``M``; direct feedback's
projections), brSF's count of draws, a weight mirror's noise generator. That state is kept as
one ``uint8`` tensor (its bytes written by ``torch.save``), so the state dict holds tensors
only, as checkpoint formats that take nothing else (safetensors, which Hugging Face's
``Trainer`` writes) require; ``torch.load(io.BytesIO(bytes(t.numpy())), weights_only=True)``
reads it. ``router.load_state_dict(sd)`` checks it, puts its feedback on the model's device,
and binds every rule again with it at the next call, as ``CreditRouter(..., feedback=...)``
binds given feedback: a Kolen–Pollack ``B`` goes on learning from where it was, brSF draws
what the saved router would have drawn next.
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
            kept = rule._state() if isinstance(rule, Rule) else {}
            if kept:
                nodes[entry.call.name] = {"rule": rule_name(rule), **kept}
    return {"format": FORMAT, "seed": seed, "nodes": nodes}


def encoded(state: dict[str, Any]) -> Tensor:
    """``state`` as the bytes ``torch.save`` writes, in a ``uint8`` tensor."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decoded(state: Any, device: torch.device) -> Any:
    """What :func:`encoded` holds, its feedback put on ``device`` (anything else as it is)."""
    if not (isinstance(state, Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
        return state  # refused by loaded_state
    data = state.detach().cpu().contiguous()
    try:
        value = torch.load(io.BytesIO(ctypes.string_at(data.data_ptr(), data.numel())), map_location="cpu", weights_only=True)
    except Exception:  # not bytes torch.save wrote, or not only tensors and plain values
        return None
    nodes = value.get("nodes") if isinstance(value, dict) else None
    if isinstance(nodes, dict):
        for kept in nodes.values():
            if isinstance(kept, dict) and "feedback" in kept:
                kept["feedback"] = pytree.tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, kept["feedback"])
    return value


def loaded_state(state: Any, G: nx.MultiDiGraph, plan: Plan | None) -> tuple[int, dict[str, dict[str, Any]]]:
    """The seed and the nodes' states of ``state`` (what :func:`router_state` made), checked
    against ``G`` and, for a router that has run, against the rules it routes by. ``state``
    is :func:`decoded`'s (None where the bytes could not be read), whose tensors are read
    afresh: the router's own, as ``load_state_dict`` copies parameters."""
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
    extra = sorted(set(kept) - {"rule", "feedback", "draws", "noise"})
    if extra:
        raise FxnxValueError(f"router.load_state_dict: node {name!r}'s state has keys {extra} no rule keeps")
    kinds = {"rule": str, "draws": int, "noise": Tensor}
    for key, kind in kinds.items():
        if key in kept and not isinstance(kept[key], kind):
            raise FxnxTypeError(
                f"router.load_state_dict: node {name!r}'s {key!r} must be a {kind.__name__}, got "
                f"{type(kept[key]).__qualname__}"
            )
