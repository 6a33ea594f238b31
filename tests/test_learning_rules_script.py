"""scripts/learning_rules.py runs end to end: every rule trains, the table and figures appear."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "learning_rules.py"


def _load():
    spec = importlib.util.spec_from_file_location("learning_rules", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def test_every_rule_trains_and_the_outputs_are_written(tmp_path):
    script = _load()
    script.main(["--steps", "4", "--probe-every", "2", "--tasks", "teacher", "--out", str(tmp_path)])
    rows = [line for line in (tmp_path / "learning_rules.md").read_text().splitlines()
            if line.startswith("| teacher |")]
    assert [row.split("|")[2].strip() for row in rows] == script.RULES
    for name in ("learning_rules_loss.png", "learning_rules_alignment.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_with_the_exact_rule_lowers_the_loss_as_autograd_does():
    """The script's loop with rule="exact" gives the metric autograd training gives."""
    import torch

    script = _load()
    task = script.teacher_task(0)
    run = script.train(task, "exact", steps=20, seed=0, probe_every=20, angles=False)

    torch.manual_seed(0)
    model = task.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    batches = torch.Generator().manual_seed(1)
    for _ in range(20):
        idx = torch.randint(len(task.x_train), (task.batch,), generator=batches)
        opt.zero_grad()
        task.loss(model(task.x_train[idx]), task.y_train[idx]).backward()
        opt.step()
    with torch.no_grad():
        expected = float(task.metric(model(task.x_test), task.y_test))
    assert run.metric[-1] == pytest.approx(expected, rel=1e-5)
    assert run.metric[-1] < run.metric[0]
