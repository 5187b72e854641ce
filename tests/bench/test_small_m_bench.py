"""bench/small_m_bench.py and bench/small_m_ab.py: the configuration space, the heuristic as the
scheduler builds it, the per-pass timer against the back-to-back one on this device, and the
A/B's switch and profile-row filter."""

from types import SimpleNamespace

import numpy as np
import pytest

from ._util import load_bench


@pytest.fixture
def sm():
    return load_bench("small_m_bench")


def test_configs_keep_to_their_bounds(sm):
    M, N, K = 128, 576, 960
    cfgs = sm.configs(M, N, K)
    assert cfgs
    for g, s in cfgs:
        threads = g.ks * (g.tm // g.rm) * (g.tn // g.rn)
        assert K % s == 0 and 64 <= threads <= 1024 and 32 <= g.ks * g.bk <= 128
        assert 96 <= s * -(-M // g.tm) * -(-N // g.tn) <= 1600


def test_heuristic_is_what_the_scheduler_runs(sm, gpu):
    from meganeura.kernels.matmul import SMALL_M_SLICED, SMALL_M_SPLIT

    rng = np.random.default_rng(0)
    for (m, n, k), want in (((128, 576, 576), (SMALL_M_SLICED, 1)),
                            ((128, 576, 960), (SMALL_M_SPLIT, 5)), ((128, 576, 1536), None)):
        desc, *_ = sm._problem(gpu, rng, m, n, k, False, False)
        g, s = sm.heuristic(desc)
        if want:
            assert (g, s) == want
        else:
            assert s == 12 and g.tm == 64  # split-K of 64x64 tiles


def test_pass_timer_and_split_calls_compute_the_product(sm, gpu):
    """A split configuration and an unsplit K-sliced one give float64's product, and both
    timers return positive times; the per-pass one refuses more than four dispatches."""
    from meganeura.kernels.matmul import Cfg

    rng = np.random.default_rng(1)
    desc, bufs, ref, rows = sm._problem(gpu, rng, 16, 32, 64, False, True)
    timers = (sm.Timer(gpu), sm.PassTimer(gpu, reps=2))
    for g, s in ((Cfg("tiled", 16, 32, 4, 4, 8, 1, 1, 2), 1),
                 (Cfg("tiled", 16, 32, 4, 4, 8, 1), 2)):
        calls = sm.calls_for(gpu, desc, bufs, g, s)
        assert len(calls) == s
        assert timers[0](calls) > 0 and timers[1](calls) > 0
        assert sm._err(gpu, bufs[-1], 16, 32, ref, rows) < 1e-5
    with pytest.raises(ValueError, match="four"):
        timers[1](calls * 3)


def test_ab_switch_and_rows():
    small_m_ab = load_bench("small_m_ab")
    from meganeura.kernels import matmul as mm

    saved = mm.SMALL_M_K
    mm.SMALL_M_K = small_m_ab.OFF
    try:
        assert not mm.small_m_sliced(1, 128, 576, 576)
    finally:
        mm.SMALL_M_K = saved
    assert mm.small_m_sliced(1, 128, 576, 576)
    rows = [{"label": lb, "calls": 1, "mean_us": us, "tflops": 1.0, "x": 0}
            for lb, us in (("matmul 1x128x576x576", 2.0), ("matmul 1x1500x384x384", 9.0),
                           ("reduce_sum (1, 128)", 5.0),
                           ("matmul 1x128x576x960 [split-K 12]", 3.0))]
    got = small_m_ab._rows(SimpleNamespace(roofline=lambda: rows))
    assert [r["label"] for r in got] == ["matmul 1x128x576x960 [split-K 12]",
                                         "matmul 1x128x576x576"]
    assert "x" not in got[0]


@pytest.mark.parametrize("switch", ["small_m", "split_sum", "small_m_split", "split_576"])
def test_ab_sessions_compile_each_mode_with_its_values_and_restore_them(switch, monkeypatch):
    """``_sessions`` compiles "on" with each attribute's on value (KEEP: as it is) and "off"
    with its off value, and leaves every attribute as it found it."""
    small_m_ab = load_bench("small_m_ab")
    entries = small_m_ab.SWITCHES[switch]
    before = [getattr(mod, attr) for mod, attr, _, _ in entries]
    seen = []
    monkeypatch.setattr(small_m_ab.mn, "compile", lambda *a, **k: seen.append(
        [getattr(mod, attr) for mod, attr, _, _ in entries]) or SimpleNamespace(
        set_params=lambda p: None))
    w = SimpleNamespace(graph=None, outputs={}, loss=None, params={})
    for on in (True, False):
        seen.clear()
        small_m_ab._sessions(w, None, switch, on)
        want = [b if (v := (v_on if on else v_off)) is small_m_ab.KEEP else v
                for b, (_, _, v_on, v_off) in zip(before, entries)]
        assert seen == [want, want]  # the inference and the training session
        assert [getattr(mod, attr) for mod, attr, _, _ in entries] == before
    assert any(v is not small_m_ab.KEEP for _, _, v, _ in small_m_ab.SWITCHES["split_576"])
