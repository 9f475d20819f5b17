"""The package's layers (tools/house_check.py LAYERS, docs/architecture.md): no module imports a higher layer, the
module graph has no cycle, and project imports sit at the top of modules except the few whose cost is argued."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import house_check  # noqa: E402

LAZY = {"pretrain.train", "pretrain.data.sample_index", "pretrain.training.evaluation", "pretrain.model.kernels"}
"""Modules allowed imports inside functions, each with its reason in a comment there: the CLI entry point (answers
--help and --check before torch and the trainer load), the optional compiled helpers (the sample index's, the
model's CPU kernels), scipy's start-up cost."""


def test_every_top_level_name_has_a_layer():
    tops = {p.stem if p.suffix == ".py" else p.name for p in (house_check.ROOT / "pretrain").iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert tops <= set(house_check.LAYERS), f"add {sorted(tops - set(house_check.LAYERS))} to LAYERS"


def test_no_upward_import():
    assert house_check.upward_imports() == []


def test_no_import_cycle():
    assert house_check.import_cycles() == []


def test_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    # The checker itself can fail: a data module importing training, and two modules importing each other.
    pkg = tmp_path / "pretrain"
    for sub in ("data", "training"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "a.py").write_text("from pretrain.training.b import x\n")
    (pkg / "training" / "b.py").write_text("def f():\n    from pretrain.data.a import y\n")
    monkeypatch.setattr(house_check, "ROOT", tmp_path)
    assert house_check.upward_imports() == ["pretrain.data.a -> pretrain.training.b (line 1)"]
    assert house_check.import_cycles() == [["pretrain.data.a", "pretrain.training.b", "pretrain.data.a"]]


def test_project_imports_at_the_top():
    inside = sorted({m for m, p in house_check.modules().items()
                     for _, lazy, _ in house_check.project_imports(p) if lazy} - LAZY)
    assert inside == [], f"imports inside functions in {inside}: move them to the top (or argue the cost)"


def test_the_compiled_modules_are_setups_extensions():
    """house_check.COMPILED (modules the checker counts though they have no .py) is what setup.py builds on the CPU."""
    import re

    setup = (house_check.ROOT / "setup.py").read_text(encoding="utf-8")
    assert set(re.findall(r'Extension\("(pretrain\.[\w.]+)"', setup)) == house_check.COMPILED
