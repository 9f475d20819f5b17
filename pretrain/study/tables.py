"""The tables of a study (``pretrain-study``): OUT/results.md and OUT/results.json from the runs' evaluations.

Layouts follow the papers: STS as SimCSE's Table (STS12–16, STS-B, SICK-R, Avg.; Spearman ×100), GLUE as
CLEAR's Table 1 (RTE, SST-2, MRPC, CoLA, STS-B, Avg.), alignment/uniformity as SimCSE's Figure 2 numbers. A
cell is the mean over the arm's seeds, "mean ± std" (sample std) when there are several; "–" where no seed
has a result yet. Reads only the evaluation files; never runs anything.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from pretrain.checkpoint import store
from pretrain.config import RunConfig
from pretrain.config.loader import from_dict, read_yaml
from pretrain.eval import glue_data
from pretrain.eval.sts import TABLE_NAMES, TASKS
from pretrain.metrics.writer import read_number
from pretrain.study.plan import EVAL_RESULTS, run_name
from pretrain.training.progress import COLLAPSE_TOLERANCE, chance_losses


def _stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def _fmt(cell: dict | None, digits: int = 2) -> str:
    if cell is None:
        return "–"
    text = f"{cell['mean']:.{digits}f}"
    return text + (f" ± {cell['std']:.{digits}f}" if cell["n"] > 1 else "")


def _results(planner, arm, eval_name: str) -> list[dict | None]:
    """The evaluation's result file of each of the arm's seeds (None where absent)."""
    tool = next(e.tool for e in planner.study.evals if e.name == eval_name)
    out = []
    for seed in arm.seeds:
        path = planner.out / "evals" / run_name(arm.name, seed) / eval_name / EVAL_RESULTS[tool]
        out.append(json.loads(path.read_text()) if path.is_file() else None)
    return out


def _rows(planner, table) -> list[tuple[str, object, str]]:
    arms = [planner.study.arm(a) for a in table.arms] if table.arms else planner.study.arms
    return [(arm.name if len(table.evals) == 1 else f"{arm.name} · {e}", arm, e) for arm in arms for e in table.evals]


def sts_average(sts: dict, tasks, convention: str) -> float:
    """The STS average of one evaluation (``eval.json``'s ``sts``) over ``tasks``: Spearman ×100, ``convention``."""
    return statistics.fmean(sts[t]["spearman"][convention] for t in tasks)


def sts_table(planner, table) -> tuple[list[str], list[dict]]:
    """Rows per arm (× evaluation): each STS task and the average over the tasks, mean ± std over seeds."""
    per_row = [(label, arm, [r.get("sts") if r else None for r in _results(planner, arm, e)])
               for label, arm, e in _rows(planner, table)]
    tasks = [t for t in TASKS if any(s and t in s for _, _, seeds in per_row for s in seeds)]
    head = ["| Model | " + " | ".join(TABLE_NAMES[t] for t in tasks) + " | Avg. | seeds |",
            "|---|" + "---:|" * (len(tasks) + 2)]
    rows, data = [], []
    for label, arm, seeds in per_row:
        done = [s for s in seeds if s and all(t in s for t in tasks)]
        cells = {t: _stats([s[t]["spearman"][table.convention] for s in done]) for t in tasks}
        cells["Avg."] = _stats([sts_average(s, tasks, table.convention) for s in done])
        rows.append(f"| {label} | " + " | ".join(_fmt(cells[t]) for t in tasks) + f" | {_fmt(cells['Avg.'])} | "
                    f"{len(done)}/{len(arm.seeds)} |")
        data.append({"label": label, "cells": cells})
    how = "subsets concatenated, as SimCSE" if table.convention == "all" else f"SentEval per-subset {table.convention}"
    note = (f"Spearman ×100 of cosine similarities; STS12–16 with the '{table.convention}' convention ({how}), "
            f"STS-B and SICK-R test sets. Avg. over the tasks shown. Cells: mean ± sample std over seeds.")
    return head + rows + ["", note], data


def glue_table(planner, table) -> tuple[list[str], list[dict]]:
    """Rows per arm: each GLUE task's dev score at the best lr (pretrain-finetune-glue's summary) and Avg."""
    per_row = [(label, arm, _results(planner, arm, e)) for label, arm, e in _rows(planner, table)]
    names = [glue_data.TASKS[k].name for k in glue_data.TABLE_ORDER
             if any(r and glue_data.TASKS[k].name in r for _, _, rs in per_row for r in rs)]
    head = ["| Method | " + " | ".join("STS" if n == "STS-B" else n for n in names) + " | Avg | seeds |",
            "|---|" + "---:|" * (len(names) + 2)]
    rows, data = [], []
    for label, arm, results in per_row:
        done = [r for r in results if r and all(n in r for n in names)]
        cells = {n: _stats([r[n]["score"] for r in done]) for n in names}
        cells["Avg"] = _stats([statistics.fmean(r[n]["score"] for n in names) for r in done])
        rows.append(f"| {label} | " + " | ".join(_fmt(cells[n]) for n in names) + f" | {_fmt(cells['Avg'])} | "
                    f"{len(done)}/{len(arm.seeds)} |")
        data.append({"label": label, "cells": cells})
    note = ("Dev sets ×100 (MRPC: mean of F1 and acc; STS: mean of Pearson and Spearman; CoLA: Matthews corr.; "
            "others: acc), each at the best of the recipe's learning rates; Avg over the tasks shown. "
            "Cells: mean ± sample std over pretraining seeds.")
    return head + rows + ["", note], data


def align_table(planner, table) -> tuple[list[str], list[dict]]:
    """Rows per arm (× evaluation): alignment and uniformity on STS-B dev (lower is better for both)."""
    head = ["| Model | align | uniform | seeds |", "|---|---:|---:|---:|"]
    rows, data = [], []
    for label, arm, e in _rows(planner, table):
        done = [r["align_uniform"] for r in _results(planner, arm, e) if r and "align_uniform" in r]
        cells = {k: _stats([d[k] for d in done]) for k in ("align", "uniform")}
        rows.append(f"| {label} | {_fmt(cells['align'], 4)} | {_fmt(cells['uniform'], 4)} | "
                    f"{len(done)}/{len(arm.seeds)} |")
        data.append({"label": label, "cells": cells})
    note = "Wang & Isola (2020) on STS-B dev pairs (score > 4 for alignment); lower is better for both."
    return head + rows + ["", note], data


def differences(configs: dict[str, dict], out: Path) -> list[str]:
    """Resolved config keys whose values differ between arms (run_dir and seed aside): what each arm varies."""
    flat = {arm: dict(_flatten(cfg)) for arm, cfg in configs.items()}
    keys = sorted({k for f in flat.values() for k in f} - {"run_dir", "seed"})
    varying = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat.values()}) > 1]
    if len(flat) < 2 or not varying:
        return ["Every arm resolves to the same config (seeds aside)." if len(flat) > 1 else "One arm."]
    arms = list(flat)
    lines = ["| setting | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for k in varying:
        cells = [_short(flat[a].get(k, "—") if k in flat[a] else "—", out) for a in arms]
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return lines


def _flatten(d, prefix=""):
    if isinstance(d, dict) and d:
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], d


def _short(value, out: Path) -> str:
    text = "null" if value is None else str(value).replace(str(out), "{out}")
    text = text.replace("|", "\\|")
    return text if len(text) <= 48 else text[:45] + "..."


def escape_step(records: list[dict], key: str, chance: float, tolerance: float) -> int | None:
    """The first logged training step from which the contrastive term ``key`` stays more than ``tolerance``
    (relative) below its chance value for the rest of the run; None when it is still at chance at the end."""
    points = [(r["step"], r[key]) for r in records if r.get("split") == "train" and key in r]
    below = [loss < (1.0 - tolerance) * chance for _, loss in points]
    if not points or not below[-1]:
        return None
    i = len(points) - 1
    while i > 0 and below[i - 1]:
        i -= 1
    return points[i][0]


def run_dynamics(run_dir: Path) -> dict | None:
    """What a run's metrics.jsonl says about its training: per contrastive term the chance value ln(2m-1) or
    ln(m), the step it escaped chance (see escape_step), its final training loss and the embeddings' final mean
    cosine; the final held-out MLM loss; the last step. None when the run has no metrics yet."""
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not metrics.is_file() or not config.is_file():
        return None
    records = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            records.append({k: read_number(v) for k, v in json.loads(line).items()})  # "nan" -> nan
        except (ValueError, AttributeError):
            continue  # a torn last line of a run that is still writing
    if not records:
        return None
    cfg = from_dict(RunConfig, read_yaml(config))
    state = store.latest_trainer_state(run_dir)
    world = state.get("world_size", 1) if state is not None else 1
    train = [r for r in records if r.get("split") == "train"]
    valid = [r for r in records if r.get("split") not in ("train", None)]
    out = {"last_step": max(r["step"] for r in records), "terms": {},
           "heldout_mlm": next((r["mlm"] for r in reversed(valid) if "mlm" in r), None)}
    for name, chance in chance_losses(cfg, world).items():
        last = next((r for r in reversed(train) if name in r), None)
        if last is None:
            continue
        cos_key = "cl_emb_cos" if name == "nt_xent" else f"{name}_emb_cos"
        out["terms"][name] = {"chance": chance, "escape_step": escape_step(records, name, chance, COLLAPSE_TOLERANCE),
                              "final": last[name], "emb_cos": last.get(cos_key)}
    return out


def training_table(planner, table) -> tuple[list[str], list[dict]]:
    """Rows per arm: steps to escape chance of the contrastive term, its final loss and embedding cosine, the
    held-out MLM loss, and the STS average of each evaluation named (mean ± std over seeds)."""
    arms = [planner.study.arm(a) for a in table.arms] if table.arms else planner.study.arms
    head = ["| Model | escaped chance at step | contrastive loss (chance) | emb. cos | held-out MLM | "
            + "".join(f"STS avg {e} | " for e in table.evals) + "seeds |",
            "|---|" + "---:|" * (5 + len(table.evals))]
    rows, data = [], []
    for arm in arms:
        dyn = [run_dynamics(planner.out / "runs" / run_name(arm.name, s)) for s in arm.seeds]
        done = [d for d in dyn if d]
        term = next((t for d in done for t in d["terms"]), None)
        cells: dict = {"heldout_mlm": _stats([d["heldout_mlm"] for d in done])}
        escape, loss, cos = "–", "–", "–"
        if term:
            ts = [d["terms"][term] for d in done if term in d["terms"]]
            steps = [t["escape_step"] for t in ts]
            cells.update(term=term, escape_steps=steps, chance=ts[0]["chance"],
                         final=_stats([t["final"] for t in ts]), emb_cos=_stats([t["emb_cos"] for t in ts]))
            escape = ", ".join("never" if s is None else str(s) for s in steps)
            loss = f"{_fmt(cells['final'], 3)} ({cells['chance']:.3f})"
            cos = _fmt(cells["emb_cos"], 3)
        for e in table.evals:
            avgs = []
            for r in _results(planner, arm, e):
                s = (r or {}).get("sts") or {}
                if s and all(t in s for t in TASKS):
                    avgs.append(sts_average(s, TASKS, "all"))
            cells[f"sts_{e}"] = _stats(avgs)
        last = ", ".join(str(d["last_step"]) for d in done) or "–"
        rows.append(f"| {arm.name} | {escape} | {loss} | {cos} | {_fmt(cells['heldout_mlm'], 3)} | "
                    + "".join(f"{_fmt(cells[f'sts_{e}'])} | " for e in table.evals)
                    + f"{len(done)}/{len(arm.seeds)} (step {last}) |")
        data.append({"label": arm.name, "cells": cells})
    note = ("Escaped chance at step: the first logged training step from which the contrastive loss stays more "
            "than 2% below its chance value (ln(2m-1) for NT-Xent over m sentences, ln(m) for InfoNCE/ArcCon) to "
            "the end; 'never' = still at chance at the last step. Contrastive loss and emb. cos (mean pairwise "
            "cosine of the pooled embeddings of different sentences) at the last logged step; held-out MLM = "
            "the last validation MLM loss. STS avg: 7 tasks, Spearman ×100, subsets concatenated.")
    return head + rows + ["", note], data


KINDS = {"sts": sts_table, "glue": glue_table, "align": align_table, "training": training_table}


def write_results(study, planner, configs: dict[str, dict], status: dict) -> Path:
    """OUT/results.md (tables, what varies, compute used) and OUT/results.json (the numbers)."""
    out = planner.out
    t = status.get("totals", {})
    runs = [s for s in status.get("steps", {}).values() if s.get("kind") == "train"]
    md = [f"# Study `{study.name}`: results", "",
          f"Study file `{study.path}`, directory `{out}`; tables written {time.strftime('%Y-%m-%d %H:%M')} by "
          f"`pretrain-study`. Runs done: {sum(r.get('state') == 'done' for r in runs)} of "
          f"{sum(len(a.seeds) for a in study.arms)}. Compute recorded so far: {t.get('cpu_s', 0) / 3600:.2f} CPU-h "
          f"(all invocations, children's user+sys time) in {t.get('invocations_wall_s', 0) / 3600:.2f} h wall; "
          f"per step in `status.json`.", ""]
    numbers = []
    for table in study.tables:
        if table.kind == "report":
            md += [f"## {table.title or 'Training curves'}", "",
                   "Every run overlaid, one colour per run: [`report/report.md`](report/report.md) "
                   "(PNG plots of each loss term, held-out MLM, STS-B dev, lr, throughput).", ""]
            continue
        lines, data = KINDS[table.kind](planner, table)
        md += [f"## {table.title or table.kind}", "", *lines, ""]
        numbers.append({"title": table.title, "kind": table.kind, "evals": table.evals, "rows": data})
    md += ["## What differs between arms", "",
           "Resolved configs (first seed of each arm) compared key by key; only the keys that differ are shown. "
           "Shared settings are applied to every arm identically.", "", *differences(configs, out), ""]
    (out / "results.md").write_text("\n".join(md), encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"study": study.name, "tables": numbers}, indent=1))
    return out / "results.md"
