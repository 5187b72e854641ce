"""The pipeline's import direction, checked on the source (direct imports, module level and
inside functions): graph → compile → kernels → runtime, with data flowing one way.

A violation names the importing module and what it imported, so a new dependency that bends
the pipeline fails here instead of surfacing later as an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "meganeura"

# (importer prefix, forbidden target prefixes, allowed exceptions (importer, target))
RULES = [
    ("kernels", ("runtime", "compile", "ops", "autodiff", "optim", "program", "reference"), ()),
    ("ops", ("compile", "kernels", "runtime", "reference"), ()),
    ("runtime", ("compile.passes", "compile.schedule", "compile.memory", "compile.pipeline",
                 "compile.emit", "compile.fusion", "compile.rewrites", "ops", "autodiff",
                 "optim"), ()),
    # compile/ never reaches into the runtime, except compile() itself, which opens the
    # device (its limits become the kernels' Target) and hands the Executable over
    ("compile", ("runtime", "reference"), (("compile", "runtime.device"),
                                           ("compile", "runtime.session"),
                                           ("compile", "runtime.tuning"),
                                           ("compile", "reference"))),
    ("graph", ("compile", "kernels", "runtime"), ()),
    ("program", ("compile", "kernels", "runtime"), ()),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Targets of every import in ``path``, as dotted names inside meganeura."""
    mod = _module_name(path)
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            if node.module:
                found.add(".".join(base + [node.module]))
            else:  # from . import x: the modules x
                found.update(".".join(base + [a.name]) for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            found.update(n[len("meganeura."):] for n in names if n.startswith("meganeura."))
    return found


def _violations():
    out = []
    for path in sorted(SRC.rglob("*.py")):
        mod = _module_name(path)
        for prefix, forbidden, allowed in RULES:
            if mod != prefix and not mod.startswith(prefix + "."):
                continue
            for target in _imports(path):
                bad = [f for f in forbidden if target == f or target.startswith(f + ".")]
                if bad and not any(mod == m and (target == t or target.startswith(t + "."))
                                   for m, t in allowed):
                    out.append(f"{mod} imports {target}")
    return sorted(set(out))


def test_imports_point_one_way_down_the_pipeline():
    assert _violations() == []


def test_the_checker_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    """The checker itself: a forbidden relative import inside a function is reported."""
    pkg = tmp_path / "meganeura" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text("def f():\n    from ..runtime.device import get_device\n")
    (tmp_path / "meganeura" / "ops.py").write_text("import meganeura.kernels.ir\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", tmp_path / "meganeura")
    assert _violations() == ["kernels.bad imports runtime.device", "ops imports kernels.ir"]
