"""tools/sts_dims_table.py: per-arm mean ± std of the 7-task STS average, full and at each truncated size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from sts_dims_table import collect, table  # noqa: E402


def _sts(*vals):
    return {f"T{i}": {"spearman": {"all": v}} for i, v in enumerate(vals)}


def test_rows_average_tasks_then_seeds(tmp_path):
    for arm, seed, full, d32 in (("step", 1, (70.0, 60.0), (50.0, 40.0)), ("step", 2, (74.0, 62.0), (52.0, 44.0)),
                                 ("micro", 1, (66.0, 60.0), (40.0, 40.0))):
        out = tmp_path / "evals" / f"{arm}-seed{seed}" / "sts"
        out.mkdir(parents=True)
        (out / "eval.json").write_text(json.dumps({"sts": _sts(*full), "sts_dims": {"32": _sts(*d32)}}))
    rows = collect(tmp_path, "sts")
    assert rows["step"] == {"full": [65.0, 68.0], "32": [45.0, 48.0]}
    assert rows["micro"] == {"full": [63.0], "32": [40.0]}
    text = table(rows, "128")
    assert "| step | 2 | 66.50 ± 2.12 | 46.50 ± 2.12 |" in text
    assert "| micro | 1 | 63.00 | 40.00 |" in text
