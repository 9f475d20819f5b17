"""Training smoke runs on a GPU: `pretrain-train` through DeepSpeed on CUDA/NCCL, every ZeRO stage,
bf16 and fp16, and ZeRO-3 with train.compile (plain, and as CUDA graphs over bucketed batches), with the fused
similarity kernel (`ops.similarity=cuda`); the held-out loss must fall, and a checkpoint written on the GPU must
resume and continue as the uninterrupted run did. Then a BERT-base CLEAR run measures whether the data pipeline
keeps the GPU fed (`data_wait_frac`).

    python tools/gpu_smoke.py OUTDIR [--steps 60] [--parallel 8]

Writes OUTDIR/smoke.json (every figure) and one log per run; exit status 1 if a check fails.
Data: the quickstart's embedded corpus (no network, no ../shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN_COMPILE = "default:dynamic"
"""The trainer's own train.compile_mode:train.compile_shapes (TrainConfig's defaults): the compiled variant run
first, and named plainly ``_compiled``."""
LOG_EVERY = 10
MINI = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.ffn_size=1024"]
MODELS = {"mini": MINI, "quickstart": []}
"""--model: the matrix runs' model (quickstart: configs/quickstart.yaml's own, for a fast CPU dry run)."""


def _run(name: str, out: Path, args: list[str], timeout: int = 900) -> dict:
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", "pretrain.train", *args], stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"name": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _train_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if r.get("split", "train") == "train" and "loss" in r}


def _valid_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("split") == "valid"]


def base_overrides(paths: dict, run_dir: Path, steps: int, model: str = "mini") -> list[str]:
    return [
        str(ROOT / "configs" / "quickstart.yaml"), f"run_dir={run_dir}", f"data.tokenizer={paths['tokenizer']}",
        f"data.sources=[{{name: docs, path: {paths['train']}}}]", f"data.valid=[{{name: docs, path: {paths['valid']}}}]",
        f"train.max_steps={steps}", f"train.log_every={LOG_EVERY}", "train.eval_every=0", "train.eval_batches=8",
        "optim.warmup_steps=10", "optim.lr=1e-3", f"checkpoint.every={steps // 2}", "checkpoint.keep_last=3",
        *MODELS[model],
    ]


def matrix(paths: dict, out: Path, steps: int, parallel: int, stages=(0, 1, 2, 3), precisions=("bf16", "fp16"),
           similarity: str = "cuda", model: str = "mini", compiled_stages=(), compile_backend: str = "inductor",
           compile_variants=(PLAIN_COMPILE,)) -> list[dict]:
    """ZeRO stages x precisions, and ``compiled_stages`` in the first precision with train.compile: run to `steps`,
    then resume a copy from the half-way checkpoint."""
    cases = [(z, p, False) for z in stages for p in precisions] + [(z, precisions[0], v) for z in compiled_stages
                                                                   for v in compile_variants]

    def case_overrides(z: int, p: str, compiled) -> list[str]:
        """``compiled``: False, or a "compile_mode:compile_shapes" variant."""
        compile_ = []
        if compiled:
            mode, shapes = compiled.split(":")
            compile_ = ["train.compile=true", f"train.compile_backend={compile_backend}", "train.unpadded=false",
                        f"train.compile_mode={mode}", f"train.compile_shapes={shapes}"]
        return [f"distributed.zero_stage={z}", f"train.precision={p}", f"ops.similarity={similarity}", *compile_]

    def full(case):
        z, p, compiled = case
        name = f"z{z}_{p}" + ("" if not compiled else "_compiled" if compiled == PLAIN_COMPILE
                               else "_compiled_" + compiled.replace(":", "_"))
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        r = _run(name, out, base_overrides(paths, run_dir, steps, model) + case_overrides(z, p, compiled))
        return dict(r, zero=z, precision=p, compiled=compiled, run_dir=str(run_dir))

    def resume(res):
        src = Path(res["run_dir"])
        dst = src.with_name(src.name + "_resumed")
        shutil.rmtree(dst, ignore_errors=True)
        tag = f"step_{steps // 2:08d}"
        if not (src / "checkpoints" / tag).is_dir():
            return dict(name=dst.name, rc="no half-way checkpoint", run_dir=str(dst))
        (dst / "checkpoints").mkdir(parents=True)
        shutil.copytree(src / "checkpoints" / tag, dst / "checkpoints" / tag)
        (dst / "checkpoints" / "latest").write_text(tag + "\n")
        r = _run(dst.name, out, base_overrides(paths, dst, steps, model) +
                 case_overrides(res["zero"], res["precision"], res["compiled"]))
        return dict(r, run_dir=str(dst))

    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(full, cases))
    with ThreadPoolExecutor(parallel) as pool:
        resumed = list(pool.map(resume, [r for r in results if r["rc"] == 0]))
    by_name = {r["name"].removesuffix("_resumed"): r for r in resumed}
    for res in results:
        rows = _metrics(Path(res["run_dir"]))
        valid = _valid_rows(rows)
        train = _train_rows(rows)
        res["valid_mlm"] = [(v["step"], v.get("mlm")) for v in valid]
        res["train_loss"] = {s: r["loss"] for s, r in sorted(train.items())}
        res["loss_falls"] = bool(len(valid) >= 2 and valid[-1]["mlm"] < valid[0]["mlm"] - 0.5)
        rr = by_name.get(res["name"])
        if rr is not None:
            log = Path(rr["log"]).read_text(errors="replace") if rr.get("log") else ""
            again = _train_rows(_metrics(Path(rr["run_dir"])))
            # A logged loss is the mean over its log window: compare only windows that start after the checkpoint.
            common = sorted(s for s in set(again) & set(train) if s - LOG_EVERY >= steps // 2)
            diffs = [abs(again[s]["loss"] - train[s]["loss"]) / abs(train[s]["loss"]) for s in common]
            res["resume"] = dict(rc=rr["rc"], resumed_msg="resumed from" in log, steps_compared=common,
                                 max_rel_diff=max(diffs) if diffs else None,
                                 resumed_loss={s: again[s]["loss"] for s in common})
            res["resume_ok"] = bool(rr["rc"] == 0 and "resumed from" in log and common
                                    and max(diffs) < 1e-2)
        else:
            res["resume_ok"] = False
    # A compiled run against the eager one at the same stage and precision (its dropout draws other noise, so the
    # two agree only roughly): on the H200 of 2026-11-27 the compiled ZeRO-3 run ended 2.9% above the eager
    # one's held-out MLM, while its step still ran eagerly after validation (since fixed), cause not established.
    final = {(r["zero"], r["precision"], r["compiled"]): r["valid_mlm"][-1][1] for r in results if r.get("valid_mlm")}
    for res in results:
        eager = final.get((res["zero"], res["precision"], False))
        if res["compiled"] and eager and res.get("valid_mlm"):
            res["valid_mlm_vs_eager"] = round(res["valid_mlm"][-1][1] / eager, 4)
    return results


def feed(paths: dict, out: Path, workers: list[int], steps: int, batch: int) -> list[dict]:
    """BERT-base CLEAR (del-span+reorder), bf16, ZeRO-2: throughput and the time spent waiting for data."""
    results = []
    for w in workers:
        run_dir = out / f"feed_w{w}"
        shutil.rmtree(run_dir, ignore_errors=True)
        args = [str(ROOT / "configs" / "recipes" / "clear_del_span_reorder.yaml"), f"run_dir={run_dir}",
                f"data.tokenizer={paths['tokenizer']}", f"data.sources=[{{name: docs, path: {paths['train']}}}]",
                "data.max_len=128", "data.view_max_len=64", f"data.num_workers={w}",
                f"train.micro_batch_size={batch}", f"train.max_steps={steps}", f"train.log_every={LOG_EVERY}",
                "optim.warmup_steps=10", "checkpoint.every=0", "ops.similarity=cuda", "train.precision=bf16"]
        r = _run(f"feed_w{w}", out, args)
        rows = [row for row in _train_rows(_metrics(run_dir)).values() if row["step"] > 10]  # past warm-up
        if rows:
            r.update(num_workers=w, batch=batch,
                     samples_per_s=sum(x["samples_per_s"] for x in rows) / len(rows),
                     data_wait_frac=sum(x.get("data_wait_frac", float("nan")) for x in rows) / len(rows))
        results.append(r)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1.3 GB of BERT-base state
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--feed-workers", type=int, nargs="*", default=[1, 4], help="data.num_workers values (1 = default)")
    p.add_argument("--feed-batch", type=int, default=128)
    p.add_argument("--feed-steps", type=int, default=50)
    p.add_argument("--only", choices=["matrix", "feed"], default=None)
    p.add_argument("--zero-stages", type=int, nargs="*", default=[0, 1, 2, 3])
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=["fp32", "bf16", "fp16"])
    p.add_argument("--compiled-zero-stages", type=int, nargs="*", default=[3],
                   help="ZeRO stages also run in the first precision with train.compile (ZeRO-3's whole-module gather, issue 24)")
    p.add_argument("--compile-backend", default="inductor", help="their train.compile_backend (aot_eager: CPU)")
    p.add_argument("--compile-variants", nargs="+", default=[PLAIN_COMPILE, "reduce-overhead:bucketed"],
                   help="the compiled runs' train.compile_mode:train.compile_shapes, one run each (e.g. "
                        "reduce-overhead:bucketed: CUDA graphs over bucketed batches)")
    p.add_argument("--similarity", default="cuda", help="ops.similarity of the matrix runs (torch: a CPU dry run)")
    p.add_argument("--model", choices=sorted(MODELS), default="mini",
                   help="the matrix runs' model (quickstart: the quickstart's tiny one, for a fast CPU dry run)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(ROOT))
    from pretrain.quickstart import prepare

    paths = {k: str(v) for k, v in prepare(out / "data").items()}
    summary: dict = {}
    if args.only in (None, "matrix"):
        summary["matrix"] = matrix(paths, out, args.steps, args.parallel, args.zero_stages, args.precisions,
                                   args.similarity, args.model, args.compiled_zero_stages, args.compile_backend,
                                   args.compile_variants)
        for r in summary["matrix"]:
            print(f"zero {r['zero']} {r['precision']}{' compiled ' + r['compiled'] if r['compiled'] else ''}: rc {r['rc']} {r['seconds']}s valid mlm "
                  f"{r['valid_mlm']} falls={r['loss_falls']} resume={r.get('resume')}"
                  + (f" held-out mlm / eager {r['valid_mlm_vs_eager']}" if "valid_mlm_vs_eager" in r else ""), flush=True)
    if args.only in (None, "feed"):
        summary["feed"] = feed(paths, out, args.feed_workers, args.feed_steps, args.feed_batch)
        for r in summary["feed"]:
            print(f"feed workers {r.get('num_workers')}: rc {r['rc']} samples/s {r.get('samples_per_s')} "
                  f"data_wait_frac {r.get('data_wait_frac')}", flush=True)
    (out / "smoke.json").write_text(json.dumps(summary, indent=1, default=str))
    ok = all(r["rc"] == 0 and r["loss_falls"] and r["resume_ok"] for r in summary.get("matrix", []))
    ok = ok and all(r["rc"] == 0 for r in summary.get("feed", []))
    print("SMOKE", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
