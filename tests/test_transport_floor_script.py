"""scripts/bench_transport_floor.py measures the rule it says it measures: its hand-written
feedback alignment gives the router's gradients (checked before any timing), and it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_transport_floor.py"


def test_the_floor_script_checks_its_sides_and_reports_each():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "2", "--width", "8", "--depth", "3"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    sides = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert sides == ["router", "hooked", "hooked_W", "function", "plain"]
