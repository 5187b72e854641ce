"""Data-parallel training (meganeura.distributed) with 2 localhost ranks on one adapter
(lavapipe in CI, shared through MEGANEURA_DP_SHARE_ADAPTER=1).

The tests launch this file as the worker: ``python tests/test_distributed.py MODE OUT`` under
torchrun (or with the torchrun environment set by hand, where a test must watch a rank die
without torchrun tearing the others down).  Rank 0 writes what it saw to OUT/rank0.json."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
B, STEPS, LR = 4, 10, 0.05  # per-rank micro-batch, steps, learning rate
FAIL_AT = 3  # the step at which a rank dies or hangs in the failure tests
TIMEOUT = 6.0  # collective timeout of the failure tests (seconds)


def _model(batch: int):
    from meganeura.models.mlp import mlp_classifier

    return mlp_classifier(batch, in_dim=16, hidden=(24,), classes=5)


def _optimizer(name: str):
    from meganeura import optim

    if name == "sgd":
        return optim.SGD(lr=LR, momentum=0.9)
    return optim.AdamW(lr=optim.WarmupCosine(LR, 2, STEPS), weight_decay=0.1)


def _data(global_batch: int, steps: int = STEPS):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps, global_batch, 16)).astype(np.float32)
    y = rng.integers(0, 5, (steps, global_batch)).astype(np.int32)
    return x, y


# ------------------------------------------------------------------------------ the worker


def _worker_equivalence(out: str) -> None:
    """Every (optimizer, accumulation) case: 10 data-parallel steps here, the same 10 steps
    of the global batch in one numpy reference session on rank 0; then the reference's
    checkpoint (one process, the global batch) is resumed on these 2 ranks."""
    from meganeura import distributed as dist_mn

    ctx = dist_mn.init()
    report = {}
    for opt in ("sgd", "adamw"):
        for k in (1, 2):
            dp, entry = _equivalence_case(ctx, opt, k, os.path.join(out, "ref.safetensors"))
            report[f"{opt}-k{k}"] = entry
    # resume the last single-process checkpoint on 2 ranks (rank 0 reads it, broadcasts it)
    ctx.barrier()
    dp.load(os.path.join(out, "ref.safetensors"), strict_fingerprint=False)
    from meganeura.checkpoint import read_checkpoint

    want, got = read_checkpoint(os.path.join(out, "ref.safetensors"))[0], dp.get_state()
    report["resume"] = {"max_diff": max(float(np.abs(got[n] - want[n].reshape(got[n].shape))
                                              .max()) for n in got),
                        "step": dp.step_count, "names_match": sorted(got) == sorted(want)}
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(report, f)
    ctx.close()


def _equivalence_case(ctx, opt: str, k: int, ckpt: str):
    import meganeura as mn
    from meganeura import distributed as dist_mn

    m = _model(B)
    dp = dist_mn.DataParallel(ctx, m.graph, m.loss, _optimizer(opt), accumulate=k,
                              bucket_mb=0.0005, seed=3)
    gb = B * k * ctx.world_size
    x, y = _data(gb)
    losses = [dp.step(**dist_mn.shard_batch({"x": x[s], "y": y[s]}, ctx.rank,
                                            ctx.world_size)).loss for s in range(STEPS)]
    state = dp.get_state()
    if ctx.rank != 0:
        return dp, None
    r = _model(gb)
    ref = mn.compile(r.graph, loss=r.loss, optimizer=_optimizer(opt), backend="reference")
    ref.init_params(3)
    ref_losses = [ref.step(x=x[s], y=y[s]).loss for s in range(STEPS)]
    ref.save(ckpt)
    want = ref.get_state()
    assert sorted(state) == sorted(want), (sorted(state), sorted(want))
    return dp, {"rel_err": max(float(np.linalg.norm(state[n] - want[n])
                                     / max(np.linalg.norm(want[n]), 1e-30)) for n in want),
                "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "buckets": dp.stats.buckets, "segments": dp.stats.segments}


def _worker_failure(out: str, how: str) -> None:
    """``die``: rank 0 checkpoints after every step; rank 1 dies at step FAIL_AT.  ``hang``:
    rank 1 stops answering; rank 0's next collective must give up after TIMEOUT seconds."""
    from meganeura import distributed as dist_mn

    ctx = dist_mn.init(timeout=TIMEOUT, open_device=how != "hang")
    clock, err = [time.perf_counter()], None  # start of the last collective or step
    try:
        if how == "hang":
            if ctx.rank == 1:
                time.sleep(600)  # the test kills this process
            clock[0] = time.perf_counter()
            ctx.barrier()
        else:
            _steps_until_death(ctx, out, clock)
    except dist_mn.DistributedError as e:
        err = str(e)
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"error": err, "seconds": time.perf_counter() - clock[0]}, f)
    ctx.abort(3 if err else 0)


def _steps_until_death(ctx, out: str, clock: list) -> None:
    from meganeura import distributed as dist_mn

    m = _model(B)
    dp = dist_mn.DataParallel(ctx, m.graph, m.loss, _optimizer("adamw"))
    x, y = _data(B * ctx.world_size)
    for s in range(STEPS):
        if ctx.rank == 1 and s == FAIL_AT:
            os._exit(17)
        clock[0] = time.perf_counter()
        dp.step(**dist_mn.shard_batch({"x": x[s], "y": y[s]}, ctx.rank, ctx.world_size))
        dp.save(os.path.join(out, "ckpt.safetensors"))


# ------------------------------------------------------------------------------ launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT,
                                         env.get("PYTHONPATH", "")])
    env["MEGANEURA_DP_SHARE_ADAPTER"] = "1"  # both ranks on the one (CPU) adapter
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _torchrun(args, timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.gpu
def test_two_ranks_equal_one_rank_with_the_global_batch(tmp_path):
    """2 ranks x batch b == 1 session x batch 2b after 10 steps, SGD (momentum) and AdamW
    (schedule, weight decay), without and with 2-micro-batch accumulation; and the single
    session's checkpoint resumes on the 2 ranks (a different number of ranks)."""
    proc = _torchrun([HERE, "equivalence", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert sorted(report) == ["adamw-k1", "adamw-k2", "resume", "sgd-k1", "sgd-k2"]
    for case in ("adamw-k1", "adamw-k2", "sgd-k1", "sgd-k2"):
        r = report[case]
        assert r["rel_err"] < 2e-5, (case, r)
        assert r["loss_err"] < 1e-5, (case, r)
        assert r["segments"] >= 2, (case, r)  # the readback overlaps the backward
    # a single-process checkpoint of the global batch resumes on 2 ranks, on each rank
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())["resume"]
        assert r == {"max_diff": 0.0, "step": STEPS, "names_match": True}, (rank, r)


def _launch_by_hand(out, how: str):
    """Two ranks with the torchrun environment but no torchrun (which would kill the
    survivor as soon as a rank dies, before it can report)."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, HERE, how, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _run_by_hand(out, how: str) -> tuple[int, dict]:
    procs = _launch_by_hand(out, how)
    try:
        out0, _ = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        procs[1].communicate()
    assert procs[0].returncode == 3, out0[-4000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.gpu
def test_a_rank_that_dies_stops_the_others_with_a_clear_error_and_a_valid_checkpoint(tmp_path):
    import meganeura as mn

    r = _run_by_hand(tmp_path, "die")
    assert "rank 0 of 2: all-reduce of gradients at step 4 failed" in r["error"], r
    assert "last checkpoint" in r["error"] and r["seconds"] < TIMEOUT, r
    m = _model(B)  # the last checkpoint (step 3) loads into a single-process session
    sess = mn.compile(m.graph, loss=m.loss, optimizer=_optimizer("adamw"),
                      backend="reference")
    sess.load(tmp_path / "ckpt.safetensors")
    assert sess.step_count == FAIL_AT


def test_a_rank_that_hangs_stops_the_others_after_the_timeout(tmp_path):
    r = _run_by_hand(tmp_path, "hang")
    assert "rank 0 of 2: barrier failed" in r["error"] and "timeout" in r["error"], r
    assert TIMEOUT * 0.8 <= r["seconds"] < TIMEOUT + 15, r


@pytest.mark.gpu
def test_cli_train_distributed_under_torchrun_resumes_on_one_rank(tmp_path):
    """``meganeura train --distributed`` on 2 ranks writes one checkpoint (rank 0) that a
    plain single-process ``--resume`` of the same run (same global batch) accepts: its
    fingerprint is the global-batch graph's."""
    common = ["--out", str(tmp_path), "--quiet", "--batch-size", "128", "--seed", "1"]
    proc = _torchrun(["-m", "meganeura.cli", "train", "--distributed", "--epochs", "1",
                      *common])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("test accuracy") == 1, proc.stdout  # rank 0 reports
    assert "2 ranks" in proc.stdout
    resumed = subprocess.run([sys.executable, "-m", "meganeura.cli", "train", "--epochs", "1",
                              "--resume", *common], env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    per_epoch = 1437 // 128
    assert f"resuming from {tmp_path / 'mlp.safetensors'}: epoch 1/1, step {per_epoch}" \
        in resumed.stdout, resumed.stdout
    assert "test accuracy" in resumed.stdout


def test_rank_info_names_what_torchrun_did_not_set():
    from meganeura.distributed import DistributedError, rank_info

    with pytest.raises(DistributedError, match="not launched by torchrun: LOCAL_RANK"):
        rank_info({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(DistributedError, match=r"RANK=2 must lie in \[0, WORLD_SIZE=2\)"):
        rank_info({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                   "MASTER_PORT": "1"})
    info = rank_info({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)


def test_sharding_splits_batches_and_datasets_evenly():
    from meganeura.distributed import shard_batch, shard_indices
    from meganeura.errors import FeedError

    x = np.arange(12).reshape(6, 2)
    parts = [shard_batch({"x": x}, r, 3)["x"] for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(parts), x)
    with pytest.raises(FeedError, match="cannot be split into 4 equal parts"):
        shard_batch({"x": x}, 0, 4)
    idx = [shard_indices(11, r, 2, shuffle=True, seed=5) for r in range(2)]
    assert len(idx[0]) == len(idx[1]) == 5 and not set(idx[0]) & set(idx[1])


def test_buckets_follow_the_backward_and_segments_cover_the_stream():
    """Plain-data check of the bucket planner on a real compiled stream (no device needed:
    the plan is built for the H200's limits)."""
    from meganeura.compile.emit import emit_stream
    from meganeura.compile.memory import NO_GROUPS, make_plan
    from meganeura.compile.passes import run_pipeline
    from meganeura.distributed import GRAD_PREFIX, LOSS, gradient_program, plan_buckets, segments
    from meganeura.kernels.common import make_target

    m = _model(B)
    prog = run_pipeline(gradient_program(m.graph, m.loss))
    plan = make_plan(prog, True, True, True, NO_GROUPS, 32)
    stream = emit_stream(plan, make_target(None), "strict", "infer")
    names = [LOSS] + [GRAD_PREFIX + n for n in m.graph.params]
    buckets = plan_buckets(stream, names, 1)  # one tensor per bucket
    assert sorted(n for b in buckets for n in b.names) == sorted(names)
    readies = [b.ready for b in buckets]
    assert readies == sorted(readies) and readies[0] < len(stream.ops) - 1
    # the last layer's weight gradient is finished before the first layer's
    order = [b.names[0] for b in buckets]
    assert order.index(GRAD_PREFIX + "mlp.1.weight") < order.index(GRAD_PREFIX + "mlp.0.weight")
    segs = segments(buckets, len(stream.ops))
    assert segs[0][0] == 0 and segs[-1][1] == len(stream.ops)
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    assert sorted(id(b) for s in segs for b in s[2]) == sorted(id(b) for b in buckets)


def test_the_core_imports_without_torch_and_init_says_what_to_install():
    code = ("import sys; sys.modules['torch'] = None; import meganeura, meganeura.cli, "
            "meganeura.distributed as d\n"
            "try:\n    d.init()\nexcept d.DistributedError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'meganeura[distributed]'" in proc.stdout


@pytest.mark.gpu
def test_a_batch_norm_gradient_session_compiles_only_its_training_stream(gpu, monkeypatch):
    """A graph with state updates (batch-norm running statistics) steps in its training
    stream; the inference stream of the same gradient program was compiled for nothing (a
    second plan, emit and pipeline set) until it was left out.  One rank, in process."""
    import dataclasses

    from meganeura import distributed as dist_mn
    from meganeura import optim
    from meganeura.errors import FeedError
    from meganeura.models.resnet import PRESETS, resnet

    monkeypatch.setenv("MEGANEURA_DP_SHARE_ADAPTER", "1")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(k, v)
    ctx = dist_mn.init(timeout=30)
    try:
        m = resnet(dataclasses.replace(PRESETS["resnet18-tiny"], image_size=16), 2)
        dp = dist_mn.DataParallel(ctx, m.graph, m.loss, optim.SGD(lr=0.1))
        assert dp.grad.train is not None and dp.grad.infer is None
        assert dp.grad.executable.infer is None
        rng = np.random.default_rng(0)
        feeds = {"x": rng.standard_normal(m.x.shape, np.float32), "y": np.array([1, 3], np.int32)}
        before = dp.get_state()["bn1.running_mean"].copy()
        assert np.isfinite(dp.step(**feeds).loss)
        assert not np.array_equal(dp.get_state()["bn1.running_mean"], before)
        with pytest.raises(FeedError, match="compiled to train only"):
            dp.grad.run(**feeds)
    finally:
        ctx.close()


@pytest.mark.gpu
def test_more_local_ranks_than_adapters_is_an_error_unless_shared(gpu):
    from meganeura.errors import DeviceError
    from meganeura.runtime.device import get_device_at

    with pytest.raises(DeviceError, match=r"adapter 7 was asked for .* has only \d+"):
        get_device_at(7, "wgpu")
    assert get_device_at(7, "wgpu", share=True).adapter_name == gpu.adapter_name


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "equivalence":
        _worker_equivalence(out)
    else:
        _worker_failure(out, mode)
