"""The house's measures over pretrain/: layering, import cycles, imports inside functions, function lengths.

    python tools/house_check.py            # prints the table; exit 1 on an upward import or a cycle

The layers (docs/architecture.md, "Layers"): a module imports from its own layer or a lower one, never a higher
one, and the module graph has no cycle. tests/unit/test_layers.py asserts the same on every run.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "config": 0, "console": 0,
    "distributed": 1, "fsutil": 1,
    "data": 2, "model": 2, "ops": 2, "metrics": 2,
    "prep": 3, "losses": 3,
    "objective": 4,
    "checkpoint": 5,
    "export": 6,
    "eval": 7,
    "training": 8,
    "train": 9, "quickstart": 9, "inspect_data": 9, "report": 9, "study": 9,
}
"""pretrain's top-level packages and modules, lowest first."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported pretrain module, inside a function?, line) for each import of a project module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(fn) if n is not fn)
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pretrain"):
            # `from pretrain.x import y` imports pretrain.x.y when y is a module, else pretrain.x
            names = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("pretrain")]
        out.extend((name, id(node) in inside, node.lineno) for name in dict.fromkeys(names))
    return out


COMPILED = {"pretrain.data._index", "pretrain.model._kernels"}
"""The compiled extension modules setup.py builds (csrc/cpu/): modules, built or not."""


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return name in COMPILED or base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "pretrain").rglob("*.py"))}


def upward_imports() -> list[str]:
    """'a -> b (line n)' for every import of a higher layer, and of a top-level name missing from LAYERS."""
    bad = []
    for mod, path in modules().items():
        for target, _, line in project_imports(path):
            mine, theirs = layer(mod), layer(target)
            if mod == "pretrain" or target == "pretrain":
                continue
            if mine is None or theirs is None:
                bad.append(f"{mod} -> {target} (line {line}): not in tools/house_check.py LAYERS")
            elif theirs > mine:
                bad.append(f"{mod} -> {target} (line {line})")
    return bad


def import_cycles() -> list[list[str]]:
    """Cycles of the module graph (imports at module level and inside functions alike)."""
    mods = modules()
    graph = {m: sorted({t for t, _, _ in project_imports(p) if t in mods and t != m}) for m, p in mods.items()}
    # A package imports its own modules through __init__; that edge plus a module importing its package's
    # __init__ is not a cycle Python trips on unless both are at module level, but we count it like any other.
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    return cycles


def function_lengths() -> list[tuple[int, str]]:
    """(lines, module:function) for every function and method, longest first."""
    out = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{mod}:{node.name}"))
    return sorted(out, reverse=True)


def main() -> int:
    imports = [(m, t, inside) for m, p in modules().items() for t, inside, _ in project_imports(p)]
    up, cycles, lengths = upward_imports(), import_cycles(), function_lengths()
    trainer = ROOT / "pretrain" / "training" / "trainer.py"
    rows = [
        ("imports between project modules", len(imports)),
        ("... of them inside functions", sum(inside for _, _, inside in imports)),
        ("upward imports", len(up)),
        ("import cycles", len(cycles)),
        ("longest function (lines)", f"{lengths[0][0]} ({lengths[0][1]})"),
        ("training/trainer.py (lines)", len(trainer.read_text(encoding="utf-8").splitlines())),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in up:
        print(f"upward: {line}")
    for c in cycles:
        print("cycle: " + " -> ".join(c))
    return 1 if up or cycles else 0


if __name__ == "__main__":
    sys.exit(main())
