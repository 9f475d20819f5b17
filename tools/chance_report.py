"""When each run's contrastive term left chance, and whether it came back (issue 29 item 2).

    python tools/chance_report.py RUNS_DIR      (the run directories of tools/recipes_at_chance.sh)

Chance: ln(2B-1) for NT-Xent (2B-1 candidates), ln(B) for InfoNCE and ArcCon (ln(2B) for InfoNCE over triples: B
hard negatives besides the B positives) (B = the micro-batch, one rank; ArcCon's
margin puts a collapsed encoder above it); "below chance" is below chance x (1 - COLLAPSE_TOLERANCE), the trainer's
collapse warning's rule. Reads metrics.jsonl and config.yaml; prints one line per run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml

from pretrain.training.progress import COLLAPSE_TOLERANCE

TERMS = ("nt_xent", "info_nce", "arccon")


def report(run: Path) -> str | None:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return None
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in recs if r.get("split", "train") == "train"]
    term = next((t for t in TERMS if train and t in train[0]), None)
    if term is None:
        return f"{run.name}: no contrastive term logged"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    b = cfg["train"]["micro_batch_size"]
    # InfoNCE over data.pairs (taken to be triples, as supervised SimCSE's): B positives + B hard negatives per anchor
    hard = term == "info_nce" and (cfg.get("data") or {}).get("pairs") and \
        ((cfg.get("objective") or {}).get("info_nce") or {}).get("hard_negative_weight") is not None
    chance = math.log(2 * b - 1) if term == "nt_xent" else math.log(2 * b if hard else b)
    band = chance * (1 - COLLAPSE_TOLERANCE)
    steps = [(r["step"], r[term]) for r in train if term in r]
    first = next((s for s, v in steps if v < band), None)
    back = [s for s, v in steps if first is not None and s > first and v >= band]
    at = dict(steps)
    line = (f"{run.name}: {term}, chance {chance:.3f}; below chance from step {first} (of {steps[-1][0]}); back at "
            f"chance at {len(back)} logged steps {back[:1]}..{back[-1:]}; at steps 2/12/50/100/250: "
            + " / ".join(f"{at.get(s, math.nan):.2f}" for s in (2, 12, 50, 100, 250)))
    valid = [r for r in recs if r.get("split") == "valid"]
    if valid:
        line += f"; held-out {term} {valid[-1].get(term, math.nan):.3f}, MLM {valid[-1].get('mlm', math.nan):.3f}"
    evals = [r for r in recs if r.get("split") == "eval" and "stsb_dev_spearman" in r]
    if evals:
        line += f"; STS-B dev {evals[-1]['stsb_dev_spearman']:.1f} (best {evals[-1].get('stsb_dev_best', math.nan):.1f})"
    return line


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for run in sorted(p for p in Path(args[0]).iterdir() if p.is_dir()):
        line = report(run)
        if line:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
