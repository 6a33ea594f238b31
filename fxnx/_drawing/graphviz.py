"""The Graphviz run: DOT text laid out by ``dot`` once per format, and the :class:`Drawing`
that holds it, shown inline by notebooks."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import FxnxError, FxnxValueError, GraphvizNotFoundError
from .._files import atomic_write
from .fit import MAX_PIXELS

#: The file suffixes draw writes: images through Graphviz, or DOT text.
FORMATS = ("png", "svg", "pdf", "dot", "gv")


#: How to install Graphviz, for the errors that need it.
INSTALL = ("Install it with: apt-get install graphviz (Debian/Ubuntu), brew install graphviz "
           "(macOS) or conda install graphviz.")


#: Seconds one dot run may take before draw() gives up and names a depth that will work.
DOT_TIMEOUT = 120.0


class Drawing:
    """A drawing of a graph, made by :func:`draw` without a path: shown inline in notebooks.

    It holds the DOT text that Graphviz's ``dot`` lays out (:attr:`dot`), with
    every attribute :func:`draw` gives dot, and renders it on first use, once
    per format: :attr:`svg` and :attr:`png`; :meth:`save` writes a file. In a
    notebook it shows as SVG; without Graphviz, or where the layout fails,
    it shows what went wrong and how to install Graphviz instead of raising.

    Attributes
    ----------
    dot : str
        The DOT text: ``dot -Tpng`` on it makes :attr:`png`.
    depth : int or None
        The depth modules are collapsed below; None when every node is drawn.
    dpi : int
        The resolution of :attr:`png`.

    Examples
    --------
    >>> import torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> d = fxnx.draw(G)
    >>> d.dot.startswith("digraph fxnx"), d.depth
    (True, None)
    """

    def __init__(self, dot: str, *, name: str, nodes: int, depth: int | None, dpi: int,
                 advice: Callable[[], str], work: tuple[int, int]) -> None:
        self.dot = dot
        self.depth = depth
        self.dpi = dpi
        self._name, self._nodes = name, nodes
        self._advice = advice  # what to do when the layout is too slow: names a depth
        self._work = work  # nodes and virtual nodes, for that error
        self._rendered: dict[str, bytes | FxnxError] = {}

    def __repr__(self) -> str:
        detail = "every node" if self.depth is None else f"modules below depth {self.depth} collapsed"
        return f"<fxnx.Drawing of {self._name}: {self._nodes} nodes, {detail}>"

    @property
    def svg(self) -> str:
        """The drawing as SVG text, rendered by Graphviz's ``dot`` on first use.

        Raises
        ------
        GraphvizNotFoundError
            Graphviz's ``dot`` is not installed.
        FxnxValueError
            Graphviz failed or did not finish the layout within two minutes.
        """
        return self._render("svg", "the drawing's SVG").decode()

    @property
    def png(self) -> bytes:
        """The drawing as PNG bytes at :attr:`dpi`, rendered by Graphviz's ``dot`` on first use.

        Raises
        ------
        GraphvizNotFoundError
            Graphviz's ``dot`` is not installed.
        FxnxValueError
            Graphviz failed, did not finish within two minutes, or would have
            scaled the PNG down.
        """
        return self._render("png", "the drawing's PNG")

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the drawing to ``path``: PNG, SVG or PDF by its suffix, or DOT text for
        ``.dot``/``.gv``, as :func:`draw` does; the same picture as shown (at :attr:`depth`).

        The file is written whole or not at all: a failed run leaves ``path``
        as it was.

        Returns
        -------
        pathlib.Path
            ``path``.

        Raises
        ------
        GraphvizNotFoundError
            Graphviz's ``dot`` is needed (PNG, SVG, PDF) but not installed.
        FxnxValueError
            An unknown suffix, or a layout that Graphviz did not finish.
        """
        path = Path(path)
        fmt = file_format(path)
        data = self.dot.encode() if fmt in ("dot", "gv") else self._render(fmt, path.name)
        with atomic_write(path) as f:
            f.write(data)
        return path

    def _render(self, fmt: str, name: str) -> bytes:
        """The drawing in ``fmt`` by one dot run, kept, as is an error (raised again)."""
        if fmt not in self._rendered:
            try:
                self._rendered[fmt] = self._run(fmt, name)
            except FxnxError as err:
                self._rendered[fmt] = err
        done = self._rendered[fmt]
        if isinstance(done, FxnxError):
            raise done
        return done

    def _run(self, fmt: str, name: str) -> bytes:
        need_dot(name)
        try:
            data, notes = run_dot(self.dot, fmt, name)
        except subprocess.TimeoutExpired as err:
            nodes, virtual = self._work
            raise FxnxValueError(
                f"Graphviz's dot did not lay out {name} within {DOT_TIMEOUT:.0f} s "
                f"({nodes} nodes, {virtual} virtual nodes for long edges): {self._advice()}"
            ) from err
        if "too large" in notes:  # dot would scale the PNG down into a blur: not what was asked
            raise FxnxValueError(
                f"{name} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG at "
                f"depth={self.depth} and dpi={self.dpi}: {self._advice()}, or write .svg or .pdf"
            )
        return data

    def _repr_svg_(self) -> str | None:
        """The SVG a notebook shows; None where it cannot be made (see :meth:`_repr_mimebundle_`)."""
        try:
            return self.svg
        except FxnxError:
            return None

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """What a notebook shows: SVG (PNG if only that is asked for) and this repr; without
        Graphviz, or where the layout fails, the repr and what to do, so the notebook goes on."""
        svg = "image/svg+xml"
        png = ((include is not None and "image/png" in include and svg not in include)
               or (exclude is not None and svg in exclude))
        fmt, mime = ("png", "image/png") if png else ("svg", svg)
        try:
            data = self._render(fmt, f"the drawing's {fmt.upper()}")
        except FxnxError as err:
            return {"text/plain": f"{self!r}\n{err}"}
        return {mime: data if png else data.decode(), "text/plain": repr(self)}


def file_format(path: Path) -> str:
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise FxnxValueError(
            f"cannot draw to {path.name!r}: give a .png, .svg, .pdf or .dot file name"
        )
    return fmt


def need_dot(name: str) -> None:
    if shutil.which("dot") is None:
        raise GraphvizNotFoundError(
            f"drawing {name} needs Graphviz's dot program, which is not installed. {INSTALL} "
            "Without it, draw to a .dot file instead."
        )


def run_dot(text: str, fmt: str, name: str) -> tuple[bytes, str]:
    """Run Graphviz's dot once on DOT text, which carries every attribute (``dpi`` too);
    return what it wrote and its warnings. ``name`` names the drawing in an error."""
    done = subprocess.run(
        ["dot", f"-T{fmt}"],
        input=text.encode(), capture_output=True, check=False, timeout=DOT_TIMEOUT,
    )
    notes = done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise FxnxValueError(f"Graphviz's dot failed on {name}: {notes.strip()}")
    return done.stdout, notes
