"""What installing fxnx costs beside a user's torch, with and without each extra (issue 25).

Builds fxnx's wheel, then for each variant makes a fresh virtual environment holding the CPU
build of torch 2.13.0 (what a user may already have), installs the wheel with that extra, and
prints the time pip took, the environment's size before and after, and whether torch was
kept. Everything comes from the machine's local package indexes (pip's configuration); nothing
is downloaded from elsewhere.

Run: ``python scripts/install_sizes.py [--extras core vision plot frames]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = "torch==2.13.0"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *args], check=True)


def _torch_version(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", nargs="+", default=["core", "vision", "plot", "frames"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist = Path(tmp) / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(dist), str(ROOT)], check=True)
        wheel = next(dist.glob("fxnx-*.whl"))
        print("| install | seconds | environment before (MB) | after (MB) | added (MB) | torch kept |")
        print("| --- | ---: | ---: | ---: | ---: | --- |", flush=True)
        for extra in args.extras:
            venv = Path(tmp) / f"venv-{extra}"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            _pip(venv, BASE)
            before, torch_before = _size(venv), _torch_version(venv)
            spec = str(wheel) if extra == "core" else f"fxnx[{extra}] @ {wheel.as_uri()}"
            start = time.perf_counter()
            _pip(venv, spec)
            seconds = time.perf_counter() - start
            after = _size(venv)
            kept = _torch_version(venv) == torch_before
            name = "fxnx" if extra == "core" else f"fxnx[{extra}]"
            print(f"| {name} | {seconds:.1f} | {before / 1e6:,.0f} | {after / 1e6:,.0f} | "
                  f"{(after - before) / 1e6:,.0f} | {'yes' if kept else 'NO: ' + _torch_version(venv)} |",
                  flush=True)


if __name__ == "__main__":
    main()
