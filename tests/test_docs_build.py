"""The API reference in docs/api builds without a warning and documents every public name.

The build is ``sphinx-build -W --keep-going -b html``, as CI runs it: a docstring that Sphinx
cannot read is a failure. The oracle for "documented" is the built HTML itself: every name in
``fxnx.__all__`` must have an entry (an element whose id is ``fxnx.NAME``) with a description,
so a new public name that no page lists, or one listed without a docstring, fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import fxnx

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "api"

pytest.importorskip("sphinx", reason="the docs extra (Sphinx) builds the API reference")


def sphinx_build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """Build ``source`` to HTML in ``out`` with warnings as errors; the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         "-d", str(out / ".doctrees"), str(source), str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )


class _Entries(HTMLParser):
    """Collect each documented object's id and the text of its own description.

    autodoc writes ``<dl class="py function"><dt id="fxnx.convert">signature</dt>
    <dd>description</dd></dl>``. A class's ``<dd>`` nests its members' ``<dl class="py ...">``,
    whose text belongs to the members, not the class; a field list (Parameters, Returns) is a
    ``<dl>`` too, but part of the description it sits in.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, str] = {}
        self._pending: str | None = None  # the id of the last object's <dt>, until its <dd>
        # The open <dl> and <dd> elements: ("dl", holds objects?) or ("dd", object id or "").
        self._stack: list[tuple[str, bool | str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "dl":
            self._stack.append(("dl", (attributes.get("class") or "").startswith("py ")))
        elif tag == "dt":  # an overloaded function has one <dt> per signature, the first with id
            ident = attributes.get("id") or ""
            if ident.startswith("fxnx."):
                self._pending = ident
        elif tag == "dd":
            ident = self._pending or ""
            self._stack.append(("dd", ident))
            if ident:
                self.entries[ident] = ""
            self._pending = None

    def handle_endtag(self, tag: str) -> None:
        if tag in ("dl", "dd"):
            while self._stack and self._stack.pop()[0] != tag:
                pass

    def handle_data(self, data: str) -> None:
        # The owner is the innermost object's <dd>, unless an object list opened inside it
        # (then the text is a member's signature, or a member's own description).
        for kind, value in reversed(self._stack):
            if kind == "dl" and value:
                return
            if kind == "dd" and value:
                self.entries[str(value)] += data
                return


def documented(html_dir: Path) -> dict[str, str]:
    """Every documented ``fxnx.*`` id in the built pages, with its description's text."""
    parser = _Entries()
    for page in sorted(html_dir.glob("*.html")):
        parser.feed(page.read_text(encoding="utf-8"))
    return {ident: " ".join(text.split()) for ident, text in parser.entries.items()}


def test_the_reference_builds_and_documents_every_public_name(tmp_path: Path):
    # One test for one build: under xdist a module fixture would build once per worker.
    done = sphinx_build(SOURCE, tmp_path)
    assert done.returncode == 0, f"sphinx-build failed:\n{done.stdout}\n{done.stderr}"
    assert done.stderr.strip() == "", done.stderr  # with -q, anything printed is a warning
    pages = {p.stem for p in tmp_path.glob("*.html")}
    assert {"index", "conversion", "analysis", "credit", "files", "drawing", "errors"} <= pages

    entries = documented(tmp_path)
    missing = [n for n in fxnx.__all__ if f"fxnx.{n}" not in entries]
    assert not missing, f"public names without an entry in docs/api/*.rst: {missing}"
    # A description of a few words at least: an entry without a docstring has none.
    bare = [n for n in fxnx.__all__ if len(entries[f"fxnx.{n}"]) < 20]
    assert not bare, f"public names documented without a description: {bare}"

    # Each docstring's opening words start its entry: autodoc read the code, not a copy
    # (inline literals lose their backquotes in HTML).
    for name in ["convert", "route_credit", "skip_connections", "read_pickle", "draw"]:
        opening = " ".join(getattr(fxnx, name).__doc__.replace("``", "").split()[:4])
        assert entries[f"fxnx.{name}"].startswith(opening), (name, opening)
    # numpydoc sections are rendered as fields, not left as raw underlined headings.
    assert "Parameters:" in entries["fxnx.convert"]
    assert "----------" not in entries["fxnx.convert"]


def test_a_warning_or_an_undocumented_name_fails(tmp_path: Path):
    """The two checks above can fail: a broken page fails the build, a dropped entry is seen."""
    source = tmp_path / "api"
    shutil.copytree(SOURCE, source)
    analysis = source / "analysis.rst"
    text = analysis.read_text(encoding="utf-8")
    assert ".. autofunction:: fxnx.census\n" in text
    analysis.write_text(
        text.replace(".. autofunction:: fxnx.census\n", ".. autofunction:: fxnx.no_such_name\n"),
        encoding="utf-8",
    )
    out = tmp_path / "html"
    done = sphinx_build(source, out)
    assert done.returncode != 0
    assert "no_such_name" in done.stderr
    # --keep-going wrote the pages anyway; census has no entry in them.
    entries = documented(out)
    assert "fxnx.census" not in entries
    assert "fxnx.skip_connections" in entries
