"""The tables of a study (``pretrain-study``): OUT/results.md and OUT/results.json from the runs' evaluations.

Layouts follow the papers: STS as SimCSE's Table (STS12–16, STS-B, SICK-R, Avg.; Spearman ×100), GLUE as
CLEAR's Table 1 (RTE, SST-2, MRPC, CoLA, STS-B, Avg.), alignment/uniformity as SimCSE's Figure 2 numbers. A
cell is the mean over the arm's seeds, "mean ± std" (sample std) when there are several; "–" where no seed
has a result yet; "(k NaN)" where k seeds' values are undefined (stored as null), which the mean leaves out. A
seed whose run diverged (recorded so in status.json) is counted in the row's seeds column, "2/3 (1 diverged)", the
cells being over the seeds that finished; results.json lists it under the row's ``diverged``.
Only results of the study as it is now are read (``current``: the driver's list of runs and evaluations made with
their present commands and weights); others are left out and named under the table. Never runs anything.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from pretrain.checkpoint import store
from pretrain.checkpoint.files import atomic_write_text, strict_json, strict_number
from pretrain.config import RunConfig
from pretrain.config.loader import from_dict, read_yaml
from pretrain.eval import glue_data
from pretrain.eval.sts import TABLE_NAMES, TASKS
from pretrain.metrics.writer import read_number
from pretrain.study.outputs import flat_keys
from pretrain.study.plan import EVAL_RESULTS, run_name
from pretrain.training.progress import COLLAPSE_TOLERANCE, chance_losses


CELLS = ("Cells: mean ± sample std (n−1) over seeds; '(k NaN)': k seeds' values are undefined (NaN, e.g. a "
         "correlation of constant embeddings) and left out of the mean; seeds '2/3 (1 diverged)': a seed's run "
         "diverged (pretrain-train exit 3), the cells are over the seeds that finished.")


def _stats(values: list) -> dict | None:
    """mean, sample std and n over the finite values; ``nan`` counts the others (None: nothing measured)."""
    values = [v for v in values if v is not None]
    finite = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    return {"mean": statistics.fmean(finite) if finite else math.nan,
            "std": statistics.stdev(finite) if len(finite) > 1 else 0.0, "n": len(finite),
            "nan": len(values) - len(finite)}


def _fmt(cell: dict | None, digits: int = 2, empty: str = "–") -> str:
    if cell is None:
        return empty
    if not cell["n"]:
        return "NaN"
    text = f"{cell['mean']:.{digits}f}"
    text += f" ± {cell['std']:.{digits}f}" if cell["n"] > 1 else ""
    return text + (f" ({cell['nan']} NaN)" if cell.get("nan") else "")


class Sources:
    """Where the tables read results: the study's directory, only the steps in ``current`` (None: all), and the
    ones found on disk but left out (another version of the study, or weights that changed since)."""

    def __init__(self, planner, current: set[str] | None = None, status: dict | None = None):
        self.planner, self.current, self.left_out = planner, current, []
        self.diverged = {sid: rec.get("diverged_at") for sid, rec in ((status or {}).get("steps") or {}).items()
                         if rec.get("state") == "diverged" and (current is None or sid in current)}
        """Runs recorded as diverged (train/RUN -> the step, None where unknown), of the study as it is now."""
        self.blocked = {sid for sid, rec in ((status or {}).get("steps") or {}).items()
                        if rec.get("state") == "blocked" and set(rec.get("blocked_by") or ()) & set(self.diverged)}
        """Steps skipped because a run they need diverged (a run starting from a diverged one)."""

    def diverged_seeds(self, arm) -> dict[int, int | None]:
        """The arm's seeds whose run diverged -> the step it diverged at (None: not known)."""
        ids = {s: f"train/{run_name(arm.name, s)}" for s in arm.seeds}
        return {s: self.diverged[i] for s, i in ids.items() if i in self.diverged}

    def blocked_seeds(self, arm) -> list[int]:
        """The arm's seeds whose run was not trained because a run it starts from diverged."""
        return [s for s in arm.seeds if f"train/{run_name(arm.name, s)}" in self.blocked]

    def _take(self, step_id: str, exists: bool) -> bool:
        if exists and self.current is not None and step_id not in self.current:
            self.left_out.append(step_id)
            return False
        return exists

    def results(self, arm, eval_name: str) -> list[dict | None]:
        """The evaluation's result file of each of the arm's seeds (None where absent or left out)."""
        tool = next(e.tool for e in self.planner.study.evals if e.name == eval_name)
        out = []
        for seed in arm.seeds:
            run = run_name(arm.name, seed)
            path = self.planner.out / "evals" / run / eval_name / EVAL_RESULTS[tool]
            if f"train/{run}" in self.diverged:  # no evaluation of it is of the run as it stands
                out.append(None)
                continue
            out.append(json.loads(path.read_text()) if self._take(f"eval/{run}/{eval_name}", path.is_file())
                       else None)
        return out

    def run_dir(self, arm, seed: int) -> Path | None:
        """The run's directory, None when it is left out."""
        path = self.planner.out / "runs" / run_name(arm.name, seed)
        return path if self._take(f"train/{run_name(arm.name, seed)}", path.is_dir()) else None

    def note(self, since: int) -> list[str]:
        """The line naming what the table left out (``left_out`` from index ``since``)."""
        left = sorted(set(self.left_out[since:]))
        return [] if not left else [
            "", f"Left out, made by another version of the study (an arm's settings changed since) or from weights "
                f"that changed since: {', '.join(left)}. A run of the whole study (without --only) redoes them."]


def _seeds(num_done: int, arm, src: Sources) -> str:
    """The seeds column: 'done/all', '(k diverged)' when k seeds' runs diverged, '(k blocked by a divergence)' when
    k seeds' runs start from a run that diverged."""
    diverged, blocked = src.diverged_seeds(arm), src.blocked_seeds(arm)
    return (f"{num_done}/{len(arm.seeds)}" + (f" ({len(diverged)} diverged)" if diverged else "")
            + (f" ({len(blocked)} blocked by a divergence)" if blocked else ""))


def _empty(arm, diverged: dict) -> str:
    """What a cell without any value shows: 'diverged' when every seed's run diverged."""
    return "diverged" if diverged and len(diverged) == len(arm.seeds) else "–"


def _row_data(label: str, cells: dict, arm, num_done: int, src: Sources) -> dict:
    """A row of results.json: its cells and its seeds (done, all, the diverged ones with their step, the ones not
    trained because the run they start from diverged)."""
    return {"label": label, "cells": cells, "seeds": {"done": num_done, "of": len(arm.seeds)},
            "diverged": [{"seed": s, "step": at} for s, at in src.diverged_seeds(arm).items()],
            "blocked": src.blocked_seeds(arm)}


def _rows(planner, table) -> list[tuple[str, object, str]]:
    arms = [planner.study.arm(a) for a in table.arms] if table.arms else planner.study.arms
    return [(arm.name if len(table.evals) == 1 else f"{arm.name} · {e}", arm, e) for arm in arms for e in table.evals]


def sts_average(sts: dict, tasks, convention: str) -> float:
    """The STS average of one evaluation (``eval.json``'s ``sts``) over ``tasks``: Spearman ×100, ``convention``;
    NaN when a task's is."""
    return statistics.fmean(strict_number(sts[t]["spearman"][convention]) for t in tasks)


def sts_table(src: Sources, table) -> tuple[list[str], list[dict]]:
    """Rows per arm (× evaluation): each STS task and the average over the tasks, mean ± std over seeds."""
    per_row = [(label, arm, [r.get("sts") if r else None for r in src.results(arm, e)])
               for label, arm, e in _rows(src.planner, table)]
    tasks = [t for t in TASKS if any(s and t in s for _, _, seeds in per_row for s in seeds)]
    head = ["| Model | " + " | ".join(TABLE_NAMES[t] for t in tasks) + " | Avg. | seeds |",
            "|---|" + "---:|" * (len(tasks) + 2)]
    rows, data = [], []
    for label, arm, seeds in per_row:
        done = [s for s in seeds if s and all(t in s for t in tasks)]
        div = src.diverged_seeds(arm)
        cells = {t: _stats([strict_number(s[t]["spearman"][table.convention]) for s in done]) for t in tasks}
        cells["Avg."] = _stats([sts_average(s, tasks, table.convention) for s in done])
        rows.append(f"| {label} | " + " | ".join(_fmt(cells[t], empty=_empty(arm, div)) for t in [*tasks, "Avg."])
                    + f" | {_seeds(len(done), arm, src)} |")
        data.append(_row_data(label, cells, arm, len(done), src))
    how = "subsets concatenated, as SimCSE" if table.convention == "all" else f"SentEval per-subset {table.convention}"
    note = (f"Spearman ×100 of cosine similarities; STS12–16 with the '{table.convention}' convention ({how}), "
            f"STS-B and SICK-R test sets. Avg. over the tasks shown. {CELLS}")
    return head + rows + ["", note], data


def glue_table(src: Sources, table) -> tuple[list[str], list[dict]]:
    """Rows per arm: each GLUE task's dev score at the best lr (pretrain-finetune-glue's summary) and Avg."""
    per_row = [(label, arm, src.results(arm, e)) for label, arm, e in _rows(src.planner, table)]
    names = [glue_data.TASKS[k].name for k in glue_data.TABLE_ORDER
             if any(r and glue_data.TASKS[k].name in r for _, _, rs in per_row for r in rs)]
    head = ["| Method | " + " | ".join("STS" if n == "STS-B" else n for n in names) + " | Avg | seeds |",
            "|---|" + "---:|" * (len(names) + 2)]
    rows, data = [], []
    for label, arm, results in per_row:
        done = [r for r in results if r and all(n in r for n in names)]
        div = src.diverged_seeds(arm)
        cells = {n: _stats([strict_number(r[n]["score"]) for r in done]) for n in names}
        cells["Avg"] = _stats([statistics.fmean(strict_number(r[n]["score"]) for n in names) for r in done])
        rows.append(f"| {label} | " + " | ".join(_fmt(cells[n], empty=_empty(arm, div)) for n in [*names, "Avg"])
                    + f" | {_seeds(len(done), arm, src)} |")
        data.append(_row_data(label, cells, arm, len(done), src))
    note = ("Dev sets ×100 (MRPC: mean of F1 and acc; STS: mean of Pearson and Spearman; CoLA: Matthews corr.; "
            "others: acc), each at the best of the recipe's learning rates; Avg over the tasks shown. "
            f"{CELLS.replace('over seeds', 'over pretraining seeds')}")
    return head + rows + ["", note], data


def align_table(src: Sources, table) -> tuple[list[str], list[dict]]:
    """Rows per arm (× evaluation): alignment and uniformity on STS-B dev (lower is better for both)."""
    head = ["| Model | align | uniform | seeds |", "|---|---:|---:|---:|"]
    rows, data = [], []
    for label, arm, e in _rows(src.planner, table):
        done = [r["align_uniform"] for r in src.results(arm, e) if r and "align_uniform" in r]
        div = src.diverged_seeds(arm)
        cells = {k: _stats([strict_number(d[k]) for d in done]) for k in ("align", "uniform")}
        rows.append(f"| {label} | {_fmt(cells['align'], 4, _empty(arm, div))} | "
                    f"{_fmt(cells['uniform'], 4, _empty(arm, div))} | {_seeds(len(done), arm, src)} |")
        data.append(_row_data(label, cells, arm, len(done), src))
    note = f"Wang & Isola (2020) on STS-B dev pairs (score > 4 for alignment); lower is better for both. {CELLS}"
    return head + rows + ["", note], data


def differences(configs: dict[str, dict], out: Path) -> list[str]:
    """Resolved config keys whose values differ between arms (run_dir and seed aside): what each arm varies."""
    flat = {arm: dict(flat_keys(cfg)) for arm, cfg in configs.items()}
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


def _term_cells(seeds: list[int], dyn: dict, diverged: dict, cells: dict) -> tuple[str, str, str]:
    """The contrastive term's columns of a training-table row: the escape step of each seed (in ``seeds``' order;
    "diverged at step N" for a diverged one), final loss (chance), emb. cos. ``dyn``: seed -> run_dynamics of the
    seeds that did not diverge; their numbers go into ``cells``."""
    done = [d for d in dyn.values() if d]
    term = next((t for d in done for t in d["terms"]), None)
    ts = {s: d["terms"][term] for s, d in dyn.items() if d and term in d["terms"]}

    def word(seed: int) -> str:
        if seed in diverged:
            return "diverged" if diverged[seed] is None else f"diverged at step {diverged[seed]}"
        return "never" if ts[seed]["escape_step"] is None else str(ts[seed]["escape_step"])

    escape = ", ".join(word(s) for s in seeds if s in ts or s in diverged) or "–"
    if not ts:
        return escape, "–", "–"
    first = next(iter(ts.values()))
    cells.update(term=term, escape_steps=[t["escape_step"] for t in ts.values()], chance=first["chance"],
                 final=_stats([t["final"] for t in ts.values()]), emb_cos=_stats([t["emb_cos"] for t in ts.values()]))
    return escape, f"{_fmt(cells['final'], 3)} ({cells['chance']:.3f})", _fmt(cells["emb_cos"], 3)


def training_table(src: Sources, table) -> tuple[list[str], list[dict]]:
    """Rows per arm: steps to escape chance of the contrastive term, its final loss and embedding cosine, the
    held-out MLM loss, and the STS average of each evaluation named (mean ± std over seeds). A diverged seed is
    named in the escape column ("diverged at step N") and left out of the cells."""
    study = src.planner.study
    arms = [study.arm(a) for a in table.arms] if table.arms else study.arms
    head = ["| Model | escaped chance at step | contrastive loss (chance) | emb. cos | held-out MLM | "
            + "".join(f"STS avg {e} | " for e in table.evals) + "seeds |",
            "|---|" + "---:|" * (5 + len(table.evals))]
    rows, data = [], []
    for arm in arms:
        div = src.diverged_seeds(arm)
        dirs = {s: src.run_dir(arm, s) for s in arm.seeds if s not in div}
        dyn = {s: run_dynamics(d) if d is not None else None for s, d in dirs.items()}
        done = [d for d in dyn.values() if d]
        cells: dict = {"heldout_mlm": _stats([d["heldout_mlm"] for d in done])}
        escape, loss, cos = _term_cells(arm.seeds, dyn, div, cells)
        for e in table.evals:
            avgs = []
            for r in src.results(arm, e):
                s = (r or {}).get("sts") or {}
                if s and all(t in s for t in TASKS):
                    avgs.append(sts_average(s, TASKS, "all"))
            cells[f"sts_{e}"] = _stats(avgs)
        last = ", ".join(str(d["last_step"]) for d in done) or "–"
        rows.append(f"| {arm.name} | {escape} | {loss} | {cos} | {_fmt(cells['heldout_mlm'], 3)} | "
                    + "".join(f"{_fmt(cells[f'sts_{e}'])} | " for e in table.evals)
                    + f"{_seeds(len(done), arm, src)} (step {last}) |")
        data.append(_row_data(arm.name, cells, arm, len(done), src))
    note = ("Escaped chance at step: the first logged training step from which the contrastive loss stays more "
            "than 2% below its chance value (ln(2m-1) for NT-Xent over m sentences, ln(m) for InfoNCE/ArcCon) to "
            "the end; 'never' = still at chance at the last step; 'diverged at step N': the seed's run stopped "
            "there (exit 3). Contrastive loss and emb. cos (mean pairwise "
            "cosine of the pooled embeddings of different sentences) at the last logged step; held-out MLM = "
            f"the last validation MLM loss. STS avg: 7 tasks, Spearman ×100, subsets concatenated. {CELLS}")
    return head + rows + ["", note], data


KINDS = {"sts": sts_table, "glue": glue_table, "align": align_table, "training": training_table}


def write_results(study, planner, configs: dict[str, dict], status: dict,
                  current: set[str] | None = None) -> Path:
    """OUT/results.md (tables, what varies, compute used) and OUT/results.json (the numbers), from the results in
    ``current`` (step ids; None: every result found)."""
    out, src = planner.out, Sources(planner, current, status)
    t = status.get("totals", {})
    runs = [f"train/{run_name(a.name, s)}" for a in study.arms for s in a.seeds]  # the study's runs as it is now
    done = sum(status.get("steps", {}).get(r, {}).get("state") == "done" and (current is None or r in current)
               for r in runs)
    diverged = [f"{r.split('/', 1)[1]}{'' if src.diverged[r] is None else f' at step {src.diverged[r]}'}"
                for r in runs if r in src.diverged]
    diverged_text = f"; diverged: {len(diverged)} ({', '.join(diverged)})" if diverged else ""
    md = [f"# Study `{study.name}`: results", "",
          f"Study file `{study.path}`, directory `{out}`; tables written {time.strftime('%Y-%m-%d %H:%M')} by "
          f"`pretrain-study`. Runs done: {done} of {len(runs)}"
          f"{diverged_text}. Compute recorded so far: "
          f"{t.get('cpu_s', 0) / 3600:.2f} CPU-h (all invocations, children's user+sys time) in "
          f"{t.get('invocations_wall_s', 0) / 3600:.2f} h wall; per step in `status.json`.", ""]
    numbers = []
    for table in study.tables:
        if table.kind == "report":
            md += [f"## {table.title or 'Training curves'}", "",
                   "Every run overlaid, one colour per run: [`report/report.md`](report/report.md) "
                   "(PNG plots of each loss term, held-out MLM, STS-B dev, lr, throughput).", ""]
            continue
        since = len(src.left_out)
        lines, data = KINDS[table.kind](src, table)
        md += [f"## {table.title or table.kind}", "", *lines, *src.note(since), ""]
        numbers.append({"title": table.title, "kind": table.kind, "evals": table.evals, "rows": data,
                        "left_out": sorted(set(src.left_out[since:]))})
    md += ["## What differs between arms", "",
           "Resolved configs (first seed of each arm) compared key by key; only the keys that differ are shown. "
           "Shared settings are applied to every arm identically.", "", *differences(configs, out), ""]
    atomic_write_text(out / "results.md", "\n".join(md))
    atomic_write_text(out / "results.json", strict_json({
        "study": study.name, "tables": numbers,
        "diverged": {r.split("/", 1)[1]: src.diverged[r] for r in runs if r in src.diverged}}))
    return out / "results.md"
