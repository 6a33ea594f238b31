"""Tiny edge-case models, each with the graph a correct conversion must give.

Expected nodes are ``(name, op, target)`` in fx order and expected edges are
``(source, destination, key, arg)`` in the order they are added; both are
written by hand from what each ``forward`` does, not produced by fxnx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Case:
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    nodes: list[tuple[str, str, str]]
    edges: list[tuple[str, str, int, int | str]]
    kwargs: Callable[[], dict[str, Any]] = field(default=lambda: {})


class SkipBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class AddSelf(nn.Module):
    def forward(self, x):
        return x + x


class MulSelf(nn.Module):
    def forward(self, x):
        return x * x


class UnusedInput(nn.Module):
    def forward(self, x, unused):
        return x.relu()


class TupleOutput(nn.Module):
    def forward(self, x):
        return x.relu(), x.sigmoid()


class DictOutput(nn.Module):
    def forward(self, x):
        return {"act": F.relu(x), "raw": x}


class ModuleTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.lin(x))


class InplaceReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.lin(x)) + x


class GetAttrParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return x @ self.w


class CatChunk(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        return torch.cat([b, a], dim=1)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        out, _ = self.mha(x, x, x, need_weights=False)
        return out


class MultiInput(nn.Module):
    def forward(self, x, y, scale: float = 2.0):
        return x * scale + y


class FunctionalAndMethods(nn.Module):
    def forward(self, x):
        h = F.relu(x)
        h = h.view(h.size(0), -1)
        return torch.flatten(h, 1), x.dim()


class NestedSkip(nn.Module):
    """A skip around a block that has a skip of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SkipBlock()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(self.inner(x)) + x


CASES: dict[str, Case] = {
    "skip_block": Case(
        SkipBlock,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("lin", "call_module", "lin"),
         ("relu", "call_function", "torch.relu"), ("add", "call_function", "operator.add"),
         ("output", "output", "output")],
        [("x", "lin", 0, 0), ("lin", "relu", 0, 0), ("relu", "add", 0, 0), ("x", "add", 0, 1),
         ("add", "output", 0, 0)],
    ),
    "add_self": Case(
        AddSelf,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("add", "call_function", "operator.add"),
         ("output", "output", "output")],
        [("x", "add", 0, 0), ("x", "add", 1, 1), ("add", "output", 0, 0)],
    ),
    "mul_self": Case(
        MulSelf,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("mul", "call_function", "operator.mul"),
         ("output", "output", "output")],
        [("x", "mul", 0, 0), ("x", "mul", 1, 1), ("mul", "output", 0, 0)],
    ),
    "unused_input": Case(
        UnusedInput,
        lambda: (torch.randn(2, 4), torch.randn(3)),
        [("x", "placeholder", "x"), ("unused", "placeholder", "unused"),
         ("relu", "call_method", "relu"), ("output", "output", "output")],
        [("x", "relu", 0, 0), ("relu", "output", 0, 0)],
    ),
    "tuple_output": Case(
        TupleOutput,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("relu", "call_method", "relu"),
         ("sigmoid", "call_method", "sigmoid"), ("output", "output", "output")],
        [("x", "relu", 0, 0), ("x", "sigmoid", 0, 0), ("relu", "output", 0, "0[0]"),
         ("sigmoid", "output", 0, "0[1]")],
    ),
    "dict_output": Case(
        DictOutput,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("relu", "call_function", "torch.nn.functional.relu"),
         ("output", "output", "output")],
        [("x", "relu", 0, 0), ("relu", "output", 0, "0['act']"), ("x", "output", 0, "0['raw']")],
    ),
    "module_twice": Case(
        ModuleTwice,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("lin", "call_module", "lin"),
         ("lin_1", "call_module", "lin"), ("output", "output", "output")],
        [("x", "lin", 0, 0), ("lin", "lin_1", 0, 0), ("lin_1", "output", 0, 0)],
    ),
    "inplace_relu": Case(
        InplaceReLU,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("lin", "call_module", "lin"),
         ("act", "call_module", "act"), ("add", "call_function", "operator.add"),
         ("output", "output", "output")],
        [("x", "lin", 0, 0), ("lin", "act", 0, 0), ("act", "add", 0, 0), ("x", "add", 0, 1),
         ("add", "output", 0, 0)],
    ),
    "get_attr_param": Case(
        GetAttrParam,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("w", "get_attr", "w"),
         ("matmul", "call_function", "operator.matmul"), ("output", "output", "output")],
        [("x", "matmul", 0, 0), ("w", "matmul", 0, 1), ("matmul", "output", 0, 0)],
    ),
    "cat_chunk": Case(
        CatChunk,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("chunk", "call_method", "chunk"),
         ("getitem", "call_function", "operator.getitem"),
         ("getitem_1", "call_function", "operator.getitem"),
         ("cat", "call_function", "torch.cat"), ("output", "output", "output")],
        [("x", "chunk", 0, 0), ("chunk", "getitem", 0, 0), ("chunk", "getitem_1", 0, 0),
         ("getitem_1", "cat", 0, "tensors[0]"), ("getitem", "cat", 0, "tensors[1]"),
         ("cat", "output", 0, 0)],
    ),
    "self_attention": Case(
        SelfAttention,
        lambda: (torch.randn(2, 5, 4),),
        [("x", "placeholder", "x"), ("mha", "call_module", "mha"),
         ("getitem", "call_function", "operator.getitem"),
         ("getitem_1", "call_function", "operator.getitem"), ("output", "output", "output")],
        [("x", "mha", 0, 0), ("x", "mha", 1, 1), ("x", "mha", 2, 2), ("mha", "getitem", 0, 0),
         ("mha", "getitem_1", 0, 0), ("getitem", "output", 0, 0)],
    ),
    "multi_input_kwargs": Case(
        MultiInput,
        lambda: (torch.randn(2, 4),),
        # scale is not passed: it stays at its default, a constant of the graph, not an input
        [("x", "placeholder", "x"), ("y", "placeholder", "y"),
         ("mul", "call_function", "operator.mul"),
         ("add", "call_function", "operator.add"), ("output", "output", "output")],
        [("x", "mul", 0, 0), ("mul", "add", 0, 0), ("y", "add", 0, 1), ("add", "output", 0, 0)],
        kwargs=lambda: {"y": torch.randn(2, 4)},
    ),
    "functional_and_methods": Case(
        FunctionalAndMethods,
        lambda: (torch.randn(2, 3, 4),),
        [("x", "placeholder", "x"), ("relu", "call_function", "torch.nn.functional.relu"),
         ("size", "call_method", "size"), ("view", "call_method", "view"),
         ("flatten", "call_function", "torch.flatten"), ("dim", "call_method", "dim"),
         ("output", "output", "output")],
        [("x", "relu", 0, 0), ("relu", "size", 0, 0), ("relu", "view", 0, 0),
         ("size", "view", 0, 1), ("view", "flatten", 0, 0), ("x", "dim", 0, 0),
         ("flatten", "output", 0, "0[0]"), ("dim", "output", 0, "0[1]")],
    ),
    "nested_skip": Case(
        NestedSkip,
        lambda: (torch.randn(2, 4),),
        [("x", "placeholder", "x"), ("inner_lin", "call_module", "inner.lin"),
         ("relu", "call_function", "torch.relu"), ("add", "call_function", "operator.add"),
         ("proj", "call_module", "proj"), ("add_1", "call_function", "operator.add"),
         ("output", "output", "output")],
        [("x", "inner_lin", 0, 0), ("inner_lin", "relu", 0, 0), ("relu", "add", 0, 0),
         ("x", "add", 0, 1), ("add", "proj", 0, 0), ("proj", "add_1", 0, 0),
         ("x", "add_1", 0, 1), ("add_1", "output", 0, 0)],
    ),
}
