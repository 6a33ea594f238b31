"""The same model gives byte-identical files in two processes (issue 26, item 5).

Within one process, a graph could be stable by accident (a dict filled in the same order, an
id() reused); a second interpreter, with its own hash seed, is the oracle that catches it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys, warnings
import torch, torchvision, fxnx
warnings.simplefilter("ignore")
torch.manual_seed(0)
level, out = sys.argv[1], sys.argv[2]
G = fxnx.convert(torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32), level=level)
fxnx.skip_connections(G, "all")
fxnx.write_pickle(G, out + ".pkl")
fxnx.write_json(G, out + ".json")
fxnx.write_graphml(G, out + ".graphml")
fxnx.draw(G, out + ".dot")
"""


@pytest.mark.parametrize("level", ["module", "aten"])
def test_two_processes_write_the_same_bytes(tmp_path, level):
    outs = []
    for seed in ("1", "2"):  # different hash seeds: set and dict orders of str keys differ
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = str(tmp_path / f"run{seed}")
        subprocess.run([sys.executable, "-c", SCRIPT, level, out], check=True, env=env,
                       timeout=300)
        outs.append(out)
    for suffix in (".pkl", ".json", ".graphml", ".dot"):
        first, second = (open(o + suffix, "rb").read() for o in outs)
        assert first == second, f"{suffix} differs between two processes"
        assert len(first) > 1000
