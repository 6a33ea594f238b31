"""The ``fxnx`` command.

``fxnx convert resnet18 --input-shape 1,3,224,224 -o resnet18.pkl`` converts a
model and prints its summary; ``fxnx info`` and ``fxnx draw`` work on saved
graphs without importing torch; ``fxnx credit`` routes credit and draws it.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .analysis import format_summary, summary
from .errors import FxnxError, FxnxValueError
from .io import read_json, read_pickle, write_json, write_pickle

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (FxnxError, OSError) as err:
        print(f"fxnx {args.command}: error: {err}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxnx", description="PyTorch models as NetworkX graphs of their real dataflow."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    conv = commands.add_parser(
        "convert",
        help="convert models to graph files and print their summaries",
        description="Convert one or more models to graph files and print their summaries.",
    )
    conv.add_argument(
        "models", nargs="+", metavar="MODEL",
        help="a torchvision model name (resnet18) or package.module:factory for your own model",
    )
    _input_options(conv)
    conv.add_argument(
        "-o", "--output", metavar="PATH",
        help="the .pkl file to write (a folder when converting several models)",
    )
    for fmt in ("png", "svg", "json"):
        conv.add_argument(f"--{fmt}", action="store_true", help=f"also write a .{fmt} beside it")
    conv.add_argument(
        "--level", choices=("module", "aten", "joint"), default="module",
        help="module calls (default), ATen operators, or the joint forward+backward ATen graph",
    )
    conv.add_argument(
        "--routes", default="auto", metavar="ROUTE[,ROUTE]",
        help="capture routes to try in order: symbolic_trace, export, draft_export, make_fx "
        "(default: all of them)",
    )
    conv.add_argument(
        "--leaf-on-failure", action="store_true",
        help="keep a submodule that symbolic tracing fails in as one opaque node",
    )
    conv.set_defaults(run=_convert)

    info = commands.add_parser(
        "info",
        help="print the summary of a saved graph (no torch needed)",
        description="Print the summary of a .pkl or .json graph file written by fxnx.",
    )
    info.add_argument("graph", help="a .pkl or .json graph file")
    info.set_defaults(run=_info)

    draw = commands.add_parser(
        "draw",
        help="draw a saved graph to PNG, SVG, PDF or DOT (no torch needed)",
        description="Draw a .pkl or .json graph file; the output's suffix picks the format.",
    )
    draw.add_argument("graph", help="a .pkl or .json graph file")
    _draw_options(draw, "graph.png")
    draw.add_argument("--color-by", metavar="ATTR", help="colour nodes by a numeric attribute")
    draw.set_defaults(run=_draw)

    credit = commands.add_parser(
        "credit",
        help="route credit through a model and draw it",
        description="Convert a model, route credit backward over it, draw nodes coloured by "
        "credit norm, and print which rule ran where.",
    )
    credit.add_argument("model", help="a torchvision model name or package.module:factory")
    _input_options(credit, default=(1, 3, 224, 224))
    credit.add_argument("--rule", default="exact", help="exact, feedback_alignment, sign_symmetry")
    credit.add_argument("--seed", type=int, default=0, help="seed of random feedback weights")
    _draw_options(credit, "credit.png")
    credit.add_argument("--graph", metavar="FILE.pkl", help="also save the graph with its credit")
    credit.set_defaults(run=_credit)
    return parser


def _input_options(parser: argparse.ArgumentParser, default: tuple[int, ...] | None = None) -> None:
    parser.add_argument(
        "--input-shape", type=_shape, metavar="N,C,H,W", default=default,
        help="shape of the example input, for example 1,3,224,224"
        + (" (omit it to convert without shapes)" if default is None else " (the default)"),
    )
    parser.add_argument(
        "--dtype", default="float32", help="dtype of the example input (default float32)"
    )


def _draw_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "-o", "--output", default=default, metavar="FILE",
        help=f".png, .svg, .pdf or .dot (default {default})",
    )
    parser.add_argument("--depth", type=int, help="collapse modules below this nesting level")
    parser.add_argument("--dpi", type=int, default=96, help="PNG resolution (default 96)")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape: give comma-separated integers such as 1,3,224,224"
        ) from None
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be a positive integer")
    return shape


def _interactive() -> bool:
    return sys.stderr.isatty()


def _status(text: str, end: str = "\n") -> None:
    """Progress on a terminal (stderr); silent when output goes to a file or a pipe."""
    if _interactive():
        print(text, end=end, file=sys.stderr, flush=True)


def _example_input(args: argparse.Namespace) -> tuple[Any, ...]:
    import torch

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise FxnxValueError(f"--dtype {args.dtype!r} is not a torch dtype (try float32 or float64)")
    return () if args.input_shape is None else (torch.randn(args.input_shape, dtype=dtype),)


def _convert(args: argparse.Namespace) -> int:
    from .dataflow import convert

    several = len(args.models) > 1
    inputs = _example_input(args)
    folder = Path(args.output) if several and args.output else None
    for i, spec in enumerate(args.models, 1):
        name = spec.rpartition(":")[2]
        _status(f"[{i}/{len(args.models)}] {spec}: building, tracing, propagating shapes…", end="")
        start = time.perf_counter()
        model = load_model(spec).eval()
        G = convert(
            model.to(inputs[0].dtype) if inputs else model, *inputs, level=args.level,
            routes=args.routes if args.routes == "auto" else args.routes.split(","),
            leaf_on_failure=args.leaf_on_failure,
        )
        if folder is not None:
            stem = folder / name
        elif args.output:
            stem = Path(args.output).with_suffix("")
        else:
            stem = Path(name)
        written = []
        if args.output:
            written.append(_write(G, stem.with_suffix(".pkl")))
        for fmt in ("png", "svg", "json"):
            if getattr(args, fmt):
                written.append(_write(G, stem.with_suffix(f".{fmt}")))
        _status(f" {time.perf_counter() - start:.1f} s")
        if several:
            print(f"== {spec}")
        print(format_summary(summary(G)))
        for path in written:
            print(f"wrote {path}")
    return 0


def _write(G: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pkl":
        write_pickle(G, path)
    elif path.suffix == ".json":
        write_json(G, path)
    else:
        from .render import draw

        draw(G, path)
    return path


def _read(path: str) -> Any:
    return read_json(path) if path.endswith(".json") else read_pickle(path)


def _info(args: argparse.Namespace) -> int:
    print(format_summary(summary(_read(args.graph))))
    return 0


def _draw(args: argparse.Namespace) -> int:
    from .render import draw

    G = _read(args.graph)
    path = draw(G, args.output, depth=args.depth, dpi=args.dpi, color_by=args.color_by)
    print(f"wrote {path}")
    return 0


def _credit(args: argparse.Namespace) -> int:
    from .credit import route_credit
    from .dataflow import convert
    from .render import draw

    (x,) = _example_input(args)
    _status(f"{args.model}: converting…", end="")
    model = load_model(args.model).eval().to(x.dtype)
    G = convert(model, x)
    _status(f" routing credit ({args.rule})…", end="")
    res = route_credit(G, model, x, rule=args.rule, seed=args.seed)
    _status(" drawing…")
    path = draw(G, args.output, depth=args.depth, dpi=args.dpi, color_by="credit_norm")
    norms = {n: v for n, v in res.norms().items() if v is not None}
    print(f"rule {args.rule}: {res.describe()}")
    print(f"credit norm: {min(norms.values()):.4g} to {max(norms.values()):.4g} over {len(norms)} nodes")
    if args.graph:
        print(f"wrote {_write(G, Path(args.graph))}")
    print(f"wrote {path}")
    return 0


def load_model(spec: str) -> Any:
    """Build a model from a torchvision name or ``package.module:factory`` (no weights)."""
    if ":" in spec:
        module_name, _, factory_name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), factory_name)
        except (ImportError, AttributeError) as err:
            raise FxnxValueError(
                f"cannot load model {spec!r}: {err}; "
                "give package.module:factory where factory() returns an nn.Module"
            ) from err
        return factory()
    import torchvision

    names = torchvision.models.list_models()
    if spec not in names:
        close = difflib.get_close_matches(spec, names, n=3)
        raise FxnxValueError(
            f"unknown model {spec!r}: not a torchvision model name"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
            + "; for your own model give package.module:factory"
        )
    return torchvision.models.get_model(spec, weights=None)
