"""Model names on the command line: torchvision, timm:NAME, hf:TYPE and hf:FOLDER, --config,
and the one line that names what to install when a package is missing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from clifactories import run_hiding

import fxnx
from fxnx._cli import main
from fxnx._models import load_model


def _parameters(summary: str) -> int:
    """The parameter count in a summary printed by fxnx convert."""
    (count,) = re.findall(r"^parameters +([\d,]+)$", summary, re.MULTILINE)
    return int(count.replace(",", ""))


def _one_error(argv, capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"fxnx {argv[0]}: error: ")
    return err.strip()


# --- a missing package is one line that names what to install -----------------------------------


def test_without_torchvision_a_torchvision_name_names_the_extra(tmp_path):
    """The "Done when" of issue 25: torch, networkx and pydot only."""
    done = run_hiding(("torchvision",), "convert", "resnet18", "--input-shape", "1,3,32,32")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "fxnx convert: error: model 'resnet18' is a torchvision name, and torchvision is not "
        "installed: pip install 'fxnx[vision]', or give your own model as package.module:factory\n"
    )
    broken = run_hiding(("torchvision",), "convert", "resnet18", error="ImportError")
    (line,) = broken.stderr.splitlines()
    assert line.startswith("fxnx convert: error: model 'resnet18' is a torchvision name, and "
                           "torchvision fails to import (ImportError: No module named")
    assert line.endswith(f"it must be a build made for torch {torch.__version__} "
                         "(pip install 'fxnx[vision]' picks one)")


def test_without_torchvision_and_matplotlib_the_library_and_the_cli_work(tmp_path):
    code = (
        "import torch, fxnx\n"
        "model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()).double()\n"
        "x = torch.randn(5, 3, dtype=torch.float64)\n"
        "G = fxnx.convert(model, x)\n"
        "res = fxnx.route_credit(G, model, x)\n"
        "x_ = x.clone().requires_grad_()\n"
        "(want,) = torch.autograd.grad(model(x_).sum(), x_)\n"
        "assert torch.equal(res.node_credit['input_1'], want)\n"
        "fxnx.draw(G, 'g.dot')\n"
        "from fxnx._cli import main\n"
        "raise SystemExit(main())\n"
    )
    done = run_hiding(("torchvision", "matplotlib"), "convert", "clifactories:tiny", "--input-shape",
                      "4,3", "-o", "t.pkl", code=code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "parameters            8" in done.stdout and (tmp_path / "g.dot").exists()


@pytest.mark.parametrize(("spec", "package"), [("timm:resnet18", "timm"), ("hf:bert", "transformers")])
def test_without_timm_or_transformers_their_names_say_what_to_install(spec, package):
    done = run_hiding((package,), "convert", spec)
    assert done.returncode == 1
    kind = "a timm name" if package == "timm" else "a Hugging Face model"
    assert done.stderr == (
        f"fxnx convert: error: model {spec!r} is {kind}, and {package} is not installed: pip "
        f"install {package}, or give your own model as package.module:factory\n"
    )


# --- torchvision and --config ------------------------------------------------------------------


def test_config_passes_keywords_to_torchvision(capsys):
    assert main(["convert", "resnet18", "--config", "num_classes=10"]) == 0
    # ResNet-18 has 11,689,512 parameters; its 512→1000 head becomes 512→10.
    assert _parameters(capsys.readouterr().out) == 11_689_512 - 513_000 + 5_130
    err = _one_error(["convert", "resnet18", "--config", "num_clases=10"], capsys)
    assert "cannot build 'resnet18': raised TypeError: " in err and "num_clases" in err


def test_config_passes_keywords_to_a_factory(capsys):
    assert main(["convert", "torch.nn:Linear", "--config", "in_features=3", "--config",
                 "out_features=5", "--config", "bias=False", "--input-shape", "2,3"]) == 0
    assert _parameters(capsys.readouterr().out) == 15  # 3·5, no bias


@pytest.mark.parametrize(("argv", "message"), [
    (["--config", "layers"], "argument --config: 'layers' is not KEY=VALUE: write for example "
                             "num_hidden_layers=2"),
    (["--config", "a=1", "--config", "a=2"], "argument --config: the option 'a' is given twice"),
    (["--config", "2a=1"], "is not KEY=VALUE"),
])
def test_a_bad_config_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "resnet18", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


# --- timm --------------------------------------------------------------------------------------


def test_timm_names_convert_and_credit(tmp_path, capsys):
    timm = pytest.importorskip("timm")
    out = tmp_path / "graphs"
    assert main(["convert", "timm:resnet18", "--config", "num_classes=7", "--input-shape",
                 "1,3,32,32", "-o", f"{out}/"]) == 0
    expected = sum(p.numel() for p in timm.create_model("resnet18", num_classes=7).parameters())
    assert _parameters(capsys.readouterr().out) == expected
    G = fxnx.read_pickle(out / "resnet18.pkl")
    assert G.graph["model"] == "timm.models.resnet.ResNet"
    assert {shape for *_, shape in G.in_edges("output", data="shape")} == {(1, 7)}
    # Credit without inputs takes timm's input size for the model: 224 for ResNet-18.
    assert main(["credit", "timm:resnet18", "-o", str(tmp_path / "c.dot")]) == 0
    assert "example inputs: 1,3,224,224:float32 (give --input to choose others)" in (
        capsys.readouterr().out)


def test_an_unknown_timm_name_suggests_close_ones(capsys):
    pytest.importorskip("timm")
    err = _one_error(["convert", "timm:resnt18"], capsys)
    assert re.search(r"unknown model 'timm:resnt18': not a timm model name \(did you mean "
                     r"resnet18, .*\); timm.list_models\(\) lists them$", err)


# --- Hugging Face ------------------------------------------------------------------------------


def test_a_model_type_converts_with_token_ids_below_its_vocabulary(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "bert.pkl"
    assert main(["convert", "hf:bert", "--config", "num_hidden_layers=1", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    # BERT's vocabulary has 30,522 tokens.
    assert text.startswith("example inputs: input_ids=1,16:int64:randint=30522 (give --input")
    ref = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1))
    assert _parameters(text) == sum(p.numel() for p in ref.parameters())
    G = fxnx.read_pickle(out)
    assert G.graph["model"] == "transformers.models.bert.modeling_bert.BertModel"
    assert [(i["name"], i["shape"]) for i in G.graph["inputs"] if i["shape"]] == [
        ("input_ids", (1, 16))]
    # The inputs given replace the default: an attention mask as a keyword input.
    assert main(["convert", "hf:bert", "--config", "num_hidden_layers=1", "--input",
                 "input_ids=2,8:int64:randint=30522", "--input", "attention_mask=2,8:int64:ones",
                 "-o", str(out)]) == 0
    assert "example inputs" not in capsys.readouterr().out
    assert [(i["name"], i["shape"]) for i in fxnx.read_pickle(out).graph["inputs"] if i["shape"]] == [
        ("input_ids", (2, 8)), ("attention_mask", (2, 8))]


def test_config_options_reach_the_constructor_which_derives_the_rest(capsys):
    """Llama derives head_dim from hidden_size / num_attention_heads when it is built: set
    afterwards, hidden_size=64 would keep the default's head_dim of 128 (4096 / 32)."""
    transformers = pytest.importorskip("transformers")
    small = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=100)
    argv = [f"--config={key}={value}" for key, value in small.items()]
    assert main(["convert", "hf:llama", *argv]) == 0
    ref = transformers.LlamaModel(transformers.LlamaConfig(**small))
    assert ref.layers[0].self_attn.q_proj.out_features == 64  # 2 heads of 32
    assert _parameters(capsys.readouterr().out) == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize(("argv", "inputs"), [
    (["hf:vit", "--config", "num_hidden_layers=1", "--config", "image_size=32", "--config",
      "patch_size=16"], "pixel_values=1,3,32,32:float32"),
    (["hf:t5", "--config", "num_layers=1", "--config", "num_decoder_layers=1", "--config",
      "vocab_size=100"], "input_ids=1,16:int64:randint=100 decoder_input_ids=1,16:int64:randint=100"),
], ids=["vit", "t5"])
def test_default_inputs_of_images_and_encoder_decoders(argv, inputs, capsys):
    pytest.importorskip("transformers")
    assert main(["convert", *argv, "--dtype", "float64"]) == 0
    assert capsys.readouterr().out.startswith(f"example inputs: {inputs.replace('float32', 'float64')} ")


def test_a_model_without_a_default_input_says_what_to_pass(capsys):
    pytest.importorskip("transformers")
    err = _one_error(["convert", "hf:whisper", "--config", "encoder_layers=1", "--config",
                      "decoder_layers=1"], capsys)
    assert re.search(r"fxnx makes no default example input for 'hf:whisper' \(its forward takes "
                     r"input_features, .*\): give them with --input NAME=SHAPE\[:DTYPE\]\[:VALUES\]$",
                     err)


@pytest.mark.parametrize(("argv", "message"), [
    (["hf:bret"], r"unknown model 'hf:bret': not a Hugging Face model type \(did you mean bert, "
                  r".*\); give a model type such as bert, gpt2 or vit, or a checkpoint folder as "
                  r"hf:\./FOLDER \(fxnx never downloads\)$"),
    (["hf:bert", "--config", "num_hiden_layers=1"],
     r"--config num_hiden_layers: the config of 'hf:bert' \(BertConfig\) has no attribute "
     r"'num_hiden_layers' \(did you mean num_hidden_layers\?\)$"),
    (["hf:./no-such-folder"], r"cannot load model 'hf:\./no-such-folder': no-such-folder is not a "
                              r"folder; give a folder written by save_pretrained"),
    (["hf:./empty"], r"empty has no config.json"),
], ids=["unknown type", "unknown config key", "no folder", "no config.json"])
def test_hugging_face_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert re.search(message, _one_error(["convert", *argv], capsys))


def _tiny_bert(transformers, architecture: str = "BertForMaskedLM"):
    config = transformers.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=32,
                                     intermediate_size=64, vocab_size=50)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return getattr(transformers, architecture)(config)


def test_a_checkpoint_folder_loads_its_own_weights_and_architecture(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    saved = _tiny_bert(transformers)
    saved.save_pretrained(tmp_path / "tiny-bert")
    model = load_model(f"hf:{tmp_path / 'tiny-bert'}")
    assert type(model) is transformers.BertForMaskedLM
    expected = saved.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    # From the command line, relative to the working folder; the graph is named after it.
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # transformers' own progress bars while saving
    assert main(["convert", "hf:./tiny-bert", "-o", "graphs/"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "randint=50 " in out.out
    G = fxnx.read_pickle(tmp_path / "graphs" / "tiny-bert.pkl")
    assert G.graph["model"] == "transformers.models.bert.modeling_bert.BertForMaskedLM"


def test_a_checkpoint_folder_without_weights_or_with_other_ones_warns(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    _tiny_bert(transformers).config.save_pretrained(tmp_path / "config-only")
    capsys.readouterr()
    assert main(["convert", f"hf:{tmp_path / 'config-only'}"]) == 0
    assert capsys.readouterr().err == (
        f"fxnx convert: warning: {tmp_path / 'config-only'} holds no weights (model.safetensors, "
        f"pytorch_model.bin): hf:{tmp_path / 'config-only'} has random weights\n"
    )
    # Weights of a BertModel, under a config that names a classifier: its head is random.
    _tiny_bert(transformers, "BertModel").save_pretrained(tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"]
    config["architectures"] = ["BertForSequenceClassification"]
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["convert", f"hf:{tmp_path / 'other'}"]) == 0
    assert capsys.readouterr().err == (
        "fxnx convert: warning: 2 weights of BertForSequenceClassification are not in "
        f"{tmp_path / 'other'} (or have another shape there) and are random: classifier.bias, "
        "classifier.weight\n"
    )
