"""bench/step_overhead.py: a mode ``PREENCODE/SEGMENTS`` sets both environment variables for
its timed steps ("default": unset) and restores what was there."""

import os

from ._util import load_bench


def test_modes_set_and_restore_the_environment(monkeypatch):
    so = load_bench("step_overhead")
    monkeypatch.setenv("MEGANEURA_SUBMIT_SEGMENTS", "3,9")
    monkeypatch.delenv("MEGANEURA_PREENCODE", raising=False)
    with so._mode("0/12,96"):
        assert os.environ["MEGANEURA_PREENCODE"] == "0"
        assert os.environ["MEGANEURA_SUBMIT_SEGMENTS"] == "12,96"
    with so._mode("1/default"):
        assert os.environ["MEGANEURA_PREENCODE"] == "1"
        assert "MEGANEURA_SUBMIT_SEGMENTS" not in os.environ
    assert os.environ["MEGANEURA_SUBMIT_SEGMENTS"] == "3,9"
    assert "MEGANEURA_PREENCODE" not in os.environ
