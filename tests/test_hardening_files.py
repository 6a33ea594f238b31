"""Graph files and the command against hostile paths, signals and characters (issue 23).

Whatever could hang (a FIFO, a device, a signal) runs in a subprocess with a
timeout, so a regression fails the test instead of stopping the suite.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import networkx as nx
import pytest
import torch
from test_io import _half_then_fail

import fxnx
import fxnx._files
from fxnx._cli import main

from blocktorch import run_without_torch

TESTS = Path(__file__).parent


def _graph() -> nx.MultiDiGraph:
    return fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()), torch.zeros(1, 3))


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _with_path(folder: Path) -> dict[str, str]:
    """The environment, with ``folder`` first on a subprocess's import path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


# --- readers never block and never read without bound ------------------------------------------

_READ = """
import resource, sys
import fxnx
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # /dev/zero read whole: MemoryError
try:
    getattr(fxnx, sys.argv[1])(sys.argv[2])
except fxnx.errors.GraphFileError as err:
    print(err)
    sys.exit(3)
"""


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("reader", ["read_pickle", "read_json"])
def test_readers_refuse_a_fifo_or_a_device_at_once(reader, kind, tmp_path):
    if kind == "fifo":
        path = tmp_path / "pipe.json"
        os.mkfifo(path)  # no writer: opening it for reading blocks for ever
    else:
        path = Path("/dev/zero")  # never ends
    try:
        done = subprocess.run(
            [sys.executable, "-c", _READ, reader, str(path)],
            capture_output=True, text=True, timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{reader}({str(path)!r}) was still reading after 30 s")
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == f"{str(path)!r} is not a regular file\n"


@pytest.mark.parametrize("writer", ["write_pickle", "write_json"])
def test_readers_refuse_a_file_over_the_size_limit(writer, tmp_path, monkeypatch):
    path = tmp_path / "g"
    getattr(fxnx, writer)(_graph(), path)
    size = path.stat().st_size
    monkeypatch.setattr(fxnx._files, "MAX_FILE_BYTES", size - 1)
    reader = fxnx.read_pickle if writer == "write_pickle" else fxnx.read_json
    with pytest.raises(fxnx.errors.GraphFileError, match=rf"is {size:,} bytes, more than the {size - 1:,} "):
        reader(path)
    monkeypatch.setattr(fxnx._files, "MAX_FILE_BYTES", size)
    assert list(reader(path)) == list(_graph())


# --- characters that files cannot hold -----------------------------------------------------------


def _spoil(G: nx.MultiDiGraph, where: str, text: str) -> str:
    """Put ``text`` somewhere in G; return what the error must name."""
    if where == "node name":
        nx.relabel_nodes(G, {"_1": f"relu{text}"}, copy=False)
        return re.escape(repr(f"relu{text}"))
    if where == "node attribute":
        G.nodes["_1"]["note"] = f"x{text}"
        return "'_1'.*'note'"
    if where == "attribute name":
        G.nodes["_1"][f"note{text}"] = 1
        return "'_1'.*" + re.escape(repr(f"note{text}"))
    if where == "edge attribute":
        G.edges["_0", "_1", 0]["note"] = f"x{text}"
        return "'_0' -> '_1'.*'note'"
    G.graph["note"] = f"x{text}"
    return "G.graph.*'note'"


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\ufffe", "\ud800"], ids=["nul", "esc", "fffe", "surrogate"])
@pytest.mark.parametrize("where", ["node name", "node attribute", "attribute name", "edge attribute", "graph"])
def test_write_graphml_refuses_what_xml_cannot_hold_and_writes_nothing(where, char, tmp_path):
    path = tmp_path / "g.graphml"
    fxnx.write_graphml(_graph(), path)
    before = path.read_bytes()
    G = _graph()
    names = _spoil(G, where, char)
    with pytest.raises(fxnx.errors.GraphContractError) as info:
        fxnx.write_graphml(G, path)
    message = str(info.value)
    assert str(path) in message and f"U+{ord(char):04X}" in message
    assert re.search(names, message), message
    assert path.read_bytes() == before
    assert _files(tmp_path) == ["g.graphml"]


def test_write_graphml_still_writes_tabs_newlines_and_any_other_text(tmp_path):
    G = _graph()
    G.nodes["_1"]["note"] = "tab\tnew\nline é ✓ \U0001f600"
    fxnx.write_graphml(G, tmp_path / "g.graphml")
    H = nx.read_graphml(tmp_path / "g.graphml")
    assert H.nodes["_1"]["note"] == "tab\tnew\nline é ✓ \U0001f600"


def _json_with(tmp_path: Path, where: str) -> Path:
    path = tmp_path / "g.json"
    fxnx.write_json(_graph(), path)
    text = path.read_text()
    if where == "node name":
        text = text.replace('"_1"', '"_1\\ud800"')
    else:
        data = json.loads(text)
        data["nodes"][1]["note"] = "x\ud800"  # json.dumps writes it as the escape \ud800
        text = json.dumps(data)
    assert "\\ud800" in text
    path.write_text(text)
    return path


@pytest.mark.parametrize("where", ["node name", "node attribute"])
def test_read_json_refuses_a_lone_surrogate(where, tmp_path):
    path = _json_with(tmp_path, where)
    with pytest.raises(fxnx.errors.GraphFileError, match=r"U\+D800.*not text"):
        fxnx.read_json(path)


def test_read_pickle_refuses_a_lone_surrogate_and_writers_refuse_to_make_one(tmp_path):
    # pickle itself keeps lone surrogates, so every reader and writer must decide: fxnx refuses.
    G = _graph()
    G.nodes["_1"]["note"] = "x\ud800"
    path = tmp_path / "g.pkl"
    buffer = io.BytesIO()
    fxnx._files._GraphPickler(buffer, protocol=4).dump(G)  # write_pickle's layout, unchecked
    path.write_bytes(buffer.getvalue())
    with pytest.raises(fxnx.errors.GraphFileError, match=r"U\+D800.*not text"):
        fxnx.read_pickle(path)
    for writer in (fxnx.write_pickle, fxnx.write_json, fxnx.write_graphml):
        with pytest.raises(fxnx.errors.GraphContractError, match=r"'_1'.*'note'.*U\+D800"):
            writer(G, tmp_path / "out")
    assert _files(tmp_path) == ["g.pkl"]


# --- atomic writes: errors about the target, and SIGTERM ---------------------------------------


def test_an_error_replacing_the_target_names_the_target_not_the_temporary_file(tmp_path):
    target = tmp_path / "g.pkl"
    target.mkdir()  # os.replace of a file over a folder fails
    with pytest.raises(IsADirectoryError) as info:
        fxnx.write_pickle(_graph(), target)
    assert info.value.filename == str(target)
    assert ".tmp" not in str(info.value) and ".fxnx-" not in str(info.value)
    assert str(target) in str(info.value)
    assert _files(tmp_path) == ["g.pkl"]


def test_a_full_disk_names_the_target(tmp_path, monkeypatch):
    target = tmp_path / "g.json"
    monkeypatch.setattr(fxnx._files, "open", _half_then_fail(open), raising=False)
    with pytest.raises(OSError) as info:
        fxnx.write_json(_graph(), target)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == f"[Errno 28] No space left on device: {str(target)!r}"
    assert _files(tmp_path) == []


def test_atomic_write_leaves_errors_about_other_files_alone(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        with fxnx._files.atomic_write(tmp_path / "out.txt", "w") as f:
            f.write(open(tmp_path / "missing.txt").read())
    assert info.value.filename == str(tmp_path / "missing.txt")


_SLOW_SYNC = """
import os, sys, time
def stall(fd):  # the new file is written but not yet in place: the middle of a write
    open(sys.argv[1], "w").close()
    time.sleep(120)
os.fsync = stall
from fxnx._cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_sigterm_during_a_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "out" / "tiny.pkl"
    target.parent.mkdir()
    target.write_bytes(b"the old file")
    marker = tmp_path / "writing"
    env = _with_path(TESTS)
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SYNC, str(marker),
         "convert", "clifactories:tiny", "--input-shape", "4,3", "-o", str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), process.stderr.read() if process.poll() is not None else "no write"
        assert len(_files(target.parent)) == 2  # the old file and the temporary one
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert err == "fxnx convert: terminated\n"
    assert process.returncode == 128 + signal.SIGTERM
    assert _files(target.parent) == ["tiny.pkl"]
    assert target.read_bytes() == b"the old file"


# --- the command: Ctrl-C at start, -o folder/, arguments checked first -----------------------------

_SLOW_MODEL = "import time\n\ndef make():\n    time.sleep(120)\n"


def _torch_loading(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "torch" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see torch load")
@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_ctrl_c_while_torch_imports_is_one_line_and_exit_130(delay, tmp_path):
    (tmp_path / "slowmodel.py").write_text(_SLOW_MODEL)
    env = _with_path(tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "fxnx", "convert", "slowmodel:make", "--input-shape", "1,3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and not _torch_loading(process.pid):
            assert time.monotonic() < deadline, "torch never started loading"
            time.sleep(0.005)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "Traceback" not in err
    assert err in ("fxnx: interrupted\n", "fxnx convert: interrupted\n")
    assert process.returncode == 130


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_output_that_is_a_folder_gets_the_model_name_inside(existing, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    folder = tmp_path / "graphs"
    if existing:
        folder.mkdir()
    assert main(["convert", "clifactories:tiny", "--input-shape", "4,3", "-o", f"{folder}{os.sep}"]) == 0
    assert _files(tmp_path) == ["graphs"]
    assert _files(folder) == ["tiny.pkl"]
    assert f"wrote {folder / 'tiny.pkl'}" in capsys.readouterr().out


@pytest.mark.parametrize("output", ["g.pkl", "g"])
def test_output_file_name_is_kept(output, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["convert", "clifactories:tiny", "--input-shape", "4,3", "-o", str(tmp_path / output)]) == 0
    assert _files(tmp_path) == ["g.pkl"]


_PARSE = """
import sys
from fxnx._cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["credit", "nosuchpkg:make", "--graph", "{tmp}/x.txt"],
         r"argument --graph: cannot save the graph to 'x\.txt': give a \.pkl or \.json file name"),
        (["credit", "nosuchpkg:make", "--graph", "{tmp}/folder.pkl"],
         r"argument --graph: .*folder\.pkl is a folder: give a file name"),
        (["convert", "nosuchpkg:make", "-o", "{tmp}/foo.xyz"],
         r"argument -o/--output: cannot write the graph to 'foo\.xyz': give a \.pkl file name, "
         r"or a folder"),
        (["convert", "nosuchpkg:make", "-o", "{tmp}/file.pkl/"],
         r"argument -o/--output: cannot write .*file\.pkl/: .*file\.pkl is a file, not a folder"),
        (["draw", "{tmp}/missing.pkl", "-o", "{tmp}/x.txt"], r"argument -o/--output: cannot draw"),
    ],
    ids=["credit-graph-suffix", "credit-graph-folder", "convert-suffix", "convert-file-as-folder",
         "draw-suffix"],
)
def test_paths_are_checked_before_torch_is_imported(argv, message, tmp_path):
    (tmp_path / "folder.pkl").mkdir()
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.pkl").write_bytes(b"")
    done = run_without_torch(_PARSE, *(arg.format(tmp=tmp_path) for arg in argv))
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.search(message, last), done.stderr
    assert "Traceback" not in done.stderr
    assert _files(tmp_path) == ["file.pkl", "folder", "folder.pkl"]
