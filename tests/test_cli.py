"""The fxnx command, called as a function and once as a real process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import clifactories
import pytest
import torch

import fxnx
from fxnx._cli import main

from blocktorch import run_without_torch
from conftest import needs_dot


def test_convert_writes_the_graph_and_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "sub" / "r18.pkl"
    assert main(["convert", "resnet18", "--input-shape", "1,3,64,64", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "skip connections      8 (5 identity, 3 with a projection; 0 other parallel branches)" in text
    assert "11,689,512" in text
    assert "call_module         60" in text
    G = fxnx.read_pickle(out)
    assert G.graph["inputs"][0]["shape"] == (1, 3, 64, 64)


def test_info_prints_the_summary_of_a_file(tmp_path, capsys):
    out = tmp_path / "r18.pkl"
    main(["convert", "resnet18", "--input-shape", "1,3,32,32", "-o", str(out)])
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert "torchvision.models.resnet.ResNet" in capsys.readouterr().out


def test_convert_without_shape_and_with_float64(capsys):
    assert main(["convert", "resnet18"]) == 0
    assert main(["convert", "resnet18", "--input-shape", "1,3,32,32", "--dtype", "float64"]) == 0


def test_own_model_by_factory(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\ndef tiny():\n    return torch.nn.Sequential(torch.nn.Linear(3, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["convert", "mymodels:tiny", "--input-shape", "4,3"]) == 0
    assert "parameters            8" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "resnet181"], "unknown model 'resnet181'.*did you mean resnet18"),
        (["convert", "nosuchpkg:make"], "cannot load model 'nosuchpkg:make'"),
        (["convert", "resnet18", "--input-shape", "1,1,64,64"], "fx node 'conv1'"),
        (["info", "missing.pkl"], "No such file"),
    ],
)
def test_bad_arguments_give_one_error_and_exit_1(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fxnx {argv[0]}: error: ")
    assert "Traceback" not in err
    import re

    assert re.search(message, err)


@pytest.mark.parametrize("shape", ["1,x", "1,-3", ""])
def test_malformed_shape_is_a_usage_error(shape, capsys):
    with pytest.raises(SystemExit) as info:
        main(["convert", "resnet18", "--input-shape", shape])
    assert info.value.code == 2
    assert "--input-shape" in capsys.readouterr().err


def test_help_on_every_command(capsys):
    for argv in (["--help"], ["convert", "--help"], ["info", "--help"], ["draw", "--help"],
                 ["credit", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    assert "torchvision model name" in capsys.readouterr().out


def test_real_process_convert_then_info_without_torch(tmp_path):
    out = tmp_path / "r18.pkl"
    done = subprocess.run(
        [sys.executable, "-m", "fxnx", "convert", "resnet18", "--input-shape", "1,3,32,32",
         "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    info = run_without_torch("from fxnx._cli import main; raise SystemExit(main())", "info", str(out))
    assert info.returncode == 0, info.stderr
    assert "skip connections      8" in info.stdout


@needs_dot
def test_batch_convert_to_a_folder_with_json_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fxnx._cli._interactive", lambda: True)
    out = tmp_path / "graphs"
    argv = ["convert", "resnet18", "mobilenet_v3_small", "--input-shape", "1,3,32,32",
            "-o", str(out), "--json", "--png"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "[1/2] resnet18" in captured.err and "[2/2] mobilenet_v3_small" in captured.err
    assert "== resnet18" in captured.out and "== mobilenet_v3_small" in captured.out
    for name in ("resnet18", "mobilenet_v3_small"):
        G = fxnx.read_pickle(out / f"{name}.pkl")
        assert G.graph["inputs"][0]["shape"] == (1, 3, 32, 32)
        assert fxnx.read_json(out / f"{name}.json").number_of_edges() == G.number_of_edges()
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_progress_stays_off_the_output_when_not_on_a_terminal(capsys):
    assert main(["convert", "resnet18"]) == 0
    assert capsys.readouterr().err == ""


def test_info_reads_json(tmp_path, capsys):
    main(["convert", "resnet18", "--input-shape", "1,3,32,32", "-o", str(tmp_path / "r.pkl"),
          "--json"])
    capsys.readouterr()
    assert main(["info", str(tmp_path / "r.json")]) == 0
    assert "skip connections      8" in capsys.readouterr().out


@needs_dot
def test_credit_routes_and_draws(tmp_path, capsys):
    out = tmp_path / "credit.png"
    argv = ["credit", "resnet18", "--input-shape", "2,3,32,32", "--rule", "feedback_alignment",
            "-o", str(out), "--graph", str(tmp_path / "g.pkl")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "rule feedback_alignment: exact on 49 nodes, feedback_alignment on 21 nodes" in text  # 60 + 9 + output - 21
    assert out.read_bytes()[:4] == b"\x89PNG"
    G = fxnx.read_pickle(tmp_path / "g.pkl")
    assert G.graph["credit_rule"] == "feedback_alignment"
    assert all(v > 0 for _, v in G.nodes(data="credit_norm") if v is not None)


@needs_dot
def test_draw_a_saved_graph_without_torch(tmp_path):
    main(["convert", "resnet50", "--input-shape", "1,3,32,32", "-o", str(tmp_path / "r.pkl")])
    code = "from fxnx._cli import main; raise SystemExit(main())"
    done = run_without_torch(code, "draw", str(tmp_path / "r.pkl"), "-o", str(tmp_path / "r.png"),
                             "--depth", "1")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    # DOT text is drawn within the PNG's bounds (collapsed as below) unless a depth is given.
    done = run_without_torch(code, "draw", str(tmp_path / "r.pkl"), "-o", str(tmp_path / "r.dot"))
    assert done.returncode == 0 and "layer4_2_conv3" not in (tmp_path / "r.dot").read_text()
    assert "collapsed below depth 2" in done.stderr
    done = run_without_torch(code, "draw", str(tmp_path / "r.pkl"), "-o", str(tmp_path / "r.dot"),
                             "--depth", "4")
    assert done.returncode == 0 and "layer4_2_conv3" in (tmp_path / "r.dot").read_text()
    # Collapsed for a readable PNG: said on one line of the command's own, no Python internals.
    done = run_without_torch(code, "draw", str(tmp_path / "r.pkl"), "-o", str(tmp_path / "r.png"))
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("fxnx draw: warning: torchvision.models.resnet.ResNet is too large")
    assert "collapsed below depth 2" in line and "(4 keeps every node)" in line
    assert "UserWarning" not in line and ".py" not in line


def test_draw_leaves_checks_out_unless_asked(tmp_path):
    class Checked(torch.nn.Module):
        def forward(self, x):
            torch._assert(x.shape[1] == 4, "four features")
            return x.relu()

    fxnx.write_pickle(fxnx.convert(Checked(), torch.zeros(2, 4)), tmp_path / "g.pkl")
    for extra, drawn in (([], False), (["--checks"], True)):
        assert main(["draw", str(tmp_path / "g.pkl"), "-o", str(tmp_path / "g.dot"), *extra]) == 0
        text = (tmp_path / "g.dot").read_text()
        assert ('"_assert"' in text) is drawn and '"relu"' in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["draw", "missing.pkl"], "No such file"),
     (["draw", "{pkl}", "--color-by", "credit_norm"], "run fxnx.route_credit on G first")],
)
@needs_dot
def test_draw_errors_are_one_line(argv, message, tmp_path, capsys):
    pkl = tmp_path / "g.pkl"
    main(["convert", "resnet18", "--input-shape", "1,3,32,32", "-o", str(pkl)])
    capsys.readouterr()
    argv = [a.replace("{pkl}", str(pkl)) for a in argv]
    assert main(argv) == 1
    import re

    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_convert_a_joint_graph_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "r18.pkl"
    args = ["convert", "resnet18", "--input-shape", "1,3,32,32", "--level", "joint", "-o", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert re.search(r"captured by\s+make_fx \(joint level\)", text)
    assert re.search(r"\n  convolution_backward\s+20\n", text)  # one per Conv2d of ResNet-18
    G = fxnx.read_pickle(out)
    assert G.graph["level"] == "joint" and G.graph["tangents"] == {"tangents_1": "output[0]"}


def test_routes_and_leaf_on_failure_from_the_command_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "gated_model.py").write_text(
        "import torch\n"
        "class Gate(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x if x.sum() > 0 else -x\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), Gate())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["convert", "gated_model:build", "--input-shape", "2,4", "--leaf-on-failure"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"captured by\s+symbolic_trace \(module level\)", text)
    assert re.search(r"opaque \(not traced\)\s+1\n", text)
    assert main(["convert", "gated_model:build", "--input-shape", "2,4", "--routes", "symbolic_trace"]) == 1
    assert "inside submodule '1'" in capsys.readouterr().err


# --- every failure is one line ------------------------------------------------------------------
#
# Each argv below once gave a traceback, a silent overwrite, exit 0 or minutes in Graphviz. Now
# each gives exit 1 with exactly one line on stderr, or argparse's usage error (exit 2: the usage
# text, then one error line). "{tmp}" is the test's folder, holding the files `bad_files` makes.

TINY = ["convert", "clifactories:tiny", "--input-shape", "4,3"]
SPEC = "give a torchvision model name .* or package.module:factory where factory\\(\\) returns a torch.nn.Module"

USAGE_ERRORS = {
    "huge shape": (["convert", "clifactories:tiny", "--input-shape", "100000,100000,3,3"],
                   "90,000,000,000 elements, more than the 1,073,741,824"),
    "huge int in shape": (["convert", "clifactories:tiny", "--input-shape", "9" * 30],
                          "elements, more than"),
    "empty shape": (["convert", "clifactories:tiny", "--input-shape", ""], "is not a shape"),
    "empty dimension": (["convert", "clifactories:tiny", "--input-shape", "1,,3"], "is not a shape"),
    "negative dimension": (["convert", "clifactories:tiny", "--input-shape", "-1"], "positive"),
    "zero dimension": (["convert", "clifactories:tiny", "--input-shape", "0"], "positive"),
    "non-ascii shape": (["convert", "clifactories:tiny", "--input-shape", "1,3,二"], "not a shape"),
    "dtype nn": ([*TINY, "--dtype", "nn"], "'nn' is not a torch dtype"),
    "dtype Tensor": ([*TINY, "--dtype", "Tensor"], "'Tensor' is not a torch dtype"),
    "dtype floaty": ([*TINY, "--dtype", "floaty"], "'floaty' is not a torch dtype"),
    "quantized dtype": ([*TINY, "--dtype", "qint8"], "'qint8' is not a torch dtype"),
    "non-ascii dtype": ([*TINY, "--dtype", "flöat32"], "is not a torch dtype"),
    "unknown route": ([*TINY, "--routes", "nope"], "unknown capture route 'nope'"),
    "empty route": ([*TINY, "--routes", "export,"], "unknown capture route ''"),
    "unknown level": ([*TINY, "--level", "deep"], "invalid choice: 'deep'"),
    "convert -o under a file": ([*TINY, "-o", "{tmp}/afile/g.pkl"], "afile is a file, not a folder"),
    "draw dpi -5": (["draw", "{tmp}/tiny.pkl", "--dpi", "-5"], "-5 is out of range: give 1 to 1200"),
    "draw dpi 0": (["draw", "{tmp}/tiny.pkl", "--dpi", "0"], "out of range"),
    "draw dpi 1201": (["draw", "{tmp}/tiny.pkl", "--dpi", "1201"], "out of range"),
    "draw dpi huge": (["draw", "{tmp}/tiny.pkl", "--dpi", "9" * 30], "out of range"),
    "draw dpi text": (["draw", "{tmp}/tiny.pkl", "--dpi", "high"], "'high' is not a whole number"),
    "draw depth 0": (["draw", "{tmp}/tiny.pkl", "--depth", "0"], "0 is out of range: give 1 or more"),
    "draw depth -1": (["draw", "{tmp}/tiny.pkl", "--depth", "-1"], "out of range"),
    "draw to jpeg": (["draw", "{tmp}/tiny.pkl", "-o", "{tmp}/x.jpeg"],
                     r"give a \.png, \.svg, \.pdf or \.dot"),
    "draw to a folder": (["draw", "{tmp}/tiny.pkl", "-o", "{tmp}/adir.png"], "is a folder"),
    "draw under a file": (["draw", "{tmp}/tiny.pkl", "-o", "{tmp}/afile/x.png"], "not a folder"),
    "credit dpi -5": (["credit", "clifactories:tiny", "--input-shape", "4,3", "--dpi", "-5"],
                      "out of range"),
    "credit depth 0": (["credit", "clifactories:tiny", "--input-shape", "4,3", "--depth", "0"],
                       "out of range"),
    "credit unknown rule": (["credit", "clifactories:tiny", "--input-shape", "4,3", "--rule", "nope"],
                            "unknown rule 'nope'; known rules: exact"),
    "credit graph under a file": (["credit", "clifactories:tiny", "--input-shape", "4,3", "--graph",
                                   "{tmp}/afile/g.pkl"], "not a folder"),
}

ERRORS = {
    "allocation failure": ([*TINY, "--dtype", "float8_e4m3fn"],
                           "cannot make an example input of shape 4,3 and dtype torch.float8_e4m3fn"),
    "factory returns a str": (["convert", "os:getcwd"],
                              f"'os:getcwd': getcwd\\(\\) returned a value of type str, .*; {SPEC}"),
    "factory returns 42": (["convert", "clifactories:returns_42"],
                           f"returned a value of type int, not a torch.nn.Module; {SPEC}"),
    "not callable": (["convert", "clifactories:NOT_CALLABLE"],
                     f"'clifactories:NOT_CALLABLE': NOT_CALLABLE is a value of type int, .*; {SPEC}"),
    "no such factory": (["convert", "clifactories:nothing"], f"clifactories has no 'nothing'; {SPEC}"),
    "import fails": (["convert", "climportfails:build"],
                     f"importing climportfails failed \\(raised RuntimeError: broken at import\\); {SPEC}"),
    "no such module": (["convert", "nosuchpkg:make"], "cannot load model 'nosuchpkg:make'"),
    "factory raises": (["convert", "clifactories:raises"],
                       f"raises\\(\\) raised RuntimeError: factory exploded; {SPEC}"),
    "factory calls sys.exit": (["convert", "clifactories:exits"],
                               f"'clifactories:exits': exits\\(\\) called sys.exit\\(0\\); {SPEC}"),
    "forward calls sys.exit": ([*TINY[:1], "clifactories:exits_in_forward", *TINY[2:]],
                               r"the model's code called sys.exit\(3\)"),
    "empty module name": (["convert", ":tiny"], "not of the form package.module:factory"),
    "empty factory name": (["convert", "clifactories:"], "not of the form package.module:factory"),
    "non-ascii model": (["convert", "modèle"], "unknown model 'modèle'"),
    "wrong shape": (["convert", "clifactories:tiny", "--input-shape", "4,5"],
                    "shape propagation failed at fx node '_0'.*; What to do"),
    "wrong shape, joint": (["convert", "clifactories:tiny", "--input-shape", "4,5", "--level", "joint"],
                           "'clifactories:tiny' failed with example input 4,5:float32: RuntimeError: "
                           "mat1 and mat2 shapes cannot be multiplied"),
    "ints into a Linear": ([*TINY, "--dtype", "int64"], "must have the same dtype"),
    "same factory name, -o folder": (["convert", "clifactories:build", "climore:build", "-o",
                                      "{tmp}/out"],
                                     "'clifactories:build' and 'climore:build' would both write "
                                     ".*out/build.pkl"),
    "same model twice, --json": (["convert", "clifactories:tiny", "clifactories:tiny", "--json"],
                                 "'clifactories:tiny' and 'clifactories:tiny' would both write "
                                 "tiny.json"),
    "torchvision name and factory": (["convert", "resnet18", "clitv:resnet18", "-o", "{tmp}/out"],
                                     "would both write .*resnet18.pkl"),
    "info missing file": (["info", "{tmp}/missing.pkl"], "No such file"),
    "info a folder": (["info", "{tmp}/adir"], "Is a directory"),
    "info a pickled int": (["info", "{tmp}/int.pkl"], "int.pkl"),
    "info a pickled list": (["info", "{tmp}/list.pkl"], "list.pkl"),
    "info an empty file": (["info", "{tmp}/empty.pkl"], "empty.pkl"),
    "info a text file": (["info", "{tmp}/text.pkl"], "text.pkl"),
    "info a JSON list": (["info", "{tmp}/list.json"], "list.json"),
    "info a JSON object": (["info", "{tmp}/object.json"], "object.json"),
    "info JSON not UTF-8": (["info", "{tmp}/latin1.json"], "latin1.json"),
    "info a graph fxnx did not write": (["info", "{tmp}/plain.pkl"], "plain.pkl"),
    "draw missing file": (["draw", "{tmp}/missing.pkl", "-o", "{tmp}/x.png"], "No such file"),
    "draw a pickled int": (["draw", "{tmp}/int.pkl", "-o", "{tmp}/x.png"], "int.pkl"),
    "draw PNG too big": (["draw", "{tmp}/chain.pkl", "--dpi", "1200", "-o", "{tmp}/x.png"],
                         "exceed Graphviz's 32767-pixel limit"),
    "credit bad factory": (["credit", "os:getcwd", "--input-shape", "4,3", "-o", "{tmp}/c.png"],
                           "not a torch.nn.Module"),
}


@pytest.fixture
def bad_files(tmp_path, monkeypatch):
    """Graph files that are not graphs, a folder, a file, and factory modules, in ``tmp_path``."""
    import pickle

    import networkx as nx

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "climportfails.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / "climore.py").write_text("from clifactories import build\n")
    (tmp_path / "clitv.py").write_text("from clifactories import tiny as resnet18\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir.png").mkdir()
    (tmp_path / "afile").write_text("a file")
    (tmp_path / "int.pkl").write_bytes(pickle.dumps(42))
    (tmp_path / "list.pkl").write_bytes(pickle.dumps([1, 2]))
    (tmp_path / "empty.pkl").write_bytes(b"")
    (tmp_path / "text.pkl").write_text("not a pickle\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "object.json").write_text('{"graph": 1}')
    (tmp_path / "latin1.json").write_bytes('{"n": "é"}'.encode("latin-1"))
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps(nx.MultiDiGraph([("a", "b")])))
    for name in ("tiny", "chain"):
        model = getattr(clifactories, name)()
        fxnx.write_pickle(fxnx.convert(model, torch.zeros(1, 3 if name == "tiny" else 2)),
                          tmp_path / f"{name}.pkl")
    return tmp_path


def _run(argv, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize(("argv", "message"), USAGE_ERRORS.values(), ids=USAGE_ERRORS)
def test_a_bad_option_is_a_usage_error(argv, message, bad_files, capsys):
    assert _run(argv, bad_files) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    *usage, line = err.splitlines()
    # argparse's form: "usage: fxnx <command> ..." wrapped over indented lines, then one error line.
    assert usage[0].startswith(f"usage: fxnx {argv[0]} ")
    assert all(part.startswith(" ") for part in usage[1:])
    assert line.startswith(f"fxnx {argv[0]}: error: argument ")
    assert re.search(message, line.replace(str(bad_files), "{tmp}")), line


@pytest.mark.parametrize(("argv", "message"), ERRORS.values(), ids=ERRORS)
@needs_dot
def test_an_error_is_one_line_and_exit_1(argv, message, bad_files, capsys):
    assert _run(argv, bad_files) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"fxnx {argv[0]}: error: ") and len(err.strip()) > len("fxnx : error:")
    assert re.search(message, err), err


def test_output_collisions_are_found_before_anything_is_written(bad_files, capsys):
    assert main(["convert", "clifactories:build", "climore:build", "-o", "out"]) == 1
    assert not (bad_files / "out").exists()


def test_a_factory_that_calls_sys_exit_is_not_a_success(bad_files, capsys):
    # Before: exit 0 and no output at all, as if the conversion had worked.
    assert main(["convert", "clifactories:exits"]) == 1


def test_interrupted_is_130_and_one_line(bad_files, capsys):
    assert main(["convert", "clifactories:interrupted"]) == 130
    assert capsys.readouterr().err == "fxnx convert: interrupted\n"


def test_an_unexpected_error_is_one_line_with_its_type(bad_files, capsys, monkeypatch):
    def broken(G):
        raise ZeroDivisionError("deep inside\nsecond line")

    monkeypatch.setattr("fxnx._cli.summary", broken)
    assert main(["info", "tiny.pkl"]) == 1
    assert capsys.readouterr().err == (
        "fxnx info: error: ZeroDivisionError: deep inside (set FXNX_TRACEBACK=1 to see the "
        "traceback)\n"
    )
    monkeypatch.setenv("FXNX_TRACEBACK", "1")
    assert main(["info", "tiny.pkl"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "in broken" in err and err.endswith("fxnx info: error: ZeroDivisionError: deep inside "
                                               "(set FXNX_TRACEBACK=1 to see the traceback)\n")


def test_integer_dtype_gives_token_ids_and_keeps_the_model_float(tmp_path, capsys):
    out = tmp_path / "tokens.pkl"
    assert main(["convert", "clifactories:tokens", "--input-shape", "4,3", "--dtype", "int64",
                 "-o", str(out)]) == 0
    G = fxnx.read_pickle(out)
    assert G.graph["inputs"] == [{"name": "input", "shape": (4, 3), "dtype": "torch.int64"}]
    # The embedding's output has the dtype of its weight: the model was not cast to int64.
    assert [d for _, _, d in G.edges(data="dtype")] == ["torch.int64", "torch.float32", "torch.float32"]
    assert main(["convert", "clifactories:tokens", "--input-shape", "4,3", "--dtype", "int32",
                 "--level", "joint"]) == 0


@needs_dot
def test_outputs_in_missing_folders_are_made(bad_files, capsys):
    assert main(["draw", "tiny.pkl", "-o", "new/deeper/t.svg"]) == 0
    assert (bad_files / "new" / "deeper" / "t.svg").read_text().lstrip().startswith("<?xml")
    assert main([*TINY, "-o", "more/t.pkl", "--json"]) == 0
    assert fxnx.read_json(bad_files / "more" / "t.json").number_of_nodes() == 3


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's read-only /proc")
@needs_dot
def test_an_unwritable_output_is_one_line(bad_files, capsys):
    for argv in ([*TINY, "-o", "/proc/fxnx-test/t.pkl"], ["draw", "tiny.pkl", "-o", "/proc/t.png"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "/proc/" in err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_folder_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(SystemExit) as info:
        main([*TINY, "-o", str(tmp_path / "ro" / "t.pkl")])
    assert info.value.code == 2
    assert "no permission to write in" in capsys.readouterr().err


def test_batch_outputs_with_dots_in_names_keep_their_stem(bad_files, capsys):
    assert main([*TINY, "-o", "my.model.pkl"]) == 0
    assert (bad_files / "my.model.pkl").exists()


def test_an_allocation_failure_is_one_line(capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 GB")

    monkeypatch.setattr("torch.randn", out_of_memory)
    assert main(["convert", "clifactories:tiny", "--input-shape", "1024,1024,1024"]) == 1
    assert capsys.readouterr().err == (
        "fxnx convert: error: cannot make an example input of shape 1024,1024,1024 and dtype "
        "torch.float32: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 4 GB; give a smaller shape or another dtype\n"
    )


def test_the_same_model_twice_without_outputs_is_converted_twice(capsys):
    assert main(["convert", "clifactories:tiny", "clifactories:tiny"]) == 0
    assert capsys.readouterr().out.count("== clifactories:tiny\n") == 2


def test_a_file_name_too_long_for_the_system_is_one_line(tmp_path, capsys):
    long = str(tmp_path / ("a" * 300 + ".png"))
    with pytest.raises(SystemExit) as exit_:
        main(["draw", str(tmp_path / "g.pkl"), "-o", long])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and "File name too long" in err


def test_credit_help_names_every_preset(capsys):
    """The --rule help is written out (the CLI imports no torch to print it): it must not drift."""
    with pytest.raises(SystemExit):
        main(["credit", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    named = help_text.split("credit rule preset: ")[1].split(" (default")[0].split(" --")[0]
    assert sorted(name.strip(" ,.") for name in named.split(", ")) == sorted(fxnx.credit.PRESETS)


def test_info_shows_the_cost_table_and_json(tmp_path, capsys):
    import json

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    path = tmp_path / "g.pkl"
    fxnx.write_pickle(fxnx.convert(model, torch.zeros(5, 3)), path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    # FLOPs by hand: 2·5·3·4 + 2·5·4·2 = 200; MACs half; 26 parameters.
    assert "FLOPs                 200 (0.00 G)" in out and "multiply-adds         100" in out
    assert "Module        Output shape  Params  Trainable  FLOPs  MACs" in out
    assert "Total parameters: 26 (trainable 26, frozen 0)" in out
    assert main(["info", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["costs"]["flops"] == 200 and data["costs"]["macs"] == 100
    # Live activations by hand: the peak holds _0's (5,4) and _1's (5,4) float32 outputs.
    assert data["memory"] == {"bytes": 160, "node": "_1", "saved_bytes": None}


# --- credit captures like convert; drawings in either direction ----------------------------------


@pytest.mark.parametrize("routes", ["symbolic_trace", "export"])
def test_credit_routes_follow_the_option_and_equal_autograd(routes, tmp_path, capsys):
    argv = ["credit", "clifactories:masked", "--input", "2,3:ones", "--input", "mask=2,2:ones",
            "--dtype", "float64", "--routes", routes, "--graph", str(tmp_path / "g.pkl"),
            "-o", str(tmp_path / "g.dot")]
    assert main(argv) == 0
    G = fxnx.read_pickle(tmp_path / "g.pkl")
    assert G.graph["capture"] == routes
    model = clifactories.masked().double()
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x, mask=torch.ones(2, 2, dtype=torch.float64)).sum(), x)
    inputs = {n for n, op in G.nodes(data="op") if op == "placeholder"}
    (x_node,) = [n for n in inputs if G.nodes[n]["credit_norm"] is not None and "mask" not in n]
    assert G.nodes[x_node]["credit_norm"] == pytest.approx(gx.norm().item(), rel=1e-12)


def test_credit_at_the_aten_level_is_the_library_s_one_line_refusal(tmp_path, capsys):
    argv = ["credit", "clifactories:tiny", "--input-shape", "4,3", "--level", "aten", "-o",
            str(tmp_path / "c.dot")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at level='module'" in err
    assert not (tmp_path / "c.dot").exists()


def test_credit_keeps_a_failing_submodule_whole_when_asked(tmp_path, capsys):
    argv = ["credit", "clifactories:gated", "--input-shape", "2,4", "--routes", "symbolic_trace",
            "-o", str(tmp_path / "c.dot"), "--graph", str(tmp_path / "g.pkl")]
    assert main(argv) == 1
    assert "inside submodule '1'" in capsys.readouterr().err
    assert main([*argv, "--leaf-on-failure"]) == 0
    G = fxnx.read_pickle(tmp_path / "g.pkl")
    assert G.graph["capture"] == "symbolic_trace"
    assert [n for n, opaque in G.nodes(data="opaque") if opaque] == ["_1"]


def test_convert_and_credit_share_their_model_input_and_capture_options():
    from fxnx._cli import _parser

    def options(command: str) -> dict:
        sub = _parser()._subparsers._group_actions[0].choices[command]
        return {a.option_strings[0]: (a.option_strings, a.dest, a.type, a.default, a.choices,
                                      a.help, type(a)) for a in sub._actions if a.option_strings}

    convert, credit = options("convert"), options("credit")
    shared = ["--config", "--input-shape", "--dtype", "--level", "--routes", "--leaf-on-failure"]
    assert {name: convert[name] for name in shared} == {name: credit[name] for name in shared}
    # --input too, but for the last words of its help: what each command does without inputs.
    assert convert["--input"][:5] == credit["--input"][:5]
    assert convert["--input"][5].split(" (without")[0] == credit["--input"][5].split(" (without")[0]


def _rankdir(path: Path) -> str | None:
    import pydot

    (graph,) = pydot.graph_from_dot_file(str(path))
    return graph.get_attributes().get("rankdir")


def test_draw_and_credit_take_a_layout_direction(bad_files, capsys):
    for extra, expected in (([], "TB"), (["--rankdir", "LR"], "LR"), (["--rankdir", "TB"], "TB")):
        assert main(["draw", "chain.pkl", "-o", "chain.dot", *extra]) == 0
        assert _rankdir(bad_files / "chain.dot") == expected
        assert main(["credit", "clifactories:tiny", "--input-shape", "4,3", "-o", "c.dot",
                     *extra]) == 0
        assert _rankdir(bad_files / "c.dot") == expected
    with pytest.raises(SystemExit) as exit_:
        main(["draw", "chain.pkl", "--rankdir", "RL"])
    assert exit_.value.code == 2
    assert "argument --rankdir: invalid choice: 'RL'" in capsys.readouterr().err


@needs_dot
def test_a_left_to_right_png_of_a_chain_is_wide(bad_files, capsys):
    """40 layers in a row: tall from top to bottom, wide from left to right."""
    import struct

    sizes = {}
    for rankdir in ("TB", "LR"):
        assert main(["draw", "chain.pkl", "-o", f"chain_{rankdir}.png", "--rankdir", rankdir]) == 0
        header = (bad_files / f"chain_{rankdir}.png").read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
        sizes[rankdir] = struct.unpack(">II", header[16:24])  # width, height
    (tb_width, tb_height), (lr_width, lr_height) = sizes["TB"], sizes["LR"]
    assert tb_height > 5 * tb_width and lr_width > 5 * lr_height


def test_a_file_that_cannot_be_written_keeps_none_of_the_others_from_being_written(tmp_path, capsys, monkeypatch):
    """One output failing (here a PNG refused) neither stops the other outputs of convert nor
    loses credit's graph: each is written, and the one error names what was not."""
    from fxnx._drawing import draw as drawing

    real = drawing.draw

    def refuse_png(G, path=None, **options):
        if str(path).endswith(".png"):
            raise fxnx.errors.FxnxValueError("too large for a readable PNG (refused here)")
        return real(G, path, **options)

    monkeypatch.setattr(drawing, "draw", refuse_png)
    out = tmp_path / "g.pkl"
    argv = ["convert", "resnet18", "--input-shape", "1,3,32,32", "-o", str(out), "--png", "--json"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "could not write 1 file" in captured.err and "g.png" in captured.err
    assert "Traceback" not in captured.err
    assert fxnx.read_pickle(out).number_of_nodes() == fxnx.read_json(tmp_path / "g.json").number_of_nodes()
    assert not (tmp_path / "g.png").exists()
    argv = ["credit", "resnet18", "--input-shape", "2,3,32,32", "-o", str(tmp_path / "c.png"),
            "--graph", str(tmp_path / "c.pkl")]
    assert main(argv) == 1
    assert fxnx.read_pickle(tmp_path / "c.pkl").graph["credit_rule"] == "exact"
