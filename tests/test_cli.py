"""The ``meganeura`` CLI: train on digits on the GPU (lavapipe in CI), info, profile."""

import json
import os

from meganeura.cli import main


def test_train_default_mlp_reaches_95_percent_on_gpu(gpu, tmp_path, capsys):
    rc = main(["train", "--out", str(tmp_path), "--quiet", "--min-accuracy", "0.95"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "test accuracy" in out
    assert os.path.getsize(tmp_path / "mlp.safetensors") > 9610 * 4
    assert (tmp_path / "mlp-loss.png").read_bytes()[:4] == b"\x89PNG"


def test_info_describes_the_adapter(gpu, capsys):
    assert main(["info"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backend_type"] in ("Vulkan", "Metal", "D3D12")
    assert "max_storage_buffer_binding_size" in d["limits"]


def test_profile_prints_a_kernel_table(gpu, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["profile", "--steps", "2", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "matmul" in out and "dispatches/step" in out
    assert json.loads(trace.read_text())["traceEvents"]


def test_train_fast_precision_says_what_ran_fast(gpu, tmp_path, capsys):
    from meganeura.kernels.matmul import SG_FEATURE

    rc = main(["train", "--out", str(tmp_path), "--quiet", "--epochs", "2",
               "--precision", "fast"])
    out = capsys.readouterr().out
    assert rc == 0, out
    if SG_FEATURE in gpu.features:
        assert "on tensor cores" in out
    else:
        assert "no f16 subgroup matrices" in out
    assert "test accuracy" in out
