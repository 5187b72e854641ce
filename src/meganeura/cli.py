"""``meganeura`` command line: ``info`` (WebGPU implementations, adapter, features, limits),
``train`` (a model on the embedded digits dataset, with progress bar, checkpoint and loss plot)
``profile`` (per-kernel GPU times and roofline of a training step), ``tune`` (time the
candidate kernel configurations on this device and cache the fastest), ``export`` (a
trained checkpoint as an artifact folder that ``mn.load_program`` and browsers run;
docs/deploy.md), ``generate`` (stream text from a GGUF file or HF llama folder, optionally with
fine-tuned weights), ``finetune`` (train such a model on prompt/response pairs) and ``embed``
(sentence embeddings).

Errors are one line on stderr (``meganeura: error: …``) and a non-zero exit status, never a
traceback: 2 for bad arguments or settings, 1 for failures while running, 3 when ``train`` ends
below ``--min-accuracy``, 130 (143) when ``train`` was stopped by SIGINT (SIGTERM) — after it
saved a checkpoint that ``--resume`` continues from."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
import time

import numpy as np

from .errors import MeganeuraError

GPU_BACKENDS = ("wgpu", "dawn", "auto")
CKPT_KEYS = ("model", "batch_size", "epochs", "lr", "weight_decay", "seed")


class CLIError(Exception):
    """A bad argument or setting found after parsing (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) pointing at ``--help``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# ------------------------------------------------------------------------- argument types


def _int_at_least(low: int):
    """An argparse type: a whole number >= ``low`` (0 epochs or batches would divide by zero
    further down; a negative seed is refused by numpy's generators)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    return parse


def _float_at_least(low: float, inclusive: bool):
    """An argparse type: a finite number >= ``low`` (> ``low`` unless ``inclusive``)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(x) or x < low or (x == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>=' if inclusive else '>'} {low:g}, got {text}")
        return x

    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _fraction(text: str) -> float:
    """A fraction in [0, 1]: ``--min-accuracy 95`` (meant as percent) is refused, not an
    impossible gate."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= x <= 1.0:
        hint = f" (for {x:g}% write {x / 100:g})" if 1 < x <= 100 else ""
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text}{hint}")
    return x


def _backend(allow_reference: bool):
    """An argparse type accepting the WebGPU implementations (and ``reference`` for train)."""
    names = GPU_BACKENDS + (("reference",) if allow_reference else ())

    def parse(text: str) -> str:
        from .runtime.device import BackendNameError, resolve_backend

        if text.strip().lower() == "reference":
            if allow_reference:
                return "reference"
            raise argparse.ArgumentTypeError("'reference' (the numpy interpreter) has no GPU "
                                             "to inspect; choose wgpu, dawn or auto")
        try:
            return resolve_backend(text)
        except BackendNameError:
            raise argparse.ArgumentTypeError(
                f"unknown backend {text!r}; choose {', '.join(names[:-1])} or {names[-1]}"
            ) from None

    return parse


def _check_env_backend(backend: str | None) -> None:
    """``$MEGANEURA_WEBGPU`` decides when ``--backend`` is absent: check it up front."""
    from .runtime.device import BackendNameError, resolve_backend

    if backend is None:
        try:
            resolve_backend(None)
        except BackendNameError as e:
            raise CLIError(str(e)) from None


# ------------------------------------------------------------------------- shared helpers


def _model(name: str, batch: int):
    from .models.mlp import mlp_classifier

    if name == "mlp":
        return mlp_classifier(batch)
    from .models.cnn import digits_cnn

    return digits_cnn(batch)


def _optimizer(args, steps_total: int):
    from . import optim

    sched = optim.WarmupCosine(args.lr, warmup_steps=min(20, steps_total // 10),
                               total_steps=steps_total, min_lr=args.lr * 0.05)
    return optim.AdamW(lr=sched, weight_decay=args.weight_decay)


def _check_batch(batch_size: int, n: int) -> None:
    if batch_size > n:
        raise CLIError(f"--batch-size {batch_size} is larger than the {n} training images")


def _prepare_out(out: str) -> None:
    """Create ``--out`` and prove it writable before any training time is spent."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out!r} is a file, not a directory")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise CLIError(f"--out {out!r} is not a writable directory "
                       f"({e.strerror or e})") from None


def _open_backend(backend: str | None) -> None:
    """Open the GPU device now, so a missing driver or package is reported before the data
    and models are built."""
    _check_env_backend(backend)
    if backend != "reference":
        from .runtime.device import get_device

        get_device(backend)


# ------------------------------------------------------------------------- info


def cmd_info(args) -> int:
    from .runtime.device import get_device

    _check_env_backend(args.backend)
    dev = get_device(args.backend)
    print(json.dumps(dev.describe(), indent=2, default=str))
    return 0


# ------------------------------------------------------------------------- train


class _StopOnSignal:
    """SIGINT/SIGTERM while training: remember the signal so the loop stops after the current
    step and saves a checkpoint; a second signal aborts at once (the last epoch's checkpoint
    stays intact, saves being atomic).  Handlers are restored on exit."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> _StopOnSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except (ValueError, OSError):  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class _Run:
    """Progress of a training run: completed epochs, batches done in the next epoch, the loss
    of every step; stored in the checkpoint's metadata so ``--resume`` continues exactly."""

    def __init__(self, args, config: dict | None = None, command: str = "train"):
        self.config = config if config is not None else {k: getattr(args, k) for k in CKPT_KEYS}
        self.command = command
        self.epoch, self.batch, self.losses = 0, 0, []

    def metadata(self) -> dict[str, str]:
        return {"cli.config": json.dumps(self.config), "cli.epoch": str(self.epoch),
                "cli.batch": str(self.batch),
                "cli.losses": json.dumps(self.losses)}

    def restore(self, meta: dict[str, str], path: str) -> None:
        """Take over a checkpoint's progress; refuse one from a run with other settings."""
        try:
            config = json.loads(meta["cli.config"])
            epoch, batch = int(meta["cli.epoch"]), int(meta["cli.batch"])
            losses = [float(x) for x in json.loads(meta["cli.losses"])]
        except (KeyError, ValueError, TypeError):
            raise CLIError(f"--resume: {path!r} was not written by 'meganeura "
                           f"{self.command}'") from None
        diff = [f"--{k.replace('_', '-')} {config.get(k)!r}" for k in self.config
                if config.get(k) != self.config[k]]
        if diff:
            raise CLIError(f"--resume: {path!r} comes from a run with " + ", ".join(diff)
                           + "; pass the same options or another --out")
        if not (0 <= epoch <= self.config["epochs"] and batch >= 0):
            raise CLIError(f"--resume: {path!r} has bad progress (epoch {epoch})")
        self.epoch, self.batch, self.losses = epoch, batch, losses


def _save(sess, path: str, run: _Run) -> None:
    from .checkpoint import save_checkpoint

    if hasattr(sess, "ctx"):  # --distributed: rank 0 writes, in the same format
        sess.save(path, extra=run.metadata())
        return
    save_checkpoint(path, sess.get_state(), sess.program.model_fingerprint, sess.step_count,
                    extra=run.metadata())


def _compile_distributed(args, total: int, n_test: int):
    """--distributed: this rank's share of every --batch-size batch on its own adapter; the
    checkpoint carries the global-batch graph's fingerprint, so it is interchangeable with a
    single-process run's (and resumable on any number of ranks)."""
    from . import compile, distributed

    if args.backend == "reference":
        raise CLIError("--distributed runs on a GPU backend, not 'reference'")
    ctx = distributed.init(args.backend)
    if args.batch_size % ctx.world_size:
        raise CLIError(f"--batch-size {args.batch_size} does not split evenly into "
                       f"{ctx.world_size} ranks")
    t0 = time.perf_counter()
    m = _model(args.model, args.batch_size // ctx.world_size)
    sess = distributed.DataParallel(
        ctx, m.graph, m.loss, _optimizer(args, total), precision=args.precision,
        seed=args.seed, fingerprint=_model(args.model, args.batch_size).graph.fingerprint())
    me = _model(args.model, n_test)
    evals = compile(me.graph, outputs={"logits": me.logits}, precision=args.precision,
                    device=ctx.device)
    if ctx.rank == 0:
        print(f"model {args.model}: {sum(p.size for p in m.graph.params.values())} parameters; "
              f"{ctx.world_size} ranks, {args.batch_size // ctx.world_size} examples each; "
              f"rank 0 device: {ctx.device.adapter_name}; "
              f"compile {time.perf_counter() - t0:.2f} s")
    return sess, evals


def _compile(args, total: int, n_test: int):
    from . import compile

    if args.distributed:
        return _compile_distributed(args, total, n_test)
    t0 = time.perf_counter()
    m = _model(args.model, args.batch_size)
    sess = compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=_optimizer(args, total), precision=args.precision,
                   backend=args.backend)
    me = _model(args.model, n_test)
    evals = compile(me.graph, outputs={"logits": me.logits}, precision=args.precision,
                    backend=args.backend)
    sess.init_params(args.seed)
    dev = getattr(sess, "dev", None)
    where = dev.describe().get("adapter", "?") if dev else "numpy reference"
    print(f"model {args.model}: {sum(p.size for p in m.graph.params.values())} parameters; "
          f"device: {where}; compile {time.perf_counter() - t0:.2f} s")
    if args.precision == "fast" and hasattr(sess, "kernel_variants"):
        kinds = sess.kernel_variants()["train"]
        n_tc = sum(n for k, n in kinds.items() if k.startswith("sgmat"))
        print(f"precision fast: {n_tc} matmuls of the training step on tensor cores"
              if n_tc else "precision fast: this device has no f16 subgroup matrices, so the "
              "program is the strict one (try --backend dawn on an NVIDIA GPU)")
    return sess, evals


def _resume(sess, ckpt: str, run: _Run) -> None:
    from .checkpoint import read_metadata

    if not os.path.exists(ckpt):
        hint = ("point --out at the run's directory" if run.command == "train"
                else "give the finetune-state.safetensors an earlier run saved")
        raise CLIError(f"--resume: no checkpoint {ckpt!r} to resume from (run without "
                       f"--resume first, or {hint})")
    run.restore(read_metadata(ckpt), ckpt)
    sess.load(ckpt)
    print(f"resuming from {ckpt}: epoch {run.epoch}/{run.config['epochs']}, "
          f"step {sess.step_count}")


def _train_epochs(sess, data, args, run: _Run, ckpt: str, stop: _StopOnSignal) -> bool:
    """Train from ``run``'s position to the last epoch, saving after every epoch; False when a
    signal stopped it (after saving the position reached)."""
    from tqdm import tqdm

    from .io.datasets import batches

    xtr, ytr = data
    per_epoch = len(xtr) // args.batch_size
    bar = tqdm(total=per_epoch * args.epochs, initial=run.epoch * per_epoch + run.batch,
               desc="train", unit="step", disable=args.quiet or _rank(sess) != 0)
    try:
        while run.epoch < args.epochs:
            pending = []
            for i, (xb, yb) in enumerate(batches(xtr, ytr, args.batch_size, shuffle=True,
                                                 seed=args.seed + run.epoch, drop_last=True)):
                if i < run.batch:  # done before the interruption this resumes
                    continue
                step = sess.step_global if args.distributed else sess.step
                pending.append(step(x=xb, y=yb))
                bar.update(1)
                if stop.signum is not None:
                    break
            run.losses += [r.loss for r in pending]  # one GPU sync per epoch
            run.batch += len(pending)
            if run.batch >= per_epoch:
                run.epoch, run.batch = run.epoch + 1, 0
                bar.set_postfix(epoch=run.epoch, loss=f"{np.mean(run.losses[-per_epoch:]):.4f}")
            _save(sess, ckpt, run)
            if stop.signum is not None:
                return False
    finally:
        bar.close()
    return True


def _rank(sess) -> int:
    return sess.ctx.rank if hasattr(sess, "ctx") else 0


def cmd_train(args) -> int:
    if not args.distributed:
        return _cmd_train(args)
    from .distributed import Context, DistributedError

    try:
        return _cmd_train(args)
    except DistributedError as e:  # the process group is broken: report and leave now
        print(f"meganeura: error: {e}", file=sys.stderr)
        Context.abort(1)


def _cmd_train(args) -> int:
    from .io.datasets import load_digits

    _prepare_out(args.out)
    if not args.distributed:  # (--distributed opens this rank's adapter itself)
        _open_backend(args.backend)
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    _check_batch(args.batch_size, len(xtr))
    per_epoch = len(xtr) // args.batch_size
    sess, evals = _compile(args, per_epoch * args.epochs, len(xte))
    ckpt = os.path.join(args.out, f"{args.model}.safetensors")
    run = _Run(args)
    if args.resume:
        _resume(sess, ckpt, run)
    t0, step0 = time.perf_counter(), sess.step_count
    with _StopOnSignal() as stop:
        finished = _train_epochs(sess, (xtr, ytr), args, run, ckpt, stop)
    if not finished:
        name = signal.Signals(stop.signum).name
        print(f"meganeura: {name} at epoch {run.epoch}/{args.epochs} (step {sess.step_count}); "
              f"saved {ckpt}; continue with --resume", file=sys.stderr)
        return 128 + stop.signum
    evals.set_params(sess.get_params())
    if _rank(sess) != 0:  # every rank holds the same parameters: rank 0 reports
        sess.ctx.close()
        return 0
    acc = float((evals.run(x=xte)["logits"].argmax(-1) == yte).mean())
    print(f"final loss {np.mean(run.losses[-per_epoch:]):.4f}; test accuracy {acc * 100:.2f}% "
          f"({len(xte)} images); {sess.step_count - step0} steps in "
          f"{time.perf_counter() - t0:.1f} s")
    png = os.path.join(args.out, f"{args.model}-loss.png")
    _plot(run.losses, png, f"{args.model} on digits — test accuracy {acc * 100:.1f}%")
    print(f"saved {ckpt} and {png}")
    if acc < args.min_accuracy:
        print(f"meganeura: test accuracy {acc:.4f} ({acc * 100:.2f}%) is below --min-accuracy "
              f"{args.min_accuracy:g}", file=sys.stderr)
        return 3
    return 0


def _plot(losses, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------- profile


def cmd_profile(args) -> int:
    from . import compile
    from .io.datasets import load_digits

    _open_backend(args.backend)
    xtr, ytr = load_digits("train")
    _check_batch(args.batch_size, len(xtr))
    m = _model(args.model, args.batch_size)
    sess = compile(m.graph, loss=m.loss, optimizer=_optimizer(args, 100), backend=args.backend)
    xb, yb = xtr[: args.batch_size], ytr[: args.batch_size]
    table = sess.profile(steps=args.steps, repeats=args.repeats, x=xb, y=yb.astype(np.int32))
    print(table)
    if args.trace:
        sess.export_trace(args.trace)
        print(f"trace written to {args.trace}")
    return 0


def cmd_tune(args) -> int:
    """Time the candidate configurations of every kernel of the model's training step and
    inference run on this device and save the fastest in the tuning cache, so later compiles
    (``tune="cache"``, the default) pick them up without timing anything."""
    from . import compile
    from .io.datasets import load_digits

    _open_backend(args.backend)
    xtr, _ = load_digits("train")
    _check_batch(args.batch_size, len(xtr))
    m = _model(args.model, args.batch_size)
    t0 = time.perf_counter()
    sess = compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=_optimizer(args, 100), backend=args.backend,
                   precision=args.precision, tune=True)
    rep = sess.tuning
    print(f"tuned {rep.timed} kernel configurations ({rep.cached} already cached, "
          f"{rep.changed} kernels differ from the heuristic) in "
          f"{time.perf_counter() - t0:.1f} s; cache: {_tune_cache_path()}")
    return 0


# ------------------------------------------------------------------------- export


def cmd_export(args) -> int:
    """A ``meganeura train`` checkpoint as an inference artifact for ``--batch-size`` examples,
    compiled portable (WebGPU's guaranteed limits, no optional features) so that browsers run
    it too (web/meganeura.js)."""
    from . import compile
    from .checkpoint import read_checkpoint

    config = _checkpoint_config(args.checkpoint)
    _open_backend(args.backend)
    tensors, _ = read_checkpoint(args.checkpoint)
    m = _model(config["model"], args.batch_size)
    sess = compile(m.graph, outputs={"logits": m.logits}, backend=args.backend, portable=True)
    try:
        sess.set_params({n: tensors[n] for n in sess.param_names}, strict=True)
    except KeyError as e:
        raise CLIError(f"--checkpoint {args.checkpoint!r} lacks the parameter {e} of the "
                       f"{config['model']} model") from None
    t0 = time.perf_counter()
    sess.export(args.out)
    out = args.out
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"exported {config['model']} (batch {args.batch_size}) to {out}: "
          f"{size / 1024:.1f} KiB in {time.perf_counter() - t0:.2f} s")
    return 0


def _checkpoint_config(path: str) -> dict:
    """The settings ``meganeura train`` stored in its checkpoint (which model it trained)."""
    from .checkpoint import read_metadata

    if not os.path.isfile(path):
        raise CLIError(f"--checkpoint {path!r} does not exist (write one with 'meganeura train')")
    try:
        config = json.loads(read_metadata(path)["cli.config"])
        if config["model"] not in ("mlp", "cnn"):
            raise ValueError(config["model"])
    except (KeyError, ValueError, TypeError):
        raise CLIError(f"--checkpoint {path!r} was not written by 'meganeura train'") from None
    return config


def _tune_cache_path() -> str:
    from .compile.tune import default_cache_path

    return str(default_cache_path())


# ------------------------------------------------------------------------- real models


def _load_lm(path: str):
    """(LlamaConfig, params, tokenizer) of a GGUF file or an HF llama folder."""
    if os.path.isdir(path):
        from .io.hf import load_hf
        from .io.tokenizer import from_tokenizer_json

        m = load_hf(path)
        if m.kind != "llama":
            raise CLIError(f"{path}: model_type {m.kind!r} is not a causal LM (llama); "
                           "for encoders use 'meganeura embed'")
        return m.config, m.params, from_tokenizer_json(path, m.hf_config)
    if not os.path.exists(path):
        raise CLIError(f"model {path!r}: no such file or directory")
    from .io.gguf import load_gguf

    m = load_gguf(path)
    return m.config, m.params, m.tokenizer


def _prompt_texts(args) -> list[str]:
    """The prompts: the positional ones, then one per non-blank line of --prompts-file."""
    texts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                texts += [line for line in f.read().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--prompts-file {args.prompts_file!r}: "
                           f"{getattr(e, 'strerror', None) or e}") from None
    if not texts:
        raise CLIError("no prompt: give one or more prompts, or --prompts-file FILE")
    return texts


def _prompt_ids(tok, text: str, raw: bool) -> list[int]:
    if tok.chat_template and not raw:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    ids = tok.encode(text)
    if not ids:
        raise CLIError(f"the prompt {text!r} is empty after tokenization")
    return ids


def cmd_generate(args) -> int:
    """Complete the prompts: prefill once, then one KV-cache decode step per token.  One
    prompt streams its text; several run as one batch (left-padded, each row as if alone)
    and print each answer.  Text goes to stdout, timings (time to first token, tokens/s) to
    stderr."""
    from .generate import LlamaGenerator, left_pad

    _open_backend(args.backend)
    texts = _prompt_texts(args)
    t0 = time.perf_counter()
    cfg, params, tok = _load_lm(args.model)
    if args.checkpoint:
        from .finetune import load_finetuned

        params = load_finetuned(args.checkpoint, params)
    prompts = [_prompt_ids(tok, t, args.raw) for t in texts]
    max_len = max(map(len, prompts)) + args.max_new_tokens
    if max_len > cfg.max_position_embeddings:
        raise CLIError(f"prompt ({max(map(len, prompts))} tokens) + --max-new-tokens "
                       f"{args.max_new_tokens} exceed the model's context of "
                       f"{cfg.max_position_embeddings}")
    gen = LlamaGenerator(cfg, params, batch=len(prompts), max_len=max_len, backend=args.backend)
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)
    ids, start = left_pad(prompts, pad)
    gen.prefill_session(ids.shape[1], bool(start.any()))  # compile now: timings = generation
    t_load = time.perf_counter() - t0
    rows, timing = _stream_rows(gen, tok, ids, start, args)
    n = sum(len(r) for r in rows)
    print(f"[{len(prompts)} prompt(s), {int((ids.shape[1] - start).sum())} prompt tokens, {n} "
          f"generated; load+compile {t_load:.1f} s; {timing}]", file=sys.stderr)
    return 0


def _stream_rows(gen, tok, ids, start, args) -> tuple[list[list[int]], str]:
    """Run the generation; a single row's text is written as it comes, several rows' answers
    once done.  Returns the new tokens of each row (up to its end-of-text) and a timing line."""
    rows: list[list[int]] = [[] for _ in range(len(ids))]
    done = np.zeros(len(ids), dtype=bool)
    shown, t_first, steps = "", None, 0
    t1 = time.perf_counter()
    for t in gen.stream(ids, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                        tok.eos_id, args.top_p, start=start):
        t_first = t_first or time.perf_counter() - t1
        steps += 1
        for b in np.flatnonzero(~done):
            rows[b].append(int(t[b]))
        done |= t == tok.eos_id
        text = tok.decode(rows[0])
        if len(rows) == 1 and not text.endswith("\ufffd"):  # hold back a partial character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    total = time.perf_counter() - t1
    if len(rows) == 1:
        sys.stdout.write("\n")
    else:
        for b, r in enumerate(rows):
            print(f"--- [{b}] {tok.decode(r)}")
    rate = (f"{(steps - 1) * len(rows) / (total - t_first):.1f} tokens/s (all rows)"
            if steps > 1 and total > t_first else "n/a")
    return rows, f"time to first token {t_first * 1e3:.0f} ms; decode {rate}"


def _finetune_data(args, tok, cfg):
    """(ids, labels) of the data file, checked before any compile time is spent."""
    from .finetune import encode_pairs, read_pairs

    if args.seq_len > cfg.max_position_embeddings:
        raise CLIError(f"--seq-len {args.seq_len} exceeds the model's context of "
                       f"{cfg.max_position_embeddings}")
    pairs = read_pairs(args.data)
    if args.batch_size > len(pairs):
        raise CLIError(f"--batch-size {args.batch_size} is larger than the {len(pairs)} "
                       f"examples in {args.data}")
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)
    ids, labels, cut = encode_pairs(tok, pairs, args.seq_len, args.data, pad)
    n_resp = int((labels != -100).sum())
    print(f"{args.data}: {len(pairs)} examples, {n_resp} response tokens"
          + (f"; {cut} responses cut at --seq-len {args.seq_len}" if cut else ""))
    return ids, labels


FINETUNE_KEYS = ("model", "data", "epochs", "batch_size", "seq_len", "lr", "weight_decay",
                 "seed")


def _finetune_run(args) -> _Run:
    """The run's progress, keyed by the settings a resumed run must share (files by their
    absolute path, so a resume from another directory is the same run)."""
    config = {k: getattr(args, k) for k in FINETUNE_KEYS}
    config["model"], config["data"] = os.path.abspath(args.model), os.path.abspath(args.data)
    return _Run(args, config, command="finetune")


def _finetune_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The shuffled example order of one epoch: a function of (seed, epoch) alone, so a
    resumed run sees exactly the batches the uninterrupted run would have."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _finetune_save(sess, args, run: _Run, state: str) -> None:
    """The parameters for ``generate --checkpoint`` (HF names) and the full training state
    (optimizer moments, step, progress) for ``--resume``; both atomic."""
    from .checkpoint import save_checkpoint

    save_checkpoint(os.path.join(args.out, "finetuned.safetensors"), sess.get_params(),
                    sess.program.model_fingerprint, sess.step_count,
                    extra={"finetune.epoch": str(run.epoch),
                           "finetune.model": os.path.abspath(args.model)})
    save_checkpoint(state, sess.get_state(), sess.program.model_fingerprint, sess.step_count,
                    extra=run.metadata())


def _finetune_epochs(sess, ids, labels, args, run: _Run, state: str, stop) -> bool:
    """AdamW over shuffled batches from ``run``'s position; the bar shows the loss and
    tokens/s (all batch x seq-len positions, padding included: what the device computes).
    Saves after every epoch, and when ``--stop-after`` steps are done or a signal arrives
    (then returns False)."""
    from tqdm import tqdm

    per_epoch = len(ids) // args.batch_size
    t0, tokens, steps = time.perf_counter(), 0, 0
    with tqdm(total=per_epoch * args.epochs, initial=run.epoch * per_epoch + run.batch,
              desc="finetune", unit="step", disable=args.quiet) as bar:
        while run.epoch < args.epochs:
            order = _finetune_order(args.seed, run.epoch, len(ids))
            while run.batch < per_epoch:
                sel = order[run.batch * args.batch_size:(run.batch + 1) * args.batch_size]
                run.losses.append(sess.step(ids=ids[sel], labels=labels[sel]).loss)
                run.batch, steps = run.batch + 1, steps + 1
                tokens += sel.size * args.seq_len
                bar.set_postfix(epoch=run.epoch + 1, loss=f"{run.losses[-1]:.4f}",
                                tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
                bar.update(1)
                if stop.signum is not None or steps == args.stop_after:
                    _finetune_save(sess, args, run, state)
                    return False
            run.epoch, run.batch = run.epoch + 1, 0
            _finetune_save(sess, args, run, state)
    return True


def cmd_finetune(args) -> int:
    """Fine-tune a GGUF file or HF llama folder on prompt/response pairs (JSON lines): chat
    template around each pair, loss on the response tokens only, AdamW; after every epoch the
    parameters (HF names, for ``generate --checkpoint``) and the full training state (for
    ``--resume``) are saved atomically."""
    from .finetune import build_session

    _prepare_out(args.out)
    _open_backend(args.backend)
    t0 = time.perf_counter()
    cfg, params, tok = _load_lm(args.model)
    ids, labels = _finetune_data(args, tok, cfg)
    per_epoch = len(ids) // args.batch_size
    sess = build_session(cfg, params, args.batch_size, args.seq_len,
                         _optimizer(args, per_epoch * args.epochs), args.backend)
    print(f"model {args.model}: {cfg.n_params} parameters; load+compile "
          f"{time.perf_counter() - t0:.1f} s")
    state = os.path.join(args.out, "finetune-state.safetensors")
    run = _finetune_run(args)
    if args.resume:
        _resume(sess, args.resume, run)
    t1, step0 = time.perf_counter(), sess.step_count
    with _StopOnSignal() as stop:
        finished = _finetune_epochs(sess, ids, labels, args, run, state, stop)
    ckpt = os.path.join(args.out, "finetuned.safetensors")
    done = f"{sess.step_count - step0} steps in {time.perf_counter() - t1:.1f} s; saved {ckpt}"
    if not finished:
        why = (signal.Signals(stop.signum).name if stop.signum is not None
               else f"--stop-after {args.stop_after}")
        print(f"stopped ({why}) at epoch {run.epoch + 1}/{args.epochs}, step "
              f"{sess.step_count}; {done}; continue with --resume {state}")
        return 128 + stop.signum if stop.signum is not None else 0
    print(f"loss {np.mean(run.losses[:per_epoch]):.4f} (first epoch) -> "
          f"{np.mean(run.losses[-per_epoch:]):.4f} (last epoch); {done}")
    print(f"chat with it: meganeura generate {args.model} \"PROMPT\" --checkpoint {ckpt}")
    return 0


def cmd_embed(args) -> int:
    """Sentence embeddings: the vectors (or a .npy file) and, for several sentences, their
    cosine similarity table."""
    from .embed import SentenceEncoder

    _open_backend(args.backend)
    if not os.path.isdir(args.model):
        raise CLIError(f"model {args.model!r}: expected a sentence-transformers / HF folder")
    if args.out and not args.out.endswith(".npy"):
        raise CLIError(f"--out {args.out!r} must end in .npy")
    enc = SentenceEncoder(args.model, backend=args.backend)
    t0 = time.perf_counter()
    vecs = enc.encode(args.sentences)
    dt = time.perf_counter() - t0
    if args.out:
        np.save(args.out, vecs)
        print(f"saved {vecs.shape[0]} embeddings of dimension {vecs.shape[1]} to {args.out}")
    else:
        for s, v in zip(args.sentences, vecs):
            print(f"{s!r}: [" + " ".join(f"{x:.6f}" for x in v) + "]")
    if len(args.sentences) > 1:
        n = np.linalg.norm(vecs, axis=-1, keepdims=True)
        sim = (vecs / np.maximum(n, 1e-12)) @ (vecs / np.maximum(n, 1e-12)).T
        print("cosine similarity:")
        print("      " + " ".join(f"{j:>6d}" for j in range(len(sim))))
        for i, row in enumerate(sim):
            print(f"{i:>5d} " + " ".join(f"{x:6.3f}" for x in row) + f"  {args.sentences[i]}")
    print(f"[{len(vecs)} sentences in {dt:.2f} s]", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------- main


def _plain(doc: str) -> str:
    """A docstring without reST markup, for ``--help``."""
    return re.sub(r"``(.*?)``", r"\1", doc, flags=re.S)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option (not the uninformative None/False of flags and of
    options whose help says what happens without them); descriptions keep their paragraphs."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"], help="model to train")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="examples per step")
    p.add_argument("--lr", type=_float_at_least(0.0, False), default=3e-3,
                   help="peak learning rate (warm-up, then cosine decay)")
    p.add_argument("--weight-decay", type=_float_at_least(0.0, True), default=0.01,
                   help="AdamW weight decay")


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog="meganeura", description=_plain(__doc__), formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    pi = sub.add_parser("info", help="WebGPU implementations, adapter, features and limits",
                        formatter_class=_HelpFormatter)
    pi.add_argument("--backend", type=_backend(False), default=None,
                    help="wgpu | dawn | auto (default: $MEGANEURA_WEBGPU, else wgpu)")
    pt = sub.add_parser("train", help="train a model on the embedded digits dataset",
                        formatter_class=_HelpFormatter)
    _add_common(pt)
    pt.add_argument("--epochs", type=_positive_int, default=20, help="passes over the data")
    pt.add_argument("--seed", type=_int_at_least(0), default=0,
                    help="initialisation and shuffling seed")
    pt.add_argument("--backend", type=_backend(True), default=None,
                    help="wgpu | dawn | auto | reference (default: $MEGANEURA_WEBGPU, else wgpu)")
    pt.add_argument("--precision", default="strict", choices=["strict", "fast"],
                    help="fast: f16 tensor-core matmuls where the device has them")
    pt.add_argument("--out", default="runs",
                    help="directory for the checkpoint (saved every epoch) and loss plot")
    pt.add_argument("--resume", action="store_true",
                    help="continue the run whose checkpoint is in --out")
    pt.add_argument("--min-accuracy", type=_fraction, default=0.0,
                    help="exit with status 3 if the test accuracy is below this fraction (0-1)")
    pt.add_argument("--quiet", action="store_true", help="no progress bar")
    pt.add_argument("--distributed", action="store_true",
                    help="data parallel over the processes torchrun started (gloo; one GPU "
                    "adapter per local rank); --batch-size is the global batch, split evenly "
                    "across ranks; rank 0 writes the checkpoint and reports (docs/distributed.md)")
    pp = sub.add_parser("profile", help="per-kernel GPU times of a training step",
                        formatter_class=_HelpFormatter)
    _add_common(pp)
    pp.add_argument("--steps", type=_positive_int, default=10, help="training steps to time")
    pp.add_argument("--repeats", type=_nonnegative_int, default=None,
                    help="back-to-back copies of each kernel beyond the first in its timed "
                    "pass, for its in-stream time (default 7; 0: each kernel alone in its "
                    "pass, pass overhead included)")
    pp.add_argument("--backend", type=_backend(False), default=None,
                    help="wgpu | dawn | auto (default: $MEGANEURA_WEBGPU, else wgpu)")
    pp.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    pn = sub.add_parser("tune", help="pre-tune the kernels of a model on this device",
                        formatter_class=_HelpFormatter)
    _add_common(pn)
    pn.add_argument("--backend", type=_backend(False), default=None,
                    help="wgpu | dawn | auto (default: $MEGANEURA_WEBGPU, else wgpu)")
    pn.add_argument("--precision", default="strict", choices=["strict", "fast"],
                    help="fast: f16 tensor-core matmuls where the device has them")
    pe = sub.add_parser("export", help="a trained checkpoint as an artifact for browsers and "
                        "mn.load_program", description=_plain(cmd_export.__doc__),
                        formatter_class=_HelpFormatter)
    pe.add_argument("--checkpoint", default="runs/mlp.safetensors",
                    help="checkpoint written by 'meganeura train'")
    pe.add_argument("--out", default="web/demo/mlp", help="artifact folder to write (replaced)")
    pe.add_argument("--batch-size", type=_positive_int, default=1,
                    help="examples per run of the exported program")
    pe.add_argument("--backend", type=_backend(False), default=None,
                    help="wgpu | dawn | auto (default: $MEGANEURA_WEBGPU, else wgpu)")
    _add_model_commands(sub)
    return p


def _add_model_commands(sub) -> None:
    """``generate`` and ``embed``: the real-model commands (docs/real-models.md)."""
    pg = sub.add_parser("generate", help="generate text with a GGUF file or HF llama folder",
                        formatter_class=_HelpFormatter)
    pg.add_argument("model", help="a .gguf file or an HF folder (config.json, safetensors, "
                    "tokenizer.json)")
    pg.add_argument("prompt", nargs="*", help="the prompt(s) (each wrapped in the model's chat "
                    "template unless --raw); several run as one batch")
    pg.add_argument("--prompts-file", default=None,
                    help="more prompts, one per line (all run as one batch)")
    pg.add_argument("--max-new-tokens", type=_positive_int, default=64,
                    help="tokens to generate at most (stops at the end-of-text token)")
    pg.add_argument("--temperature", type=_float_at_least(0.0, True), default=0.0,
                    help="0: greedy; > 0: sample from softmax(logits / temperature)")
    pg.add_argument("--top-p", type=_fraction, default=1.0,
                    help="nucleus sampling: keep the most likely tokens up to this probability")
    pg.add_argument("--top-k", type=_positive_int, default=None,
                    help="sample among the k most likely tokens")
    pg.add_argument("--seed", type=_int_at_least(0), default=0, help="sampling seed")
    pg.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    pg.add_argument("--checkpoint", default=None,
                    help="fine-tuned weights (.safetensors written by 'meganeura finetune')")
    pg.add_argument("--backend", type=_backend(True), default=None,
                    help="wgpu | dawn | auto | reference (default: $MEGANEURA_WEBGPU, else wgpu)")
    _add_finetune(sub)
    pm = sub.add_parser("embed", help="sentence embeddings with a BERT-family folder",
                        formatter_class=_HelpFormatter)
    pm.add_argument("model", help="a sentence-transformers / HF bert folder")
    pm.add_argument("sentences", nargs="+", help="one or more sentences")
    pm.add_argument("--out", default=None, help="save the embeddings to this .npy file")
    pm.add_argument("--backend", type=_backend(True), default=None,
                    help="wgpu | dawn | auto | reference (default: $MEGANEURA_WEBGPU, else wgpu)")


def _add_finetune(sub) -> None:
    pf = sub.add_parser("finetune", help="fine-tune a GGUF file or HF llama folder on "
                        "prompt/response pairs", description=_plain(cmd_finetune.__doc__),
                        formatter_class=_HelpFormatter)
    pf.add_argument("model", help="a .gguf file or an HF llama folder")
    pf.add_argument("--data", required=True,
                    help="JSON lines, one {\"prompt\": ..., \"response\": ...} per line")
    pf.add_argument("--epochs", type=_positive_int, default=3, help="passes over the data")
    pf.add_argument("--lr", type=_float_at_least(0.0, False), default=1e-4,
                    help="peak learning rate (warm-up, then cosine decay)")
    pf.add_argument("--weight-decay", type=_float_at_least(0.0, True), default=0.0,
                    help="AdamW weight decay")
    pf.add_argument("--batch-size", type=_positive_int, default=8, help="examples per step")
    pf.add_argument("--seq-len", type=_int_at_least(2), default=128,
                    help="tokens per example (padded or truncated to this)")
    pf.add_argument("--seed", type=_int_at_least(0), default=0, help="shuffling seed")
    pf.add_argument("--out", default="runs/finetune",
                    help="directory for finetuned.safetensors (saved every epoch)")
    pf.add_argument("--backend", type=_backend(True), default=None,
                    help="wgpu | dawn | auto | reference (default: $MEGANEURA_WEBGPU, else wgpu)")
    pf.add_argument("--quiet", action="store_true", help="no progress bar")
    pf.add_argument("--resume", default=None, metavar="CKPT",
                    help="continue a run from its finetune-state.safetensors (same settings)")
    pf.add_argument("--stop-after", type=_positive_int, default=None, metavar="STEPS",
                    help="stop (saving a resumable state) after this many steps of this call")


def main(argv=None) -> int:
    """Run the command line; every failure is one ``meganeura: error:`` line and an exit
    status (see the module docstring), not a traceback."""
    p = _parser()
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        return 2
    try:
        commands = {"info": cmd_info, "train": cmd_train, "profile": cmd_profile,
                    "tune": cmd_tune, "export": cmd_export, "generate": cmd_generate,
                    "embed": cmd_embed, "finetune": cmd_finetune}
        return commands[args.cmd](args)
    except CLIError as e:
        print(f"meganeura: error: {e}", file=sys.stderr)
        return 2
    except (MeganeuraError, OSError) as e:
        print(f"meganeura: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meganeura: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
