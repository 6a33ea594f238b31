"""Private torch names live in fxnx/_compat.py only, each listed with its fallback."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

import fxnx
from fxnx import _compat

PACKAGE = Path(fxnx.__file__).parent
#: Private names outside torch that fxnx may use, with the reason.
NOT_TORCH = {
    "_getframe": "sys._getframe: the caller's frame for warnings",
    "_replace": "a named tuple's documented _replace",
    "_pred": "networkx's in-edge table: read_pickle restores a file's in-edge order",
    "_succ": "networkx's out-edge table, read alongside _pred",
}


def _defined_names() -> set[str]:
    """Every name fxnx itself defines or assigns (functions, classes, attributes, variables)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path, own: set[str]) -> set[str]:
    """Private names of other libraries that the source file ``path`` touches."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            found.update(f"{node.module}" for p in parts if _private(p))
            found.update(f"{node.module}.{a.name}" for a in node.names if _private(a.name))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if any(_private(p) for p in a.name.split(".")))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            found.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg and _private(node.arg) and node.arg not in own:
            found.add(node.arg)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if isinstance(name, str) and _private(name) and name not in own:
                    found.add(name)
    return found - set(NOT_TORCH)


def test_no_private_torch_name_outside_compat():
    own = _defined_names()
    offenders = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_compat.py" and (uses := private_uses(path, own))
    }
    assert offenders == {}, "private names belong in fxnx/_compat.py, with a fallback"


def test_every_private_name_in_compat_is_listed():
    listed = " ".join(name for name, _, _ in _compat.PRIVATE_APIS)
    uses = private_uses(PACKAGE / "_compat.py", own=set())
    unlisted = sorted(u for u in uses if u.rpartition(".")[2] not in listed)
    assert unlisted == []
    assert len(_compat.PRIVATE_APIS) >= 9
    for name, purpose, fallback in _compat.PRIVATE_APIS:
        assert purpose and fallback, name


def test_the_scanner_sees_private_uses(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from torch.utils import _pytree\nimport torch._dynamo\n"
        "x = fn._sequence_nr()\nmake_fx(f, _error_on_data_dependent_ops=False)\n"
        "y = getattr(op, '_schema', None)\n"
    )
    assert private_uses(src, own=set()) == {
        "torch.utils._pytree", "torch._dynamo", "_sequence_nr", "_error_on_data_dependent_ops",
        "_schema",
    }


DENSE_TENSORS = {
    "plain": torch.zeros(2, 3),
    "channels_last": torch.zeros(1, 3, 4, 4).to(memory_format=torch.channels_last),
    "int": torch.zeros(5, dtype=torch.int64),
    "transposed": torch.zeros(2, 3).t(),
    "requires_grad": torch.zeros(2, 3, requires_grad=True),
    # size-1 dims: contiguous in both formats, whichever way the tensor was made
    "pooled": torch.zeros(1, 8, 1, 1),
    "pooled_channels_last": torch.zeros(2, 8, 1, 1).to(memory_format=torch.channels_last),
    "channels_last_3d": torch.zeros(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
    "expanded": torch.zeros(3).expand(4, 3),
    "scalar": torch.zeros(()),
    "empty": torch.zeros(0, 3),
    "strided_slice": torch.zeros(2, 4)[:, ::2],
    "permuted": torch.zeros(2, 3, 4, 4).permute(0, 2, 3, 1),
    "complex": torch.zeros(2, 3, dtype=torch.complex64),
    "parameter": torch.nn.Parameter(torch.zeros(2, 3)),
}


@pytest.mark.parametrize("tensor", DENSE_TENSORS.values(), ids=DENSE_TENSORS.keys())
def test_own_tensor_metadata_equals_torchs(tensor):
    assert _compat._own_tensor_metadata(tensor) == _extract_tensor_metadata(tensor)
    assert _compat.extract_tensor_metadata(tensor) == _extract_tensor_metadata(tensor)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_tensor_metadata_of_quantised_and_sparse_tensors_is_torchs():
    quantised = torch.quantize_per_tensor(torch.ones(2, 3), 0.5, 3, torch.quint8)
    for tensor in (quantised, torch.eye(3).to_sparse()):
        assert _compat.extract_tensor_metadata(tensor) == _extract_tensor_metadata(tensor)
    assert _compat.extract_tensor_metadata(quantised).qparams["scale"] == 0.5


def test_fallbacks_when_a_private_name_is_gone():
    class NoSeq:
        pass

    assert _compat.sequence_nr(NoSeq()) is None
    assert _compat.method_schema_signatures("no_such_operator_xyz") == []
    assert _compat.op_schema(NoSeq()) is None
    assert _compat.schema_signature(object()) is None
    assert _compat.OpOverload is type(torch.ops.aten.mul.Tensor)


def test_joint_graph_without_sequence_numbers(monkeypatch):
    """Without _sequence_nr, backward ops still get the scope their inputs share."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(2, 3)
    monkeypatch.setattr("fxnx._capture.make_fx.sequence_nr", lambda fn: None)
    G = fxnx.convert(model, x, level="joint")
    backward = [d for _, d in G.nodes(data=True) if d["phase"] == "backward"]
    assert backward and G.graph["gradients"]["0.weight"] in G


def test_norms_and_saved_tensor_hooks_without_their_private_names(monkeypatch):
    """Without torch._foreach_norm the norms are vector_norm's, the same; without the hooks'
    push and pop, weight transport enters the context manager: the same credit bit for bit."""
    from fxnx._credit import native

    tensors = [torch.randn(3, 4), torch.randn(5), torch.zeros(0)]
    fast = _compat.vector_norms(tensors)
    monkeypatch.delattr(torch, "_foreach_norm")
    assert [float(a) for a in fast] == [float(b) for b in _compat.vector_norms(tensors)]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    G = fxnx.convert(model, x)

    def credit():
        router = fxnx.CreditRouter(G, model, rule="feedback_alignment", seed=1)
        x_ = x.clone().requires_grad_()
        router(x_).pow(2).sum().backward()
        return x_.grad

    direct = credit()
    monkeypatch.setattr(native, "_HOOKS", None)
    assert torch.equal(direct, credit())


def test_conv_feedback_matches_the_layers_own_forward():
    """The padded-conv transport (functional_call with B) equals torch's conv with B by hand."""
    conv = torch.nn.Conv2d(2, 3, 3, padding="same", padding_mode="reflect").double()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    B = torch.randn_like(conv.weight)
    credit = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    from fxnx._credit.nodecall import NodeCall
    from fxnx._credit.transport import _input_credit

    got = _input_credit(NodeCall("conv", "call_module", "conv", conv, [], [], [], None, {}), x.detach(), credit, B)
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
    (want,) = torch.autograd.grad(torch.nn.functional.conv2d(padded, B), x, credit)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_make_fx_wrapper_follows_tensor_values():
    def f(x):
        return x * 2 if x.sum() > 0 else x - 1

    gm = _compat.make_fx_following_values(f, "real")(torch.ones(2))
    assert "mul" in str(gm.code)
    # The pinned torch still has the private option (else the fallback, make_fx's default, runs).
    assert "_error_on_data_dependent_ops" in inspect.signature(make_fx).parameters
