"""Tables of a graph: the cost table and its totals, per-module rows, pandas DataFrames."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from torch import nn

import fxnx
from fxnx.errors import PandasNotFoundError
from fxnx.frames import cost_summary, cost_table, module_costs, to_frames

from zoo import CASES


def _tiny():
    """Conv2d(1 -> 2, 3x3) with a frozen bias, ReLU, Flatten, Linear(32 -> 3), on 1x1x6x6."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    model[0].bias.requires_grad_(False)
    return model, torch.randn(1, 1, 6, 6)


# Counted by hand: parameters are weights and biases; multiply-adds are output elements x
# inputs per output (3x3 window of 1 channel; 32 features); FLOPs are two per multiply-add.
CONV = {"params": 2 * 9 + 2, "trainable": 2 * 9, "macs": (2 * 4 * 4) * 9}
LINEAR = {"params": 32 * 3 + 3, "trainable": 32 * 3 + 3, "macs": 32 * 3}


def _cells(table: str, label: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.strip().startswith(label))
    return re.split(r"\s{2,}", line.strip())


def test_cost_table_rows_and_totals_are_the_hand_counts():
    model, x = _tiny()
    G = fxnx.convert(model, x)
    table = cost_table(G)
    assert _cells(table, "0 (Conv2d)") == [
        "0 (Conv2d)", "(1, 2, 4, 4)", "20", "18", f"{2 * CONV['macs']:,}", f"{CONV['macs']:,}"]
    assert _cells(table, "1 (ReLU)") == ["1 (ReLU)", "(1, 2, 4, 4)", "0", "0", "0", "0"]
    assert _cells(table, "3 (Linear)") == [
        "3 (Linear)", "(1, 3)", "99", "99", f"{2 * LINEAR['macs']:,}", f"{LINEAR['macs']:,}"]
    params = CONV["params"] + LINEAR["params"]
    trainable = CONV["trainable"] + LINEAR["trainable"]
    macs = CONV["macs"] + LINEAR["macs"]
    assert _cells(table, "Sequential") == [
        "Sequential", "(1, 3)", f"{params:,}", f"{trainable:,}", f"{2 * macs:,}", f"{macs:,}"]
    assert f"Total parameters: {params} (trainable {trainable}, frozen {params - trainable})" in table
    assert f"Total FLOPs: {2 * macs:,} ({2 * macs:,} forward, 0 backward)" in table
    assert f"Total MACs: {macs:,}" in table
    # ... and the graph's own totals
    assert (G.graph["num_params"], G.graph["trainable_params"], G.graph["flops"], G.graph["macs"]) == (
        params, trainable, 2 * macs, macs)
    assert cost_summary(G) == {
        "params": params, "trainable_params": trainable, "frozen_params": params - trainable,
        "flops": 2 * macs, "macs": macs, "forward_flops": 2 * macs, "backward_flops": 0,
    }


def test_joint_graph_totals_split_forward_and_backward():
    model, x = _tiny()
    G = fxnx.convert(model, x, level="joint")
    summary = cost_summary(G)
    assert summary["forward_flops"] == 2 * (CONV["macs"] + LINEAR["macs"])
    assert summary["backward_flops"] == G.graph["flops"] - summary["forward_flops"] > 0
    assert f"({summary['forward_flops']:,} forward, {summary['backward_flops']:,} backward)" in cost_table(G)


@pytest.mark.parametrize("level", ["module", "aten", "joint"])
def test_module_rows_add_up_and_their_output_shapes_are_the_modules(level, torchvision_model):
    model, x = torchvision_model("resnet18"), torch.randn(1, 3, 64, 64)
    G = fxnx.convert(model, x, level=level)
    rows = {row["module"]: row for row in module_costs(G)}
    shapes = {}
    hooks = [m.register_forward_hook(lambda m, i, out, name=name: shapes.__setitem__(name, tuple(out.shape)))
             for name, m in model.named_modules() if name]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    assert {path: row["out_shape"] for path, row in rows.items() if path} == shapes
    for path, row in rows.items():
        children = [r for p, r in rows.items() if p and p.rpartition(".")[0] == path and p != path]
        if children and row["type"] != "torchvision.models.resnet.BasicBlock":  # blocks add own nodes
            for key in ("params", "trainable_params"):
                assert row[key] == sum(child[key] for child in children), (path, key)
    assert rows[""]["out_shape"] == (1, 1000)
    assert rows[""]["flops"] == G.graph["flops"] and rows[""]["params"] == G.graph["num_params"]
    assert rows["layer1"]["flops"] == rows["layer1.0"]["flops"] + rows["layer1.1"]["flops"]
    assert max(row["depth"] for row in module_costs(G, depth=1)) == 1
    assert len(cost_table(G, depth=1).splitlines()) == 2 + len(module_costs(G, depth=1)) + 4


def test_a_graph_made_before_costs_shows_them_unknown():
    model, x = _tiny()
    G = fxnx.convert(model, x)
    for attribute in ("flops", "macs", "trainable_params"):
        del G.graph[attribute]
    for _, data in G.nodes(data=True):
        for attribute in ("flops", "macs", "trainable_params", "kernel"):
            del data[attribute]
    summary = cost_summary(G)
    assert summary["params"] == G.graph["num_params"]
    assert [summary[k] for k in ("trainable_params", "frozen_params", "flops", "macs")] == [None] * 4
    assert _cells(cost_table(G), "0 (Conv2d)") == ["0 (Conv2d)", "(1, 2, 4, 4)", "20", "-", "-", "-"]


def _same(value, attribute) -> bool:
    """A cell holds the attribute: the same type and value (numpy scalars as Python's)."""
    import numpy
    import pandas

    if attribute is None:
        return value is None or value is pandas.NA or (isinstance(value, float) and math.isnan(value))
    if isinstance(value, numpy.generic):
        value = value.item()
    return type(value) is type(attribute) and value == attribute


@pytest.mark.parametrize("name", ["skip_block", "tuple_output", "add_self"])
def test_to_frames_rows_and_values_are_the_graphs(name):
    pytest.importorskip("pandas")
    case = CASES[name]
    G = fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())
    fxnx.skip_connections(G)  # branch_role on some nodes and edges only
    first = next(iter(G))
    G.nodes[first]["mine"] = {"a": (1, 2)}
    nodes, edges = to_frames(G)
    assert list(nodes.index) == list(G.nodes)
    for node, data in G.nodes(data=True):
        for column in nodes.columns:
            value = nodes.at[node, column]
            assert _same(value, data.get(column)), (node, column, value, data.get(column))
        assert set(data) <= set(nodes.columns)
    assert list(zip(edges["source"], edges["target"], edges["key"], strict=True)) == list(G.edges(keys=True))
    for i, (*_, data) in enumerate(G.edges(keys=True, data=True)):
        for column in set(edges.columns) - {"source", "target", "key"}:
            assert _same(edges.at[i, column], data.get(column)), (i, column)
    assert list(nodes.columns[:3]) == ["op", "target", "module_type"]  # the contract's order
    assert str(nodes["num_params"].dtype) == "int64" and str(nodes["order"].dtype) == "int64"


def test_to_frames_keeps_unknown_counts_as_missing():
    pytest.importorskip("pandas")
    G = fxnx.convert(nn.Sequential(nn.Linear(3, 2)))  # no example inputs: flops None
    nodes, _ = to_frames(G)
    assert str(nodes["flops"].dtype) == "Int64" and nodes["flops"].isna().all()
    assert nodes.at["_0", "kernel"] is None and nodes.at["_0", "out_shape"] is None


def test_to_frames_without_pandas_says_how_to_install_it(monkeypatch):
    G = fxnx.convert(nn.Linear(2, 2), torch.zeros(1, 2))
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now fails
    with pytest.raises(PandasNotFoundError, match=r"pip install fxnx\[frames\]") as err:
        to_frames(G)
    assert isinstance(err.value, ImportError)


def test_tables_need_neither_torch_nor_pandas(tmp_path):
    from blocktorch import run_without_torch

    model, x = _tiny()
    fxnx.write_pickle(fxnx.convert(model, x), tmp_path / "g.pkl")
    done = run_without_torch(
        """
        import sys
        sys.modules["pandas"] = None
        import fxnx
        from fxnx.frames import cost_table
        print(cost_table(fxnx.read_pickle(sys.argv[1])))
        assert "torch" not in sys.modules
        """,
        str(tmp_path / "g.pkl"),
    )
    assert done.returncode == 0, done.stderr
    assert "Total MACs: 384" in done.stdout


class _Blocks(torch.nn.Module):
    """Blocks held in an nn.ModuleList, which no node calls."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2))
        self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 2)})

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.heads["a"](x)


@pytest.mark.parametrize("routes", [("symbolic_trace",), ("export",)])
def test_a_container_no_node_calls_has_its_row_above_its_members(routes):
    """Oracle: the model's own modules (named_modules, in order) and their parameter counts."""
    model = _Blocks()
    G = fxnx.convert(model, torch.randn(3, 4), routes=routes)
    rows = {row["module"]: row for row in fxnx.frames.module_costs(G)}
    assert list(rows) == [name for name, _ in model.named_modules()]
    for name in ("blocks", "heads"):
        assert rows[name]["type"] == type(model.get_submodule(name)).__module__ + "." + type(model.get_submodule(name)).__qualname__
        assert rows[name]["params"] == sum(p.numel() for p in model.get_submodule(name).parameters())
        assert rows[name]["depth"] == 1
    table = fxnx.frames.cost_table(G, depth=2)
    assert "  blocks (ModuleList)" in table and "    0 (Sequential)" in table


class _Bypassed(torch.nn.Module):
    """Calls its encoder's projection itself: the encoder's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = _Encoder()

    def forward(self, x):
        return self.enc.proj(x).relu()


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 100)

    def forward(self, x):
        return self.unused(self.proj(x))


def test_a_module_with_a_forward_no_node_runs_has_no_row():
    """Only containers (no forward of their own) are added: a module whose forward never ran
    would be shown as if it had, holding a part of its parameters."""
    G = fxnx.convert(_Bypassed(), torch.randn(2, 4))
    assert [row["module"] for row in fxnx.frames.module_costs(G)] == ["", "enc.proj"]
