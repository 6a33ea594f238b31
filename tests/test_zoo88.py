"""Issue 27's zoo: 88 models people use, converted as a new user would (slow).

For each model of ``tests/zoo88.py``, in eval mode:

1. ``fxnx.convert`` with default options succeeds, ``fxnx.validate(G)`` passes, and the route
   expected wins (a ``make_fx`` capture is announced by a warning that credit will be refused,
   a model that changes itself on its first call by the warning ``zoo88`` expects); neither
   convert nor route_credit changes the model's mode or buffers;
2. the output equals the eager model's, ``model(x)`` itself: ``route_credit``'s output in
   float64 (relative error at most 1e-12), or where credit is refused the captured graph
   module's output in float32;
3. credit in float64 (zero-initialised parameters re-initialised first) equals
   ``torch.autograd.grad`` of the sum of the float outputs at every parameter, relative
   error at most 1e-10; or, where credit is refused, one ``fxnx.errors.FxnxError`` whose message
   says why and what to do;
4. the default PNG is within the bound ``fxnx.draw`` promises (Graphviz's 32,767 pixels, and
   the area of ``PNG_AREA`` square inches with the slack ``tests/test_draw_bounds.py``
   allows), read from the PNG's own header; or the refusal names only depths of 1 or more and
   says to write SVG, PDF or DOT, or to draw a part with ``fxnx.scope_subgraph``.

Each check fails with its own exception class, so that a known defect is marked
``xfail(strict=True, raises=...)`` for that check alone: another check that fails on the same
model still fails the test, and a check marked that passes fails it too.
"""

from __future__ import annotations

import re
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo88

import fxnx
import fxnx._drawing.draw
from fxnx import _drawing as dr

from conftest import needs_dot, rel_error

pytestmark = pytest.mark.slow

#: Relative errors allowed on outputs and on credit, by the dtype the checks run in (float32
#: only where credit is refused, or the model does not run in float64: zoo88.Entry.why32).
OUTPUT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
CREDIT_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
#: The slack on PNG_AREA that tests/test_draw_bounds.py allows dot's layout over the prediction.
AREA_SLACK = 1.5


class ConvertFailed(AssertionError):
    """Check 1: convert, validate or the route."""


class OutputDiffers(AssertionError):
    """Check 2: the graph's output against the eager model's."""


class CreditWrong(AssertionError):
    """Check 3: exact credit against autograd, or the refusal's message."""


class DrawingUnbounded(AssertionError):
    """Check 4: the default PNG's size, or the refusal's message."""


CHECKS: dict[str, type[AssertionError]] = {
    "convert": ConvertFailed, "output": OutputDiffers, "credit": CreditWrong, "draw": DrawingUnbounded,
}


def _param(name: str) -> Any:
    entry = zoo88.ZOO[name]
    if not entry.xfail:
        return name
    reason = "; ".join(f"{check}: {why}" for check, why in entry.xfail.items())
    raises = tuple(CHECKS[check] for check in entry.xfail)
    return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason, raises=raises))


def _leaves(value: Any) -> list[Any]:
    """The leaves of a model's output; Hugging Face's ModelOutput as the dict it is."""
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):
        value = dict(value)
    return torch.utils._pytree.tree_leaves(value)


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in _leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _compare(got: Any, want: Any, tol: float) -> str | None:
    """What differs between two outputs, leaf by leaf: None where they agree."""
    got, want = _leaves(got), _leaves(want)
    if len(got) != len(want):
        return f"{len(got)} output leaves, the model gives {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"leaf {i}: {a!r}, the model gives {b!r}"
        elif not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return f"leaf {i}: {getattr(a, 'shape', type(a))}, the model gives shape {tuple(b.shape)}"
        elif not b.is_floating_point():
            if not torch.equal(a, b):
                return f"leaf {i}: integer values differ"
        elif (err := rel_error(a, b)) > tol:
            return f"leaf {i}: relative error {err:.3g} > {tol:g}"
    return None


def _aten_output(G, model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The output of the graph module ``G``'s route captures (make_fx: parameters, buffers and
    input tensors are its inputs, in the order ``Capture.aten.primals`` names them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = fxnx.capture(model, args, kwargs, routes=G.graph["capture"], propagate=False)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    inputs = iter(t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    values = []
    for slot in cap.aten.primals.values():
        kind, name = slot["kind"], slot["name"]
        values.append(params[name] if kind == "parameter" else buffers[name] if kind == "buffer" else next(inputs))
    assert next(inputs, None) is None, "an input tensor the capture did not take"
    with torch.no_grad():
        return cap.gm(values, [])


def _check_convert(entry: zoo88.Entry, model, args, kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            G = fxnx.convert(model, *args, kwargs=kwargs)
            fxnx.validate(G)
        except Exception as err:
            raise ConvertFailed(f"convert failed: {type(err).__name__}: {err}") from err
    if G.graph["capture"] != entry.route:
        raise ConvertFailed(f"captured by {G.graph['capture']}, expected {entry.route}: "
                            f"{G.graph.get('capture_failures')}")
    messages = [str(w.message) for w in caught]
    if entry.warns and not any(re.search(entry.warns, m) for m in messages):
        raise ConvertFailed(f"convert did not warn {entry.warns!r}; it warned {messages}")
    announced = any("route_credit and CreditRouter refuse" in m for m in messages)
    if announced != (entry.route == "make_fx"):
        raise ConvertFailed(f"convert {'warned' if announced else 'did not warn'} that credit is refused "
                            f"on a graph captured by {entry.route}")
    return G


def _check_credit(entry: zoo88.Entry, G, model, args, kwargs) -> dict[str, Any]:
    """Checks 2 and 3 where credit is offered (float64); what was measured."""
    dtype = zoo88.dtype_of(entry)
    fixed = G.graph.get("fixed_kwargs") or {}
    try:
        res = fxnx.route_credit(G, model, *args, kwargs=kwargs)
    except Exception as err:
        raise CreditWrong(f"route_credit failed: {type(err).__name__}: {err}") from err
    out = model(*args, **kwargs, **fixed)
    if (why := _compare(res.output, out, OUTPUT_TOL[dtype])) is not None:
        raise OutputDiffers(f"route_credit's output differs from model(x): {why}")
    outputs = [t for t in _floats(out) if t.requires_grad]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(outputs, [p for _, p in named], [torch.ones_like(t) for t in outputs],
                                allow_unused=True)
    worst, nonzero = 0.0, 0
    for (name, p), g in zip(named, grads, strict=True):
        want = torch.zeros_like(p) if g is None else g
        got = res.param_credit.get(name)
        if got is None:
            if want.any():
                raise CreditWrong(f"no credit for {name}, which autograd gives {float(want.norm()):.3g}")
            continue
        nonzero += bool(want.any())
        if (err := rel_error(got, want)) > CREDIT_TOL[dtype]:
            raise CreditWrong(f"credit of {name}: relative error {err:.3g} > {CREDIT_TOL[dtype]:g}")
        worst = max(worst, err)
    if not nonzero:
        raise CreditWrong("autograd gives no parameter a gradient: the comparison is vacuous")
    return {"credit": worst, "compared": nonzero, "dtype": str(dtype).removeprefix("torch.")}


def _check_refusal(entry: zoo88.Entry, G, model, args, kwargs) -> dict[str, Any]:
    """Check 3 where credit is refused, then check 2 on the captured graph module (float32)."""
    try:
        fxnx.route_credit(G, model, *args, kwargs=kwargs)
    except Exception as err:
        if not isinstance(err, fxnx.errors.FxnxError) or not re.search(entry.refused, str(err)):
            raise CreditWrong(f"refused with {err!r}, expected an FxnxError matching {entry.refused!r}") from err
        refusal = str(err)
    else:
        raise CreditWrong("route_credit did not refuse")
    with torch.no_grad():
        out = model(*args, **kwargs, **(G.graph.get("fixed_kwargs") or {}))
    try:
        got = _aten_output(G, model, args, kwargs)
    except Exception as err:
        raise OutputDiffers(f"the captured graph module did not run: {type(err).__name__}: {err}") from err
    if (why := _compare(got, out, OUTPUT_TOL[torch.float32])) is not None:
        raise OutputDiffers(f"the captured graph module's output differs from model(x): {why}")
    return {"refused": refusal}


def png_size(path: Path) -> tuple[int, int, float]:
    """Width and height in pixels, from the PNG's header, and its dots per inch: from its pHYs
    chunk where it has one, else Graphviz's 96 (the ``dpi`` draw uses by default)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    at = data.find(b"pHYs")
    if at >= 0:
        x, _, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
        if unit == 1:  # pixels per metre
            return width, height, x * 0.0254
    return width, height, 96.0


def _check_drawing(G, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "g.png"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the depth chosen is announced
            fxnx.draw(G, path)
    except fxnx.errors.FxnxValueError as err:
        message = str(err)
        depths = [int(d) for d in re.findall(r"depth=(-?\d+)", message)]
        if any(d < 1 for d in depths) or "smaller depth" in message:
            raise DrawingUnbounded(f"the refusal names a depth below 1: {message}") from err
        if not depths and not re.search(r"\.svg|\.dot|scope_subgraph", message):
            raise DrawingUnbounded(f"the refusal names no depth, SVG, DOT or part that works: {message}") from err
        if path.exists():
            raise DrawingUnbounded("a refused drawing left a file behind") from err
        return {"png": f"refused: {message}"}
    except Exception as err:
        raise DrawingUnbounded(f"draw failed: {type(err).__name__}: {err}") from err
    width, height, dpi = png_size(path)
    area = width * height / dpi**2
    if max(width, height) > dr.fit.MAX_PIXELS or area > AREA_SLACK * dr.fit.PNG_AREA:
        raise DrawingUnbounded(f"{width} by {height} pixels at {dpi:g} dpi: {area:,.0f} square inches, "
                               f"the bound is {dr.fit.PNG_AREA:g} (with slack {AREA_SLACK})")
    return {"png": (width, height, dpi)}


def _state(model: torch.nn.Module) -> tuple[bool, dict[str, torch.Tensor]]:
    """The model's mode and a copy of its buffers (BatchNorm's running statistics)."""
    return model.training, {name: b.clone() for name, b in model.named_buffers()}


def _unchanged(before: tuple[bool, dict[str, torch.Tensor]], model: torch.nn.Module, what: str,
               fails: type[AssertionError]) -> None:
    training, buffers = _state(model)
    if training != before[0]:
        raise fails(f"{what} changed the model's mode: training={training}")
    changed = [n for n, b in buffers.items() if n not in before[1] or not torch.equal(b, before[1][n])]
    if changed or len(buffers) != len(before[1]):
        raise fails(f"{what} changed the model's buffers: {changed[:5] or 'their names'}")


def check(entry: zoo88.Entry, tmp_path: Path) -> tuple[dict[str, Any], dict[str, AssertionError]]:
    """Run the four checks on one model: what each measured, and the checks that failed."""
    model, args, kwargs = zoo88.built(entry)
    before = _state(model)
    G = _check_convert(entry, model, args, kwargs)  # nothing else can run without a graph
    _unchanged(before, model, "convert", ConvertFailed)
    found: dict[str, Any] = {"route": G.graph["capture"], "nodes": G.number_of_nodes(),
                             "residuals": len(fxnx.skip_connections(G)),
                             "failures": dict(G.graph.get("capture_failures") or {})}
    failed: dict[str, AssertionError] = {}
    steps = [(lambda: _check_credit(entry, G, model, args, kwargs)) if entry.refused is None
             else (lambda: _check_refusal(entry, G, model, args, kwargs)),
             lambda: _check_drawing(G, tmp_path)]
    for step in steps:
        try:
            found.update(step())
        except (OutputDiffers, CreditWrong, DrawingUnbounded) as err:
            failed[next(c for c, k in CHECKS.items() if isinstance(err, k))] = err
    if "credit" not in failed:  # route_credit restores what it ran
        try:
            _unchanged(before, model, "route_credit", CreditWrong)
        except CreditWrong as err:
            failed["credit"] = err
    return found, failed


@pytest.fixture
def one_thread():
    """One torch thread per test: ``pytest -n 2`` runs two at once on two cores, and these
    models are too small to gain from more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", [_param(name) for name in zoo88.ZOO])
@needs_dot
def test_zoo_model(name, tmp_path, one_thread):
    entry = zoo88.ZOO[name]
    _, failed = check(entry, tmp_path)  # ConvertFailed: an xfail on "convert" expects it
    unexpected = {c: e for c, e in failed.items() if c not in entry.xfail}
    fixed = [c for c in entry.xfail if c not in failed and c != "convert"]
    if unexpected or fixed:
        lines = [f"{c}: {e}" for c, e in unexpected.items()]
        lines += [f"{c} passes now: remove its xfail ({entry.xfail[c]})" for c in fixed]
        raise AssertionError(f"{name}:\n" + "\n".join(lines))
    if failed:
        raise next(iter(failed.values()))
