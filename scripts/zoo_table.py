"""The table of issue 27's zoo: what each of the 88 models of ``tests/zoo88.py`` gave.

    python scripts/zoo_table.py [--out figures/zoo88.md] [--jobs 2] [--pngs DIR] [NAME ...]

Runs, on each model (or on the ones named), the checks of ``tests/test_zoo88.py`` itself
(``check``: convert with default options, the output against ``model(x)``, credit against
autograd or its refusal, the default PNG), and prints a markdown table: the model, its family,
the capture route that won, the graph's nodes, its residuals (``len(fxnx.skip_connections(G))``),
the credit (exact: the largest relative error over the parameters, and the dtype; refused: the
reason), and the PNG (its size, or why it is refused). Below the table: why the routes before
the one that won failed (torch's own limits), and the known defects the zoo marks ``xfail``.
Writes the table to ``--out`` too (for the whole zoo, ``figures/zoo88.md`` by default). About
five minutes of CPU time for the whole zoo.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import zoo88  # noqa: E402
from test_zoo88 import check  # noqa: E402


def _first(text: str, limit: int = 160) -> str:
    """The first sentence of a message, cut to ``limit`` characters, safe in a table cell."""
    text = text.split(". ")[0].split("\n")[0].replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def measure(name: str, pngs: Path | None = None) -> dict[str, Any]:
    """What the zoo's checks measured on one model, and the checks that failed; its PNG is
    kept in ``pngs`` as ``<name>.png`` where given."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    entry = zoo88.ZOO[name]
    row: dict[str, Any] = {"name": name, "family": entry.family, "defects": dict(entry.xfail)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            found, failed = check(entry, Path(tmp))
        except AssertionError as err:
            return row | {"failed": {"convert": _first(str(err))}}
        if pngs is not None and (Path(tmp) / "g.png").exists():
            shutil.copyfile(Path(tmp) / "g.png", pngs / f"{name}.png")
    return row | found | {"failed": {c: _first(str(e)) for c, e in failed.items()}}


def _credit(row: dict[str, Any]) -> str:
    if "credit" in row["failed"] or "output" in row["failed"]:
        return "**fails**: " + "; ".join(row["failed"][c] for c in ("output", "credit") if c in row["failed"])
    if "refused" in row:
        return "refused: " + _first(row["refused"], 120)
    error = "0" if row["credit"] == 0 else f"{row['credit']:.0e}"
    return f"exact: {error} ({row['dtype']}, {row['compared']} parameters)"


def _png(row: dict[str, Any]) -> str:
    if "draw" in row["failed"]:
        return "**fails**: " + row["failed"]["draw"]
    png = row["png"]
    if isinstance(png, str):
        area = re.search(r"about ([\d,]+) square inches", png)
        advice = [what for what, said in (("SVG/PDF", ".svg"), ("DOT", ".dot"), ("a part", "scope_subgraph"))
                  if said in png]
        return (f"refused ({area[1] + ' in² ' if area else ''}at depth 1); advises "
                + ", ".join(advice))
    width, height, dpi = png
    return f"{width}×{height} px, {width * height / dpi**2:.0f} in²"


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | family | route | nodes | residuals | credit | PNG |",
        "| --- | --- | --- | ---: | ---: | --- | --- |",
    ]
    for row in rows:
        if "route" not in row:
            lines.append(f"| {row['name']} | {row['family']} | **convert fails**: {row['failed']['convert']} "
                         "| | | | |")
            continue
        lines.append(f"| {row['name']} | {row['family']} | {row['route']} | {row['nodes']} | "
                     f"{row['residuals']} | {_credit(row)} | {_png(row)} |")
    return "\n".join(lines)


def notes(rows: Sequence[dict[str, Any]]) -> str:
    routes: dict[str, int] = {}
    for row in rows:
        routes[row.get("route", "none")] = routes.get(row.get("route", "none"), 0) + 1
    out = ["", "Routes: " + ", ".join(f"{r} {n}" for r, n in sorted(routes.items(), key=lambda i: -i[1])) + ".",
           "", "Why the routes before the one that won failed (models with the same reason together):", ""]
    reasons: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        for route, why in (row.get("failures") or {}).items():
            why = re.sub(r"(could not trace) \w+:", r"\1 it:", _first(why, 220))
            reasons.setdefault((route, why), []).append(row["name"])
    out += [f"- {route} ({', '.join(names)}): {why}" for (route, why), names in reasons.items()]
    defects = [row for row in rows if row["defects"]]
    if defects:
        out += ["", "Known defects (marked xfail in tests/zoo88.py):", ""]
        out += [f"- {row['name']}, {check}: {why}" for row in defects for check, why in row["defects"].items()]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="models of tests/zoo88.py (default: all 88)")
    parser.add_argument("--out", type=Path, help="the markdown file to write (default, for the whole zoo: "
                        "figures/zoo88.md; for models named, none)")
    parser.add_argument("--jobs", type=int, default=2, help="models measured at once, one process each")
    parser.add_argument("--pngs", type=Path, help="a folder to keep each model's default PNG in")
    args = parser.parse_args(argv)
    names = args.names or list(zoo88.ZOO)
    unknown = [n for n in names if n not in zoo88.ZOO]
    if unknown:
        parser.error(f"not in tests/zoo88.py: {', '.join(unknown)}")
    if args.pngs is not None:
        args.pngs.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(functools.partial(measure, pngs=args.pngs), names))
    text = (f"# Issue 27's zoo: {len(rows)} models\n\nWritten by `python scripts/zoo_table.py` "
            f"(torch {torch.__version__}); each model built from its config with random weights, "
            "eval mode, and checked as tests/test_zoo88.py checks it.\n\n" + table(rows) + "\n" + notes(rows) + "\n")
    print(text)
    out = args.out or (None if args.names else ROOT / "figures" / "zoo88.md")
    if out is not None:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
