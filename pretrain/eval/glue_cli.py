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
import statistics
from pathlib import Path

from pretrain.checkpoint.store import CheckpointError
from pretrain.console import set_verbose
from pretrain.eval import fail, find_data_dir
from pretrain.eval.encoder import load_backbone
from pretrain.eval.glue import FinetuneConfig, check_max_len, finetune
from pretrain.eval.glue_data import TABLE_ORDER, TASKS, get_task
from pretrain.export.resolve import select_checkpoint

DEFAULT_EPOCHS_LARGE = 3


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
    p.add_argument("--trust-checkpoint", action="store_true", help="read an old checkpoint of ours that has no model.safetensors by unpickling its DeepSpeed files (runs any code they carry: only for checkpoints you trust)")
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


def run_one(args, task: str, lr: float, seed: int) -> dict:
    import torch


    if args.threads:
        torch.set_num_threads(args.threads)
    spec = get_task(task)
    cfg = FinetuneConfig(
        task=task, lr=lr, seed=seed, epochs=args.epochs if spec.small else args.epochs_large,
        batch_size=args.batch_size, max_len=args.max_len, warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, max_train_examples=args.max_train_examples,
        eval_every=args.eval_every, device=args.device, bf16=args.bf16,
    )

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
    path.write_text(json.dumps(res, indent=1))
    return res


def summarize(out: Path, name: str = "model") -> dict:
    """Per task: best lr by median-over-seeds dev score; writes results.json and results.md."""
    runs: dict[str, dict[float, list[dict]]] = {}
    for f in sorted(out.glob("*/lr*_seed*.json")):
        r = json.loads(f.read_text())
        if r.get("best") is None:
            continue
        runs.setdefault(r["task"], {}).setdefault(r["config"]["lr"], []).append(r)
    summary = {}
    for task, by_lr in runs.items():
        med = {lr: statistics.median(r["best"]["score"] for r in rs) for lr, rs in by_lr.items()}
        lr = max(med, key=med.get)
        rs = by_lr[lr]
        summary[task] = {
            "score": med[lr], "lr": lr, "seeds": [r["config"]["seed"] for r in rs],
            "per_seed": [r["best"] for r in rs], "wall_s": [r["wall_s"] for r in rs],
            "epochs": rs[0]["config"]["epochs"], "num_train": rs[0]["num_train"],
            "all_lrs": med,
        }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(markdown_table({name: summary}))
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
    args = build_parser().parse_args(argv)

    set_verbose(args.verbose)
    out = Path(args.out)
    if args.summarize:
        print(markdown_table({args.name: summarize(out, args.name)}))
        return
    entries = grid(args)
    if args.count_runs:
        print(len(entries))
        return
    if args.list_runs:
        for i, (task, lr, seed) in enumerate(entries):
            print(f"{i}\t{task}\tlr {lr:g}\tseed {seed}\t-> {run_path(out, task, lr, seed)}")
        print(f"{len(entries)} runs (sbatch --array=0-{len(entries) - 1}; --count-runs prints the number alone)")
        return
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
    if args.run_index is not None:
        if not 0 <= args.run_index < len(entries):
            raise SystemExit(f"--run-index {args.run_index} out of range: the grid has {len(entries)} runs")
        entries = [entries[args.run_index]]
    for task, lr, seed in entries:
        try:
            res = run_one(args, task, lr, seed)
        except FileNotFoundError as e:
            fail("pretrain-finetune-glue", f"{e} (pass --glue-dir or set PRETRAIN_DATA_DIR to the directory "
                                           f"holding glue/)")
        print(json.dumps({"task": res["task"], "lr": lr, "seed": seed, "best": res["best"],
                          "wall_s": round(res["wall_s"], 1)}))
    if args.run_index is None:
        print(markdown_table({args.name: summarize(out, args.name)}))


if __name__ == "__main__":
    main()
