"""Why fxnx's pickle reader decodes opcodes itself instead of walking them with pickletools.genops.

    python scripts/bench_pickle_reader.py [--runs 21]

Both scanners below keep the same allow-list and track the same kinds of stack values (so
that only scalars become dict keys); one reads the opcodes with ``pickletools.genops``, the
other is fxnx's own (``fxnx._safepickle._scan``). Each reads the graph file of ResNet-152,
interleaved, and the ratio of medians is printed for the scan alone and for the whole
``read_pickle``. Measured 2026-11-24 on the dev machine: genops 2.1x the scan, 1.55x the load
(21.6 vs 13.9 ms), against the project's rule that a rewrite must not make a benchmark slower.
"""

from __future__ import annotations

import argparse
import pickletools
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torchvision

import fxnx
from fxnx import _safepickle
from fxnx.errors import GraphFileError, UnsafePickleError

_OPS = {op.name: op for op in pickletools.opcodes}
_SCALAR_KINDS = frozenset("six")
# What each opcode fxnx's writer emits does to the stack of value kinds (s: str, i: int, x:
# another scalar, d: dict, l: list, t: tuple, c: class, g: graph): a kind it pushes, or a step.
_GET, _MEMOIZE, _MARK, _SETITEM, _SETITEMS, _APPENDS, _TUPLE, _TUPLE_N, _APPEND, _GLOBAL, \
    _NEWOBJ, _BUILD, _STOP, _SKIP = range(14)
_DOES: dict = {
    **{_OPS[n]: "s" for n in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")},
    **{_OPS[n]: "i" for n in ("BININT1", "BININT2", "BININT", "LONG1", "LONG4")},
    **{_OPS[n]: "x" for n in ("BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE")},
    _OPS["EMPTY_DICT"]: "d", _OPS["EMPTY_LIST"]: "l", _OPS["EMPTY_TUPLE"]: "t",
    _OPS["BINGET"]: _GET, _OPS["LONG_BINGET"]: _GET, _OPS["MEMOIZE"]: _MEMOIZE,
    _OPS["MARK"]: _MARK, _OPS["SETITEM"]: _SETITEM, _OPS["SETITEMS"]: _SETITEMS,
    _OPS["APPENDS"]: _APPENDS, _OPS["TUPLE"]: _TUPLE, _OPS["TUPLE1"]: _TUPLE_N,
    _OPS["TUPLE2"]: _TUPLE_N, _OPS["TUPLE3"]: _TUPLE_N, _OPS["APPEND"]: _APPEND,
    _OPS["STACK_GLOBAL"]: _GLOBAL, _OPS["NEWOBJ"]: _NEWOBJ, _OPS["BUILD"]: _BUILD,
    _OPS["STOP"]: _STOP, _OPS["PROTO"]: _SKIP, _OPS["FRAME"]: _SKIP,
}
_TUPLE_SIZE = {_OPS["TUPLE1"]: 1, _OPS["TUPLE2"]: 2, _OPS["TUPLE3"]: 3}


def genops_scan(data: bytes) -> None:
    if data[:1] != b"\x80" or data[1:2] > b"\x04":
        raise GraphFileError("it does not start like a pickle of protocol 2 to 4")
    stack: list[str] = []
    marks: list[int] = []
    memo: list[str] = []
    does = _DOES
    try:
        for op, arg, pos in pickletools.genops(data):
            step = does.get(op)
            if step.__class__ is str:
                stack.append(step)
            elif step == _GET:
                if arg >= len(memo):
                    raise GraphFileError(f"byte {pos}: memo entry {arg} does not exist")
                stack.append(memo[arg])
            elif step == _MEMOIZE:
                if not stack:
                    raise GraphFileError(f"byte {pos}: MEMOIZE on an empty stack")
                memo.append(stack[-1])
            elif step == _MARK:
                marks.append(len(stack))
            elif step == _SETITEM:
                del stack[-1]
                key = stack.pop()
                if key not in _SCALAR_KINDS or stack[-1] != "d":
                    raise UnsafePickleError(f"byte {pos}: SETITEM with a {key!r} key or on a non-dict")
            elif step in (_SETITEMS, _APPENDS, _TUPLE):
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                if step == _TUPLE:
                    stack.append("t")
                elif step == _SETITEMS and (len(items) % 2 or stack[-1] != "d"
                                            or not _SCALAR_KINDS.issuperset(items[::2])):
                    raise UnsafePickleError(f"byte {pos}: SETITEMS with a non-scalar key or on a non-dict")
                elif step == _APPENDS and stack[-1] != "l":
                    raise UnsafePickleError(f"byte {pos}: APPENDS on a non-list")
            elif step == _TUPLE_N:
                del stack[len(stack) - _TUPLE_SIZE[op]:]
                stack.append("t")
            elif step == _APPEND:
                stack.pop()
                if stack[-1] != "l":
                    raise UnsafePickleError(f"byte {pos}: APPEND on a non-list")
            elif step == _GLOBAL:  # find_class decides on the names
                del stack[-2:]
                stack.append("c")
            elif step == _NEWOBJ:
                args, cls = stack.pop(), stack.pop()
                if cls != "c" or args != "t":
                    raise UnsafePickleError(f"byte {pos}: NEWOBJ on something other than a graph class")
                stack.append("g")
            elif step == _BUILD:
                stack.pop()
                if stack[-1] != "g":
                    raise UnsafePickleError(f"byte {pos}: BUILD on something other than a graph")
            elif step == _STOP:
                if len(stack) != 1 or marks:
                    raise GraphFileError(f"byte {pos}: STOP with {len(stack)} values on the stack")
                return
            elif step != _SKIP:
                raise UnsafePickleError(f"byte {pos}: opcode {op.name}, which fxnx files never contain")
    except (IndexError, ValueError) as err:  # an empty stack; genops: a truncated or unknown opcode
        raise GraphFileError(f"its opcodes cannot be read: {err}") from None
    raise GraphFileError("the file ends before its STOP opcode: it is truncated")


def _ms(fn, data: bytes) -> float:
    start = time.perf_counter()
    fn(data)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    runs = parser.parse_args().runs
    G = fxnx.convert(torchvision.models.resnet152(weights=None).eval(), torch.zeros(1, 3, 224, 224))
    path = Path(tempfile.mkdtemp()) / "resnet152.pkl"
    fxnx.write_pickle(G, path)
    data = path.read_bytes()
    own = _safepickle._scan

    def load_with(scan):
        def load(data: bytes) -> None:
            _safepickle._scan = scan
            try:
                _safepickle.load(data, "resnet152.pkl")
            finally:
                _safepickle._scan = own
        return load

    scans, loads = ([], []), ([], [])
    for i in range(runs):  # interleaved, each side first in turn
        order = ((0, own), (1, genops_scan)) if i % 2 else ((1, genops_scan), (0, own))
        for side, scan in order:
            scans[side].append(_ms(scan, data))
            loads[side].append(_ms(load_with(scan), data))
    m = statistics.median
    print(f"ResNet-152 graph file, {len(data) / 1024:.0f} KiB, {runs} interleaved runs")
    print(f"scan:        fxnx {m(scans[0]):.1f} ms, genops {m(scans[1]):.1f} ms: genops {m(scans[1]) / m(scans[0]):.2f}x")
    print(f"read_pickle: fxnx {m(loads[0]):.1f} ms, genops {m(loads[1]):.1f} ms: genops {m(loads[1]) / m(loads[0]):.2f}x")


if __name__ == "__main__":
    main()
