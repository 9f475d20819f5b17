"""STS average at every embedding size, mean ± sample std over a study's seeds (Study D, issue 26 item 6).

Reads ``evals/<arm>-seed<N>/<eval>/eval.json`` of a study directory (``pretrain-eval --dims ...``): the full
embedding's 7-task average ('all' convention) and each truncated size's. One row per arm, one column per size.

    python tools/sts_dims_table.py runs/studies/negatives_small [--eval sts]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _avg(sts: dict) -> float:
    vals = [r["spearman"]["all"] for r in sts.values()]
    return sum(vals) / len(vals)


def collect(study: Path, eval_name: str) -> dict[str, dict[str, list[float]]]:
    """{arm: {"full" | d: [7-task average per seed]}}."""
    out: dict[str, dict[str, list[float]]] = {}
    for path in sorted(study.glob(f"evals/*-seed*/{eval_name}/eval.json")):
        arm = path.parent.parent.name.rsplit("-seed", 1)[0]
        res = json.loads(path.read_text(encoding="utf-8"))
        row = out.setdefault(arm, {})
        row.setdefault("full", []).append(_avg(res["sts"]))
        for d, sts in (res.get("sts_dims") or {}).items():
            row.setdefault(str(d), []).append(_avg(sts))
    return out


def table(rows: dict[str, dict[str, list[float]]], full_dim: str) -> str:
    sizes = sorted({k for r in rows.values() for k in r if k != "full"}, key=lambda d: -int(d))
    head = [f"{full_dim} (full)" if full_dim else "full", *sizes]
    lines = ["| arm | seeds | " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(head)]
    for arm, r in rows.items():
        cells = []
        for k in ["full", *sizes]:
            v = r.get(k, [])
            cells.append(f"{statistics.mean(v):.2f} ± {statistics.stdev(v):.2f}" if len(v) > 1
                         else (f"{v[0]:.2f}" if v else "–"))
        lines.append(f"| {arm} | {len(r['full'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", type=Path)
    p.add_argument("--eval", default="sts", help="the evaluation's name in the study file (default sts)")
    p.add_argument("--full-dim", default="", help="the full embedding's size, for the header")
    args = p.parse_args(argv)
    rows = collect(args.study, args.eval)
    if not rows:
        print(f"sts_dims_table: no evals/*-seed*/{args.eval}/eval.json under {args.study}", file=sys.stderr)
        return 2
    print(table(rows, args.full_dim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
