"""scripts/learning_rules.py runs end to end: the rules train, the table and figures appear."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "learning_rules.py"

pytest.importorskip("sklearn")
pytest.importorskip("mnist1d")


def _load():
    spec = importlib.util.spec_from_file_location("learning_rules", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def test_the_rules_train_and_the_outputs_are_written(tmp_path):
    script = _load()
    rules = ["exact", "direct_feedback_alignment", "kolen_pollack", "weight_mirror"]
    assert script.main(["--steps", "20", "--probe-every", "10", "--seeds", "0", "--rules", *rules,
                        "--out", str(tmp_path)]) == 0
    text = (tmp_path / "learning_rules.md").read_text()
    rows = [line.split("|")[1:4] for line in text.splitlines() if line.startswith(("| digits |", "| mnist1d |"))]
    assert [[cell.strip() for cell in row] for row in rows] == [
        [task, model, rule] for task in ("digits", "mnist1d") for model in ("mlp", "cnn") for rule in rules
    ]
    assert "python scripts/learning_rules.py --steps 20" in text
    for name in ("learning_rules_error.png", "learning_rules_alignment.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_exact_rule_trains_as_autograd_does(model):
    """The script's loop with rule="exact" gives plain autograd SGD's losses, bit for bit."""
    import torch
    import torch.nn.functional as F

    script = _load()
    task = script.digits_task()
    settings = script.Settings(steps=10, lr=0.05, weight_decay=1e-3, batch=32, probe_every=10)
    run = script.train(task, model, "exact", seed=3, settings=settings)

    torch.manual_seed(3)
    net = script.make_model(task, model)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, weight_decay=1e-3)
    batches = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(10):
        idx = torch.randint(len(task.x_train), (32,), generator=batches)
        opt.zero_grad()
        loss = F.cross_entropy(net(task.x_train[idx]), task.y_train[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert run.losses == losses
    assert losses[-1] < losses[0]


def test_learned_feedback_learns_after_the_optimizer_step(monkeypatch):
    """Weight mirrors mirror the W that the next step runs with: update_feedback follows
    opt.step, as in Akrout et al.'s code and BioTorch's (called between the backward pass and
    the step, B lagged W by one step, and one seed of the digits CNN diverged)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import fxnx

    script = _load()
    calls = []
    update = fxnx.CreditRouter.update_feedback

    def recorded(self, *args, **kwargs):
        calls.append("update_feedback")
        return update(self, *args, **kwargs)

    monkeypatch.setattr(fxnx.CreditRouter, "update_feedback", recorded)
    handle = register_optimizer_step_post_hook(lambda *_: calls.append("step"))
    try:
        settings = script.Settings(steps=3, lr=0.02, weight_decay=1e-3, batch=8, probe_every=10)
        script.train(script.digits_task(), "mlp", "weight_mirror", seed=0, settings=settings)
    finally:
        handle.remove()
    assert calls == ["step", "update_feedback"] * 3
