"""Graph files: round trip, no torch needed to load, nothing but graph data accepted."""

from __future__ import annotations

import os
import pickle

import networkx as nx
import pytest
import torch

import fxnx

from blocktorch import run_without_torch
from conftest import TORCHVISION, assert_graphs_equal
from zoo import CASES


@pytest.mark.parametrize("name", CASES)
def test_round_trip_zoo(name, tmp_path):
    case = CASES[name]
    G = fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    assert_graphs_equal(fxnx.read_pickle(tmp_path / "g.pkl"), G)


def test_round_trip_resnet18_and_plain_pickle_loads_it(torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    G.nodes  # noqa: B018 - fills networkx's cached views, which must not reach the file
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    assert_graphs_equal(fxnx.read_pickle(tmp_path / "g.pkl"), G)
    with open(tmp_path / "g.pkl", "rb") as f:
        assert_graphs_equal(pickle.load(f), G)


def test_file_loads_where_torch_cannot_be_imported(torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    path = tmp_path / "g.pkl"
    fxnx.write_pickle(G, path)
    code = """
        import pickle, sys
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit("torch imported")
        G = pickle.load(open(sys.argv[1], "rb"))
        import fxnx
        H = fxnx.read_pickle(sys.argv[1])
        assert "torch" not in sys.modules
        print(G.number_of_nodes(), H.number_of_edges(), len(fxnx.skip_connections(H)))
    """
    done = run_without_torch(code, str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(G.number_of_nodes()), str(G.number_of_edges()), "8"]


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    G = nx.MultiDiGraph(payload=_Exploit(str(marker)))
    with open(path, "wb") as f:
        pickle.dump(G, f)
    with pytest.raises(fxnx.UnsafePickleError, match=r"refused to load posix\.system"):
        fxnx.read_pickle(path)
    assert not marker.exists()
    # The check is real: plain pickle would have run the command.
    with open(path, "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_truncated_file_is_a_clear_error(torchvision_model, tmp_path):
    path = tmp_path / "g.pkl"
    fxnx.write_pickle(fxnx.convert(CASES["skip_block"].build(), torch.randn(2, 4)), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(fxnx.GraphFileError, match="truncated or corrupt"):
        fxnx.read_pickle(path)
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(fxnx.GraphFileError, match="not a readable fxnx graph file"):
        fxnx.read_pickle(path)


def test_newer_format_is_refused_with_upgrade_advice(tmp_path):
    path = tmp_path / "g.pkl"
    fxnx.write_pickle(nx.MultiDiGraph(format_version=fxnx.FORMAT_VERSION + 1), path)
    with pytest.raises(fxnx.GraphFileError, match="upgrade fxnx"):
        fxnx.read_pickle(path)


def test_a_pickle_of_something_else_is_refused(tmp_path):
    path = tmp_path / "list.pkl"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(fxnx.GraphFileError, match="holds a list, not a graph"):
        fxnx.read_pickle(path)


def test_writing_torch_objects_is_refused_and_nothing_is_written(tmp_path):
    G = nx.MultiDiGraph(dtype=torch.float32)
    path = tmp_path / "g.pkl"
    with pytest.raises(fxnx.FxnxValueError, match="not plain data"):
        fxnx.write_pickle(G, path)
    assert not path.exists()
    assert G.graph["dtype"] is torch.float32
    with pytest.raises(TypeError, match="needs a networkx graph"):
        fxnx.write_pickle({"not": "a graph"}, path)


@pytest.mark.parametrize("name", CASES)
def test_json_round_trip_keeps_tuples_and_keys(name, tmp_path):
    case = CASES[name]
    G = fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())
    fxnx.skip_connections(G)
    fxnx.write_json(G, tmp_path / "g.json")
    assert_graphs_equal(fxnx.read_json(tmp_path / "g.json"), G)


def test_json_round_trip_resnet18_with_credit(torchvision_model, tmp_path):
    model = torchvision_model("resnet18")
    x = torch.randn(1, 3, 32, 32)
    G = fxnx.convert(model, x)
    fxnx.route_credit(G, model, x)
    fxnx.write_json(G, tmp_path / "g.json")
    H = fxnx.read_json(tmp_path / "g.json")
    assert_graphs_equal(H, G)
    assert type(H.edges["maxpool", "add", 0]["shape"]) is tuple
    assert type(H.nodes["add"]["credit_norm"]) is float


def test_json_errors(tmp_path):
    path = tmp_path / "g.json"
    path.write_text('{"directed": true, "multigraph": true, "graph": {}, "nodes": [')
    with pytest.raises(fxnx.GraphFileError, match="not a readable fxnx JSON graph"):
        fxnx.read_json(path)
    fxnx.write_json(nx.MultiDiGraph(format_version=fxnx.FORMAT_VERSION + 1), path)
    with pytest.raises(fxnx.GraphFileError, match="upgrade fxnx"):
        fxnx.read_json(path)
    with pytest.raises(fxnx.FxnxValueError, match="JSON cannot write"):
        fxnx.write_json(nx.MultiDiGraph(bad=float("nan")), tmp_path / "nan.json")


def test_graphml_export_loads_in_networkx(torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 32, 32))
    fxnx.write_graphml(G, tmp_path / "g.graphml")
    H = nx.read_graphml(tmp_path / "g.graphml", force_multigraph=True)
    assert H.number_of_nodes() == G.number_of_nodes()
    assert H.number_of_edges() == G.number_of_edges()
    assert H.nodes["conv1"]["module_type"] == "torch.nn.modules.conv.Conv2d"
    assert H.nodes["conv1"]["num_params"] == 9408
    import json

    assert json.loads(H.nodes["conv1"]["out_shape"]) == {"__tuple__": [1, 64, 16, 16]}


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_round_trip_torchvision_pickle_and_json(name, torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model(name), torch.randn(1, 3, 224, 224))
    fxnx.skip_connections(G)
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    fxnx.write_json(G, tmp_path / "g.json")
    assert_graphs_equal(fxnx.read_pickle(tmp_path / "g.pkl"), G)
    assert_graphs_equal(fxnx.read_json(tmp_path / "g.json"), G)
