"""Run a snippet in a fresh Python where importing torch (or torchvision) fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
