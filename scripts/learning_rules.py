"""Train small models with every credit rule fxnx knows and compare them.

    python scripts/learning_rules.py                  # both tasks, every rule, figures/ + table
    python scripts/learning_rules.py --steps 200      # shorter runs
    python scripts/learning_rules.py --tasks teacher  # one task

Two tasks, with data made here or shipped inside an installed package (nothing is downloaded):

- ``teacher``: a teacher-student regression. A fixed random two-layer tanh network
  (the teacher) labels Gaussian inputs; a deeper tanh MLP (the student) learns it.
- ``digits``: scikit-learn's 8x8 digits (1,797 images shipped with scikit-learn, the
  ``bench`` extra), classified by an MLP with a residual block, so the rules also have to
  route credit across a skip connection.

Each rule trains the same initial student with :class:`fxnx.CreditRouter` and SGD with
momentum. The script writes into ``--out`` (default ``figures/``):

- ``learning_rules.md``: the table (final training loss, test loss or error, steps, seconds);
- ``learning_rules_loss.png``: test loss (teacher) and test error (digits) per rule over training;
- ``learning_rules_alignment.png``: per layer, the angle between each rule's weight credit
  and the exact (backprop) weight credit over training on the teacher task. Lillicrap et al.
  (2016) saw feedback alignment start near 90 degrees and fall as the forward weights come
  to align with the fixed feedback weights.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import fxnx  # noqa: E402

#: The rules compared, in the order of the table and the legends.
RULES = ["exact", "feedback_alignment", "usf", "brsf", "frsf", "direct_feedback_alignment"]
#: Colour-blind-safe colours (Okabe-Ito), one per rule.
COLOURS = dict(zip(RULES, ["#000000", "#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#D55E00"], strict=True))


@dataclass
class Task:
    """A data set, a model factory and how to score it."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    make_model: object
    loss: object
    metric_name: str
    metric: object
    lr: float
    batch: int = 32


@dataclass
class Run:
    """What training one model with one rule produced."""

    rule: str
    steps: list[int] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)
    train_loss: float = float("nan")  # mean over the last 100 steps
    seconds: float = 0.0
    angles: dict[str, list[float]] = field(default_factory=dict)  # weight name -> angle per probe


class StudentMLP(nn.Module):
    """The student of the teacher task: four tanh layers."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        h = torch.tanh(self.fc3(h))
        return self.out(h)


class ResidualMLP(nn.Module):
    """The digits classifier: a hidden layer, a residual block around two more, a readout."""

    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.block1 = nn.Linear(hidden, hidden)
        self.block2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.fc1(x))
        h = h + self.block2(F.relu(self.block1(h)))
        return self.out(F.relu(h))


def teacher_task(seed: int) -> Task:
    """Gaussian inputs labelled by a fixed random tanh network, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    d_in, d_hidden, d_out = 30, 20, 10
    w1 = torch.randn(d_hidden, d_in, generator=g) / d_in**0.5
    w2 = torch.randn(d_out, d_hidden, generator=g) / d_hidden**0.5

    def label(x: Tensor) -> Tensor:
        return torch.tanh(x @ w1.T) @ w2.T

    x = torch.randn(4096 + 1024, d_in, generator=g)
    y = label(x) + 0.01 * torch.randn(len(x), d_out, generator=g)
    return Task(
        name="teacher", x_train=x[:4096], y_train=y[:4096], x_test=x[4096:], y_test=y[4096:],
        make_model=lambda: StudentMLP(d_in, 64, d_out), loss=F.mse_loss,
        metric_name="test MSE", metric=F.mse_loss, lr=0.02,
    )


def digits_task(seed: int) -> Task | None:
    """scikit-learn's digits, scaled to [0, 1], split 1,437 / 360; None without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("digits task skipped: scikit-learn is not installed (pip install -e '.[bench]')")
        return None
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]

    def error(logits: Tensor, target: Tensor) -> Tensor:
        return (logits.argmax(1) != target).float().mean()

    return Task(
        name="digits", x_train=x[:1437], y_train=y[:1437], x_test=x[1437:], y_test=y[1437:],
        make_model=ResidualMLP, loss=F.cross_entropy, metric_name="test error",
        metric=error, lr=0.02,
    )


def train(task: Task, rule: str, steps: int, seed: int, probe_every: int, angles: bool) -> Run:
    """Train ``task``'s model from the same initial weights with ``rule``; probe as it goes."""
    torch.manual_seed(seed)
    model = task.make_model()
    G = fxnx.convert(model, task.x_train[: task.batch])
    router = fxnx.CreditRouter(G, model, rule=rule, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    batches = torch.Generator().manual_seed(seed + 1)
    run = Run(rule)
    weights = [name for name, p in model.named_parameters() if p.dim() == 2]
    elapsed = 0.0
    recent: list[float] = []
    for step in range(steps + 1):
        if step % probe_every == 0 or step == steps:
            with torch.no_grad():
                run.metric.append(float(task.metric(model(task.x_test), task.y_test)))
            run.steps.append(step)
        if step == steps:
            break
        idx = torch.randint(len(task.x_train), (task.batch,), generator=batches)
        x, y = task.x_train[idx], task.y_train[idx]
        if angles and step % probe_every == 0:
            _probe_angles(run, G, model, router, task, x, y, weights, seed)
        start = time.perf_counter()
        opt.zero_grad()
        loss = task.loss(router(x), y)
        router.backward(loss)
        opt.step()
        elapsed += time.perf_counter() - start
        recent = [*recent[-99:], loss.item()]
    run.train_loss = sum(recent) / max(1, len(recent))
    run.seconds = elapsed
    return run


def _probe_angles(
    run: Run, G, model: nn.Module, router, task: Task, x: Tensor, y: Tensor,
    weights: list[str], seed: int,
) -> None:
    """Angle between the rule's and backprop's weight credit, per layer, on one batch.

    Both are routed by :func:`fxnx.route_credit` (no side effects) from the same credit
    at the output, d(loss)/d(output) computed here by autograd, with the router's own
    feedback weights.
    """
    out = model(x).detach().requires_grad_()
    (output_credit,) = torch.autograd.grad(task.loss(out, y), out)
    exact = fxnx.route_credit(G, model, x, output_credit=output_credit)
    ours = fxnx.route_credit(G, model, x, output_credit=output_credit, rule=run.rule,
                             seed=seed, feedback=router.feedback)
    aligned = fxnx.credit_alignment(ours, exact, params=True)
    for name in weights:
        run.angles.setdefault(name, []).append(aligned.get(name, {}).get("angle", float("nan")))


def table(results: dict[str, list[Run]], tasks: dict[str, Task]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| task | rule | steps | training loss (last 100 steps) | final test metric | seconds |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        for run in runs:
            lines.append(
                f"| {name} | {run.rule} | {run.steps[-1]} | {run.train_loss:.4f} | "
                f"{tasks[name].metric_name} {run.metric[-1]:.4f} | {run.seconds:.1f} |"
            )
    return "\n".join(lines)


def plot_loss(results: dict[str, list[Run]], tasks: dict[str, Task], path: Path) -> None:
    """One panel per task: the test metric per rule over training."""
    fig, axes = plt.subplots(1, len(results), figsize=(3.4 * len(results), 2.8), squeeze=False)
    for ax, (name, runs) in zip(axes[0], results.items(), strict=True):
        for run in runs:
            ax.plot(run.steps, run.metric, label=run.rule, color=COLOURS[run.rule], lw=1.4)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(tasks[name].metric_name)
        if name == "teacher":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)


def plot_alignment(runs: list[Run], path: Path) -> None:
    """One panel per rule: the angle per hidden layer's weight over training.

    Exact credit (0 degrees everywhere) and the readout layer (its weight credit is the
    exact one under every rule: 0 degrees) are left out.
    """
    runs = [run for run in runs if run.rule != "exact" and run.angles]
    cols = 3
    rows = -(-(len(runs) + 1) // cols)  # one cell more for the legend
    fig, axes = plt.subplots(rows, cols, figsize=(7.0, 2.2 * rows), sharey=True, squeeze=False)
    cells = list(axes.flat)
    hidden = list(runs[0].angles)[:-1]  # the readout's weight credit is exact: 0 degrees
    for ax, run in zip(cells, runs, strict=False):
        probes = run.steps[: len(run.angles[hidden[0]])]
        for i, name in enumerate(hidden):
            ax.plot(probes, run.angles[name], label=name.removesuffix(".weight"), lw=1.3,
                    color=plt.cm.viridis(i / max(1, len(hidden) - 1) * 0.85))
        ax.set_title(run.rule.replace("_", " "), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.axhline(90, color="0.6", lw=0.8, ls=":")
        ax.set_ylim(0, 100)
        ax.set_yticks([0, 30, 60, 90])
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("angle (degrees)")
    handles, labels = cells[0].get_legend_handles_labels()
    for ax in cells[len(runs):]:
        ax.axis("off")
    cells[-1].legend(handles, labels, loc="center", fontsize=8, frameon=False,
                     title="hidden layer's weight credit\nvs backprop's (teacher task)",
                     title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps per rule")
    parser.add_argument("--tasks", nargs="+", default=["teacher", "digits"],
                        choices=["teacher", "digits"])
    parser.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    parser.add_argument("--probe-every", type=int, default=50, help="steps between probes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small models: threads cost more than they give

    makers = {"teacher": teacher_task, "digits": digits_task}
    tasks = {name: task for name in args.tasks if (task := makers[name](args.seed))}
    results: dict[str, list[Run]] = {}
    for name, task in tasks.items():
        for rule in args.rules:
            run = train(task, rule, args.steps, args.seed, args.probe_every,
                        angles=name == "teacher")
            results.setdefault(name, []).append(run)
            print(f"{name:8s} {rule:26s} {task.metric_name} {run.metric[-1]:.4f} "
                  f"({run.seconds:.1f} s)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results, tasks)
    (args.out / "learning_rules.md").write_text(
        f"# Learning rules ({args.steps} steps, seed {args.seed}; "
        "`python scripts/learning_rules.py`)\n\n" + text + "\n"
    )
    print(text)
    plot_loss(results, tasks, args.out / "learning_rules_loss.png")
    if "teacher" in results:
        plot_alignment(results["teacher"], args.out / "learning_rules_alignment.png")
    print(f"wrote {args.out / 'learning_rules.md'} and the figures beside it")


if __name__ == "__main__":
    main()
