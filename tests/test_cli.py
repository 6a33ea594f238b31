"""The fxnx command, called as a function and once as a real process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import fxnx
from fxnx.cli import main

from blocktorch import run_without_torch


def test_convert_writes_the_graph_and_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "sub" / "r18.pkl"
    assert main(["convert", "resnet18", "--input-shape", "1,3,64,64", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "skip connections      8 (5 identity, 3 with a projection)" in text
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
        (["convert", "resnet18", "--input-shape", "1,3,64,64", "--dtype", "floaty"],
         "--dtype 'floaty' is not a torch dtype"),
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
    info = run_without_torch("from fxnx.cli import main; raise SystemExit(main())", "info", str(out))
    assert info.returncode == 0, info.stderr
    assert "skip connections      8" in info.stdout


def test_batch_convert_to_a_folder_with_json_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fxnx.cli._interactive", lambda: True)
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


def test_credit_with_an_unknown_rule_is_one_line(capsys):
    assert main(["credit", "resnet18", "--input-shape", "1,3,32,32", "--rule", "nope"]) == 1
    assert "unknown rule 'nope'; known rules:" in capsys.readouterr().err


def test_draw_a_saved_graph_without_torch(tmp_path):
    main(["convert", "resnet50", "--input-shape", "1,3,32,32", "-o", str(tmp_path / "r.pkl")])
    code = "from fxnx.cli import main; raise SystemExit(main())"
    done = run_without_torch(code, "draw", str(tmp_path / "r.pkl"), "-o", str(tmp_path / "r.png"),
                             "--depth", "1")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    done = run_without_torch(code, "draw", str(tmp_path / "r.pkl"), "-o", str(tmp_path / "r.dot"))
    assert done.returncode == 0 and "layer4_2_conv3" in (tmp_path / "r.dot").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["draw", "missing.pkl"], "No such file"),
     (["draw", "{pkl}", "-o", "x.jpeg"], r"give a \.png, \.svg, \.pdf or \.dot"),
     (["draw", "{pkl}", "--color-by", "credit_norm"], "run fxnx.route_credit on G first")],
)
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
