"""A router's state_dict: saved, loaded into a new router, training goes on as if it never stopped.

Oracle: the same training run uninterrupted (bit for bit, float64), against one saved after
two steps through ``torch.save``/``torch.load(weights_only=True)`` and resumed in a new router
built with another seed, on a fresh model.
"""

from __future__ import annotations

import io

import pytest
import torch
from test_router import _batches, _Net  # conv, train-mode BatchNorm, in-place ReLU, a skip
from torch import nn
from torch.nn import functional as F

import fxnx
from fxnx.errors import FxnxValueError

RULES = ["feedback_alignment", "usf", "brsf", "frsf", "direct_feedback_alignment", "kolen_pollack", "weight_mirror"]
LEARNS = {"kolen_pollack", "weight_mirror"}


def _mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _mlp_batches(steps):
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(5, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (5,), generator=gen))
            for _ in range(steps)]


MODELS = {"mlp": (_mlp, _mlp_batches), "conv": (lambda: _fresh_net(), _batches)}


def _fresh_net():
    torch.manual_seed(1)
    return _Net().double()


class _Run:
    """A model, its router and an SGD optimizer with momentum (whose state resumes too)."""

    def __init__(self, G, make, rule, seed):
        self.model = make()
        self.router = fxnx.CreditRouter(G, self.model, rule=rule, seed=seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.rule = rule

    def train(self, batches):
        for x, y in batches:
            self.opt.zero_grad()
            F.cross_entropy(self.router(x), y).backward()
            self.opt.step()
            if isinstance(self.rule, str) and self.rule in LEARNS:
                self.router.update_feedback(lr=0.05, weight_decay=1e-2)

    def saved(self):
        buffer = io.BytesIO()
        torch.save({"router": self.router.state_dict(), "opt": self.opt.state_dict()}, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    def load(self, saved):
        self.router.load_state_dict(saved["router"])
        self.opt.load_state_dict(saved["opt"])

    def state(self):
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def _uninterrupted(G, make, rule, batches):
    run = _Run(G, make, rule, seed=0)
    run.train(batches)
    return run.state()


def _checkpoint(G, make, rule, batches):
    """The state of a run trained on ``batches`` from seed 0, through torch.save and torch.load."""
    run = _Run(G, make, rule, seed=0)
    run.train(batches)
    return run.saved()


def _same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("rule", RULES)
def test_a_resumed_router_trains_as_the_uninterrupted_one(model, rule):
    make, batches_of = MODELS[model]
    batches = batches_of(5)
    G = fxnx.convert(make(), batches[0][0])
    want = _uninterrupted(G, make, rule, batches)
    resumed = _Run(G, make, rule, seed=7)  # another seed and fresh weights: the state brings both
    resumed.load(_checkpoint(G, make, rule, batches[:2]))
    resumed.train(batches[2:])
    _same(resumed.state(), want)


@pytest.mark.parametrize("rule", ["feedback_alignment", "brsf", "kolen_pollack", "direct_feedback_alignment"])
def test_loaded_into_a_router_that_has_run(rule):
    batches = _mlp_batches(5)
    G = fxnx.convert(_mlp(), batches[0][0])
    want = _uninterrupted(G, _mlp, rule, batches)
    other = _Run(G, _mlp, rule, seed=3)
    other.train(_mlp_batches(7)[5:])  # its own feedback drawn, learned, its draws counted
    drawn = other.router.feedback.keys()
    other.load(_checkpoint(G, _mlp, rule, batches[:2]))
    if rule != "brsf":  # brSF keeps how far its draws got; its feedback is each step's own draw
        assert other.router.feedback.keys() == drawn
    other.train(batches[2:])
    _same(other.state(), want)


def _extra(router):
    """The router's extra state, read as the module's docstring says a user reads it."""
    state = router.state_dict()["_extra_state"]
    assert state.dtype == torch.uint8  # tensors only, as safetensors takes them
    return torch.load(io.BytesIO(bytes(state.numpy())), weights_only=True)


def test_the_state_holds_each_nodes_rule_and_feedback():
    x, _ = _mlp_batches(1)[0]
    model = _mlp()
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment", seed=3)
    assert _extra(router)["nodes"] == {}  # nothing drawn before the first call
    router(x)
    state = _extra(router)
    assert state["seed"] == 3
    assert {name: kept["rule"] for name, kept in state["nodes"].items()} == {
        "_0": "feedback_alignment", "_1": "exact", "_2": "feedback_alignment", "_3": "exact",
        "_4": "feedback_alignment",
    }
    assert sorted(name for name, kept in state["nodes"].items() if "feedback" in kept) == ["_0", "_2", "_4"]
    for name, B in router.feedback.items():
        assert torch.equal(state["nodes"][name]["feedback"], B)


def test_a_router_checkpoint_goes_through_safetensors(tmp_path):
    """A state dict of tensors only, as safetensors files (Hugging Face Trainer's) need."""
    safetensors = pytest.importorskip("safetensors.torch")
    batches = _mlp_batches(4)
    G = fxnx.convert(_mlp(), batches[0][0])
    want = _uninterrupted(G, _mlp, "kolen_pollack", batches)
    first = _Run(G, _mlp, "kolen_pollack", seed=0)
    first.train(batches[:2])
    safetensors.save_file(first.router.state_dict(), tmp_path / "router.safetensors")
    resumed = _Run(G, _mlp, "kolen_pollack", seed=1)
    resumed.router.load_state_dict(safetensors.load_file(tmp_path / "router.safetensors"))
    resumed.opt.load_state_dict(first.opt.state_dict())
    resumed.train(batches[2:])
    _same(resumed.state(), want)


def test_a_loaded_state_is_the_routers_own():
    """Loading copies, as load_state_dict copies parameters: a Kolen–Pollack B learning in the
    router loaded leaves the router saved (and the dict loaded) as they were."""
    batches = _mlp_batches(3)
    G = fxnx.convert(_mlp(), batches[0][0])
    first = _Run(G, _mlp, "kolen_pollack", seed=0)
    first.train(batches[:1])
    state = first.router.state_dict()
    before = {k: v.clone() for k, v in first.router.feedback.items()}
    second = _Run(G, _mlp, "kolen_pollack", seed=0)
    second.router.load_state_dict(state)
    second.train(batches[1:])
    for name, B in first.router.feedback.items():
        assert torch.equal(B, before[name])
        assert not torch.equal(second.router.feedback[name], B)  # it learned


def test_state_round_trips_before_any_call():
    batches = _mlp_batches(3)
    G = fxnx.convert(_mlp(), batches[0][0])
    first = _Run(G, _mlp, "kolen_pollack", seed=0)
    first.train(batches[:1])
    middle = _Run(G, _mlp, "kolen_pollack", seed=5)
    middle.load(first.saved())
    assert sorted(middle.router.feedback) == sorted(first.router.feedback)  # before its next call
    last = _Run(G, _mlp, "kolen_pollack", seed=9)
    last.load(middle.saved())  # saved before middle ran again
    first.train(batches[1:])
    last.train(batches[1:])
    _same(last.state(), first.state())


def test_another_rule_is_refused_before_anything_loads():
    batches = _mlp_batches(2)
    G = fxnx.convert(_mlp(), batches[0][0])
    saved = _checkpoint(G, _mlp, "kolen_pollack", batches[:1])
    fa = _Run(G, _mlp, "feedback_alignment", seed=0)
    fa.train(batches[1:])
    weights, feedback = fa.state(), {k: v.clone() for k, v in fa.router.feedback.items()}
    with pytest.raises(FxnxValueError, match="node '_0' was saved routed by 'kolen_pollack', and this router routes it by 'feedback_alignment'"):
        fa.router.load_state_dict(saved["router"])
    _same(fa.state(), weights)  # the model's state loads after the router's own: untouched
    for name, B in fa.router.feedback.items():
        assert torch.equal(B, feedback[name])


def test_a_state_that_is_not_a_routers_is_refused():
    x, _ = _mlp_batches(1)[0]
    model = _mlp()
    router = fxnx.CreditRouter(fxnx.convert(model, x), model, rule="feedback_alignment", seed=0)
    state = router.state_dict()
    for wrong in ({"nodes": {}}, _extra(router), torch.zeros(5, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8), _bytes({"nodes": {}})):
        with pytest.raises(FxnxValueError, match="is not a CreditRouter's state"):
            router.load_state_dict({**state, "_extra_state": wrong})
    nodes = {"not_a_node": {"rule": "feedback_alignment"}}
    with pytest.raises(FxnxValueError, match=r"nodes \['not_a_node'\] that this router's G does not have"):
        router.load_state_dict({**state, "_extra_state": _bytes({**_extra(router), "nodes": nodes})})
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*_extra_state.*no router state \('_extra_state'.*load a model's state_dict into router.model, or this one with strict=False"):
        router.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items()})
    router.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items()}, strict=False)


def _bytes(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("rule", ["kolen_pollack", "weight_mirror", "brsf"])
def test_a_layer_replaced_after_a_resume_is_bound_as_in_the_router_saved(rule):
    """What was loaded binds the rules once; a layer replaced later is bound afresh, as in the
    router that was saved, not from the checkpoint again (KP's B, a mirror's noise and brSF's
    draw count were put back: up to 1e-2 off the uninterrupted run, found in review)."""
    batches = _mlp_batches(6)
    G = fxnx.convert(_mlp(), batches[0][0])

    def replace(run):
        torch.manual_seed(5)
        run.model[2] = nn.Linear(8, 8).double()
        run.opt.add_param_group({"params": run.model[2].parameters()})

    whole = _Run(G, _mlp, rule, seed=0)
    whole.train(batches[:3])
    replace(whole)
    whole.train(batches[3:])
    resumed = _Run(G, _mlp, rule, seed=4)
    resumed.load(_checkpoint(G, _mlp, rule, batches[:2]))
    resumed.train(batches[2:3])
    replace(resumed)
    resumed.train(batches[3:])
    _same(resumed.state(), whole.state())


@pytest.mark.parametrize("saved", ["kolen_pollack", "usf", "exact", "brsf"])
def test_a_state_saved_under_any_other_rule_is_refused(saved):
    """At the first call, where the router's rules are bound. Every node's rule is saved, not
    only those that keep feedback: a uSF or exact state is refused too, naming the node."""
    batches = _mlp_batches(2)
    G = fxnx.convert(_mlp(), batches[0][0])
    fresh = _Run(G, _mlp, "feedback_alignment", seed=0)
    fresh.load(_checkpoint(G, _mlp, saved, batches[:1]))
    with pytest.raises(FxnxValueError, match=f"node '_0' was saved routed by '{saved}', and this router routes it by 'feedback_alignment'"):
        fresh.router(batches[1][0])


class _Annealed(fxnx.credit.FeedbackAlignment):
    """Feedback alignment whose B grows with the steps it has routed: state of its own."""

    name = "annealed"

    def bind(self, call, seed, feedback=None):
        bound = super().bind(call, seed, feedback)
        bound.steps = 0
        return bound

    def feedback_for(self, call):
        self.steps += 1
        return {p: B * (1 + 0.1 * self.steps) for p, B in self._weights.items()}

    def get_extra_state(self):
        return {"steps": self.steps}

    def set_extra_state(self, state):
        self.steps = state["steps"]


def test_a_rule_of_ones_own_keeps_its_state_through_its_extra_state():
    batches = _mlp_batches(5)
    G = fxnx.convert(_mlp(), batches[0][0])
    rule = {nn.Linear: _Annealed()}
    want = _uninterrupted(G, _mlp, rule, batches)
    resumed = _Run(G, _mlp, {nn.Linear: _Annealed()}, seed=2)
    resumed.load(_checkpoint(G, _mlp, rule, batches[:2]))
    resumed.train(batches[2:])
    _same(resumed.state(), want)


def test_a_resumed_router_trains_on_bert_as_the_uninterrupted_one():
    """The class, not the example: a Hugging Face BERT (random weights from a config) with an
    attention mask, Kolen–Pollack on every projection, saved through safetensors."""
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")

    def make():
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        return transformers.BertForSequenceClassification(config).double().train()

    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 5:] = 0
    batches = [(torch.randint(0, 50, (4, 8), generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(4)]
    G = fxnx.convert(make(), batches[0][0], kwargs={"attention_mask": mask})

    def trained(seed, steps, state=None):
        model = make()
        router = fxnx.CreditRouter(G, model, rule="kolen_pollack", seed=seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if state is not None:
            router.load_state_dict(safetensors.load(safetensors.save(state[0])))
            opt.load_state_dict(state[1])
        for ids, y in steps:
            opt.zero_grad()
            F.cross_entropy(router(ids, attention_mask=mask).logits, y).backward()
            opt.step()
            router.update_feedback(lr=0.05, weight_decay=1e-2)
        return model, router, opt

    want, router, _ = trained(0, batches)
    assert len(router.feedback) == 14  # every projection, the pooler and the head
    _, first, opt = trained(0, batches[:2])
    resumed, _, _ = trained(5, batches[2:], (first.state_dict(), opt.state_dict()))
    _same(resumed.state_dict(), want.state_dict())
