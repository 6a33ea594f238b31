"""scripts/bench_transport_floor.py and bench_rule_floor.py measure the rules they say they
measure: their hand-written rules give the router's gradients (checked before any timing),
and they run."""

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


def test_the_rule_floor_script_checks_each_rule_against_the_router_and_reports_it():
    script = SCRIPT.with_name("bench_rule_floor.py")
    done = subprocess.run(
        [sys.executable, str(script), "--runs", "2", "--width", "8", "--depth", "3"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    rules = [line.split()[0] for line in done.stdout.splitlines()[2:]]
    assert rules == ["feedback_alignment", "usf", "frsf", "brsf", "direct_feedback_alignment"]
