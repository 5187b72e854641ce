"""``compile`` pauses Python's cyclic garbage collector while it builds (a third of a large
model's compile time was the collector rescanning the compile's own objects) and must always
restore it: after a success, after an error, and leave it off when the caller had it off."""

import gc

import pytest

import meganeura as mn
from meganeura.errors import GraphBuildError


def _graph():
    g = mn.Graph("gc")
    x = g.input("x", (4, 3))
    return g, mn.nn.Linear(3, 2, name="fc")(g, x)


def test_collector_restored_after_compile_and_after_errors():
    g, y = _graph()
    assert gc.isenabled()
    mn.compile(g, outputs={"y": y}, backend="reference")
    assert gc.isenabled()
    other, _ = _graph()
    stranger = other.input("z", (1,))
    with pytest.raises(GraphBuildError, match="not a value of this graph"):
        mn.compile(g, outputs={"y": stranger}, backend="reference")
    assert gc.isenabled()


def test_collector_left_off_when_the_caller_turned_it_off():
    g, y = _graph()
    gc.disable()
    try:
        mn.compile(g, outputs={"y": y}, backend="reference")
        assert not gc.isenabled()
    finally:
        gc.enable()
