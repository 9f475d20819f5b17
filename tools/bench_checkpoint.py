"""Training time lost per checkpoint: synchronous saves vs background ones (issue 25 item 3: background <= 20% of sync).

The mini model (configs/models/mini.yaml) on a small generated corpus (the test suite's embedded text, a 2000-word
WordPiece vocabulary), one fresh ``pretrain-train`` process per run, at ZeRO 0 and 2. Per ZeRO stage three runs of
``--steps`` steps: no periodic checkpoint, one every ``--every`` steps written synchronously
(``checkpoint.background=false``), and the same in the background (the default). Every run ends with its final
(waited-for) checkpoint, so the time measured — from the first step's metrics record to the final publish of
``checkpoints/latest`` — also counts a background save still being written at the end. Lost per checkpoint, two
ways: the seconds the training loop stood still in saves (the trainer's own ``"checkpoint"`` records in
metrics.jsonl: ``pause_s``, ``wait_prev_s``), and by wall time, (time with periodic saves - time without) / number of
periodic saves, which also counts the CPU the background writer takes from training but moves with the machine's
load. A warm-up run goes first. ``--repeat`` runs each arm again (alternating)
and keeps the fastest. The load average (1 min) is printed at the start and end: on a shared machine the figures
move with it.

    python tools/bench_checkpoint.py                 # mini, ZeRO 0 and 2, 1 rank, 40 steps, a save every 10
    python tools/bench_checkpoint.py --ranks 2 --repeat 2 --json-out bench_ckpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pretrain, not an installed one

ARMS = ("none", "sync", "background")


def build_corpus(root: Path) -> dict:
    """{"tokenizer", "train"}: the embedded text, tokenized (vocab 2000) and preprocessed."""
    from pretrain.prep.embedded import write_embedded_corpus
    from pretrain.prep.preprocess import preprocess
    from pretrain.prep.tokenizer import train_tokenizer

    train_txt, _ = write_embedded_corpus(root / "text", valid_every=10)
    tok = root / "tokenizer.json"
    train_tokenizer([str(train_txt)], str(tok), kind="wordpiece", vocab_size=2000)
    preprocess([str(train_txt)], str(root / "train"), str(tok), num_workers=1)
    return {"tokenizer": str(tok), "train": str(root / "train")}


def run_arm(corpus: dict, run_dir: Path, *, arm: str, zero: int, steps: int, every: int, ranks: int,
            model: str, batch: int, seq: int) -> tuple[float, float]:
    """(seconds from the first step's record to the final checkpoint's publish, seconds the training loop stood
    still per periodic checkpoint by the trainer's own "checkpoint" records)."""
    overrides = [f"model={model}", f"run_dir={run_dir}", f"data.tokenizer={corpus['tokenizer']}",
                 f"data.sources=[{{name: b, path: {corpus['train']}}}]", "data.valid=[]", f"data.max_len={seq}",
                 "data.view_max_len=32", "data.num_workers=0", f"train.micro_batch_size={batch}",
                 f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0", "eval.stsb_every=0",
                 f"distributed.zero_stage={zero}", f"checkpoint.every={0 if arm == 'none' else every}",
                 f"checkpoint.background={arm != 'sync'}", "checkpoint.keep_last=2"]
    if ranks == 1:
        cmd = [sys.executable, "-m", "pretrain.train", *overrides]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "pretrain.train", *overrides]
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, check=False, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{arm} ZeRO-{zero} exited {code}; see {log}")
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("split") == "train")
    wall = (run_dir / "checkpoints" / "latest").stat().st_mtime - first["time"]
    return wall, stall_per_checkpoint(records, steps)


def stall_per_checkpoint(records: list[dict], steps: int) -> float:
    """Seconds the loop stood still per periodic save: their pauses (snapshot; the whole save when synchronous; the
    wait for the save before) plus the final save's wait for the last periodic one, over the periodic saves."""
    saves = [r for r in records if r.get("split") == "checkpoint"]
    periodic = [r for r in saves if r["step"] < steps]
    final = [r for r in saves if r["step"] == steps]
    if not periodic:
        return 0.0
    return (sum(r["pause_s"] for r in periodic) + sum(r["wait_prev_s"] for r in final)) / len(periodic)


def lost_per_checkpoint(times: dict, stalls: dict, num_saves: int) -> dict:
    """Seconds lost per periodic checkpoint, sync and background: by wall time against the run without saves (CPU the
    background writer takes from training included; noisy on a loaded machine) and by the loop's own stall; the
    ratios background/sync."""
    out = {f"{arm}_wall": (times[arm] - times["none"]) / num_saves for arm in ("sync", "background")}
    out.update({f"{arm}_stall": stalls[arm] for arm in ("sync", "background")})
    for kind in ("wall", "stall"):
        sync = out[f"sync_{kind}"]
        out[f"ratio_{kind}"] = out[f"background_{kind}"] / sync if sync > 0 else float("nan")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 2])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="train.micro_batch_size")
    p.add_argument("--seq", type=int, default=128, help="data.max_len")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    num_saves = (args.steps - 1) // args.every
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
          f"({os.cpu_count()} cores)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        corpus = build_corpus(Path(tmp) / "corpus")
        # A first run pays one-time costs (caches, page cache of the corpus) that would land on the first arm.
        run_arm(corpus, Path(tmp) / "warmup", arm="none", zero=args.zero[0], steps=min(args.steps, 4),
                every=args.every, ranks=args.ranks, model=args.model, batch=args.batch, seq=args.seq)
        for zero in args.zero:
            times = {arm: float("inf") for arm in ARMS}
            stalls = {arm: float("inf") for arm in ARMS}
            for rep in range(args.repeat):
                for arm in ARMS:
                    run_dir = Path(tmp) / f"z{zero}_{arm}_{rep}"
                    seconds, stall = run_arm(corpus, run_dir, arm=arm, zero=zero, steps=args.steps, every=args.every,
                                      ranks=args.ranks, model=args.model, batch=args.batch, seq=args.seq)
                    times[arm], stalls[arm] = min(times[arm], seconds), min(stalls[arm], stall)
                    shutil.rmtree(run_dir, ignore_errors=True)
                    print(f"  ZeRO-{zero} {arm:<10} {seconds:7.2f} s, stalled {stall:.3f} s per checkpoint  "
                          f"(load {os.getloadavg()[0]:.2f})", flush=True)
            rows.append({"zero": zero, **{f"{a}_s": t for a, t in times.items()},
                         **lost_per_checkpoint(times, stalls, num_saves)})
    load_end = os.getloadavg()
    print(f"\nmodel={args.model}, {args.ranks} rank(s), micro-batch {args.batch} x {args.seq} tokens, {args.steps} steps, a checkpoint every {args.every} "
          f"({num_saves} periodic + the final one), best of {args.repeat}")
    print("lost per checkpoint: 'stall' = the training loop stood still (trainer's checkpoint records); 'wall' = run "
          "time minus the run without periodic saves (also counts CPU the writer takes; noisy under load)")
    print(f"{'ZeRO':>4} | {'no saves s':>10} | {'sync s':>7} | {'bg s':>7} | {'stall sync':>10} | {'stall bg':>9} | "
          f"{'bg/sync':>7} | {'wall sync':>9} | {'wall bg':>8} | {'bg/sync':>7}")
    for r in rows:
        print(f"{r['zero']:>4} | {r['none_s']:>10.2f} | {r['sync_s']:>7.2f} | {r['background_s']:>7.2f} | "
              f"{r['sync_stall']:>9.3f}s | {r['background_stall']:>8.3f}s | {r['ratio_stall']:>7.1%} | "
              f"{r['sync_wall']:>8.2f}s | {r['background_wall']:>7.2f}s | {r['ratio_wall']:>7.1%}")
    print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}  (goal: bg/sync <= 20%)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "load_start": load_start, "load_end": load_end,
                                                   "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
