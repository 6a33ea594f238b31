"""The command line's example inputs (--input, --input-shape, --seed), and how the process
behaves around them: without torch, on Ctrl-C, on a closed pipe, and with warnings during
the progress line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import clifactories
import pytest
import torch
from clifactories import run_hiding

import fxnx
from fxnx._argtypes import input_spec
from fxnx._cli import main
from fxnx._models import example_inputs

TESTS = Path(__file__).parent
ROOT = TESTS.parent
FORM = re.escape("[NAME=]SHAPE[:DTYPE][:VALUES]")


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    *usage, line = err.splitlines()
    assert usage[0].startswith(f"usage: fxnx {argv[0]} ")
    return line


# --- several inputs, keyword inputs ------------------------------------------------------------


def test_keyword_inputs_are_keywords_of_forward(tmp_path, capsys):
    out = tmp_path / "g.pkl"
    argv = ["convert", "clifactories:masked", "--input", "2,3", "--input", "mask=2,2:int64:ones",
            "--dtype", "float64", "-o", str(out)]
    assert main(argv) == 0
    # The graph names its inputs from forward's signature, not from the command line.
    assert fxnx.read_pickle(out).graph["inputs"] == [
        {"name": "x", "shape": (2, 3), "dtype": "torch.float64"},
        {"name": "mask", "shape": (2, 2), "dtype": "torch.int64"},
    ]
    # Without the keyword, forward's default (None) holds and mask is no input of the graph.
    assert main(["convert", "clifactories:masked", "--input-shape", "2,3", "-o", str(out)]) == 0
    assert [i["name"] for i in fxnx.read_pickle(out).graph["inputs"]] == ["x"]


def test_credit_with_a_keyword_input_equals_autograd(tmp_path, capsys):
    """Values given as ones, so that the oracle can make the same inputs without fxnx."""
    argv = ["credit", "clifactories:masked", "--input", "2,3:ones", "--input", "mask=2,2:ones",
            "--dtype", "float64", "--graph", str(tmp_path / "g.pkl"), "-o", str(tmp_path / "g.dot")]
    assert main(argv) == 0
    norms = dict(fxnx.read_pickle(tmp_path / "g.pkl").nodes(data="credit_norm"))
    model = clifactories.masked().double()
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    gx, gmask = torch.autograd.grad(model(x, mask=mask).sum(), [x, mask])
    assert norms["x"] == pytest.approx(gx.norm().item(), rel=1e-12)
    assert norms["mask"] == pytest.approx(gmask.norm().item(), rel=1e-12)


def test_positional_inputs_keep_their_order(tmp_path, capsys):
    out = tmp_path / "g.pkl"
    # --input-shape is short for --input: both add a positional input, in the order given.
    assert main(["convert", "clifactories:product", "--input", "2,3", "--input-shape", "3,5",
                 "-o", str(out)]) == 0
    G = fxnx.read_pickle(out)
    assert [i["shape"] for i in G.graph["inputs"]] == [(2, 3), (3, 5)]
    assert {shape for *_, shape in G.in_edges("output", data="shape")} == {(2, 5)}  # (2,3)@(3,5)


def test_values_zeros_ones_and_randint_bounds():
    specs = [input_spec(t) for t in ("4:int64", "4:float64:ones", "5000:int64:randint=7",
                                     "5000:float64", "m=3:bool:ones")]
    args, kwargs = example_inputs(specs, torch.float32, seed=0)
    assert torch.equal(args[0], torch.zeros(4, dtype=torch.int64))
    assert torch.equal(args[1], torch.ones(4, dtype=torch.float64))
    assert sorted(args[2].unique().tolist()) == list(range(7))  # 0 to N-1, each drawn
    assert abs(args[3].mean().item()) < 0.1 and abs(args[3].std().item() - 1) < 0.1  # randn
    assert kwargs["m"].dtype == torch.bool and kwargs["m"].all()
    again, _ = example_inputs(specs, torch.float32, seed=0)
    other, _ = example_inputs(specs, torch.float32, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(args, again, strict=True))
    assert not torch.equal(args[3], other[3]) and not torch.equal(args[2], other[2])


def test_example_inputs_leave_the_global_random_state_alone():
    state = torch.get_rng_state()
    example_inputs([input_spec("100:randint=5"), input_spec("100")], torch.float32, seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_token_ids_below_the_vocabulary_fit_an_embedding(capsys):
    """clifactories:tokens embeds 10 tokens: randint=10 fits for every seed, randint=1000 not."""
    for seed in range(5):
        assert main(["convert", "clifactories:tokens", "--input", "4,3:int64:randint=10",
                     "--seed", str(seed)]) == 0
    capsys.readouterr()
    assert main(["convert", "clifactories:tokens", "--input", "4,3:int64:randint=1000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "IndexError: index out of range" in err


def test_credit_inputs_come_from_the_seed(tmp_path, capsys):
    """x's credit is mask times W^T 1: it changes with the random mask, so with the seed."""
    def norms(seed: str) -> dict:
        path = tmp_path / f"{seed}.pkl"
        assert main(["credit", "clifactories:masked", "--input", "2,3", "--input", "mask=2,2",
                     "--seed", seed, "--graph", str(path), "-o", str(tmp_path / "c.dot")]) == 0
        return dict(fxnx.read_pickle(path).nodes(data="credit_norm"))

    first = norms("0")
    assert norms("0") == first
    assert norms("1")["x"] != first["x"]


def test_randn_of_an_integer_dtype_is_one_line(capsys):
    assert main(["convert", "clifactories:tokens", "--input", "ids=4,3:int64:randn"]) == 1
    assert capsys.readouterr().err == (
        "fxnx convert: error: cannot make example input 'ids' of shape 4,3 and dtype torch.int64 "
        "from randn, which draws floats: give a float dtype, or randint=N, zeros or ones\n"
    )


BAD_INPUTS = {
    "shape": ("ids=1,x:int64", r"'1,x' is not a shape: give comma-separated integers .* \(in 'ids=1,x:int64'\)"),
    "dtype": ("1,16:lnog", rf"'lnog' in '1,16:lnog' is neither a torch dtype .* nor values .*: write {FORM}"),
    "name": ("2x=1,16", rf"'2x' in '2x=1,16' is not a keyword of forward .*: write {FORM}"),
    "empty name": ("=1,16", "'' in '=1,16' is not a keyword of forward"),
    "randint 0": ("1,16:int64:randint=0", "'randint=0' in '1,16:int64:randint=0': write randint=N with N a whole number of 1 or more"),
    "randint text": ("1,16:randint=many", "write randint=N"),
    "randint bare": ("1,16:randint", "write randint=N"),
    "randn=3": ("1,16:randn=3", "'randn=3' in '1,16:randn=3': randn takes no '=': write randn"),
    "too many fields": ("1,16:int64:ones:zeros", rf"'zeros' in '1,16:int64:ones:zeros' is one field too many: write {FORM}"),
    "values before dtype": ("1,16:ones:int64", "'int64' .* is one field too many"),
    "huge": ("100000,100000,3,3", "elements, more than"),
}


@pytest.mark.parametrize(("text", "message"), BAD_INPUTS.values(), ids=BAD_INPUTS)
def test_a_bad_input_names_the_token_and_the_form(text, message, capsys):
    line = _usage_error(["convert", "clifactories:tiny", "--input", text], capsys)
    assert line.startswith("fxnx convert: error: argument --input: ")
    assert re.search(message, line), line


def test_a_keyword_input_given_twice_is_a_usage_error(capsys):
    line = _usage_error(["credit", "clifactories:masked", "--input", "2,3", "--input", "mask=2,2",
                         "--input", "mask=2,2:ones"], capsys)
    assert line == ("fxnx credit: error: argument --input: the keyword input 'mask' is given "
                    "twice: give it once")


# --- without torch -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("error", "how"),
    [("ModuleNotFoundError", "is not installed: pip install torch"),
     ("ImportError", "fails to import (ImportError: No module named 'torch'): reinstall torch")],
)
@pytest.mark.parametrize("argv", [["convert", "resnet18"], ["credit", "clifactories:tiny"],
                                  ["convert", "resnet18", "--dtype", "int64"],
                                  ["convert", "resnet18", "--input", "ids=1,16:int64"],
                                  ["credit", "resnet18", "--rule", "usf"]],
                         ids=["convert", "credit", "dtype", "input", "rule"])
def test_without_torch_a_command_that_needs_it_says_so_in_one_line(argv, error, how):
    done = run_hiding(("torch",), *argv, error=error)
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"fxnx {argv[0]}: error: this command builds models with torch, which ")
    assert how in line and "fxnx info and fxnx draw work without it" in line


def test_without_torch_help_info_json_and_draw_work(tmp_path):
    fxnx.write_json(fxnx.convert(clifactories.tiny(), torch.zeros(1, 3)), tmp_path / "g.json")
    for argv in (["convert", "--help"], ["credit", "--help"], ["info", "--json", "g.json"],
                 ["draw", "g.json", "-o", "g.dot", "--rankdir", "LR"]):
        done = run_hiding(("torch", "torchvision"), *argv, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
    import json

    summary = json.loads(run_hiding(("torch",), "info", "--json", "g.json", cwd=tmp_path).stdout)
    assert summary["nodes"] == 3 and summary["num_params"] == 8  # Linear(3, 2): 3·2 + 2
    assert "rankdir=LR" in (tmp_path / "g.dot").read_text()


# --- Ctrl-C, SIGTERM and closed pipes ----------------------------------------------------------

_SLOW_TORCH = """
import os, sys, time
class _Slow:
    done = False
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not self.done:
            self.done = True
            open(os.environ["MARKER"], "w").close()
            for _ in range(30):  # 3 s unless stopped
                time.sleep(0.1)
        return None
sys.meta_path.insert(0, _Slow())
from fxnx._cli import main
raise SystemExit(main())
"""


@pytest.mark.parametrize(("signals", "code", "line"), [
    ([signal.SIGINT], 130, "fxnx: interrupted"),
    ([signal.SIGINT, signal.SIGINT], 130, "fxnx: interrupted"),  # the second stops the import
    ([signal.SIGTERM], 143, "fxnx: terminated"),
], ids=["ctrl-c", "ctrl-c twice", "sigterm"])
def test_a_signal_while_torch_imports_is_one_line(signals, code, line, tmp_path):
    marker = tmp_path / "importing"
    env = {**os.environ, "MARKER": str(marker),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_TORCH, "convert", "clifactories:tiny", "--input-shape", "4,3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.2)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (code, "", line + "\n")


def _info_process(path: Path, *, buffered: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([sys.executable, "-m", "fxnx", "info", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_reader_that_leaves_ends_the_command_quietly(buffered, tmp_path):
    path = tmp_path / "g.pkl"
    fxnx.write_pickle(fxnx.convert(clifactories.chain(), torch.zeros(1, 2)), path)
    proc = _info_process(path, buffered=buffered)
    proc.stdout.close()  # before anything is written: `fxnx info g.pkl | head -0`
    _, err = proc.communicate(timeout=120)
    # Before: with Python's default buffering, "Exception ignored ... BrokenPipeError", exit 120.
    assert (proc.returncode, err) == (128 + signal.SIGPIPE, b"")
    proc = _info_process(path, buffered=buffered)
    assert proc.stdout.readline().startswith(b"model ")  # `| head -1`
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 128 + signal.SIGPIPE) and err == b""


# --- warnings and errors during the progress line ----------------------------------------------

STATUS = re.escape("[1/1] clifactories:warns: building, tracing, propagating shapes…")
WARNING = "fxnx convert: warning: this model warns while it runs"


def test_a_warning_during_the_progress_line_has_its_own_line(capsys, monkeypatch):
    monkeypatch.setattr("fxnx._cli._interactive", lambda: True)
    assert main(["convert", "clifactories:warns", "--input-shape", "2,3"]) == 0
    lines = capsys.readouterr().err.split("\n")
    assert lines[-1] == ""
    assert re.fullmatch(STATUS, lines[0])  # the line as it stood when the warning came
    warned = [i for i, line in enumerate(lines) if "warning" in line]
    assert warned and all(lines[i] == WARNING for i in warned)
    assert re.fullmatch(STATUS + r" \d+\.\d s", lines[-2])  # shown again, then completed


def test_an_error_during_the_progress_line_has_its_own_line(capsys, monkeypatch):
    monkeypatch.setattr("fxnx._cli._interactive", lambda: True)
    assert main(["convert", "clifactories:exits_in_forward", "--input-shape", "2,3"]) == 1
    assert capsys.readouterr().err.split("\n") == [
        "[1/1] clifactories:exits_in_forward: building, tracing, propagating shapes…",
        "fxnx convert: error: the model's code called sys.exit(3)",
        "",
    ]


@pytest.mark.skipif(os.name != "posix", reason="needs a pseudo-terminal")
def test_on_a_terminal_the_warning_and_the_progress_line_stay_whole(tmp_path):
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fxnx", "convert", "clifactories:warns", "--input-shape", "2,3"],
        stdout=subprocess.PIPE, stderr=follower, env=env, cwd=tmp_path)
    os.close(follower)
    out, _ = proc.communicate(timeout=300)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.returncode == 0 and b"parameters            8" in out
    lines = b"".join(chunks).decode().split("\r\n")
    assert re.fullmatch(STATUS, lines[0]) and lines[1] == WARNING
    assert re.fullmatch(STATUS + r" \d+\.\d s", lines[-2]) and lines[-1] == ""
