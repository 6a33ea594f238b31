"""The ``fxnx`` command.

``fxnx convert resnet18 --input-shape 1,3,224,224 -o resnet18.pkl`` converts a
model and prints its summary; ``fxnx info`` and ``fxnx draw`` work on saved
graphs without importing torch; ``fxnx credit`` routes credit and draws it.
A model is a torchvision name, ``timm:NAME``, ``hf:TYPE``, ``hf:FOLDER`` or
``package.module:factory`` (:mod:`fxnx._models`); ``--input`` gives several
example inputs, positional or by keyword (:func:`fxnx._argtypes.input_spec`).

Every failure is one line on stderr and a non-zero exit: 2 for a bad argument
(argparse's usage error, before any model is built or file read), 1 for
anything else, 130 when interrupted (Ctrl-C), 143 when terminated (SIGTERM,
which raises an exception here so that a file being written is cleaned up).
Set ``FXNX_TRACEBACK=1`` to see the traceback behind a line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from . import _argtypes as argtypes
from ._analysis import format_summary, summary
from ._errors import FxnxError, FxnxValueError, first_line
from ._files import read_json, read_pickle, write_json, write_pickle
from ._frames import cost_table
from ._version import __version__

__all__ = ["main"]

TRACEBACK_VARIABLE = "FXNX_TRACEBACK"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with _terminate_by_exception():
        try:
            with _held(signal.SIGINT, signal.SIGTERM):  # parsing --dtype imports torch: seconds
                args = _parser().parse_args(argv)  # a usage error exits 2 here, --help exits 0
        except (KeyboardInterrupt, _Terminated) as stop:
            return _stopped("fxnx", stop)
        except argtypes.TorchMissingError as err:  # convert and credit check torch's dtypes
            command = next((a for a in argv if a in COMMANDS), None)
            print(f"fxnx {command}: error: {err}" if command else f"fxnx: error: {err}",
                  file=sys.stderr)
            return 1
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    status = _Status(_interactive())
    try:
        with warnings.catch_warnings():  # restores Python's own display afterwards
            warnings.showwarning = partial(_show_warning, args.command, status)
            code = int(args.run(args, status))
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return code
    except (KeyboardInterrupt, _Terminated) as stop:
        status.close()
        return _stopped(f"fxnx {args.command}", stop)
    except BrokenPipeError:  # the reader left (fxnx info g.pkl | head -1): nothing to say
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except (Exception, SystemExit) as err:  # SystemExit: a model's own code called sys.exit
        status.close()
        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            traceback.print_exc()
        print(f"fxnx {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 1


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so flushing it at exit raises no second BrokenPipeError."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


class _Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that ``finally`` blocks and clean-ups run."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


@contextlib.contextmanager
def _terminate_by_exception() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`_Terminated` instead of ending the process at once
    (which would leave :func:`fxnx._files.atomic_write`'s temporary file). Only where SIGTERM still has
    its default action: a program that calls :func:`main` and handles SIGTERM keeps its handler."""
    install = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    )
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if install else None
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _held(*signums: int) -> Iterator[None]:
    """Within the block, the signals whose handlers are Python's are held, then handled at its end.

    An exception raised while torch imports is at times swallowed by it (Ctrl-C does nothing)
    or makes Python exit by SIGINT whatever :func:`main` returns. A second signal while one is
    held is handled at once: pressing Ctrl-C again stops even a slow import.
    """
    current = {s: signal.getsignal(s) for s in signums}
    handlers = {s: h for s, h in current.items() if callable(h)}
    if threading.current_thread() is not threading.main_thread():
        handlers = {}
    caught: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if caught:
            handlers[signum](signum, frame)
        caught.append(signum)

    for signum in handlers:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if caught:
        handlers[caught[0]](caught[0], None)


def _stopped(command: str, stop: BaseException) -> int:
    """One line for Ctrl-C or SIGTERM, and the exit code a shell gives for the signal."""
    if isinstance(stop, KeyboardInterrupt):
        print(f"{command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    print(f"{command}: terminated", file=sys.stderr)
    return 128 + signal.SIGTERM


def _show_warning(
    command: str, status: _Status, message: Warning | str, *args: Any, **kwargs: Any
) -> None:
    """A warning as the command's own line on stderr: no file name, no source line, and never
    in the middle of the progress line."""
    text = " ".join(str(message).split())
    status.interject(f"fxnx {command}: warning: {text}")


def _one_line(err: BaseException) -> str:
    """What went wrong, on one line: ours and the file system's in full, the rest by type."""
    if isinstance(err, (FxnxError, OSError)):
        return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, SystemExit):
        return f"the model's code called sys.exit({err.code!r})"
    return (
        f"{type(err).__name__}: {first_line(err)} "
        f"(set {TRACEBACK_VARIABLE}=1 to see the traceback)"
    )


# --- arguments ---------------------------------------------------------------------------------

COMMANDS = ("convert", "info", "draw", "credit")

_MODEL_HELP = (
    "a torchvision model name (resnet18), timm:NAME (timm:resnet50), hf:TYPE (hf:bert, a "
    "Hugging Face model type from its default config), hf:FOLDER (a local checkpoint folder, "
    "./tiny-bert) or package.module:factory for your own model; random weights, never a download"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxnx", description="PyTorch models as NetworkX graphs of their real dataflow.",
        epilog=f"Exit codes: 0 done, 1 error, 2 bad arguments, 130 interrupted, 143 terminated. "
        f"Set {TRACEBACK_VARIABLE}=1 to see the traceback behind an error.",
    )
    parser.add_argument("--version", action="version", version=f"fxnx {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    conv = commands.add_parser(
        "convert",
        help="convert models to graph files and print their summaries",
        description="Convert one or more models to graph files and print their summaries.",
    )
    conv.add_argument("models", nargs="+", metavar="MODEL", help=_MODEL_HELP)
    _model_options(conv)
    _input_options(conv, "without inputs: no shapes, except token ids for a Hugging Face model")
    conv.add_argument(
        "-o", "--output", type=argtypes.graph_output, metavar="PATH",
        help="the .pkl file to write, or a folder to write MODEL.pkl in: one that exists, a path "
        "ending in /, or any PATH when converting several models",
    )
    for fmt in ("png", "svg", "json"):
        conv.add_argument(f"--{fmt}", action="store_true", help=f"also write a .{fmt} beside it")
    _capture_options(conv)
    conv.set_defaults(run=_convert)

    info = commands.add_parser(
        "info",
        help="print the summary of a saved graph (no torch needed)",
        description="Print the summary of a .pkl or .json graph file written by fxnx.",
    )
    info.add_argument("graph", help="a .pkl or .json graph file")
    info.add_argument(
        "--depth", type=argtypes.bounded(1), default=2,
        help="the deepest modules in the cost table (the model's children are 1; default 2)",
    )
    info.add_argument("--json", action="store_true", help="print the summary as JSON instead")
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
    credit.add_argument("model", help=_MODEL_HELP)
    _model_options(credit)
    credit.add_argument(
        "--rule", type=argtypes.rule, default="exact", help="a credit rule preset: exact, feedback_alignment, direct_feedback_alignment, usf, brsf, frsf, kolen_pollack, weight_mirror"
    )
    _input_options(credit, "without inputs: a timm model's input size, token ids for a Hugging "
                   "Face model, else 1,3,224,224", seed="and of random feedback weights")
    _capture_options(credit)
    _draw_options(credit, "credit.png")
    credit.add_argument(
        "--graph", type=argtypes.graph_file, metavar="FILE",
        help="also save the graph with its credit, as .pkl or .json",
    )
    credit.set_defaults(run=_credit)
    return parser


class _AppendOnce(argparse.Action):
    """Append each value to a list; a value whose key another already has is a usage error."""

    def key(self, value: Any) -> str | None:
        raise NotImplementedError

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given = list(getattr(namespace, self.dest) or [])
        key = self.key(values)
        if key is not None and any(self.key(v) == key for v in given):
            raise argparse.ArgumentError(self, f"{key} is given twice: give it once")
        setattr(namespace, self.dest, [*given, values])


class _AppendInput(_AppendOnce):
    def key(self, value: argtypes.InputSpec) -> str | None:
        return None if value.name is None else f"the keyword input {value.name!r}"


class _AppendOption(_AppendOnce):
    def key(self, value: tuple[str, Any]) -> str | None:
        return f"the option {value[0]!r}"


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=argtypes.model_option, action=_AppendOption, dest="options",
        default=[], metavar="KEY=VALUE",
        help="an option of the model, repeatable: an attribute of a Hugging Face config "
        "(hf:bert --config num_hidden_layers=2), else a keyword argument of timm.create_model, "
        "torchvision's builder or your factory (num_classes=10); VALUE is read as a Python literal",
    )


def _input_options(parser: argparse.ArgumentParser, default: str, seed: str = "") -> None:
    parser.add_argument(
        "--input", type=argtypes.input_spec, action=_AppendInput, dest="inputs",
        metavar="[NAME=]SHAPE[:DTYPE][:VALUES]",
        help="an example input, repeatable: positional in the order given, or the keyword NAME of "
        "forward (--input input_ids=1,16:int64:randint=30522 --input attention_mask=1,16:int64:"
        "ones); DTYPE defaults to --dtype; VALUES are zeros, ones, randn or randint=N (0 to N-1), "
        f"by default randn for float dtypes and zeros for others ({default})",
    )
    parser.add_argument(
        "--input-shape", type=argtypes.positional_input, action=_AppendInput, dest="inputs",
        metavar="N,C,H,W",
        help="the shape of a positional example input of --dtype, for example 1,3,224,224 "
        "(short for --input 1,3,224,224)",
    )
    parser.add_argument(
        "--dtype", type=argtypes.dtype, default="float32",
        help="dtype of the model and of inputs that name none (default float32); an integer dtype "
        "such as int64 gives zeros (token ids) and leaves the model's own dtype",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help=" ".join(["seed of the random values of example inputs", *seed.split(), "(default 0)"]),
    )


def _capture_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--level", choices=("module", "aten", "joint"), default="module",
        help="module calls (default), ATen operators, or the joint forward+backward ATen graph",
    )
    parser.add_argument(
        "--routes", type=argtypes.routes, default="auto", metavar="ROUTE[,ROUTE]",
        help="capture routes to try in order: symbolic_trace, export, draft_export, make_fx "
        "(default: all of them)",
    )
    parser.add_argument(
        "--leaf-on-failure", action="store_true",
        help="keep a submodule that symbolic tracing fails in as one opaque node",
    )


def _draw_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "-o", "--output", type=argtypes.drawing, default=default, metavar="FILE",
        help=f".png, .svg, .pdf or .dot (default {default})",
    )
    parser.add_argument(
        "--depth", type=argtypes.bounded(1), help="collapse modules below this nesting level (1 or more)"
    )
    parser.add_argument(
        "--dpi", type=argtypes.bounded(1, argtypes.MAX_DPI), default=96,
        help=f"PNG resolution, 1 to {argtypes.MAX_DPI} (default 96)",
    )
    parser.add_argument(
        "--rankdir", choices=("TB", "LR"), default="TB",
        help="the layout's direction: top to bottom (default) or left to right",
    )
    parser.add_argument(
        "--checks", action="store_true",
        help="also draw the model's assertions and the reads that only feed them",
    )


# --- commands ----------------------------------------------------------------------------------


def _interactive() -> bool:
    return sys.stderr.isatty()


class _Status:
    """The progress line on a terminal (stderr); silent when stderr is a file or a pipe.

    :meth:`interject` prints a line (a warning, an error) on a line of its own and then
    shows the progress line again below it, so neither runs into the other.
    """

    def __init__(self, shown: bool) -> None:
        self.shown = shown
        self.line: str | None = None  # the open progress line, None when none is open

    def show(self, text: str, end: str = "") -> None:
        if self.shown:
            print(text, end=end, file=sys.stderr, flush=True)
            self.line = None if end == "\n" else (self.line or "") + text

    def close(self) -> None:
        if self.line is not None:
            print(file=sys.stderr, flush=True)
            self.line = None

    def interject(self, text: str) -> None:
        line = self.line
        self.close()
        print(text, file=sys.stderr, flush=True)
        if line is not None:
            self.show(line)


def _convert(args: argparse.Namespace, status: _Status) -> int:
    from ._convert import convert
    from ._models import load_model, model_for

    plan = _outputs(args)
    failed: list[str] = []  # each file that could not be written, and why
    for i, (spec, paths) in enumerate(plan, 1):
        status.show(f"[{i}/{len(plan)}] {spec}: building, tracing, propagating shapes…")
        start = time.perf_counter()
        model = model_for(load_model(spec, dict(args.options)), args.dtype)
        given = args.inputs or (_defaults(spec, model) if spec.startswith("hf:") else [])
        with _running(spec, given, args.dtype):
            inputs, kwargs = _inputs(given, args)
            G = convert(model, *inputs, kwargs=kwargs, level=args.level, routes=args.routes,
                        leaf_on_failure=args.leaf_on_failure)
        written = []
        for path in paths:  # one file that cannot be written keeps none of the others from it
            try:
                written.append(_write(G, path))
            except (FxnxError, OSError) as err:
                failed.append(f"{path}: {err}")
        status.show(f" {time.perf_counter() - start:.1f} s", end="\n")
        if len(plan) > 1:
            print(f"== {spec}")
        if given and not args.inputs:
            print(f"example inputs: {_listed(given, args.dtype)} (give --input to choose others)")
        print(format_summary(summary(G)))
        for path in written:
            print(f"wrote {path}")
    if failed:
        raise FxnxValueError(f"could not write {len(failed)} file{'s' * (len(failed) > 1)}, "
                             "the others were written: " + "; ".join(failed))
    return 0


def _defaults(spec: str, model: Any) -> list[argtypes.InputSpec]:
    from ._models import default_inputs

    return list(default_inputs(spec, model))


def _inputs(given: list[argtypes.InputSpec], args: argparse.Namespace) -> tuple[tuple, dict]:
    from ._models import example_inputs

    return example_inputs(given, args.dtype, args.seed)


def _listed(inputs: list[argtypes.InputSpec], dtype: Any) -> str:
    """The inputs as ``--input`` would give them, each with its dtype."""
    return " ".join(str(spec._replace(dtype=spec.dtype or dtype)) for spec in inputs)


@contextlib.contextmanager
def _running(spec: str, inputs: list[argtypes.InputSpec], dtype: Any) -> Iterator[None]:
    """Name the model and its example inputs in an error the model's own code raised."""
    try:
        yield
    except (FxnxError, OSError):
        raise
    except Exception as err:
        given = (f"example input{'s' * (len(inputs) > 1)} {_listed(inputs, dtype)}" if inputs
                 else "no example input")
        raise FxnxValueError(
            f"{spec!r} failed with {given}: {type(err).__name__}: {first_line(err)}; check "
            f"--input, --input-shape and --dtype (set {TRACEBACK_VARIABLE}=1 to see the traceback)"
        ) from err


def _outputs(args: argparse.Namespace) -> list[tuple[str, list[Path]]]:
    """The files each model will write, refusing two models that would write the same file."""
    from ._models import model_stem

    several = len(args.models) > 1
    plan: list[tuple[str, list[Path]]] = []
    owners: dict[Path, str] = {}
    for spec in args.models:
        name = model_stem(spec)
        if args.output and (several or args.output.folder):
            stem = args.output.path / name
        elif args.output:
            stem = args.output.path.with_suffix("")
        else:
            stem = Path(name)
        suffixes = [".pkl"] if args.output else []
        suffixes += [f".{fmt}" for fmt in ("png", "svg", "json") if getattr(args, fmt)]
        paths = [stem.with_name(stem.name + suffix) for suffix in suffixes]
        for path in paths:
            key = path.resolve()
            if key in owners:
                raise FxnxValueError(
                    f"{owners[key]!r} and {spec!r} would both write {path}: convert them "
                    "separately, each with its own -o"
                )
            owners[key] = spec
        plan.append((spec, paths))
    return plan


def _write(G: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".pkl":
        write_pickle(G, path)
    elif path.suffix.lower() == ".json":
        write_json(G, path)
    else:
        from ._drawing.draw import draw

        draw(G, path)
    return path


def _read(path: str) -> Any:
    """The graph in a .pkl or .json file; the readers check it against the graph contract and
    raise one GraphFileError for anything else."""
    return read_json(path) if path.lower().endswith(".json") else read_pickle(path)


def _info(args: argparse.Namespace, status: _Status) -> int:
    G = _read(args.graph)
    if args.json:
        print(json.dumps(summary(G), indent=2))
        return 0
    print(format_summary(summary(G)))
    if "flops" in G.graph:  # graphs written before costs were recorded have no table
        print()
        print(cost_table(G, depth=args.depth))
    return 0


def _draw(args: argparse.Namespace, status: _Status) -> int:
    from ._drawing.draw import draw

    G = _read(args.graph)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    path = draw(G, args.output, depth=args.depth, dpi=args.dpi, color_by=args.color_by,
                checks=args.checks, rankdir=args.rankdir)
    print(f"wrote {path}")
    return 0


def _credit(args: argparse.Namespace, status: _Status) -> int:
    from ._argtypes import InputSpec
    from ._convert import convert
    from ._credit import route_credit
    from ._drawing.draw import draw
    from ._models import load_model, model_for

    status.show(f"{args.model}: converting…")
    model = model_for(load_model(args.model, dict(args.options)), args.dtype)
    given = args.inputs or _defaults(args.model, model) or [InputSpec(None, (1, 3, 224, 224))]
    with _running(args.model, given, args.dtype):
        inputs, kwargs = _inputs(given, args)
        G = convert(model, *inputs, kwargs=kwargs, level=args.level, routes=args.routes,
                    leaf_on_failure=args.leaf_on_failure)
        status.show(f" routing credit ({args.rule})…")
        res = route_credit(G, model, *inputs, kwargs=kwargs, rule=args.rule, seed=args.seed)
    status.show(" drawing…", end="\n")
    norms = [v for v in res.norms().values() if v is not None]
    if not args.inputs:
        print(f"example inputs: {_listed(given, args.dtype)} (give --input to choose others)")
    print(f"rule {args.rule}: {res.describe()}")
    if norms:
        print(f"credit norm: {min(norms):.4g} to {max(norms):.4g} over {len(norms)} nodes")
    if args.graph:  # before the drawing: a drawing that fails loses none of the credit
        print(f"wrote {_write(G, args.graph)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    path = draw(G, args.output, depth=args.depth, dpi=args.dpi, color_by="credit_norm",
                checks=args.checks, rankdir=args.rankdir)
    print(f"wrote {path}")
    return 0
