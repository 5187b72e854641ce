"""bench/roofline.py's markdown: in-stream and alone columns, the floor note, split-K rows."""

from __future__ import annotations

from tests.bench._util import load_bench


def _row(label, mean, alone, est=False):
    return {"label": label, "calls": 3, "mean_us": mean, "alone_us": alone, "estimated": est,
            "tflops": 1.5, "gbps": 10.0, "bound": "compute", "pct_of_bound": 20.0}


def test_markdown_shows_both_timings_and_split_k_groups():
    roofline = load_bench("roofline")
    rows = [_row("matmul 1x8x8x64 [split-K 4]", 5.0, 12.0),
            _row("sgd_update", 2.0, 9.0, est=True)]
    res = {"device": "H", "impl": "dawn", "precision": "strict", "date": "d", "workloads": {
        "m-train": {"gpu_ms": 1.0, "rows": rows, "dispatches": 2, "pass_floor_us": 8.0,
                    "stream_floor_us": 1.5, "repeats": 7, "weighted_pct": 20.0,
                    "split_k": [{"label": "matmul 1x8x8x64", "calls": 3, "mean_us": 6.5,
                                 "tflops": 2.25}]}}}
    md = roofline.markdown(res, 10)
    assert "an empty dispatch: 1.5 µs in stream, 8.0 µs alone in its pass" in md
    assert "| `matmul 1x8x8x64 [split-K 4]` | 3 | 5.0 | 12.0 | 1.50 |" in md
    assert "| `sgd_update` | 3 | 2.0~ | 9.0 |" in md
    assert "| `matmul 1x8x8x64` | 3 | 6.5 | 2.25 |" in md
    assert roofline.weighted_pct(rows) == 20.0
