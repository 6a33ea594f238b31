"""Tiny models and broken factories for the command-line tests (``clifactories:tiny``), and
:func:`run_hiding`, which runs the command line where some packages cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

_TESTS = Path(__file__).parent

_HIDE = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise {error}(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
"""


def run_hiding(hidden: tuple[str, ...], *argv: str, error: str = "ModuleNotFoundError",
               cwd: Path | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """Run ``fxnx *argv`` (or Python ``code``) in a fresh Python that cannot import the packages
    ``hidden``: as if they were not installed (``ModuleNotFoundError``) or broken (``error``)."""
    code = code or "from fxnx._cli import main\nraise SystemExit(main())\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_TESTS.parent), str(_TESTS)])}
    return subprocess.run(
        [sys.executable, "-c", _HIDE.format(hidden=hidden, error=error) + code, *argv],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )


#: An attribute that is not a factory.
NOT_CALLABLE = 5


def tiny() -> nn.Module:
    """Takes inputs of shape (N, 3)."""
    return nn.Sequential(nn.Linear(3, 2))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 2))


def tokens() -> nn.Module:
    """Takes token ids below 10."""
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))


def chain() -> nn.Module:
    """40 layers deep: too tall for a PNG at a high dpi."""
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(40)])


def returns_42() -> int:
    return 42


def raises() -> nn.Module:
    raise RuntimeError("factory exploded")


def exits() -> nn.Module:
    sys.exit(0)


def interrupted() -> nn.Module:
    raise KeyboardInterrupt


class _ExitsInForward(nn.Module):
    def forward(self, x):
        sys.exit(3)


def exits_in_forward() -> nn.Module:
    return _ExitsInForward()


class _Masked(nn.Module):
    """``forward(x, mask=None)``: a Linear(3, 2), multiplied by ``mask`` when one is given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x, mask=None):
        y = self.linear(x)
        return y if mask is None else y * mask


def masked() -> nn.Module:
    """The same weights on every call (seeded apart from the caller's random state)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _Masked()


class _Product(nn.Module):
    def forward(self, x, y):
        return x @ y


def product() -> nn.Module:
    """Two positional inputs: ``x @ y``."""
    return _Product()


class _Warns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        warnings.warn("this model warns while it runs", UserWarning, stacklevel=1)
        return self.linear(x)


def warns() -> nn.Module:
    """Warns from its forward, that is while it is converted."""
    return _Warns()


class _Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def gated() -> nn.Module:
    """A branch on a tensor's value: symbolic tracing fails in submodule '1'."""
    return nn.Sequential(nn.Linear(4, 4), _Gate())
