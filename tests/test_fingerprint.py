"""The capture guard's fingerprint (``fxnx._capture.fingerprint``) against Python's own
equality, on random nested attributes (hypothesis).

A reused capture is only right while everything its trace read is unchanged, so the oracle
is the attributes themselves: a deep copy (equal by ``==``, containers of the same types)
gives an equal fingerprint, and any in-place change anywhere inside them (a leaf set to
another value, an item added to a container, an empty container filled, a config object's
field changed) gives another one.
"""

from __future__ import annotations

import collections
import copy
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fxnx._capture.fingerprint import Fingerprints, fingerprint

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=3)


def _containers(children):
    keys = st.text(max_size=2) | st.integers(0, 9)
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(keys, children, max_size=4)
        | st.dictionaries(keys, children, max_size=4).map(collections.OrderedDict)
        | st.dictionaries(st.from_regex(r"[a-z]{1,3}", fullmatch=True), children, max_size=4).map(
            lambda d: types.SimpleNamespace(**d))  # an object with a __dict__ (a config)
    )


NESTED = st.recursive(LEAVES, _containers, max_leaves=12)


class Holder(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value


def _mutable_places(value, path=()):
    """Every container inside ``value``, as (path, container)."""
    if isinstance(value, (list, dict, types.SimpleNamespace)):
        yield path, value
    items = (vars(value).items() if isinstance(value, types.SimpleNamespace)
             else value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in items:
        yield from _mutable_places(item, (*path, key))


def _changed(container, how: int) -> None:
    """One change in place that Python's == sees."""
    if isinstance(container, list):
        if container and how % 2:
            container[how % len(container)] = ("changed", how)
        else:
            container.append(how)
    elif isinstance(container, dict):
        container[("new", how)] = how  # a key no strategy draws
    else:
        setattr(container, f"new{how}", how)


@SETTINGS
@given(NESTED)
def test_an_equal_copy_has_an_equal_fingerprint(value):
    assert fingerprint([Holder(value)])[1:] == fingerprint([Holder(copy.deepcopy(value))])[1:]


@SETTINGS
@given(NESTED, st.data())
def test_any_change_in_place_changes_the_fingerprint(value, data):
    holder = Holder(value)
    places = list(_mutable_places(value))
    if not places:  # a leaf or tuples of leaves: rebinding the attribute is the change
        before = fingerprint([holder])
        holder.value = ("changed", value)
        assert fingerprint([holder]) != before
        return
    _, container = data.draw(st.sampled_from(places))
    before = fingerprint([holder])
    _changed(container, data.draw(st.integers(0, 7)))
    assert fingerprint([holder]) != before


@SETTINGS
@given(NESTED, NESTED)
def test_fingerprints_are_equal_exactly_when_the_values_are(a, b):
    same = _strictly_equal(a, b)
    assert (fingerprint([Holder(a)])[1:] == fingerprint([Holder(b)])[1:]) == same


def _strictly_equal(a, b) -> bool:
    """Python's ==, with containers of the same types all the way down."""
    if isinstance(a, types.SimpleNamespace) or isinstance(b, types.SimpleNamespace):
        return type(a) is type(b) and _strictly_equal(vars(a), vars(b))
    if isinstance(a, (list, tuple, dict)) or isinstance(b, (list, tuple, dict)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(_strictly_equal(a[k], b[k]) for k in a)
        return all(_strictly_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_a_change_in_any_of_many_config_objects_changes_the_fingerprint():
    """Config objects inside config objects, each field changed in turn. The walk had taken
    the identity of each object's copied attributes, freed at once, so a later object given
    that identity was read as one already seen: 14 of these 20 changes went unseen, and the
    router reused a capture of the model as it was."""
    holder = Holder([_Config(x=i, sub=_Config(z=i)) for i in range(10)])
    for config in holder.value:
        for owner, field in ((config, "x"), (config.sub, "z")):
            before = fingerprint([holder])
            setattr(owner, field, getattr(owner, field) + 100)
            assert fingerprint([holder]) != before


@SETTINGS
@given(NESTED, st.data())
def test_the_routers_fingerprints_walk_again_exactly_where_something_changed(value, data):
    """Fingerprints (the router's guard, at each call) keeps its last fingerprint while
    everything that walk read is the same objects: with no change, the same key and no walk;
    after any change in place, a fresh walk's key (the oracle, tested above against ==)."""
    holder = Holder(value)
    prints = Fingerprints()
    modules = [holder]
    first = prints(modules)
    assert prints(modules) is first
    places = list(_mutable_places(value))
    if places:
        _, container = data.draw(st.sampled_from(places))
        _changed(container, data.draw(st.integers(0, 7)))
    else:
        holder.value = ("changed", value)
    assert prints(modules) == fingerprint(modules) != first


def _closure(scale):
    def f(x):
        return x * scale
    return f, lambda: f.__closure__[0].__setattr__("cell_contents", scale + 1)


def _default(scale=2):
    return scale


_CHANGES = {  # an attribute of each kind the walk reads by other means than ==, and a change
    "closure": lambda: _closure(2),
    "defaults": lambda: (_default, lambda: setattr(_default, "__defaults__", (3,))),
    "tensor": lambda: (t := torch.zeros(2), lambda: t.add_(1)),
    "array": lambda: (a := np.zeros(2), lambda: a.__setitem__(0, 1)),
    "array_shape": lambda: (a := np.zeros(2), lambda: setattr(a, "shape", (2, 1))),
    "set": lambda: (s := {1, 2}, lambda: s.add(3)),
    "global_hook": lambda: (None, lambda: nn.modules.module.register_module_forward_hook(lambda *a: None)),
    "class_forward": lambda: (None, lambda: setattr(Holder, "forward", lambda self, x: x)),
    "object_class": lambda: (c := _Config(x=1), lambda: setattr(c, "__class__", _Other)),
    "module_dict": lambda: (None, lambda holder: setattr(holder, "__dict__", {**vars(holder), "value": 2})),
    "module_class": lambda: (None, lambda holder: setattr(holder, "__class__", _OtherHolder)),
}


class _Other:
    x = 5


_SCALE = 3.0


class _OtherHolder(Holder):
    def forward(self, x):
        return x * _SCALE


@pytest.mark.parametrize("kind", list(_CHANGES))
def test_the_routers_fingerprints_see_every_kind_of_change(kind, monkeypatch):
    monkeypatch.setattr(_default, "__defaults__", _default.__defaults__)
    monkeypatch.setattr(Holder, "forward", Holder.forward, raising=False)
    monkeypatch.setattr(nn.modules.module, "_global_forward_hooks", type(nn.modules.module._global_forward_hooks)())
    value, change = _CHANGES[kind]()
    holder = Holder(value)
    prints = Fingerprints()
    first = prints([holder])
    modules = prints._last[0]
    change(holder) if change.__code__.co_argcount else change()
    assert prints(modules) == fingerprint(modules) != first


def test_the_routers_fingerprints_see_a_global_rebound_in_a_dict_subclass():
    """A forward defined in globals that are a dict subclass (code run with exec)."""

    class Globals(dict):
        pass

    table = Globals(SCALE=2.0)
    exec("def forward(self, x):\n    return x * SCALE", table)
    holder = Holder(None)
    holder.forward = table["forward"].__get__(holder)
    prints = Fingerprints()
    modules = [holder]
    first = prints(modules)
    table["SCALE"] = 3.0
    assert prints(modules) == fingerprint(modules) != first
