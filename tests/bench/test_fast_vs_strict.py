"""bench/fast_vs_strict.py: the per-kernel strict / fast comparison runs and reports every
kernel of both profiled steps (on lavapipe fast is the strict program: no tensor-core labels)."""

import os
import re
import sys

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def test_fast_vs_strict_quick(gpu, capsys):
    sys.path.insert(0, BENCH)
    try:
        import fast_vs_strict

        assert fast_vs_strict.main(["wgpu", "mlp", "--quick", "--steps", "1"]) == 0
        assert fast_vs_strict.main(["wgpu", "mlp", "--quick", "--steps", "1",
                                    "--inference"]) == 0
    finally:
        sys.path.remove(BENCH)
    out = capsys.readouterr().out
    heads = re.findall(r"== mlp (SGD training|inference): strict ([\d.]+) µs, fast ([\d.]+) µs",
                       out)
    assert [h[0] for h in heads] == ["SGD training", "inference"]
    assert all(float(s) > 0 and float(f) > 0 for _, s, f in heads)
    assert "matmul" in out  # kernels matched by label, one line each
    from meganeura.kernels.matmul import SG_FEATURE

    if SG_FEATURE not in gpu.features:  # fast is the strict program here
        assert out.count("tensor-core labels: 0,") == 2
