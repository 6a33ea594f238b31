"""scripts/bench_transport_floor.py and bench_rule_floor.py measure the rules they say they
measure: their hand-written rules give the router's gradients (checked before any timing),
and they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _run(script: str) -> list[str]:
    """The script's output lines, run small; it must exit cleanly."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--runs", "2", "--width", "8", "--depth", "3"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_floor_script_checks_its_sides_and_reports_each():
    sides = [line.split()[0] for line in _run("bench_transport_floor.py")[1:]]
    assert sides == ["router", "hooked", "hooked_W", "function", "plain"]


def test_the_rule_floor_script_checks_each_rule_against_the_router_and_reports_it():
    rules = [line.split()[0] for line in _run("bench_rule_floor.py")[2:]]
    assert rules == ["feedback_alignment", "usf", "frsf", "brsf", "direct_feedback_alignment"]
