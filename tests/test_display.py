"""Graphs and drawings in notebooks: what IPython's own display machinery shows for them.

Every oracle here is a real ``IPython.core.interactiveshell.InteractiveShell`` run in a fresh
Python (a shell changes the process it lives in), or the files ``fxnx.draw(G, path)`` writes.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import textwrap
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch

import fxnx
import fxnx._drawing.draw
from fxnx import _drawing as dr

from conftest import needs_dot
from zoo import CASES


def _zoo(name):
    case = CASES[name]
    torch.manual_seed(0)
    return fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())


def _in_ipython(code: str, *, before_fxnx: str = "", env: dict | None = None) -> dict:
    """Run ``code`` in a fresh Python inside a real IPython shell started before fxnx is
    imported (as a notebook's kernel is), after ``before_fxnx``; return what it put in
    ``out``."""
    program = textwrap.dedent("""
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        out = {}
        def show(obj, **kw):
            data, metadata = shell.display_formatter.format(obj, **kw)
            return data
    """) + textwrap.dedent(before_fxnx) + "\nimport fxnx\n" + textwrap.dedent(code) + \
        "\nprint('RESULT' + json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.rpartition("RESULT")[2])


def _frozen(G):
    return copy.deepcopy((G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))))


# --- a drawing without a path ------------------------------------------------------------------


@needs_dot
def test_a_drawing_is_the_picture_draw_writes(tmp_path, torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    before = _frozen(G)
    with pytest.warns(UserWarning, match=r"collapsed below depth (\d)") as inline:
        drawing = fxnx.draw(G)
    with pytest.warns(UserWarning, match=r"collapsed below depth (\d)") as written:
        png = fxnx.draw(G, tmp_path / "g.png")
    assert str(inline[0].message) == str(written[0].message)  # the same depth choice
    assert isinstance(drawing, fxnx.Drawing) and drawing.depth == 2
    assert drawing.png == png.read_bytes()  # the oracle: the file draw(G, path) wrote
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert drawing.dot == fxnx.draw(G, tmp_path / "g.dot").read_text()
    svg = ET.fromstring(drawing.svg)  # well-formed, one element per node drawn
    ids = {g.get("id") for g in svg.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "node"}
    assert ids == set(dr.view.collapse(G, 2)) - {n for n in G if G.nodes[n]["op"] == "get_attr"}
    for suffix in ("png", "svg", "pdf", "dot"):  # save: by suffix, as draw(G, path)
        saved = drawing.save(tmp_path / f"saved.{suffix}")
        assert saved == tmp_path / f"saved.{suffix}"
    assert (tmp_path / "saved.png").read_bytes() == png.read_bytes()
    assert (tmp_path / "saved.svg").read_text() == drawing.svg
    assert (tmp_path / "saved.pdf").read_bytes().startswith(b"%PDF")
    assert (tmp_path / "saved.dot").read_text() == drawing.dot
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"give a \.png, \.svg, \.pdf or \.dot"):
        drawing.save(tmp_path / "g.jpeg")
    assert not (tmp_path / "g.jpeg").exists()
    assert _frozen(G) == before  # drawing never writes into the caller's graph
    assert "resnet" in repr(drawing).lower() and "depth 2" in repr(drawing)


@needs_dot
def test_a_drawing_obeys_the_options_and_bounds_of_draw(tmp_path):
    G = _zoo("nested_skip")
    drawing = fxnx.draw(G, depth=1, rankdir="LR", dpi=150)
    assert drawing.depth == 1 and drawing.dpi == 150
    assert drawing.png == fxnx.draw(G, tmp_path / "g.png", depth=1, rankdir="LR", dpi=150).read_bytes()
    with pytest.raises(fxnx.errors.FxnxValueError, match="dpi must be a whole number"):
        fxnx.draw(G, dpi=0)
    with pytest.raises(fxnx.errors.FxnxTypeError, match="unknown option 'colour'"):
        fxnx.draw(G, colour="red")
    chain = fxnx.convert(torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(60))),
                         torch.zeros(1, 2))
    with pytest.raises(fxnx.errors.FxnxValueError, match="32767-pixel limit"):
        fxnx.draw(chain, depth=1, dpi=1200)  # as draw(G, "g.png", ...) refuses it


def test_without_graphviz_a_drawing_still_has_its_dot_text_and_says_what_to_install(tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setattr(dr.graphviz.shutil, "which", lambda name: None)
    G = _zoo("skip_block")
    drawing = fxnx.draw(G)
    assert drawing.dot.startswith("digraph fxnx {")
    assert drawing.save(tmp_path / "g.dot").read_text() == drawing.dot
    bundle = drawing._repr_mimebundle_()
    assert set(bundle) == {"text/plain"}
    assert "apt-get install graphviz" in bundle["text/plain"]
    assert drawing._repr_svg_() is None
    with pytest.raises(fxnx.errors.GraphvizNotFoundError, match="apt-get install graphviz"):
        drawing.svg  # noqa: B018
    with pytest.raises(fxnx.errors.GraphvizNotFoundError):
        drawing.save(tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()


@needs_dot
def test_ipython_shows_a_drawing_inline(tmp_path):
    G = _zoo("nested_skip")
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    svg = fxnx.draw(G, tmp_path / "g.svg").read_text()
    out = _in_ipython(f"""
        G = fxnx.read_pickle({str(tmp_path / "g.pkl")!r})
        drawing = fxnx.draw(G)
        out["types"] = sorted(show(drawing))
        out["svg"] = show(drawing)["image/svg+xml"]
        out["png"] = sorted(show(drawing, include=["image/png"]))
    """)
    assert out["types"] == ["image/svg+xml", "text/plain"]
    assert out["svg"] == svg  # the oracle: the file draw(G, "g.svg") wrote
    assert out["png"] == ["image/png"]


def test_ipython_shows_what_to_install_without_graphviz(tmp_path):
    G = _zoo("skip_block")
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}  # no dot on this PATH
    out = _in_ipython(f"""
        import shutil
        out["dot"] = shutil.which("dot")
        drawing = fxnx.draw(fxnx.read_pickle({str(tmp_path / "g.pkl")!r}))
        out["data"] = show(drawing)
    """, env=env)
    assert out["dot"] is None
    assert list(out["data"]) == ["text/plain"]
    assert "Graphviz" in out["data"]["text/plain"]
    assert "apt-get install graphviz" in out["data"]["text/plain"]


# --- a graph's own display ---------------------------------------------------------------------


def test_ipython_shows_an_fxnx_graph_by_its_summary_and_other_graphs_as_networkx_does(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    G = fxnx.convert(model, x)
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    out = _in_ipython(f"""
        import networkx as nx
        G = fxnx.read_pickle({str(tmp_path / "g.pkl")!r})
        out["fxnx"] = show(G)
        plain = nx.MultiDiGraph([(1, 2)])
        out["plain"] = show(plain)["text/plain"]
        out["plain_id"] = hex(id(plain))
        out["digraph"] = show(nx.DiGraph(G))["text/plain"]
        unmarked = G.copy()
        del unmarked.graph["format_version"]
        out["unmarked"] = sorted(show(unmarked))
        out["modules"] = sorted(k for k in sys.modules if k.split(".")[0] == "IPython")[:1]
    """, before_fxnx="""
        import networkx as nx
        out["before"] = show(nx.MultiDiGraph([(1, 2)]))["text/plain"]
    """)
    text = out["fxnx"]["text/plain"]
    assert set(out["fxnx"]) == {"text/plain", "text/html"}
    # The oracles: the model and the eager pass, not fxnx's summary.
    assert "torch.nn.modules.container.Sequential" in text
    assert "symbolic_trace route, module level" in text
    assert f"{G.number_of_nodes()} / {G.number_of_edges()}" in text
    assert f"{sum(p.numel() for p in model.parameters()):,}" in text
    (name,) = [item["name"] for item in G.graph["inputs"]]
    assert re.search(rf"input {name} +2×3×8×8 float32", text)
    assert "×".join(map(str, model(x).shape)) in text
    with torch.utils.flop_counter.FlopCounterMode(display=False) as flops:
        model(x)
    assert re.search(rf"FLOPs +{flops.get_total_flops():,} \(", text)
    assert re.search(r"skip connections +0\n", text)
    assert "fxnx.draw(G)" in text
    for row in ("model", "2×3×8×8"):
        assert row in out["fxnx"]["text/html"]
    # Every other graph: what IPython showed before fxnx was imported.
    before = out["before"].rsplit(" at 0x", 1)[0]
    assert out["plain"] == f"{before} at {out['plain_id']}>"
    assert out["digraph"].startswith("<networkx.classes.digraph.DiGraph at 0x")
    assert out["unmarked"] == ["text/plain"]


def test_the_graph_display_is_registered_only_inside_ipython():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, fxnx; print('IPython' in sys.modules)"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_graph_with_skip_connections_shows_them(tmp_path):
    G = _zoo("nested_skip")
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    out = _in_ipython(f"""
        G = fxnx.read_pickle({str(tmp_path / "g.pkl")!r})
        out["text"] = show(G)["text/plain"]
        out["marked"] = any("branch_role" in d for _, d in G.nodes(data=True))
    """)
    # By hand: relu(lin(x)) + x inside, proj(inner(x)) + x around it, both adding x itself.
    assert re.search(r"skip connections +2 \(2 identity\)", out["text"])
    assert not out["marked"]  # showing G does not write into it


def test_a_graph_broken_by_hand_falls_back_to_networkxs_display():
    out = _in_ipython("""
        import networkx as nx
        G = nx.MultiDiGraph([("x", "y"), ("y", "x")], format_version=3)  # a cycle: no summary
        out["data"] = show(G)
    """)
    assert list(out["data"]) == ["text/plain"]
    assert out["data"]["text/plain"].startswith("<networkx.classes.multidigraph.MultiDiGraph at 0x")
