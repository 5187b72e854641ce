"""bench/attention_bench.py ``--table``: issue 12's attention table, on this device at the
smoke shapes (a device without tensor cores runs the strict forward in the fast column; no
CUDA PyTorch here, so the SDPA cells are empty)."""

import os
import sys

import pytest

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


@pytest.fixture
def ab(monkeypatch):
    sys.path.insert(0, BENCH)
    try:
        import attention_bench

        monkeypatch.setattr(attention_bench, "SHAPES", dict(attention_bench.SMOKE))
        monkeypatch.setitem(attention_bench.REPEATS, "n", 2)
        monkeypatch.setitem(attention_bench.REPEATS, "warm_s", 0.0)
        yield attention_bench
    finally:
        sys.path.remove(BENCH)


def test_table_rows_and_markdown(ab, gpu, tmp_path):
    from meganeura.kernels import attention_fast as AF

    md = tmp_path / "table.md"
    rows = ab.attention_table(gpu, md, rounds=1)
    assert [r["shape"] for r in rows] == list(ab.SMOKE)
    tc = AF.SG_FEATURE in gpu.features
    for r in rows:
        assert r["strict_fwd_us"] > 0 and r["strict_total_us"] > r["strict_fwd_us"]
        assert r["fast_fwd_us"] > 0
        assert r["fast_err"] <= (1e-2 if tc else 2e-5)  # checked against float64
    lines = md.read_text().splitlines()
    assert len(lines) == 2 + len(ab.SMOKE) and lines[0].startswith("| shape")
    assert all(line.count("|") == 9 for line in lines)
