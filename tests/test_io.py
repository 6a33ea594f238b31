"""Graph files: round trip, no torch needed to load, nothing but graph data accepted."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc

import networkx as nx
import pytest
import torch

import fxnx
import fxnx._files
from fxnx._cli import main

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
    with pytest.raises(fxnx.errors.UnsafePickleError, match=r"opcode REDUCE.*Nothing in it was run"):
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
    with pytest.raises(fxnx.errors.GraphFileError, match="truncated or corrupt"):
        fxnx.read_pickle(path)
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(fxnx.errors.GraphFileError, match="not a readable fxnx graph file"):
        fxnx.read_pickle(path)




def test_a_pickle_of_something_else_is_refused(tmp_path):
    path = tmp_path / "list.pkl"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(fxnx.errors.GraphFileError, match="holds a list, not a graph"):
        fxnx.read_pickle(path)


def test_writing_torch_objects_is_refused_and_nothing_is_written(tmp_path):
    G = _graph()
    G.graph["dtype"] = torch.float32
    path = tmp_path / "g.pkl"
    with pytest.raises(fxnx.errors.GraphContractError, match="'dtype': torch.dtype is not plain data"):
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
    with pytest.raises(fxnx.errors.GraphFileError, match="not a readable fxnx JSON graph"):
        fxnx.read_json(path)
    G = _graph()
    G.graph["bad"] = float("nan")
    with pytest.raises(fxnx.errors.FxnxValueError, match="JSON cannot write"):
        fxnx.write_json(G, tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()


def test_graphml_export_loads_in_networkx(torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 32, 32))
    fxnx.write_graphml(G, tmp_path / "g.graphml")
    H = nx.read_graphml(tmp_path / "g.graphml", force_multigraph=True)
    assert H.number_of_nodes() == G.number_of_nodes()
    assert H.number_of_edges() == G.number_of_edges()
    assert H.nodes["conv1"]["module_type"] == "torch.nn.modules.conv.Conv2d"
    assert H.nodes["conv1"]["num_params"] == 9408
    assert H.nodes["conv1"]["out_shape"] == "1x64x16x16" and H.nodes["conv1"]["out_rank"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_round_trip_torchvision_pickle_and_json(name, torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model(name), torch.randn(1, 3, 224, 224))
    fxnx.skip_connections(G)
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    fxnx.write_json(G, tmp_path / "g.json")
    assert_graphs_equal(fxnx.read_pickle(tmp_path / "g.pkl"), G)
    assert_graphs_equal(fxnx.read_json(tmp_path / "g.json"), G)


# --- hardening: helpers that write files fxnx's writers would refuse --------------------------


def _graph():
    G = fxnx.convert(CASES["skip_block"].build(), torch.randn(2, 4))
    fxnx.skip_connections(G)
    return G


def _raw_pickle(G, path):
    """Pickle G exactly as write_pickle lays it out, but without the contract check."""
    buffer = io.BytesIO()
    fxnx._files._GraphPickler(buffer, protocol=4).dump(G)
    path.write_bytes(buffer.getvalue())
    return path


def _raw_json(G, path):
    path.write_text(json.dumps(fxnx._files._encode(nx.node_link_data(G, edges="edges"))))
    return path


def _proto(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"


def _binint(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


# --- atomic writes -----------------------------------------------------------------------------


def _half_then_fail(real_open):
    """An open() whose files write half of what they are given, then fail like a full disk."""

    class Half:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    return lambda file, mode="r", *args, **kwargs: Half(real_open(file, mode, *args, **kwargs))


@pytest.mark.parametrize("writer", ["write_pickle", "write_json", "write_graphml"])
def test_a_write_that_fails_part_way_leaves_the_old_file(writer, tmp_path, monkeypatch):
    path = tmp_path / "g.out"
    path.write_bytes(b"the old file")
    monkeypatch.setattr(fxnx._files, "open", _half_then_fail(open), raising=False)
    monkeypatch.setattr(nx.readwrite.graphml, "open", _half_then_fail(open), raising=False)
    with pytest.raises(OSError, match="No space left"):
        getattr(fxnx, writer)(_graph(), path)
    assert path.read_bytes() == b"the old file"
    assert [p.name for p in tmp_path.iterdir()] == ["g.out"]


def test_atomic_write_keeps_the_old_file_on_any_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"old\x00bytes")
    with pytest.raises(KeyError):
        with fxnx._files.atomic_write(path) as f:
            f.write(b"new")
            raise KeyError("boom")
    assert path.read_bytes() == b"old\x00bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with fxnx._files.atomic_write(path, "w") as f:
        f.write("né")
    assert path.read_bytes() == "né".encode()
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_json_encoding_failure_leaves_the_old_file(tmp_path):
    path = tmp_path / "g.json"
    fxnx.write_json(_graph(), path)
    before = path.read_bytes()
    G = _graph()
    G.nodes["lin"]["score"] = float("inf")
    with pytest.raises(fxnx.errors.FxnxValueError, match="JSON cannot write"):
        fxnx.write_json(G, path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("value", [1j, slice(1, 2), {1, 2}, frozenset(), b"raw", bytearray(b"x")])
def test_writers_refuse_what_readers_would_refuse(value, tmp_path):
    G = _graph()
    G.nodes["lin"]["mine"] = value
    for writer in (fxnx.write_pickle, fxnx.write_json):
        with pytest.raises(fxnx.errors.GraphContractError, match="is not plain data"):
            writer(G, tmp_path / "g")
    assert not list(tmp_path.iterdir())


# --- pickles that run or allocate ---------------------------------------------------------------


@pytest.mark.parametrize("outer", ["list", "tuple", "frozenset", "str", "bytes", "complex", "slice"])
def test_a_small_pickle_that_would_allocate_through_reduce_is_refused(outer, tmp_path):
    # outer(bytes(10**8)): two globals, one integer, two calls; about 50 bytes.
    data = _proto(_global("builtins", outer), _global("builtins", "bytes"), _binint(10**8),
                  b"\x85R\x85R")
    path = tmp_path / "bomb.pkl"
    path.write_bytes(data)
    assert len(data) < 300
    tracemalloc.start()
    try:
        with pytest.raises(fxnx.errors.UnsafePickleError, match="Nothing in it was run"):
            fxnx.read_pickle(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10**7


def test_a_graph_class_called_with_arguments_is_refused(tmp_path):
    data = _proto(_global("networkx.classes.multidigraph", "MultiDiGraph"), b"]\x85R")
    with pytest.raises(fxnx.errors.UnsafePickleError, match="REDUCE"):
        fxnx.read_pickle(tmp_path.joinpath("g.pkl").write_bytes(data) and tmp_path / "g.pkl")


def test_a_tuple_as_a_dict_key_is_refused_before_it_is_hashed(tmp_path):
    # A 200,000-deep tuple used as a key: hashing it overflows the C stack (a crash, not an error).
    data = _proto(b"}", b")" + b"\x85" * 200_000, b"Ns")
    path = tmp_path / "deep_key.pkl"
    path.write_bytes(data)
    with pytest.raises(fxnx.errors.UnsafePickleError, match="SETITEM with a 't' key"):
        fxnx.read_pickle(path)


def _memo_bomb_graph(levels: int):
    """A graph whose attribute shares one list 4 ways at each of ``levels`` levels: 4**levels
    elements as a tree, a few bytes per level as a file."""
    G = _graph()
    value: list = [0]
    for _ in range(levels):
        value = [value, value, value, value]
    G.graph["bomb"] = value
    return G


def test_a_memo_reference_bomb_is_refused(tmp_path, capsys):
    path = _raw_pickle(_memo_bomb_graph(30), tmp_path / "bomb.pkl")
    assert path.stat().st_size < 10_000
    with pytest.raises(fxnx.errors.GraphFileError, match="expands into more than .* shared references"):
        fxnx.read_pickle(path)
    assert main(["info", str(path)]) == 1
    assert "decompression bomb" in capsys.readouterr().err


def test_modest_sharing_is_read(tmp_path):
    path = _raw_pickle(_memo_bomb_graph(5), tmp_path / "shared.pkl")
    assert fxnx.read_pickle(path).graph["bomb"][3][3][3][3][3] == [0]


def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path):
    depth = 100_000
    data = _proto(b"]" * depth + b"a" * (depth - 1))
    path = tmp_path / "deep.pkl"
    path.write_bytes(data)
    with pytest.raises(fxnx.errors.GraphFileError, match="holds a list, not a graph"):
        fxnx.read_pickle(path)
    G = _graph()
    G.graph["deep"] = []
    inner = G.graph["deep"]
    for _ in range(200):  # deeper than the limit, shallow enough for pickle.dumps
        inner.append([])
        inner = inner[0]
    with pytest.raises(fxnx.errors.GraphFileError, match="nests values more than 40 deep"):
        fxnx.read_pickle(_raw_pickle(G, tmp_path / "deep_attr.pkl"))


# --- wrong-schema files --------------------------------------------------------------------------


def _string_num_params(G):
    G.nodes["lin"]["num_params"] = "20"


def _empty(G):
    G.remove_nodes_from(list(G))


def _list_graph(G):
    G.graph = ["not", "a", "dict"]


def _cycle(G):
    G.add_edge("add", "lin", **G.edges["x", "lin", 0])


WRONG_SCHEMA = {
    "string num_params": (_string_num_params, "node 'lin' attribute 'num_params' must be an int >= 0, got str"),
    "empty graph": (_empty, "G has no nodes"),
    "list as graph": (_list_graph, "G.graph must be a dict of graph attributes, got list"),
    "cycle": (_cycle, "G has a cycle"),
}


@pytest.mark.parametrize("fmt", ["pkl", "json"])
@pytest.mark.parametrize("case", WRONG_SCHEMA)
def test_a_wrong_schema_file_is_one_error_and_the_cli_says_one_line(case, fmt, tmp_path, capsys):
    edit, message = WRONG_SCHEMA[case]
    G = _graph()
    edit(G)
    path = (_raw_pickle if fmt == "pkl" else _raw_json)(G, tmp_path / f"g.{fmt}")
    read = fxnx.read_pickle if fmt == "pkl" else fxnx.read_json
    with pytest.raises(fxnx.errors.GraphFileError, match=f"is not a valid fxnx graph: {message}") as info:
        read(path)
    assert isinstance(info.value.__cause__, fxnx.errors.GraphContractError)
    for command in (["info", str(path)], ["draw", str(path), "-o", str(tmp_path / "g.dot")]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message.split(",")[0] in err and "Traceback" not in err


@pytest.mark.parametrize("version", ["2", 2.0, 99.5, True, fxnx.contract.FORMAT_VERSION + 1])
@pytest.mark.parametrize("fmt", ["pkl", "json"])
def test_format_version_must_be_an_int_this_fxnx_knows(version, fmt, tmp_path):
    G = _graph()
    G.graph["format_version"] = version
    path = (_raw_pickle if fmt == "pkl" else _raw_json)(G, tmp_path / f"g.{fmt}")
    read = fxnx.read_pickle if fmt == "pkl" else fxnx.read_json
    newer = type(version) is int and version == fxnx.contract.FORMAT_VERSION + 1  # True == 2.0 == 2 in Python
    advice = "upgrade fxnx" if newer else "must be an int"
    with pytest.raises(fxnx.errors.GraphFileError, match=f"format_version.*{advice}"):
        read(path)


# --- JSON ----------------------------------------------------------------------------------------


def _node_link():
    return json.loads(_raw_json(_graph(), _node_link_dir() / "g.json").read_text())


def _node_link_dir():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


def _duplicate_node(data):
    data["nodes"].append(dict(data["nodes"][0]))
    return json.dumps(data).encode()


def _edge_to_nowhere(data):
    data["edges"].append({**data["edges"][0], "target": "nowhere"})
    return json.dumps(data).encode()


def _missing_key(data):
    del data["edges"]
    return json.dumps(data).encode()


JSON_CASES = {
    "invalid utf-8": (lambda d: b'{"graph": "\xff\xfe"}', "truncated or corrupt: 'utf-8' codec"),
    "list at top level": (lambda d: b"[1, 2, 3]", "got a JSON list"),
    "missing keys": (_missing_key, r"expected an object with \['directed', 'edges'"),
    "deep arrays": (lambda d: b"[" * 100_000 + b"]" * 100_000, "nests JSON values too deeply"),
    "NaN": (lambda d: json.dumps(d).replace('"num_params": 20', '"num_params": NaN').encode(),
            "NaN is not a number fxnx graphs hold"),
    "Infinity as a float": (lambda d: json.dumps(d).replace('"num_params": 20', '"num_params": 1e999').encode(),
                            "1e999 is not a finite number"),
    "invalid literal": (lambda d: b'{"directed": tru}', "truncated or corrupt: Expecting value"),
    "huge int": (lambda d: json.dumps(d).replace('"num_params": 20', '"num_params": ' + "9" * 5000).encode(),
                 "truncated or corrupt: Exceeds the limit"),
    "duplicate node ids": (_duplicate_node, "node id 'x' appears twice"),
    "edge to a missing node": (_edge_to_nowhere, "joins 'x' to 'nowhere'.*not two nodes of the file"),
}


@pytest.mark.parametrize("case", JSON_CASES)
def test_read_json_turns_every_bad_file_into_one_error(case, tmp_path):
    make, message = JSON_CASES[case]
    path = tmp_path / "g.json"
    path.write_bytes(make(_node_link()))
    with pytest.raises(fxnx.errors.GraphFileError, match=message):
        fxnx.read_json(path)


# --- truncation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pkl", "json"])
def test_a_file_cut_anywhere_is_a_graph_file_error(fmt, tmp_path):
    G = _graph()
    G.graph["author"] = "Zoë Ångström"  # multi-byte UTF-8: cuts land inside characters too
    path = tmp_path / f"g.{fmt}"
    (fxnx.write_pickle if fmt == "pkl" else fxnx.write_json)(G, path)
    read = fxnx.read_pickle if fmt == "pkl" else fxnx.read_json
    data = path.read_bytes()
    cut = tmp_path / f"cut.{fmt}"
    for end in sorted({*range(0, len(data), max(1, len(data) // 400)), *range(len(data) - 40, len(data))}):
        cut.write_bytes(data[:end])
        with pytest.raises(fxnx.errors.GraphFileError):
            read(cut)
    assert_graphs_equal(read(path), G)


# --- round trips after every annotation ----------------------------------------------------------


def test_pickle_and_json_round_trips_after_skip_connections_and_route_credit(torchvision_model, tmp_path):
    model = torchvision_model("resnet18")
    x = torch.randn(1, 3, 32, 32)
    G = fxnx.convert(model, x)
    fxnx.skip_connections(G)
    fxnx.route_credit(G, model, x)
    for write, read, name in ((fxnx.write_pickle, fxnx.read_pickle, "g.pkl"),
                              (fxnx.write_json, fxnx.read_json, "g.json")):
        write(G, tmp_path / name)
        H = read(tmp_path / name)
        assert_graphs_equal(H, G)
    # A pickle also keeps the in-edge order (node-link JSON cannot: it lists out-edges).
    H = fxnx.read_pickle(tmp_path / "g.pkl")
    assert [list(H.predecessors(n)) for n in H] == [list(G.predecessors(n)) for n in G]
    assert math.isfinite(H.nodes["add"]["credit_norm"])


# --- found in review: huge values, shared strings, odd files, long names ---------------------


@pytest.mark.parametrize(
    "spoil",
    [
        lambda G: G.nodes["lin"].update(num_params=10**6000),
        lambda G: G.graph.update(mine={10**6000: 1}),
        lambda G: G.graph.update(model=["x" * 1000] * 3000),
    ],
    ids=["huge int attribute", "huge int key", "huge repr"],
)
def test_huge_values_give_one_graph_file_error(spoil, tmp_path):
    G = _graph()
    spoil(G)
    path = _raw_pickle(G, tmp_path / "g.pkl")
    with pytest.raises(fxnx.errors.GraphFileError):
        fxnx.read_pickle(path)
    assert main(["info", str(path)]) == 1


def test_a_shared_string_bomb_is_refused(tmp_path, capsys):
    """Memo references to one long string: a small file whose text spelt out is gigabytes."""
    G = _graph()
    G.graph["opaque_modules"] = ["m" * 100_000] * 100_000  # 10 GB as text, one string in memory
    path = _raw_pickle(G, tmp_path / "bomb.pkl")
    assert path.stat().st_size < 600_000
    with pytest.raises(fxnx.errors.GraphFileError, match="characters through shared references"):
        fxnx.read_pickle(path)
    capsys.readouterr()
    assert main(["info", str(path)]) == 1
    assert len(capsys.readouterr().err) < 1000


def test_format_version_zero_is_refused(tmp_path):
    G = _graph()
    G.graph["format_version"] = 0
    with pytest.raises(fxnx.errors.GraphFileError, match="must be an int from 1 to"):
        fxnx.read_pickle(_raw_pickle(G, tmp_path / "g.pkl"))


def test_a_device_or_a_pipe_is_not_read(tmp_path):
    with pytest.raises(fxnx.errors.GraphFileError, match="not a regular file"):
        fxnx.read_pickle("/dev/zero")  # would never end
    fifo = tmp_path / "pipe.pkl"
    os.mkfifo(fifo)
    keep_open = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer, so opening cannot block
    try:
        with pytest.raises(fxnx.errors.GraphFileError, match="not a regular file"):
            fxnx.read_pickle(fifo)
    finally:
        os.close(keep_open)


def test_atomic_write_works_for_the_longest_name_and_keeps_permissions(tmp_path):
    path = tmp_path / ("n" * 250 + ".pkl")
    fxnx.write_pickle(_graph(), path)
    os.chmod(path, 0o640)
    fxnx.write_pickle(_graph(), path)
    assert fxnx.read_pickle(path).graph["format_version"] == fxnx.contract.FORMAT_VERSION
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_the_permissions_the_os_gives_under_the_umask(tmp_path, umask):
    # The oracle is the OS itself: a file opened for writing in the same process and folder.
    done = subprocess.run(
        [sys.executable, "-c", f"""
import os, fxnx, networkx as nx
os.umask({umask})
open({str(tmp_path / "plain")!r}, "w").close()
from fxnx._files import atomic_write
with atomic_write({str(tmp_path / "g.txt")!r}, "w") as f:
    f.write("x")
"""], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = (tmp_path / "plain").stat().st_mode & 0o777
    assert plain == 0o666 & ~umask
    assert (tmp_path / "g.txt").stat().st_mode & 0o777 == plain


def test_a_pickle_of_protocol_five_is_named_as_what_it_is(tmp_path):
    """``pickle.dump(G, f, protocol=5)`` is a readable pickle, just not one fxnx writes: it was
    called "truncated or corrupt", which sends the user looking for a broken disk."""
    G = fxnx.convert(torch.nn.Linear(2, 2), torch.randn(1, 2))
    path = tmp_path / "g.pkl"
    with open(path, "wb") as f:
        pickle.dump(G, f, protocol=5)
    with pytest.raises(fxnx.errors.GraphFileError, match=r"is a pickle of protocol 5, which fxnx's writer never uses: a file pickle.dump wrote.*load it with pickle.load"):
        fxnx.read_pickle(path)
