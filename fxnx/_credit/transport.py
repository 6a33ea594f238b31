"""Credit through a layer whose weights are replaced, on the way back, by feedback weights.

:func:`transported` gives what a layer sends back when each of its weights
``W`` is replaced by a feedback weight ``B`` in the backward pass only: the
credit to the input is that of the layer computed with ``B``, the layer's own
parameters get their exact credit. For ``nn.MultiheadAttention``, whose
projections are hidden inside one module, the attention is recomputed from
functional pieces (:func:`attention`) with each projection a linear map whose
backward uses ``B``; the softmax attention itself is differentiated exactly.

Any other node with a trainable weight of two or more dimensions is
recomputed with ``B`` in the weight's place, and its input credit is the VJP of
that recomputation: a function node (``F.linear(x, self.weight)``,
``aten.conv2d`` in an exported graph, ``torch.addmm(b, x, W)``, ``x @ self.W``)
with each such parameter argument replaced, a module without a dedicated
transport (transformers' ``Conv1D``) through ``torch.func.functional_call``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import pytree
from .._errors import FxnxTypeError, FxnxValueError
from .kinds import CONTAINERS, LAYERS, TRANSPOSED, WEIGHTED_MODULES, kind_name
from .nodecall import Credit, NodeCall, call_target, pairs

__all__ = ["attention", "exact_parameters", "feedback_weights", "has_weights", "no_weights", "transported"]



def feedback_weights(call: NodeCall) -> dict[str, Tensor]:
    """The weights of ``call``'s layer that feedback weights replace, by parameter name."""
    module = call.module
    if isinstance(module, LAYERS):
        return {"weight": module.weight}
    if isinstance(module, nn.MultiheadAttention):
        if module.in_proj_weight is not None:  # one packed weight when q, k, v sizes agree
            weights: dict[str, Tensor] = {"in_proj_weight": module.in_proj_weight}
        else:
            weights = {n: getattr(module, n) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")}
        return {**weights, "out_proj.weight": module.out_proj.weight}
    if isinstance(module, CONTAINERS):
        return {
            f"{path}.{name}": W for path, layer in _inner_layers(module)
            for name, W in feedback_weights(NodeCall(call.name, "call_module", path, layer, [], [], [], None, {})).items()
        }
    weights = _other_weights(call)
    if weights:
        return weights
    raise no_weights(call)


def no_weights(call: NodeCall) -> FxnxTypeError:
    """The error for feedback weights asked of ``call``'s node, which has no weight: one
    wording for module and function nodes alike."""
    module = call.module
    if module is not None:
        kind = type(module).__qualname__
    else:
        kind = kind_name(("call_method", call.target) if call.op == "call_method" else call.target)
    return FxnxTypeError(
        f"node {call.name!r} ({kind}) has no weight to replace with feedback weights: no "
        "parameter of two or more dimensions is among its arguments, nor a trainable one among "
        "its module's parameters; route it exactly, e.g. rules={" + repr(call.name) + ": fxnx.credit.Exact()}"
    )


def has_weights(call: NodeCall) -> bool:
    """Whether ``call``'s node has a weight that feedback weights can replace."""
    if isinstance(call.module, WEIGHTED_MODULES):
        return True
    return bool(_other_weights(call))


def _other_weights(call: NodeCall) -> dict[str, Tensor]:
    """A generic node's weights: the trainable parameters of two or more dimensions of its
    module (by local name; a frozen one there may be a mask or a table, not a weight), or
    the parameters among a function node's arguments (by qualified name), frozen ones too,
    as for ``nn.Linear``: a layer's backward reads its weight whether or not it trains."""
    if call.module is not None:
        return {n: p for n, p in call.module.named_parameters() if p.requires_grad and p.dim() >= 2}
    return {name: p for name, p in call.param_inputs.values() if p.dim() >= 2}


def exact_parameters(call: NodeCall, credit: Credit) -> tuple[list[Credit], dict[str, Tensor]]:
    """Exact credit for ``call``'s parameters only: those its module owns, and its input
    occurrences that are parameters (a function node's weight and bias); None elsewhere."""
    if not call.param_inputs:
        _, params = call.exact(credit, inputs=False)
        return [None] * len(call.inputs), params
    wanted = [call.wants(i) and i in call.param_inputs for i in range(len(call.inputs))]
    return dataclasses.replace(call, wanted=wanted).exact(credit)


def transported(call: NodeCall, credit: Credit, B: dict[str, Tensor]) -> tuple[list[Credit], dict[str, Tensor]]:
    """The layer's credit with each weight ``W`` replaced by ``B[name]`` for the input's credit."""
    if isinstance(call.module, nn.MultiheadAttention):
        return _attention_credit(call, credit, B)
    if isinstance(call.module, CONTAINERS):
        return _container_credit(call, credit, B)
    if not isinstance(call.module, LAYERS):
        return _recomputed_credit(call, credit, B)
    _, param_credit = call.exact(credit, inputs=False)
    inputs: list[Credit] = [None] * len(call.inputs)
    x = call.inputs[0] if call.inputs else None
    if isinstance(x, Tensor) and x.requires_grad and (not call.wanted or call.wanted[0]):
        inputs[0] = _input_credit(call, x, credit, B["weight"].to(credit))
    return inputs, param_credit


def _same(T: Tensor) -> Tensor:
    return T


def _recomputed_credit(call: NodeCall, credit: Credit, B: dict[str, Tensor]) -> tuple[list[Credit], dict[str, Tensor]]:
    """Exact credit for the parameters; for the other inputs, the VJP of the node recomputed
    with each weight replaced by its ``B`` (same call, same other arguments)."""
    inputs, params = exact_parameters(call, credit)
    data = [i for i in range(len(call.inputs)) if call.wants(i) and i not in call.param_inputs]
    if not data:
        return inputs, params
    module = call.module
    if module is not None:
        _refuse_dropout(call, module)
        swapped = {n: B[n].to(W) for n, W in _other_weights(call).items()}
        with torch.enable_grad():
            out = torch.func.functional_call(module, swapped, tuple(call.args), dict(call.kwargs))
    else:
        swap = {  # B in the weight's place: as the node read it (a view of it, for ``W.T``)
            id(call.inputs[k]): call.param_views.get(k, _same)(B[name].to(W)).to(call.inputs[k])
            for k, (name, W) in call.param_inputs.items() if name in B
        }
        args, kwargs = pytree.tree_map(
            lambda v: swap.get(id(v), v) if isinstance(v, Tensor) else v, (call.args, call.kwargs)
        )
        with torch.enable_grad():
            out = call_target(call.op, call.target, None, args, kwargs)
    outs, grads = pairs(out, credit)
    if outs:
        got = torch.autograd.grad(outs, [call.inputs[i] for i in data], grads, allow_unused=True)
        for i, g in zip(data, got, strict=True):
            inputs[i] = g
    return inputs, params


def _refuse_dropout(call: NodeCall, module: nn.Module) -> None:
    """A module recomputed in training mode must not draw dropout masks afresh."""
    dropping = [p for p, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if module.training and dropping:
        raise FxnxValueError(
            f"feedback weights inside {type(module).__qualname__} (node {call.name!r}) need its "
            f"dropout off in training mode ({dropping[0] or 'the module'} has p="
            f"{module.get_submodule(dropping[0]).p}): the recomputed module cannot replay the "
            f"dropout masks; set dropout=0, or route it exactly: rules={{{call.name!r}: fxnx.credit.Exact()}}"
        )


def _inner_layers(module: nn.Module) -> list[tuple[str, nn.MultiheadAttention | nn.Linear]]:
    """The linear layers and attention modules inside ``module``, outermost only (not the
    ``out_proj`` inside an attention)."""
    found: list[tuple[str, nn.MultiheadAttention | nn.Linear]] = []
    for path, sub in module.named_modules():
        if any(path.startswith(p + ".") for p, _ in found):
            continue
        if isinstance(sub, nn.MultiheadAttention | nn.Linear):
            found.append((path, sub))
    return found


def _container_credit(call: NodeCall, credit: Credit, B: dict[str, Tensor]) -> tuple[list[Credit], dict[str, Tensor]]:
    """The VJP of the module recomputed with each inner linear layer and attention sending
    credit to its input through its feedback weights (their own weights get exact credit)."""
    module = call.module
    assert module is not None
    _refuse_dropout(call, module)
    like = next(c for c in pytree.tree_leaves(credit) if isinstance(c, Tensor))
    patched = []
    try:
        for path, layer in _inner_layers(module):
            mine = {n[len(path) + 1:]: b.to(like) for n, b in B.items() if n.startswith(path + ".")}
            if isinstance(layer, nn.MultiheadAttention):
                layer.forward = functools.partial(attention, layer, feedback=mine)  # type: ignore[method-assign]
            else:
                layer.forward = functools.partial(_feedback_linear, layer, mine["weight"])  # type: ignore[method-assign]
            patched.append(layer)
        with torch.enable_grad():
            out = module(*call.args, **call.kwargs)
    finally:
        for layer in patched:
            del layer.forward
    pairs = [(o, c) for o, c in zip(pytree.tree_leaves(out), pytree.tree_leaves(credit), strict=False)
             if isinstance(o, Tensor) and isinstance(c, Tensor) and o.requires_grad]
    return _recomputed_vjp(call, pairs)


def _recomputed_vjp(call: NodeCall, pairs: list[tuple[Tensor, Tensor]]) -> tuple[list[Credit], dict[str, Tensor]]:
    """Credit for ``call``'s wanted inputs and its parameters, from (output, credit) pairs of
    a recomputation of the node on its recorded leaves."""
    wanted = [i for i, x in enumerate(call.inputs)
              if isinstance(x, Tensor) and x.requires_grad and (not call.wanted or call.wanted[i])]
    names = list(call.params)
    wrt = [call.inputs[i] for i in wanted] + [call.params[n] for n in names]
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)
    inputs: list[Credit] = [None] * len(call.inputs)
    for i, g in zip(wanted, got, strict=False):
        inputs[i] = g
    params = {n: g for n, g in zip(names, got[len(wanted):], strict=True) if g is not None}
    return inputs, params


def _feedback_linear(layer: nn.Linear, B: Tensor, x: Tensor) -> Tensor:
    return _FeedbackLinear.apply(x, layer.weight, layer.bias, B)


def _input_credit(call: NodeCall, x: Tensor, credit: Tensor, B: Tensor) -> Tensor:
    module: Any = call.module  # one of LAYERS
    if isinstance(module, nn.Linear):
        return credit @ B
    dims = B.dim() - 2
    if isinstance(module, TRANSPOSED) or isinstance(module.padding, str) or module.padding_mode != "zeros":
        # Padding the layer does itself, or a transposed convolution (its output_padding, or
        # the output_size= of its call): differentiate its call with B as the weight (the bias
        # does not reach the input's credit).
        rest, kwargs = tuple(call.args[1:]), dict(call.kwargs)
        swapped = {"weight": B}  # in B's dtype, as the layer ran under autocast
        if module.bias is not None:
            swapped["bias"] = module.bias.detach().to(B.dtype)
        _, vjp = torch.func.vjp(  # type: ignore[misc]  # torch's annotation has no has_aux=False overload (a pair)
            lambda inp: torch.func.functional_call(module, swapped, (inp, *rest), kwargs), x.detach().to(B.dtype)
        )
        return vjp(credit)[0]
    return torch.ops.aten.convolution_backward(
        credit, x.detach(), B, None, module.stride, module.padding, module.dilation,
        False, [0] * dims, module.groups, [True, False, False],
    )[0]


class _FeedbackLinear(torch.autograd.Function):
    """``F.linear(x, W, b)`` whose backward sends ``credit @ B`` to ``x``; ``W`` and ``b`` exact."""

    @staticmethod
    def forward(x: Tensor, W: Tensor, b: Tensor | None, B: Tensor) -> Tensor:  # type: ignore[override]
        return F.linear(x, W, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, _, b, B = inputs
        ctx.save_for_backward(x, B)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx: Any, credit: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, B = ctx.saved_tensors
        flat = credit.reshape(-1, credit.shape[-1])
        # in the credit's dtype, as autograd's own linear backward under autocast (x and B
        # kept as they were given; autograd casts each credit to its input's dtype)
        gx = credit @ B.to(credit.dtype) if ctx.needs_input_grad[0] else None
        gW = flat.T @ x.reshape(-1, x.shape[-1]).to(credit.dtype) if ctx.needs_input_grad[1] else None
        gb = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gW, gb, None


def _exact_linear(x: Tensor, W: Tensor, b: Tensor | None, B: Tensor | None) -> Tensor:
    return F.linear(x, W, b)


def attention(
    module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
    key_padding_mask: Tensor | None = None, need_weights: bool = True,
    attn_mask: Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False,
    feedback: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``module(query, key, value, ...)`` recomputed from functional pieces.

    With ``feedback`` (parameter name to ``B``), each projection's backward sends
    credit to its input through ``B`` in place of its weight. Dropout on the
    attention weights is refused in training mode (it could not be replayed),
    as are ``bias_k``/``bias_v`` and ``add_zero_attn``.
    """
    m = module
    if m.bias_k is not None or m.add_zero_attn:
        raise FxnxValueError(
            "feedback weights inside nn.MultiheadAttention do not support bias_k/bias_v or "
            "add_zero_attn; route this module exactly: rules={nn.MultiheadAttention: Exact()}"
        )
    if m.training and m.dropout > 0:
        raise FxnxValueError(
            f"feedback weights inside nn.MultiheadAttention need its dropout off in training "
            f"mode (it is {m.dropout}): the recomputed attention cannot replay the dropout mask; "
            "set dropout=0, or route it exactly: rules={nn.MultiheadAttention: Exact()}"
        )
    linear = _FeedbackLinear.apply if feedback is not None else _exact_linear
    B = feedback or {}
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif m.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    L, N, E = query.shape
    S, heads = key.shape[0], m.num_heads
    d = E // heads
    if m.in_proj_weight is not None:
        Ws = m.in_proj_weight.chunk(3)
        Bs = B["in_proj_weight"].chunk(3) if B else (None,) * 3
    else:
        names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        Ws = tuple(getattr(m, n) for n in names)
        Bs = tuple(B[n] for n in names) if B else (None,) * 3
    bs = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
    q, k, v = (linear(t, W, b, Bt) for t, W, b, Bt in zip((query, key, value), Ws, bs, Bs, strict=True))
    q = q.reshape(L, N * heads, d).transpose(0, 1)
    k = k.reshape(S, N * heads, d).transpose(0, 1)
    v = v.reshape(S, N * heads, d).transpose(0, 1)
    scores = torch.bmm(q * (1.0 / math.sqrt(d)), k.transpose(1, 2))
    scores = scores + _additive(attn_mask, scores, N, heads)
    if key_padding_mask is not None:
        pad = _additive(key_padding_mask, scores, N, heads, padding=True)
        scores = scores + pad
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, v).transpose(0, 1).reshape(L * N, E)
    out = linear(out, m.out_proj.weight, m.out_proj.bias, B.get("out_proj.weight"))
    out = out.reshape(L, N, E)
    if m.batch_first and batched:
        out = out.transpose(0, 1)
    if not batched:
        out = out.squeeze(1)
    if not need_weights:
        return out, None
    weights = weights.reshape(N, heads, L, S)
    if average_attn_weights:
        weights = weights.mean(1)
    return out, (weights if batched else weights.squeeze(0))


def _additive(mask: Tensor | None, scores: Tensor, N: int, heads: int, padding: bool = False) -> Tensor | float:
    """A boolean (True = masked) or additive mask, shaped to add to ``(N·heads, L, S)`` scores."""
    if mask is None:
        return 0.0
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).masked_fill(mask, float("-inf"))
    mask = mask.to(scores.dtype)
    if padding:  # (N, S) -> (N·heads, 1, S)
        return mask.reshape(N, 1, 1, -1).expand(N, heads, 1, mask.shape[-1]).reshape(N * heads, 1, -1)
    return mask  # (L, S) or (N·heads, L, S): broadcasts


_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _attention_credit(call: NodeCall, credit: Credit, B: dict[str, Tensor]) -> tuple[list[Credit], dict[str, Tensor]]:
    """The VJP of the recomputed attention with feedback weights ``B``."""
    module = call.module
    bound = _SIGNATURE.bind(module, *call.args, **call.kwargs)
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    like = next(c for c in credit if isinstance(c, Tensor))
    out, weights = attention(module, **arguments, feedback={p: b.to(like) for p, b in B.items()})  # type: ignore[arg-type]
    pairs = [(o, c) for o, c in zip((out, weights), credit, strict=False)
             if isinstance(o, Tensor) and isinstance(c, Tensor)]
    return _recomputed_vjp(call, pairs)
