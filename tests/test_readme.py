"""The README runs: every code block, in order, in one namespace, as a user would run it.

Python blocks run in one namespace in a temporary working directory, so the files the README
writes land there. A line that is one expression and whose comment starts with a value
(``G.nodes["conv1"]["out_shape"]   # (1, 64, 112, 112)``) is a claim: the test evaluates the
expression and checks it equals that value, written by hand in the README. Shell blocks run
each ``fxnx ...`` line through the command's entry point, ``fxnx._cli.main``, and expect exit
code 0. A block that cannot run here is preceded in the README by a visible
``<!-- not run: why -->`` comment; those, and only those, are skipped, each listed as a
skipped test with its reason.

Beyond the README's own claims, the NetworkX path count it prints is checked here against
an independent count (enumerating the paths) and the hand count 2**8.
"""

from __future__ import annotations

import ast
import io
import re
import shlex
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import torch
import torchvision

import fxnx
from fxnx._cli import main as fxnx_main

from conftest import needs_dot

README = Path(__file__).resolve().parents[1] / "README.md"

FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>.*?)\s*-->\s*\Z", re.DOTALL)
SHELL = {"sh", "bash", "shell", "console"}

# The README's `mypackage.models:build` stands for the reader's own factory module; the
# test supplies one that fits the shapes the README passes (`--input-shape 8,16`, `2,16`).
FACTORY = """
import torch

def build():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
"""


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # the README line of the block's first line of code
    not_run: str | None  # the reason given in the README, for a block that is skipped


def readme_blocks(text: str) -> list[Block]:
    """The fenced code blocks of ``text`` in order, each with its ``not run`` reason, if any."""
    blocks = []
    for match in FENCE.finditer(text):
        line_before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(line_before)
        blocks.append(
            Block(
                lang=match["lang"],
                code=match["code"],
                line=text.count("\n", 0, match.start("code")) + 1,
                not_run=reason["why"] if reason else None,
            )
        )
    return blocks


def comments(code: str) -> dict[int, str]:
    """Line number (1-based) to the text of the comment on that line."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def claimed_value(comment: str) -> tuple[bool, Any]:
    """The value a comment starts with: the longest prefix that is a Python literal and is
    followed by the end, a space, ``:``, ``;`` or ``,``. ``(False, None)`` for prose."""
    for end in range(len(comment), 0, -1):
        if end < len(comment) and comment[end] not in " :;,":
            continue
        try:
            return True, ast.literal_eval(comment[:end])
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return False, None


@dataclass(frozen=True)
class Claim:
    line: int  # in the README
    source: str
    expected: Any


def run_python(block: Block, namespace: dict[str, Any]) -> list[Claim]:
    """Run a Python block statement by statement; check and return its claims.

    Line numbers are the README's, so a traceback shows the README line that failed.
    """
    code = "\n" * (block.line - 1) + block.code  # the README's line numbers
    notes = comments(code)
    checked = []
    for statement in ast.parse(code).body:
        where = f"README.md, line {statement.lineno}"
        source = ast.get_source_segment(code, statement) or ""
        one_line = statement.lineno == statement.end_lineno
        is_claim, expected = (
            claimed_value(notes[statement.lineno])
            if isinstance(statement, ast.Expr) and one_line and statement.lineno in notes
            else (False, None)
        )
        if not is_claim:
            module = ast.Module(body=[statement], type_ignores=[])
            exec(compile(module, str(README), "exec"), namespace)
            continue
        value = eval(compile(ast.Expression(statement.value), str(README), "eval"), namespace)
        assert type(value) is type(expected) and value == expected, (
            f"{where}: `{source}` gives {value!r}; the README says {expected!r}"
        )
        checked.append(Claim(statement.lineno, source, expected))
    return checked


def run_shell(block: Block) -> list[str]:
    """Run each ``fxnx ...`` command of a shell block in process; return the commands run."""
    ran = []
    for number, line in enumerate(block.code.splitlines()):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "fxnx", (
            f"README.md, line {block.line + number}: `{line.strip()}` is not an fxnx command; "
            "mark the block <!-- not run: why --> if it cannot run here"
        )
        code = fxnx_main(words[1:])
        assert code == 0, f"README.md, line {block.line + number}: `{line.strip()}` exited {code}"
        ran.append(" ".join(words))
    return ran


@needs_dot
def test_every_block_of_the_readme_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mypackage").mkdir()
    (tmp_path / "mypackage" / "__init__.py").write_text("")
    (tmp_path / "mypackage" / "models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)

    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    claims: list[Claim] = []
    commands: list[str] = []
    skipped: list[str] = []
    for block in blocks:
        if block.not_run is not None:
            skipped.append(f"line {block.line} ({block.lang}): {block.not_run}")
        elif block.lang == "python":
            claims += run_python(block, namespace)
        elif block.lang in SHELL:
            commands += run_shell(block)
        else:
            raise AssertionError(
                f"README.md, line {block.line}: a ```{block.lang} block is neither python nor "
                "shell; mark it <!-- not run: why --> if it is not code to run"
            )

    # The README documents fxnx with its examples: they stay, and so do their checks.
    assert len(claims) >= 15, [c.source for c in claims]
    assert len(commands) >= 8, commands
    assert len(skipped) <= 3, skipped
    # Files the README says it writes are there.
    for name in ["resnet18.png", "stages.png", "layer2.png"]:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
    assert "<svg" in (tmp_path / "stages.svg").read_text(encoding="utf-8")
    assert isinstance(fxnx.read_pickle(tmp_path / "resnet18.pkl"), nx.MultiDiGraph)


NOT_RUN_BLOCKS = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.not_run]


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=[f"line{b.line}" for b in NOT_RUN_BLOCKS])
def test_blocks_marked_not_run_are_listed_as_skipped(block):
    """Each block the README marks ``<!-- not run: why -->`` shows in pytest's skip summary."""
    pytest.skip(f"README.md, line {block.line}: not run: {block.not_run}")


def test_the_path_count_the_readme_prints_is_right():
    """The README's dynamic programme says ResNet-18 has 256 input-to-output paths.

    Oracles that share nothing with it: the hand count (8 basic blocks, each with a residual
    branch and a skip, each doubling the paths: 2**8), and NetworkX enumerating the paths.
    """
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    counting = next(b for b in blocks if "nx.topological_sort(G)" in b.code)
    assert re.search(r'^paths\["output"\]\s+# 256$', counting.code, re.MULTILINE)

    model = torchvision.models.resnet18(weights=None).eval()
    G = fxnx.convert(model, torch.randn(1, 3, 64, 64))
    blocks_with_two_branches = [
        s for s in fxnx.skip_connections(G) if len(s.branches) == 2
    ]
    assert len(blocks_with_two_branches) == 8
    enumerated = sum(1 for _ in nx.all_simple_paths(G, "x", "output"))
    assert enumerated == 2**8

    namespace: dict[str, Any] = {"G": G}
    run_python(counting, namespace)  # the README's own code, on this graph
    assert namespace["paths"]["output"] == enumerated


def test_not_run_markers_are_read_and_only_from_the_line_before():
    text = textwrap.dedent(
        """\
        Intro.

        <!-- not run: needs two processes -->
        ```python
        a = 1
        ```

        <!-- not run: a comment further up does not count -->
        Some prose.

        ```sh
        fxnx info g.pkl
        ```
        """
    )
    first, second = readme_blocks(text)
    assert (first.lang, first.code, first.line, first.not_run) == (
        "python", "a = 1\n", 5, "needs two processes"
    )
    assert (second.lang, second.line, second.not_run) == ("sh", 12, None)


@pytest.mark.parametrize(
    "comment, expected",
    [
        ("(1, 64, 56, 56)", (True, (1, 64, 56, 56))),
        ("(12845056, 'bn1'): ResNet-18, batch 2", (True, (12845056, "bn1"))),
        ('"merge"; nodes and edges on branches', (True, "merge")),
        ("8: forks and merges", (True, 8)),
        ("256", (True, 256)),
        ("the identity branch of the first block", (False, None)),
        ("{node: ReceptiveField(size, jump, start) or None}", (False, None)),
        ("{'kernel_size': (7, 7), ...}", (False, None)),
        ("3rd block", (False, None)),
    ],
)
def test_claims_are_comments_that_start_with_a_value(comment, expected):
    assert claimed_value(comment) == expected


def test_a_wrong_claim_fails_and_names_the_readme_line():
    block = Block("python", "x = [1, 2]\nlen(x)   # 3\n", line=40, not_run=None)
    with pytest.raises(AssertionError, match=r"line 41: `len\(x\)` gives 2; the README says 3"):
        run_python(block, {})
    # A value of another type is not the same claim: (1, 2) is not [1, 2].
    block = Block("python", "x = [1, 2]\nx   # (1, 2)\n", line=1, not_run=None)
    with pytest.raises(AssertionError, match="gives"):
        run_python(block, {})


def test_every_file_the_readme_links_to_exists():
    """Links and images with a relative target (figures, docs, the notebook) resolve."""
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert len(local) >= 10, local  # the figures at least: the pattern still finds links
    missing = sorted({t for t in local if not (README.parent / t).exists()})
    assert not missing, f"README.md links to files that do not exist: {missing}"
