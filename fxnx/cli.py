"""The ``fxnx`` command.

``fxnx convert resnet18 --input-shape 1,3,224,224 -o resnet18.pkl`` converts a
model and prints its summary; ``fxnx info resnet18.pkl`` prints the summary of
a saved graph without importing torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from .analysis import format_summary, summary
from .errors import FxnxError, FxnxValueError
from .io import read_pickle, write_pickle

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
        help="convert a model to a graph file and print its summary",
        description="Convert a model to a graph file and print its summary.",
    )
    conv.add_argument(
        "model",
        help="a torchvision model name (resnet18) or package.module:factory for your own model",
    )
    conv.add_argument(
        "--input-shape",
        type=_shape,
        metavar="N,C,H,W",
        help="shape of the example input, for example 1,3,224,224 "
        "(omit it to convert without shapes)",
    )
    conv.add_argument(
        "--dtype", default="float32", help="dtype of the example input (default float32)"
    )
    conv.add_argument("-o", "--output", metavar="FILE.pkl", help="where to write the graph")
    conv.set_defaults(run=_convert)

    info = commands.add_parser(
        "info",
        help="print the summary of a saved graph (no torch needed)",
        description="Print the summary of a graph file written by fxnx convert.",
    )
    info.add_argument("graph", help="a .pkl graph file")
    info.set_defaults(run=_info)
    return parser


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


def _convert(args: argparse.Namespace) -> int:
    import torch

    from .dataflow import convert

    model = load_model(args.model).eval()
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise FxnxValueError(f"--dtype {args.dtype!r} is not a torch dtype (try float32 or float64)")
    inputs = () if args.input_shape is None else (torch.randn(args.input_shape, dtype=dtype),)
    G = convert(model.to(dtype), *inputs)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        write_pickle(G, args.output)
    print(format_summary(summary(G)))
    if args.output:
        print(f"graph written to {args.output}")
    return 0


def _info(args: argparse.Namespace) -> int:
    print(format_summary(summary(read_pickle(args.graph))))
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
