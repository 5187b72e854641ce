"""The ``meganeura`` CLI: train on digits on the GPU (lavapipe in CI), info, profile."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

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


# --------------------------------------------------------------------------- errors


def _fails(argv, capsys):
    """(exit status, stderr) of a CLI call expected to fail; argparse errors exit via
    SystemExit, the others return their status."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc not in (0, None), err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("meganeura"), err
    return rc, lines[0]


@pytest.mark.parametrize("argv, message", [
    (["train", "--backend", "cuda"], "choose wgpu, dawn, auto or reference"),
    (["info", "--backend", "vulkan"], "choose wgpu, dawn or auto"),
    (["profile", "--backend", "reference"], "has no GPU to inspect"),
    (["train", "--epochs", "0"], "--epochs: must be at least 1, got 0"),
    (["train", "--epochs", "-1"], "--epochs: must be at least 1"),
    (["train", "--batch-size", "0"], "--batch-size: must be at least 1"),
    (["train", "--batch-size", "many"], "expected a whole number"),
    (["train", "--lr", "nan"], "--lr: must be a finite number > 0"),
    (["train", "--lr", "0"], "--lr: must be a finite number > 0, got 0"),
    (["profile", "--weight-decay", "-1"], "--weight-decay: must be a finite number >= 0"),
    (["train", "--seed", "-1"], "--seed: must be at least 0"),
    (["profile", "--steps", "0"], "--steps: must be at least 1"),
    (["train", "--min-accuracy", "99"], "fraction from 0 to 1, got 99 (for 99% write 0.99)"),
    (["train", "--min-accuracy", "-0.1"], "fraction from 0 to 1"),
    (["train", "--model", "rnn"], "invalid choice: 'rnn'"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    rc, line = _fails(argv, capsys)
    assert rc == 2 and message in line, line


def test_bad_settings_found_before_training_are_one_line_errors(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    ref = ["train", "--backend", "reference"]
    cases = [
        (ref + ["--out", str(afile)], 2, "is a file, not a directory"),
        (ref + ["--out", str(afile / "sub")], 2, "is not a writable directory"),
        (ref + ["--out", str(tmp_path), "--batch-size", "100000"], 2,
         "--batch-size 100000 is larger than the 1437 training images"),
        (["profile", "--batch-size", "5000"], 2, "larger than the 1437 training images"),
        (ref + ["--out", str(tmp_path), "--resume"], 2, "no checkpoint"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        cases.append((ref + ["--out", str(ro)], 2, "is not a writable directory"))
    for argv, want_rc, message in cases:
        rc, line = _fails(argv, capsys)
        assert (rc, line.startswith("meganeura: error:")) == (want_rc, True), line
        assert message in line, line
    assert not (tmp_path / "mlp.safetensors").exists()  # nothing was trained
    monkeypatch.setenv("MEGANEURA_WEBGPU", "vulkan")
    for cmd in (["info"], ["train", "--out", str(tmp_path)], ["profile"]):
        rc, line = _fails(cmd, capsys)
        assert rc == 2 and "'vulkan' (from $MEGANEURA_WEBGPU)" in line, line


def test_dawn_without_its_package_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from meganeura.runtime import device as device_module

    monkeypatch.setitem(sys.modules, "wgpudawn", None)  # as if the extra were not installed
    monkeypatch.setattr(device_module, "_CACHE", {})  # (a Dawn device opened earlier)
    for argv in (["info", "--backend", "dawn"], ["profile", "--backend", "dawn"],
                 ["train", "--backend", "dawn", "--out", str(tmp_path)]):
        rc, line = _fails(argv, capsys)
        assert rc == 1 and "meganeura[dawn]" in line, line


def test_failing_accuracy_gate_says_why(tmp_path, capsys):
    rc = main(["train", "--backend", "reference", "--epochs", "1", "--batch-size", "512",
               "--out", str(tmp_path), "--quiet", "--min-accuracy", "0.999"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "is below --min-accuracy 0.999" in err and "Traceback" not in err


def test_runtime_failures_and_interrupts_outside_the_loop_are_one_line(tmp_path, capsys,
                                                                       monkeypatch):
    import meganeura.cli as cli

    args = ["train", "--backend", "reference", "--epochs", "1", "--batch-size", "512",
            "--out", str(tmp_path), "--quiet"]
    (tmp_path / "mlp.safetensors").write_bytes(b"\x08" + b"\0" * 40)  # a corrupt checkpoint
    rc, line = _fails(args + ["--resume"], capsys)
    assert rc == 1 and "corrupt or truncated" in line, line

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_compile", ctrl_c)
    rc, line = _fails(args, capsys)
    assert rc == 130 and line == "meganeura: interrupted"


def test_version_and_help(capsys):
    from meganeura import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"meganeura {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "train (a model on the embedded digits dataset" in top
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    sub = capsys.readouterr().out
    for default in ("(default: 20)", "(default: 64)", "(default: 0.003)", "(default: runs)"):
        assert default in " ".join(sub.split()), default
    assert "--resume" in sub


# --------------------------------------------------------------------------- interruption

RUN = ["train", "--backend", "reference", "--epochs", "40", "--batch-size", "256", "--quiet"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The checkpoint of the same run, never interrupted."""
    out = tmp_path_factory.mktemp("whole")
    assert main(RUN + ["--out", str(out)]) == 0
    return out / "mlp.safetensors"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_checkpoint_that_resume_continues_exactly(tmp_path, uninterrupted, sig,
                                                                 code, capsys):
    """A signal after the first epoch's checkpoint stops the run cleanly (exit 128+signal, one
    line, a checkpoint of the position reached); --resume then ends where an uninterrupted
    run ends, bit for bit, with the whole loss history."""
    from meganeura.checkpoint import read_checkpoint

    ckpt = tmp_path / "mlp.safetensors"
    proc = subprocess.Popen([sys.executable, "-m", "meganeura.cli", *RUN, "--out",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"meganeura: {sig.name} at epoch"), err
    meta = read_checkpoint(ckpt)[1]
    assert 1 <= int(meta["cli.epoch"]) < 40, meta["cli.epoch"]
    assert "continue with --resume" in err
    assert main(RUN + ["--out", str(tmp_path), "--resume"]) == 0
    got, got_meta = read_checkpoint(ckpt)
    want, want_meta = read_checkpoint(uninterrupted)
    assert got_meta["step"] == want_meta["step"] == str(40 * 5)
    assert json.loads(got_meta["cli.losses"]) == json.loads(want_meta["cli.losses"])
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    # resuming with other settings is refused rather than mixing two runs
    capsys.readouterr()
    rc, line = _fails(RUN + ["--out", str(tmp_path), "--resume", "--seed", "1"], capsys)
    assert rc == 2 and "comes from a run with --seed 0" in line, line


def test_tune_fills_the_cache_and_says_so(tmp_path):
    """``meganeura tune`` compiles the model with tune=True and reports the cache it wrote."""
    import subprocess
    import sys

    env = {**os.environ, "MEGANEURA_TUNE_CACHE": str(tmp_path / "t.json")}
    out = subprocess.run([sys.executable, "-m", "meganeura.cli", "tune", "--batch-size", "16"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tuned" in out.stdout and str(tmp_path / "t.json") in out.stdout


def test_export_writes_a_portable_artifact_of_the_trained_model(gpu, tmp_path, capsys):
    import numpy as np

    import meganeura as mn
    from meganeura.io.datasets import load_digits

    assert main(["train", "--out", str(tmp_path), "--quiet", "--epochs", "1"]) == 0
    ckpt, out = tmp_path / "mlp.safetensors", tmp_path / "web" / "mlp"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out),
                 "--batch-size", "4"]) == 0
    assert f"exported mlp (batch 4) to {out}" in capsys.readouterr().out
    assert oct((out / "weights.safetensors").stat().st_mode & 0o444) == "0o444"  # servable
    x = load_digits("test")[0][:4]
    got = mn.load_program(out, device=gpu).run(x=x)["logits"]
    tensors = mn.checkpoint.read_checkpoint(ckpt)[0]
    w0, b0, w1, b1 = (tensors[f"mlp.{i}.{k}"] for i in (0, 1) for k in ("weight", "bias"))
    want = np.maximum(x @ w0.T + b0, 0) @ w1.T + b1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert main(["export", "--checkpoint", str(tmp_path / "none.safetensors")]) == 2
    assert "does not exist (write one with 'meganeura train')" in capsys.readouterr().err
