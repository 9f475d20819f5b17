"""`pretrain-finetune-glue`: GLUE sweeps over (task, lr, seed), JSON per run, summary JSON + markdown.

    pretrain-finetune-glue --model runs/x/hf --glue-dir ../shared/data/glue --tasks rte,mrpc \
        --lrs 1e-5,2e-5,3e-5 --seeds 1,2,3 --out runs/x/glue
    pretrain-finetune-glue --out runs/x/glue --summarize        # table only
Under a Slurm array, `--run-index $SLURM_ARRAY_TASK_ID` runs the i-th (task, lr, seed) of the grid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import asdict
from pathlib import Path

from pretrain.checkpoint.files import atomic_write_text, strict_json, strict_number
from pretrain.checkpoint.store import CheckpointError
from pretrain.console import set_verbose
from pretrain.eval import check_out, fail, find_data_dir
from pretrain.eval.encoder import check_max_len, load_backbone
from pretrain.eval.glue import FinetuneConfig, finetune
from pretrain.eval.glue_data import TABLE_ORDER, TASKS, GlueFormatError, get_task, rank_score, task_files
from pretrain.export.resolve import select_checkpoint

DEFAULT_EPOCHS_LARGE = 3
GRID_KEYS = ("task", "lr", "seed")
"""The settings a sweep varies within one output directory."""
UNSCORED_KEYS = ("device", "eval_batch_size", "dropout")
"""Settings that do not change a run's numbers (dropout follows from the model)."""


def build_parser() -> argparse.ArgumentParser:
    import dataclasses


    # One source of truth for the hyperparameters' defaults: FinetuneConfig.
    d = {f.name: f.default for f in dataclasses.fields(FinetuneConfig) if f.default is not dataclasses.MISSING}
    p = argparse.ArgumentParser(prog="pretrain-finetune-glue", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="our checkpoint, a pretrain-convert output dir or any HF BERT dir")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|step_N",
                   help="with a run directory as --model: its newest checkpoint (default), best/ (best STS-B dev) or "
                        "checkpoints/step_N")
    p.add_argument("--backend", default="auto", choices=["auto", "pretrain", "transformers"])
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read an old checkpoint of ours that has no model.safetensors by unpickling its DeepSpeed "
                        "files (runs any code they carry: only for checkpoints you trust)")
    p.add_argument("--glue-dir", default="",
                   help="GLUE root with one folder per task (default: glue/ under $PRETRAIN_DATA_DIR, else under "
                        "../shared/data from here, then beside the repository)")
    p.add_argument("--tasks", default="rte,mrpc,cola,stsb,sst2", help="comma list or 'all'")
    p.add_argument("--lrs", default="1e-5,2e-5,3e-5")
    p.add_argument("--seeds", default="1")
    p.add_argument("--epochs", type=int, default=d["epochs"], help="small tasks (RoBERTa: 10)")
    p.add_argument("--epochs-large", type=int, default=DEFAULT_EPOCHS_LARGE, help="MNLI/QNLI/QQP/SST-2")
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--max-len", type=int, default=d["max_len"])
    p.add_argument("--warmup-ratio", type=float, default=d["warmup_ratio"])
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"],
                   help="RoBERTa's 0.1 (run_glue: 0, BERT: 0.01); never on biases and norms")
    p.add_argument("--max-grad-norm", type=float, default=d["max_grad_norm"],
                   help="clip the global gradient norm (Trainer and BERT: 1.0); 0 = off (RoBERTa's recipe)")
    p.add_argument("--max-train-examples", type=int, default=d["max_train_examples"], help="0 = all")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="0 = every epoch")
    p.add_argument("--device", default=d["device"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave)")
    p.add_argument("--run-index", type=int, default=None, help="run only this grid entry (Slurm array id)")
    p.add_argument("--list-runs", action="store_true",
                   help="print the grid: one line per run (its --run-index, task, lr, seed), then the count, and exit")
    p.add_argument("--count-runs", action="store_true", help="print only the number of runs (for sbatch --array)")
    p.add_argument("--save-best", action="store_true",
                   help="save the best dev head+backbone state (best_model.safetensors beside the run's json)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", default="model", help="row label in the markdown table")
    p.add_argument("--verbose", action="store_true", help="let transformers' messages through to the console")
    p.add_argument("--summarize", action="store_true", help="only rebuild results.{json,md} from run files")
    return p


def parse_list(s: str, typ):
    return [typ(x) for x in s.split(",") if x.strip()]


def grid(args) -> list[tuple[str, float, int]]:
    tasks = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:
        get_task(t)
    return list(itertools.product(tasks, parse_list(args.lrs, float), parse_list(args.seeds, int)))


def run_path(out: Path, task: str, lr: float, seed: int) -> Path:
    return out / get_task(task).folder / f"lr{lr:g}_seed{seed}.json"


def build_config(args, task: str, lr: float, seed: int) -> FinetuneConfig:
    spec = get_task(task)
    return FinetuneConfig(
        task=task, lr=lr, seed=seed, epochs=args.epochs if spec.small else args.epochs_large,
        batch_size=args.batch_size, max_len=args.max_len, warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, max_train_examples=args.max_train_examples,
        eval_every=args.eval_every, device=args.device, bf16=args.bf16,
    )


def settings_of(model: str | None, config: dict) -> dict:
    """What must agree between the runs of one task in one output directory for their summary to mean anything:
    the model and every setting but the grid's and those that do not change the numbers (JSON-normalised)."""
    keep = {k: v for k, v in config.items() if k not in GRID_KEYS + UNSCORED_KEYS}
    return json.loads(json.dumps({"model": model, **keep}))


def differing(a: dict, b: dict) -> str:
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def check_same_settings(runs: list[tuple[Path, dict]], model: str | None = None,
                        configs: dict[str, FinetuneConfig] | None = None) -> None:
    """ValueError when the run files of a task disagree on the model or a setting, or tasks on the model (an output
    directory reused for another model or recipe: results.json would mix them under one name); with ``model`` and
    ``configs`` (per task name), also when the runs about to start disagree with those already there."""
    by_task: dict[str, tuple[Path, dict]] = {}
    for path, r in runs:
        s = settings_of(r.get("model"), r.get("config", {}))
        if r["task"] in by_task and by_task[r["task"]][1] != s:
            raise ValueError(f"{path} and {by_task[r['task']][0]} were run with different settings "
                             f"({differing(by_task[r['task']][1], s)}); keep one model and recipe per --out")
        by_task.setdefault(r["task"], (path, s))
    models = {s["model"]: path for path, s in by_task.values()}
    if len(models) > 1:
        raise ValueError(f"{' and '.join(map(str, models.values()))} are runs of different models "
                         f"({', '.join(map(repr, models))}); keep one model per --out")
    for name, cfg in (configs or {}).items():
        want = settings_of(model, asdict(cfg))
        if name in by_task:
            path, have = by_task[name]
        elif by_task:  # another task's runs: the model must be the same, the recipe may differ per task
            path, have = next(iter(by_task.values()))
            want, have = {"model": want["model"]}, {"model": have["model"]}
        else:
            continue
        if have != want:
            raise ValueError(f"--out already holds {path}, run with other settings ({differing(have, want)}); "
                             f"pass a new --out, or delete the old runs to replace them")


def read_runs(out: Path) -> list[tuple[Path, dict]]:
    """(path, contents) of every run file under ``out``."""
    runs = []
    for f in sorted(out.glob("*/lr*_seed*.json")):
        try:
            runs.append((f, json.loads(f.read_text())))
        except ValueError as e:
            raise ValueError(f"{f} is not a run file pretrain-finetune-glue wrote ({e}); delete it") from None
    return runs


def run_one(args, task: str, lr: float, seed: int) -> dict:
    import torch


    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = build_config(args, task, lr, seed)

    try:
        backbone, tok = load_backbone(args.model, backend=args.backend, device=args.device,
                                      trust=args.trust_checkpoint)
        check_max_len(backbone, args.max_len, "--max-len")  # before any work: not an index error mid-run
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        fail("pretrain-finetune-glue", e)
    path = run_path(Path(args.out), task, lr, seed)
    res = finetune(cfg, backbone, tok, args.glue_dir,
                   save_dir=path.with_suffix("") if args.save_best else None)
    res["model"] = str(args.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, strict_json(res))  # a Slurm array's summary reads these while others run
    return res


def median_score(scores: list[float]) -> float:
    """statistics.median with NaN (a run that never had a finite dev score) ordered below every number; the median
    sorts by ``<``, which NaN leaves in any order."""
    s = sorted(scores, key=rank_score)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def summarize(out: Path, name: str = "model") -> dict:
    """Per task: best lr by median-over-seeds dev score; writes results.json and results.md (each whole or not at
    all), with the model and settings the task's runs share. ValueError when the run files mix models or settings."""
    found = read_runs(out)
    check_same_settings(found)
    runs: dict[str, dict[float, list[dict]]] = {}
    for _, r in found:
        if r.get("best") is None:
            continue
        runs.setdefault(r["task"], {}).setdefault(r["config"]["lr"], []).append(r)
    summary = {}
    for task, by_lr in runs.items():
        med = {lr: median_score([strict_number(r["best"]["score"]) for r in rs]) for lr, rs in by_lr.items()}
        lr = max(med, key=lambda k: rank_score(med[k]))
        rs = by_lr[lr]
        summary[task] = {
            "score": med[lr], "lr": lr, "seeds": [r["config"]["seed"] for r in rs],
            "per_seed": [r["best"] for r in rs], "wall_s": [r["wall_s"] for r in rs],
            "epochs": rs[0]["config"]["epochs"], "num_train": rs[0]["num_train"],
            "all_lrs": med, "model": rs[0].get("model"),
            "config": {k: v for k, v in rs[0]["config"].items() if k != "seed"},
        }
    atomic_write_text(out / "results.json", strict_json(summary))
    atomic_write_text(out / "results.md", markdown_table({name: summary}))
    return summary


def markdown_table(rows: dict[str, dict]) -> str:
    """CLEAR Table 1 layout: MNLI QNLI QQP RTE SST-2 MRPC CoLA STS Avg (Avg over present tasks)."""
    cols = [TASKS[k].name for k in TABLE_ORDER]
    head = "| Method | " + " | ".join("STS" if c == "STS-B" else c for c in cols) + " | Avg |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for name, summary in rows.items():
        cells, vals = [], []
        for c in cols:
            if c in summary:
                vals.append(summary[c]["score"])
                cells.append(f"{summary[c]['score']:.2f}")
            else:
                cells.append("–")
        avg = f"{sum(vals) / len(vals):.2f}" if vals else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {avg} |")
    lines.append("")
    lines.append("MNLI: mean of matched/mismatched acc; MRPC, QQP: mean of F1 and acc; STS: mean of "
                 "Pearson and Spearman; CoLA: Matthews corr.; others: acc. Dev sets, ×100; median over "
                 "seeds at the best lr. Avg is over the tasks present.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """The grid's listing, or its runs: every name, setting, input file and earlier run in ``--out`` checked before
    the first one trains."""
    args = build_parser().parse_args(argv)
    set_verbose(args.verbose)
    out = Path(args.out)
    try:  # a file as --out: one line now, not a traceback after the first run has trained
        check_out(args.out, ())
    except ValueError as e:
        fail("pretrain-finetune-glue", e)
    if args.summarize:
        if not out.is_dir():
            fail("pretrain-finetune-glue", f"--out {out} does not exist: no runs to summarize (run the sweep first)")
        try:
            print(markdown_table({args.name: summarize(out, args.name)}))
        except ValueError as e:
            fail("pretrain-finetune-glue", e)
        return
    try:  # every bad name or setting before anything slow
        entries = grid(args)
        configs = {get_task(task).name: build_config(args, task, lr, seed) for task, lr, seed in entries}
    except ValueError as e:
        fail("pretrain-finetune-glue", e)
    if _list_grid(args, entries, out):
        return
    _resolve_inputs(args)
    if args.run_index is not None:
        if not 0 <= args.run_index < len(entries):
            raise SystemExit(f"--run-index {args.run_index} out of range: the grid has {len(entries)} runs")
        entries = [entries[args.run_index]]
    _check_before_runs(args, entries, configs, out)
    for task, lr, seed in entries:
        try:
            res = run_one(args, task, lr, seed)
        except FileNotFoundError as e:
            fail("pretrain-finetune-glue", f"{e} (pass --glue-dir or set PRETRAIN_DATA_DIR to the directory "
                                           f"holding glue/)")
        except GlueFormatError as e:
            fail("pretrain-finetune-glue", e)
        print(strict_json({"task": res["task"], "lr": lr, "seed": seed, "best": res["best"],
                           "wall_s": round(res["wall_s"], 1)}, indent=None))
    if args.run_index is None:
        print(markdown_table({args.name: summarize(out, args.name)}))


def _list_grid(args, entries: list, out: Path) -> bool:
    """``--count-runs`` / ``--list-runs``: print the grid and say so (True); False when asked for neither."""
    if args.count_runs:
        print(len(entries))
        return True
    if args.list_runs:
        for i, (task, lr, seed) in enumerate(entries):
            print(f"{i}\t{task}\tlr {lr:g}\tseed {seed}\t-> {run_path(out, task, lr, seed)}")
        print(f"{len(entries)} runs (sbatch --array=0-{len(entries) - 1}; --count-runs prints the number alone)")
        return True
    return False


def _resolve_inputs(args) -> None:
    """``args.model`` as the checkpoint it reads (said on stdout) and ``args.glue_dir`` found when not given."""
    if not args.model:
        fail("pretrain-finetune-glue", "--model is required (a checkpoint or a HF model directory)")
    try:
        model_path, reading = select_checkpoint(args.model, args.checkpoint)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        fail("pretrain-finetune-glue", e)
    print(reading, flush=True)
    args.model = str(model_path)
    if not args.glue_dir:
        try:
            args.glue_dir = os.path.join(find_data_dir(need="glue", what="GLUE data", flag="--glue-dir"), "glue")
        except FileNotFoundError as e:
            fail("pretrain-finetune-glue", e)


def _check_before_runs(args, entries: list, configs: dict, out: Path) -> None:
    """Every train/dev file of the runs' tasks present (all missing ones named: not a crash after hours of the tasks
    that have theirs), and the runs already in ``out`` of this model and recipe."""
    tasks = [get_task(t) for t in dict.fromkeys(t for t, _, _ in entries)]
    missing = [str(f) for t in tasks for f in task_files(t, args.glue_dir) if not f.is_file()]
    if missing:
        fail("pretrain-finetune-glue", f"GLUE files not found: {', '.join(missing)} (pass --glue-dir or set "
                                       f"PRETRAIN_DATA_DIR to the directory holding glue/)")
    try:
        check_same_settings(read_runs(out), args.model, {t.name: configs[t.name] for t in tasks})
    except ValueError as e:
        fail("pretrain-finetune-glue", e)

if __name__ == "__main__":
    main()
