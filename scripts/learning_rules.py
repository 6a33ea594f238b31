"""The learning-rules benchmark: every credit rule fxnx knows, on two small data sets.

    python scripts/learning_rules.py                         # everything: 2 x 2 x 8 rules x 3 seeds
    python scripts/learning_rules.py --steps 300 --seeds 0   # a quick look
    python scripts/learning_rules.py --tasks digits --models cnn --rules exact usf

Both data sets are made here, offline (nothing is downloaded):

- ``digits``: scikit-learn's 8x8 digits (1,797 images shipped inside scikit-learn),
  scaled to [0, 1] and split 1,437 train / 360 test by a fixed permutation;
- ``mnist1d``: MNIST-1D (Greydanus, 2020), 4,000 train / 1,000 test sequences of
  length 40, generated from the ``mnist1d`` package's templates by its
  ``make_dataset`` (its default arguments, 5,000 samples).

Each data set is learned by an MLP and by a small CNN (``--models``). Every rule
(``--rules``) trains the same initial weights (per seed) on the same batches with
:class:`fxnx.CreditRouter`, plain SGD (no momentum) and one learning rate and weight
decay for every rule, backprop's; Kolen-Pollack and weight mirrors let their feedback
weights learn after each optimizer step (``router.update_feedback``), so that a mirror
reflects the weights the next step runs with, as Akrout et al.'s code and BioTorch's
do. The script writes into ``--out`` (default ``figures/``):

- ``learning_rules.md``: test error (mean and standard deviation over seeds), training
  loss, W-B angle, credit angle and seconds per data set, model and rule; the command and
  settings; BioTorch's published MNIST errors beside it, for orderings only;
- ``learning_rules_error.png``: test error over training per rule (mean over seeds);
- ``learning_rules_alignment.png``: the angle between each weight-transport node's
  feedback weights B and its weights W (mean over nodes), and the angle between each
  rule's weight credit and backprop's (mean over hidden layers), over training.

The packages (scikit-learn, mnist1d) come with the ``bench`` extra:
``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import fxnx  # noqa: E402

#: The rules compared, in the order of the table and the legends.
RULES = [
    "exact", "feedback_alignment", "usf", "brsf", "frsf", "direct_feedback_alignment",
    "kolen_pollack", "weight_mirror",
]
#: Short names for legends.
LABELS = dict(zip(RULES, ["BP", "FA", "uSF", "brSF", "frSF", "DFA", "KP", "WM"], strict=True))
#: Colour-blind-safe colours (Okabe-Ito, and Tol's wine for the eighth), one per rule;
#: line styles tell the families apart as well (random feedback solid, DFA dotted, sign
#: symmetry dashed, learned feedback dash-dotted).
COLOURS = dict(zip(RULES, [
    "#000000", "#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#D55E00", "#0072B2", "#882255",
], strict=True))
STYLES = dict(zip(RULES, ["-", "-", "--", "--", "--", ":", "-.", "-."], strict=True))
#: Rules whose nodes hold feedback weights B in place of W (``router.alignment()``).
TRANSPORT = ["feedback_alignment", "usf", "brsf", "frsf", "kolen_pollack", "weight_mirror"]
#: Rules whose feedback weights learn (``router.update_feedback``).
LEARNED = ("kolen_pollack", "weight_mirror")
TASKS = ["digits", "mnist1d"]
MODELS = ["mlp", "cnn"]

#: BioTorch's published test errors in % (Sanfiz & Akrout, 2021, BioTorch's Benchmarks.md):
#: MNIST with LeNet, and CIFAR-10 with LeNet under SGD, the latter with the learning rate of
#: each rule's config file in BioTorch's benchmark_configs/cifar10/le_net/sgd (momentum 0.9);
#: Kolen-Pollack and weight mirrors are not reported there.
BIOTORCH = {
    "exact": ("0.91", "14.23", "0.1"),
    "feedback_alignment": ("1.7", "46.69", "0.001"),
    "usf": ("0.94", "16.22", "0.1"),
    "brsf": ("0.91", "16.02", "0.1"),
    "frsf": ("0.97", "16.86", "0.1"),
    "direct_feedback_alignment": ("1.61", "54.21", "0.0001"),
    "kolen_pollack": ("not reported",) * 3,
    "weight_mirror": ("not reported",) * 3,
}


@dataclass
class Task:
    """A classification data set: flat inputs, labels, and the shape a CNN sees."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    image: tuple[int, ...]  # one sample's shape for a CNN, channels first


@dataclass
class Run:
    """What training one model with one rule from one seed produced."""

    task: str
    model: str
    rule: str
    seed: int
    losses: list[float] = field(default_factory=list)  # training loss per step
    steps: list[int] = field(default_factory=list)  # probe steps
    error: list[float] = field(default_factory=list)  # test error per probe
    wb_angle: list[float] = field(default_factory=list)  # mean W-B angle per probe
    credit_angle: list[float] = field(default_factory=list)  # weight credit vs backprop's
    seconds: float = 0.0

    @property
    def train_loss(self) -> float:
        """The mean training loss over the last 100 steps."""
        recent = self.losses[-100:]
        return sum(recent) / len(recent) if recent else float("nan")


def digits_task() -> Task | None:
    """scikit-learn's digits, scaled to [0, 1], split 1,437 / 360; None without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("digits skipped: scikit-learn is not installed (pip install -e '.[bench]')")
        return None
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return Task("digits", x[:1437], y[:1437], x[1437:], y[1437:], image=(1, 8, 8))


def mnist1d_task() -> Task | None:
    """MNIST-1D made from the package's templates (no download), 4,000 / 1,000; None without it."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        print("mnist1d skipped: mnist1d is not installed (pip install -e '.[bench]')")
        return None
    args = get_dataset_args()
    args.num_samples = 5000  # its default: 4,000 train, 1,000 test
    data = make_dataset(args)  # seeds numpy's global generator with args.seed
    return Task(
        "mnist1d",
        torch.tensor(data["x"], dtype=torch.float32), torch.tensor(data["y"]),
        torch.tensor(data["x_test"], dtype=torch.float32), torch.tensor(data["y_test"]),
        image=(1, 40),
    )


class ResidualMLP(nn.Module):
    """A hidden layer, a residual block around two more, a readout."""

    def __init__(self, d_in: int, hidden: int, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.block1 = nn.Linear(hidden, hidden)
        self.block2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.fc1(x))
        h = h + self.block2(F.relu(self.block1(h)))
        return self.out(F.relu(h))


class SmallCNN(nn.Module):
    """Two convolutions with ReLU, then a linear readout; 2-D for images, 1-D for sequences."""

    def __init__(self, image: tuple[int, ...], classes: int = 10) -> None:
        super().__init__()
        self.unflatten = nn.Unflatten(1, image)
        if len(image) == 3:  # 8x8 digits: 3x3 kernels, same size
            self.conv1 = nn.Conv2d(image[0], 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            features = 32 * image[1] * image[2]
        else:  # MNIST-1D: kernels of 5, stride 2 (40 -> 20 -> 10)
            self.conv1 = nn.Conv1d(image[0], 32, 5, stride=2, padding=2)
            self.conv2 = nn.Conv1d(32, 32, 5, stride=2, padding=2)
            features = 32 * image[1] // 4
        self.out = nn.Linear(features, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.conv1(self.unflatten(x)))
        h = F.relu(self.conv2(h))
        return self.out(torch.flatten(h, 1))


def make_model(task: Task, name: str) -> nn.Module:
    """``name`` ("mlp" or "cnn") for ``task``, initialised as BioTorch initialises.

    Every linear and convolution weight is drawn by ``xavier_uniform_`` and every bias is
    zero, as BioTorch does (Sanfiz & Akrout, 2021); fxnx draws the feedback weights B by
    the same law.
    """
    d_in = task.x_train.shape[1]
    model = ResidualMLP(d_in, 128 if d_in < 40 else 256) if name == "mlp" else SmallCNN(task.image)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    return model


@dataclass
class Settings:
    """What every run shares."""

    steps: int
    lr: float
    weight_decay: float
    batch: int
    probe_every: int
    probe_batch: int = 256


def train(task: Task, model_name: str, rule: str, seed: int, settings: Settings) -> Run:
    """Train ``model_name`` on ``task`` with ``rule`` from ``seed``'s initial weights and batches.

    Every rule sees the same initial weights and the same batches for a given seed; the
    seconds count the training steps only, not the probes.
    """
    torch.manual_seed(seed)
    model = make_model(task, model_name)
    G = fxnx.convert(model, task.x_train[: settings.batch])
    router = fxnx.CreditRouter(G, model, rule=rule, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    batches = torch.Generator().manual_seed(seed + 1)
    probe = torch.randperm(len(task.x_train), generator=torch.Generator().manual_seed(seed + 2))
    probe = probe[: settings.probe_batch]
    run = Run(task.name, model_name, rule, seed)
    router(task.x_train[: settings.batch])  # binds the rules, so that B is there at step 0's probe
    for step in range(settings.steps + 1):
        if step % settings.probe_every == 0 or step == settings.steps:
            _probe(run, step, G, model, router, task, task.x_train[probe], task.y_train[probe])
        if step == settings.steps:
            break
        idx = torch.randint(len(task.x_train), (settings.batch,), generator=batches)
        x, y = task.x_train[idx], task.y_train[idx]
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(router(x), y)
        loss.backward()
        opt.step()
        if rule in LEARNED:
            # After the step: a weight mirror then mirrors the W the next step runs with (mirrored
            # before it, B lags W by a step, and one seed of the digits CNN diverged). Kolen-Pollack's
            # B takes W's SGD step from W.grad, the same before or after (SGD leaves .grad alone).
            router.update_feedback(lr=settings.lr, weight_decay=settings.weight_decay)
        run.seconds += time.perf_counter() - start
        run.losses.append(loss.item())
    return run


def _probe(run: Run, step: int, G, model: nn.Module, router, task: Task, x: Tensor, y: Tensor) -> None:
    """Test error, the mean W-B angle, and the angle of the rule's weight credit to backprop's.

    The credit angle: both credits are routed by :func:`fxnx.route_credit` (no side
    effects) from the same credit at the output, d(loss)/d(logits) on a fixed batch of
    training samples, with the router's own feedback weights; the angle is averaged over
    the hidden layers' weights (the readout's credit is backprop's under every rule).
    """
    with torch.no_grad():
        run.error.append(float((model(task.x_test).argmax(1) != task.y_test).float().mean()))
    run.steps.append(step)
    angles = [a["angle"] for a in router.alignment().values()]
    run.wb_angle.append(statistics.fmean(angles) if angles else float("nan"))
    if run.rule == "exact":
        run.credit_angle.append(0.0)
        return
    out = model(x).detach().requires_grad_()
    (output_credit,) = torch.autograd.grad(F.cross_entropy(out, y), out)
    exact = fxnx.route_credit(G, model, x, output_credit=output_credit)
    ours = fxnx.route_credit(G, model, x, output_credit=output_credit, rule=run.rule,
                             seed=run.seed, feedback=router.feedback)
    aligned = fxnx.credit.credit_alignment(ours, exact, params=True)
    hidden = [name for name, p in model.named_parameters() if p.dim() > 1 and not name.startswith("out.")]
    run.credit_angle.append(statistics.fmean(aligned.get(n, {}).get("angle", float("nan")) for n in hidden))


def _mean(values: Sequence[float]) -> float:
    """The mean of the values that are numbers (a dead network's angles are NaN)."""
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


def failed(run: Run) -> bool:
    """Training failed: the loss over the last 100 steps is not finite or near chance's (ln 10)."""
    return not math.isfinite(run.train_loss) or run.train_loss > 2.0


def _spread(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _groups(runs: list[Run]) -> dict[tuple[str, str, str], list[Run]]:
    """Runs grouped by (task, model, rule), in the order they ran."""
    out: dict[tuple[str, str, str], list[Run]] = {}
    for run in runs:
        out.setdefault((run.task, run.model, run.rule), []).append(run)
    return out


def table(runs: list[Run]) -> str:
    """The results as a Markdown table: one row per data set, model and rule."""
    lines = [
        "| data set | model | rule | test error % (mean ± std) | training loss (last 100 steps) "
        "| W–B angle ° | credit angle ° | failed | steps | seconds |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (task, model, rule), group in _groups(runs).items():
        errors = [100 * run.error[-1] for run in group]
        wb = _mean([run.wb_angle[-1] for run in group])
        credit = _mean([run.credit_angle[-1] for run in group])
        lines.append(
            f"| {task} | {model} | {rule} | {_mean(errors):.2f} ± {_spread(errors):.2f} | "
            f"{_mean([run.train_loss for run in group]):.3f} | "
            f"{'–' if math.isnan(wb) else f'{wb:.1f}'} | {credit:.1f} | "
            f"{sum(map(failed, group))} of {len(group)} | {group[0].steps[-1]} | "
            f"{_mean([run.seconds for run in group]):.1f} |"
        )
    return "\n".join(lines)


def biotorch_table() -> str:
    """BioTorch's published test errors (MNIST; CIFAR-10 with its learning rates), for orderings only."""
    lines = [
        "| rule | BioTorch, MNIST, LeNet: test error % | BioTorch, CIFAR-10, LeNet, SGD: test error % "
        "| its learning rate there |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {rule} | {' | '.join(values)} |" for rule, values in BIOTORCH.items()]
    return "\n".join(lines)


def report(runs: list[Run], command: str, settings: Settings, seeds: Sequence[int]) -> str:
    """The Markdown file: settings, the table, BioTorch's figures."""
    return f"""# Learning rules

Written by `{command}` (torch {torch.__version__}, one CPU thread).
Settings shared by every rule: plain SGD (no momentum), learning rate {settings.lr},
weight decay {settings.weight_decay} (also given to `router.update_feedback`, called after
each optimizer step, for Kolen–Pollack and weight mirrors), batch {settings.batch}, {settings.steps} steps,
seeds {", ".join(map(str, seeds))}; Xavier-uniform weights, zero biases. Test error after
the last step; the angles are at the last probe (W–B: mean over weight-transport nodes;
credit: the rule's hidden-layer weight credit against backprop's on 256 training samples,
mean over layers; both averaged over the seeds where they are defined); failed: seeds whose
training loss over the last 100 steps is not finite or above 2.0 (chance: ln 10 = 2.30),
counted in the mean error all the same; seconds of training (probes excluded), mean over
seeds.

{table(runs)}

For the reader, BioTorch's published figures (Sanfiz & Akrout, 2021, BioTorch's
Benchmarks.md). These are **MNIST** and **CIFAR-10**, other data sets, models and training
schedules: compare the orderings of the rules, not the numbers. On CIFAR-10's LeNet, a CNN
without normalisation layers, feedback alignment and DFA trail backprop by 32 and 40 points
while the sign-symmetry variants stay within 3, and BioTorch trains them at learning rates 100
and 1,000 times below backprop's (its config files); here every rule has backprop's.

{biotorch_table()}
"""


def _panels(n: int, width: float = 3.5, height: float = 2.5) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(2, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.5), squeeze=False)
    cells = list(axes.flat)
    for ax in cells[n:]:
        ax.axis("off")
    return fig, cells[:n]


def _curve(ax: plt.Axes, group: list[Run], values: Callable[[Run], list[float]], rule: str) -> None:
    steps = group[0].steps
    series = [values(run) for run in group]
    mean = [_mean(column) for column in zip(*series, strict=True)]
    ax.plot(steps, mean, color=COLOURS[rule], ls=STYLES[rule], lw=1.3, label=LABELS[rule])


def _legend(fig: plt.Figure, rules: list[str]) -> None:
    handles = [plt.Line2D([], [], color=COLOURS[r], ls=STYLES[r], lw=1.5) for r in rules]
    fig.legend(handles, [LABELS[r] for r in rules], loc="upper center", ncol=len(rules),
               fontsize=8, frameon=False, handlelength=2.2, columnspacing=1.0)


def _style(ax: plt.Axes, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def plot_error(runs: list[Run], path: Path) -> None:
    """One panel per data set and model: test error per rule over training, mean over seeds."""
    groups = _groups(runs)
    pairs = list(dict.fromkeys((task, model) for task, model, _ in groups))
    rules = list(dict.fromkeys(rule for _, _, rule in groups))
    fig, cells = _panels(len(pairs))
    for ax, (task, model) in zip(cells, pairs, strict=True):
        for rule in rules:
            if (task, model, rule) in groups:
                _curve(ax, groups[task, model, rule], lambda run: [100 * e for e in run.error], rule)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        _style(ax, f"{task}, {model}", "test error (%)")
    _legend(fig, rules)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=200)
    plt.close(fig)


def plot_alignment(runs: list[Run], path: Path) -> None:
    """Per data set and model: the mean W-B angle over training, and each rule's credit angle.

    Left column: the angle between B and W (mean over weight-transport nodes) for the
    rules that hold B; Kolen-Pollack and weight mirrors should fall towards 0 degrees.
    Right column: the angle between each rule's hidden-layer weight credit and backprop's.
    """
    groups = _groups(runs)
    pairs = list(dict.fromkeys((task, model) for task, model, _ in groups))
    rules = [r for r in dict.fromkeys(rule for _, _, rule in groups) if r != "exact"]
    if not rules:
        return
    fig, cells = _panels(2 * len(pairs))
    for i, (task, model) in enumerate(pairs):
        left, right = cells[2 * i], cells[2 * i + 1]
        for rule in rules:
            group = groups.get((task, model, rule))
            if group is None:
                continue
            if rule in TRANSPORT:
                _curve(left, group, lambda run: run.wb_angle, rule)
            _curve(right, group, lambda run: run.credit_angle, rule)
        _style(left, f"{task}, {model}: B vs W", "angle (degrees)")
        _style(right, f"{task}, {model}: credit vs backprop's", "angle (degrees)")
        for ax in (left, right):
            ax.axhline(90, color="0.6", lw=0.8, ls=":")
            ax.set_ylim(0, 100)
            ax.set_yticks([0, 30, 60, 90])
    _legend(fig, rules)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=200)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8000, help="training steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    parser.add_argument("--lr", type=float, default=0.02, help="every rule's learning rate")
    parser.add_argument("--weight-decay", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--probe-every", type=int, default=200, help="steps between probes")
    parser.add_argument("--out", type=Path, default=Path("figures"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small models: threads cost more than they give
    settings = Settings(args.steps, args.lr, args.weight_decay, args.batch, args.probe_every)

    makers = {"digits": digits_task, "mnist1d": mnist1d_task}
    tasks = [task for name in args.tasks if (task := makers[name]())]
    runs: list[Run] = []
    start = time.perf_counter()
    for task in tasks:
        for model in args.models:
            for rule in args.rules:
                for seed in args.seeds:
                    run = train(task, model, rule, seed, settings)
                    runs.append(run)
                    print(f"{task.name:8s} {model:4s} {rule:26s} seed {seed}: test error "
                          f"{100 * run.error[-1]:5.2f} %, loss {run.train_loss:.3f} "
                          f"({run.seconds:.1f} s)", flush=True)
    print(f"{len(runs)} runs in {time.perf_counter() - start:.0f} s")
    if not runs:
        return 1

    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "scripts/learning_rules.py", *argv])
    (args.out / "learning_rules.md").write_text(report(runs, command, settings, args.seeds))
    print(table(runs))
    plot_error(runs, args.out / "learning_rules_error.png")
    plot_alignment(runs, args.out / "learning_rules_alignment.png")
    print(f"wrote {args.out / 'learning_rules.md'} and the figures beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
