"""Mutation testing of the modules where a silent bug costs most (issue 18), with cosmic-ray.

Each module is mutated in a private copy of the tree (never in the checkout you work in), one
mutant at a time, and the narrow test file that owns the module runs against each mutant: a
mutant the tests still pass on ("survived") is either a missing test or an equivalent mutant.

  pip install -e ".[mutation]"            # cosmic-ray, pinned
  nice -n 15 python bench/mutation.py run                     # all modules (hours on 2 cores)
  nice -n 15 python bench/mutation.py run --modules checkpoint
  python bench/mutation.py report                             # counts + survivors (markdown)

Sessions live in ``--workdir`` (default /tmp/mn-mutation); ``run`` resumes an unfinished one
(delete the folder to start over, e.g. after changing the tests).  Not part of CI: too slow.

Why a reduced operator set: cosmic-ray replaces each binary operator by all ten others and each
comparison by all nine others; nearly all of those are killed by any test that runs the line
and multiply the run time by ~5.  We keep one natural replacement per operator (the set mutmut
uses: ``+``↔``-``, ``*``↔``/``, ``<``↔``<=``, ``==``↔``!=``, ``is``↔``is not`` …) and every other
cosmic-ray operator (numbers ±1, ``and``↔``or``, ``not`` added/removed, ``True``↔``False``,
break/continue, exceptions, zero-iteration loops, decorators removed).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CR_VERSION = "8.7.0"


@dataclass(frozen=True)
class Target:
    """One module to mutate, the tests that own it, and (optionally) which code in it counts."""

    name: str
    module: str  # path from the repository root
    tests: tuple[str, ...]
    vjps_only: bool = False  # keep only mutants inside VJP code (ops/elementwise.py)


TARGETS = {
    t.name: t
    for t in (
        Target("reduce", "src/meganeura/kernels/reduce.py", ("tests/kernels/test_reduce.py",)),
        Target("pointwise", "src/meganeura/kernels/pointwise.py",
               ("tests/kernels/test_pointwise.py",)),
        Target("checkpoint", "src/meganeura/checkpoint.py", ("tests/test_checkpoint.py",)),
        Target("elementwise_vjps", "src/meganeura/ops/elementwise.py",
               ("tests/ops/test_elementwise.py",), vjps_only=True),
    )
}

# one replacement per operator (see the module docstring); everything else of these families
# is filtered out before the run
_KEEP_BINARY = ("Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Div", "Mod_Div",
                "Pow_Mul", "LShift_RShift", "RShift_LShift", "BitAnd_BitOr", "BitOr_BitAnd",
                "BitXor_BitAnd")
_KEEP_COMPARE = ("Eq_NotEq", "NotEq_Eq", "Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Is_IsNot",
                 "IsNot_Is", "In_NotIn", "NotIn_In")
_KEEP_UNARY = ("USub_UAdd", "UAdd_USub", "Delete_USub", "Delete_Not", "Delete_Invert")
EXCLUDE_OPERATORS = (
    rf"core/ReplaceBinaryOperator_(?!(?:{'|'.join(_KEEP_BINARY)})$)",
    rf"core/ReplaceComparisonOperator_(?!(?:{'|'.join(_KEEP_COMPARE)})$)",
    rf"core/ReplaceUnaryOperator_(?!(?:{'|'.join(_KEEP_UNARY)})$)",
)

# Survivors judged equivalent (no input can tell them apart), keyed by target, operator and the
# stripped source line, so line moves do not invalidate them; docs/mutation-testing.md says why.
EQUIVALENT: dict[tuple[str, str, str], str] = {}


def _config(t: Target, timeout: float) -> str:
    """The cosmic-ray TOML for one target; the test command imports the mutated copy only."""
    tests = " ".join(t.tests)
    cmd = (f"env PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=src:. {sys.executable} -m pytest -q -x "
           f"-p no:cacheprovider {tests}")
    excl = ", ".join(f"'{e}'" for e in EXCLUDE_OPERATORS)
    return (f'[cosmic-ray]\nmodule-path = "{t.module}"\ntimeout = {timeout}\n'
            f'excluded-modules = []\ntest-command = "{cmd}"\n\n'
            f'[cosmic-ray.distributor]\nname = "local"\n\n'
            f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{excl}]\n")


def _copy_tree(dest: Path) -> None:
    """A private copy of what the tests import (mutations are written to disk)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def vjp_spans(source: str) -> list[tuple[int, int, int, int]]:
    """(line, col, end line, end col) of the VJP code of an op family module: the ``vjp``
    argument (4th) of every ``_unary``/``_binary``/``defop`` registration, and the module's own
    helper functions those reach by name (``_tie_mask``, ``_sum_to`` …), but not op builders
    (``where``, ``exp`` …: their code is the forward, tested by the forward tests)."""
    tree = ast.parse(source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    builders = {n.name for n in funcs.values()
                if any("register_builder" in ast.unparse(d) for d in n.decorator_list)}
    seen: set[str] = set()
    spans: list[tuple[int, int, int, int]] = []

    def add(node: ast.AST) -> None:
        spans.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset))
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Name) and sub.id in funcs and sub.id not in builders
                    and sub.id not in seen):
                seen.add(sub.id)
                add(funcs[sub.id])

    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("_unary", "_binary", "defop") and len(node.args) > 3):
            vjp = node.args[3]
            if not (isinstance(vjp, ast.Constant) and vjp.value is None):
                add(vjp)
    return spans


def _inside(pos: tuple[int, int], spans) -> bool:
    return any((l0, c0) <= pos <= (l1, c1) for l0, c0, l1, c1 in spans)


def _skip_outside_vjps(session: Path, module: Path) -> int:
    """Mark every mutant outside the VJP code as skipped; returns how many remain."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans = vjp_spans(module.read_text())
    with use_db(str(session)) as db:
        skip = [w.job_id for w in db.pending_work_items
                if not all(_inside(tuple(m.start_pos), spans) for m in w.mutations)]
        if skip:
            db.set_multiple_results(skip, WorkResult(output="outside VJP code",
                                                     worker_outcome=WorkerOutcome.SKIPPED))
        return sum(1 for _ in db.pending_work_items)


def _cr(*args: str, cwd: Path) -> None:
    """Run one cosmic-ray command line tool from this interpreter's environment."""
    exe = Path(sys.executable).parent / args[0]
    subprocess.run([str(exe), *args[1:]], cwd=cwd, check=True)


def run_target(t: Target, workdir: Path, timeout: float) -> None:
    """Initialise (once), filter, baseline and execute one target's session (resumable)."""
    home = workdir / t.name
    tree, cfg, session = home / "tree", home / "config.toml", home / "session.sqlite"
    if not session.exists():
        _copy_tree(tree)
        cfg.write_text(_config(t, timeout))
        _cr("cosmic-ray", "init", str(cfg), str(session), cwd=tree)
        _cr("cr-filter-operators", str(session), str(cfg), cwd=tree)
        if t.vjps_only:
            _skip_outside_vjps(session, tree / t.module)
        _cr("cosmic-ray", "baseline", str(cfg), cwd=tree)
    start = time.time()
    _cr("cosmic-ray", "exec", str(cfg), str(session), cwd=tree)
    (home / "exec_seconds").write_text(
        str(time.time() - start + _float(home / "exec_seconds")))


def _float(p: Path) -> float:
    return float(p.read_text()) if p.exists() else 0.0


def summarize(t: Target, workdir: Path) -> tuple[dict, list[dict]]:
    """Counts (killed, timeout, survived, equivalent, incompetent, pending, skipped) and the
    survivors (line, operator, source line, equivalence reason or None) of one session."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    home = workdir / t.name
    lines = (home / "tree" / t.module).read_text().splitlines()
    counts = dict.fromkeys(("killed", "timeout", "survived", "equivalent", "incompetent",
                            "pending", "skipped"), 0)
    survivors = []
    with use_db(str(home / "session.sqlite"), WorkDB.Mode.open) as db:
        done = {job: r for job, r in db.results}
        for item in db.work_items:
            r = done.get(item.job_id)
            m = item.mutations[0]
            if r is None:
                counts["pending"] += 1
            elif r.worker_outcome == WorkerOutcome.SKIPPED:
                counts["skipped"] += 1
            elif r.test_outcome == TestOutcome.SURVIVED:
                text = lines[m.start_pos[0] - 1].strip()
                why = EQUIVALENT.get((t.name, m.operator_name, text))
                counts["equivalent" if why else "survived"] += 1
                survivors.append({"line": m.start_pos[0], "op": m.operator_name,
                                  "occurrence": m.occurrence, "text": text, "why": why,
                                  "diff": r.diff or ""})
            elif r.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            elif (r.output or "").strip() == "timeout":
                counts["timeout"] += 1
            else:
                counts["killed"] += 1
    counts["seconds"] = round(_float(home / "exec_seconds"))
    return counts, sorted(survivors, key=lambda s: (s["line"], s["op"]))


def report(names, workdir: Path, diffs: bool) -> str:
    """Markdown: one row of counts per target, then every survivor."""
    out = ["| module | mutants run | killed | timeout | survived | equivalent | incompetent "
           "| score | pending | exec time |", "|---|---|---|---|---|---|---|---|---|---|"]
    tail = []
    for name in names:
        t = TARGETS[name]
        c, surv = summarize(t, workdir)
        ran = c["killed"] + c["timeout"] + c["survived"] + c["equivalent"] + c["incompetent"]
        caught = c["killed"] + c["timeout"]
        denom = caught + c["survived"]
        score = f"{100 * caught / denom:.1f} %" if denom else "-"
        out.append(f"| {t.module} | {ran} | {c['killed']} | {c['timeout']} | {c['survived']} "
                   f"| {c['equivalent']} | {c['incompetent']} | {score} | {c['pending']} "
                   f"| {c['seconds'] / 60:.0f} min |")
        for s in surv:
            tag = f"equivalent: {s['why']}" if s["why"] else "SURVIVED"
            tail.append(f"- {name}:{s['line']} `{s['op']}` #{s['occurrence']} ({tag}): "
                        f"`{s['text']}`")
            if diffs:
                tail.append("```diff\n" + s["diff"].strip() + "\n```")
    return "\n".join(out + ["", "Score = (killed + timeout) / (killed + timeout + survived); "
                            "equivalent and incompetent mutants are left out.", ""] + tail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--modules", default=",".join(TARGETS),
                    help=f"comma-separated, of: {', '.join(TARGETS)}")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/mn-mutation"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    ap.add_argument("--diffs", action="store_true", help="report: show each survivor's diff")
    a = ap.parse_args(argv)
    names = [n for n in a.modules.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; choose from {sorted(TARGETS)}")
    if a.command == "run":
        os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp/mn-mutation-xdg")
        os.makedirs(os.environ["XDG_RUNTIME_DIR"], mode=0o700, exist_ok=True)
        for n in names:
            run_target(TARGETS[n], a.workdir, a.timeout)
    print(report(names, a.workdir, a.diffs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
