"""Training throughput of every shipped recipe at ``model=tiny`` on this machine (issue 29 item 1: >= 40 samples/s).

Each recipe runs as its header says, with only its data paths added: the CLEAR recipes from scratch on the
quickstart data, the continued-training ones (SimCSE, ArcCSE, RankCSE) from a tiny checkpoint (``--start``) on the
shared wiki1m sentences; RankCSE's two teachers are that checkpoint too; SARCSE (with ``--roberta``) from a
``pretrain-convert from-hf`` init directory of a tiny RoBERTa (``tools/tiny_roberta.py``), with its tokenizer;
supervised SimCSE (with ``--pairs``) from the tiny checkpoint on a file of (anchor, positive, hard negative) rows
(``tools/sick_triples.py`` makes one from SICK: SimCSE's NLI triples are not in the shared data). One fresh process
per recipe, run one after another; the figure is the median of ``samples_per_s`` over the logged windows after
the first (worker start-up) -- the trainer's own meter, optimizer step included. Run it on a quiet machine; the load
average is printed before and after each run.

    python -m pretrain.quickstart runs/qs --prepare-only
    bash tools/recipes_at_chance.sh runs/qs runs/at_chance     # or any tiny run of clear_del_span_reorder
    python tools/tiny_roberta.py ../shared/data/corpus/wiki1m/wiki1m_for_simcse.txt runs/tiny_roberta --init
    python tools/sick_triples.py runs/sick_triples.csv
    python tools/bench_recipes.py runs/qs runs/at_chance/clear_del_span_reorder OUT [--steps 40] \
        [--roberta runs/tiny_roberta/init] [--pairs runs/sick_triples.csv]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLEAR = ["clear_del_span_reorder", "clear_del_span", "clear_del_word", "clear_subs_del_span"]
CONTINUED = ["simcse_unsup_bert_base", "arccse_bert_base", "rankcse_listnet_bert_base", "rankcse_listmle_bert_base"]
SARCSE, SUP = "sarcse_roberta_base", "simcse_sup_bert_base"


def overrides(name: str, qs: Path, start: Path, data: Path, roberta: Path | None = None,
              pairs: Path | None = None) -> list[str]:
    tok = f"data.tokenizer={qs / 'tokenizer' / 'tokenizer.json'}"
    if name == SUP:  # (anchor, positive, hard negative) rows instead of sentences
        return [tok, f"checkpoint.init_from={start}", f"data.pairs={pairs}"]
    if name == SARCSE:  # RoBERTa's start and byte-level BPE tokenizer
        start, tok = roberta, f"data.tokenizer={roberta / 'tokenizer.json'}"
    if name in CLEAR:
        return [tok, f"data.sources=[{{name: qs, path: {qs / 'data' / 'train'}}}]",
                f"data.valid=[{{name: qs, path: {qs / 'data' / 'valid'}}}]"]
    extra = [f"objective.rank_distill.teachers=[{start},{start}]"] if name.startswith("rankcse") else []
    return [tok, f"checkpoint.init_from={start}", f"data.sentences={data / 'corpus' / 'wiki1m' / 'wiki1m_for_simcse.txt'}",
            *extra]


def run(name: str, out: Path, steps: int, extra: list[str], data: Path) -> dict:
    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    load0 = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "pretrain.train", str(ROOT / "configs" / "recipes" / f"{name}.yaml"), "model=tiny",
           f"run_dir={run_dir}", f"train.max_steps={steps}", "train.log_every=5", "train.eval_every=0",
           "checkpoint.every=0", "eval.stsb_every=0", *extra]
    env = dict(os.environ, PRETRAIN_DATA_DIR=str(data),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        return {"recipe": name, "rc": code}
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if r.get("split") == "train" and "samples_per_s" in r][1:]
    batch = next((ln for ln in (run_dir / "config.yaml").read_text().splitlines()
                  if ln.strip().startswith("micro_batch_size:")), "").split(":")[-1].strip()
    return {"recipe": name, "rc": 0, "samples_per_s": statistics.median(rates) if rates else float("nan"),
            "range": (min(rates), max(rates)) if rates else None, "micro_batch": batch,
            "load": (load0, os.getloadavg()[0])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("quickstart", type=Path, help="a `python -m pretrain.quickstart DIR --prepare-only` directory")
    p.add_argument("start", type=Path, help="a tiny run to continue from (its latest checkpoint)")
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--roberta", type=Path, default=None,
                   help="a `pretrain-convert from-hf` init directory of a tiny RoBERTa (model=tiny's sizes): adds "
                        "sarcse_roberta_base, which starts from it")
    p.add_argument("--pairs", type=Path, default=None,
                   help="(anchor, positive, hard negative) rows (tools/sick_triples.py): adds simcse_sup_bert_base")
    p.add_argument("--recipes", nargs="+", default=None, choices=CLEAR + CONTINUED + [SUP, SARCSE])
    args = p.parse_args(argv)
    args.recipes = args.recipes or (CLEAR + CONTINUED + ([SUP] if args.pairs else [])
                                    + ([SARCSE] if args.roberta else []))
    if SARCSE in args.recipes and args.roberta is None:
        p.error("sarcse_roberta_base starts from a RoBERTa: pass --roberta INIT (tools/tiny_roberta.py --init)")
    if SUP in args.recipes and args.pairs is None:
        p.error("simcse_sup_bert_base trains on triples: pass --pairs FILE (tools/sick_triples.py)")
    data = Path(os.environ.get("PRETRAIN_DATA_DIR", ROOT.parent / "shared" / "data"))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} cores; model=tiny, {args.steps} steps a recipe, samples/s = median of the trainer's "
          f"meter over 5-step windows after the first", flush=True)
    print("| recipe | micro-batch | samples/s (median) | range | load at start → end |\n|---|---:|---:|---|---|")
    rows = []
    for name in args.recipes:
        r = run(name, args.out, args.steps, overrides(name, args.quickstart.resolve(), args.start.resolve(), data,
                                                      args.roberta and args.roberta.resolve(),
                                                      args.pairs and args.pairs.resolve()), data)
        rows.append(r)
        if r["rc"]:
            print(f"| {name} | | exit {r['rc']} (see {args.out / (name + '.log')}) | | |", flush=True)
            continue
        lo, hi = r["range"]
        print(f"| {name} | {r['micro_batch']} | {r['samples_per_s']:.0f} | {lo:.0f}–{hi:.0f} | "
              f"{r['load'][0]:.2f} → {r['load'][1]:.2f} |", flush=True)
    (args.out / "bench_recipes.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
