"""The wheel a user installs: complete, honest about its dependencies, and working outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a clean copy of the sources (a stale build/ folder could fill gaps)."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "out"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(out)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("fxnx-*.whl")
    return path


def test_every_package_and_module_of_the_checkout_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {
        str(p.relative_to(ROOT)) for p in (ROOT / "fxnx").rglob("*.py") if "__pycache__" not in p.parts
    }
    assert source, "no sources found"
    assert sorted(source - names) == []
    assert "fxnx/py.typed" in names
    assert "fxnx/_credit/__init__.py" in names  # the subpackage an explicit package list left out


def test_the_wheel_declares_ranges_not_pins(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    torch_req = [r for r in requires if r.startswith(("torch ", "torch>", "torch<", "torch="))]
    assert torch_req and all("==" not in r for r in requires), requires
    assert any(">=" in r and "<" in r for r in torch_req), torch_req


def test_the_installed_wheel_converts_and_routes_credit_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (site / "bin" / "fxnx").exists()  # the console script
    script = textwrap.dedent(
        f"""
        import sys, torch, fxnx
        assert fxnx.__file__.startswith({str(site)!r}), fxnx.__file__
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        model = model.double()
        x = torch.randn(5, 3, dtype=torch.float64)
        G = fxnx.convert(model, x)
        res = fxnx.route_credit(G, model, x, rule="exact")
        x_ = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(model(x_).sum(), x_)
        assert torch.equal(res.node_credit["input_1"], want)
        fa = fxnx.route_credit(G, model, x, rule="feedback_alignment")
        outside = [m for n, m in sys.modules.items() if n.startswith("fxnx")
                   and not getattr(m, "__file__", "").startswith({str(site)!r})]
        assert not outside, outside
        print(len(G), sorted(fa.feedback))
        """
    )
    # -S: no .pth files, so the development checkout's editable install cannot lend modules;
    # torch and the other dependencies come from this environment's site-packages.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    run = subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "5"  # input, three layers, output


def test_nothing_refers_to_files_outside_the_repository():
    """The project owns its design: docs/design.md and docs/graph.md, not a sibling folder."""
    outside = ("DESIGN" + ".md", "../" + "shared", "STYLE" + ".md")
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "dev.sh"] + [
        p for folder in ("fxnx", "tests", "scripts", "docs", ".ci")
        for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in ("", ".py", ".md", ".sh")
    ]
    hits = [f"{p.relative_to(ROOT)}: {word}" for p in files for word in outside if word in p.read_text()]
    assert hits == []
    assert (ROOT / "docs" / "design.md").exists() and (ROOT / "docs" / "graph.md").exists()


def test_the_wheel_carries_the_license_and_the_citation_matches_the_version(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    licences = [n for n in names if n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licences, names
    text = zipfile.ZipFile(wheel).read(licences[0]).decode()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text
    yaml = pytest.importorskip("yaml")
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    import fxnx

    assert citation["cff-version"] == "1.2.0" and citation["license"] == "MIT"
    assert citation["version"] == fxnx.__version__ and citation["title"].startswith("fxnx")
    assert all(key in citation for key in ("message", "authors"))


def test_version_prints_without_torch():
    import fxnx

    from blocktorch import run_without_torch

    proc = run_without_torch("from fxnx._cli import main; raise SystemExit(main(['--version']))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"fxnx {fxnx.__version__}"


@pytest.mark.slow
def test_the_wheel_installs_beside_a_cpu_torch_2_13_and_keeps_it(wheel, tmp_path):
    """A user's environment with the CPU build of torch 2.13.0: installing fxnx keeps that
    torch, brings neither torchvision nor matplotlib, and the library and the CLI work."""
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python, fxnx_cli = env_dir / "bin" / "python", env_dir / "bin" / "fxnx"

    def pip(*args: str) -> None:
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args],
                              capture_output=True, text=True, check=False, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]

    def installed() -> dict[str, str]:
        out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"],
                             capture_output=True, text=True, check=True).stdout
        import json

        return {p["name"].lower(): p["version"] for p in json.loads(out)}

    pip("torch==2.13.0")
    before = installed()
    if not before.get("torch", "").endswith("+cpu"):
        pytest.skip("the CPU wheel of torch 2.13.0 is not on this machine's local disk")
    pip(str(wheel))
    after = installed()
    assert after["torch"] == before["torch"] == "2.13.0+cpu"
    assert "torchvision" not in after and "matplotlib" not in after
    assert {"fxnx", "networkx", "pydot"} <= set(after)
    script = textwrap.dedent(
        """
        import shutil, torch, fxnx
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        model = model.double()
        x = torch.randn(5, 3, dtype=torch.float64)
        G = fxnx.convert(model, x)
        res = fxnx.route_credit(G, model, x)
        x_ = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(model(x_).sum(), x_)
        assert torch.equal(res.node_credit["input_1"], want)
        fxnx.write_pickle(G, "g.pkl")
        fxnx.draw(G, "g.svg" if shutil.which("dot") else "g.dot")
        print(torch.__version__)
        """
    )
    run = subprocess.run([str(python), "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         check=False, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "2.13.0+cpu"
    for args in (["info", "g.pkl"], ["draw", "g.pkl", "-o", "g2.dot"]):
        done = subprocess.run([str(fxnx_cli), *args], cwd=tmp_path, capture_output=True, text=True,
                              check=False, timeout=300)
        assert done.returncode == 0, done.stderr
    done = subprocess.run([str(fxnx_cli), "convert", "resnet18", "--input-shape", "1,3,32,32"],
                          cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "fxnx convert: error: model 'resnet18' is a torchvision name, and torchvision is not "
        "installed: pip install 'fxnx[vision]', or give your own model as package.module:factory"
    )
    assert "Traceback" not in done.stderr


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    import torch

    import fxnx

    path = tmp_path / "g.pkl"
    fxnx.write_pickle(fxnx.convert(torch.nn.Linear(3, 2), torch.zeros(1, 3)), path)
    proc = subprocess.Popen([sys.executable, "-m", "fxnx", "info", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first line (as `| head -0` does)
    _, err = proc.communicate(timeout=120)
    assert err == b"" and proc.returncode == 141
