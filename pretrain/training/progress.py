"""What the trainer tells the user while it runs: time left, a collapsed contrastive term, a re-stretched LR
schedule on resume, and the summary at the end. Pure functions and small trackers; the trainer prints."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from pretrain.config import OptimConfig, from_dict
from pretrain.distributed.comm import all_reduce_host
from pretrain.metrics.accumulate import MetricSums
from pretrain.metrics.writer import format_duration
from pretrain.training.optim import lr_lambda

DATA_WAIT_WARN = 0.10
"""Warn (once) when the step spends more than this fraction of its time waiting for the next batch."""
COLLAPSE_TOLERANCE = 0.02
"""A contrastive loss within this fraction of its chance value counts as "at chance"."""
COLLAPSE_PATIENCE = 200
"""Steps at chance before the warning."""


def every(n: int, step: int, *, last: bool = False) -> bool:
    """The one rule for "every N steps": step is a multiple of n > 0 (n = 0 is off), or it is the ``last`` step
    of the run where the caller asks for that too."""
    return last or (n > 0 and step % n == 0)


class LogWindow:
    """What happened since the last log line: metric sums, samples and real tokens (this rank's: the sequence's and
    both views'), the time spent waiting for data. ``scalars`` turns it into the logged figures: samples/s and
    tokens/s summed over all ranks (each rank's own counts, in the figures' one all-reduce), over the window's wall
    time less what ran ``paused`` (validation, STS-B, checkpoints), data waits included; the data-wait fraction of
    the rank that waited most (the step waits for the slowest rank), from the same all-reduce. The first step after
    a (re)start (``resume``: a launch, a rollback) holds the start-up (compilation, the loader's new workers), so
    the rates and the data-wait fraction of its window are over the window's later steps (all of it when it has
    no other step)."""

    COUNTS = ("window.samples", "window.tokens", "window.tokens_seen")
    """The counts ``scalars`` sums over ranks with the metric sums (not figures of their own)."""

    def __init__(self) -> None:
        self.sums = MetricSums()
        self._starting = False
        """Set by ``resume`` until the next ``add``: that step holds the start-up."""
        self.reset()

    def reset(self) -> None:
        self.sums.reset()
        self.t0, self.samples, self.tokens, self.data_wait_s = time.perf_counter(), 0, 0, 0.0
        self.paused_s = 0.0
        self.started: tuple | None = None
        """(time, samples, tokens, data_wait_s, paused_s) just after the first step since ``resume``, else None."""

    @contextlib.contextmanager
    def paused(self):
        """Time inside is not the training's (validation, evaluation, a checkpoint): left out of the rates."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t0

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if self._starting:  # the first step since a (re)start ends here: the rates begin after it
            self._starting = False
            self.started = (time.perf_counter(), self.samples, self.tokens, self.data_wait_s, self.paused_s)

    def carry(self, env, micro_steps: int) -> dict:
        """The metric sums and counts of the window so far, over all ranks (collective), and the step's
        ``micro_steps`` (ranks x grad_accum): what a checkpoint inside a window keeps, so that the resumed run's
        record at the window's end still covers the whole window. The figures ``scalars`` sets (lr, grad norm,
        bad-step counters) are not sums and stay out; an empty window carries nothing."""
        left_out = ("lr", "grad_norm", *BadSteps.KEYS, *self.COUNTS)
        sums = {n: t for n, t in self.sums.totals(env).items() if n not in left_out}
        return {"micro_steps": micro_steps, "sums": sums} if sums else {}

    def resume(self, carried: dict, env, micro_steps: int) -> None:
        """Continue a window a checkpoint cut (``carry``): its sums go in once, on the main rank. The rates and the
        data-wait fraction stay this launch's own (measured from the end of its first step). Split into other
        micro-steps (another rank count) the window starts afresh: figures counted per micro-step would weigh the
        carried steps differently from the new ones."""
        self._starting = True
        if env.is_main and carried.get("micro_steps") == micro_steps:
            for name, (value_sum, count) in carried["sums"].items():
                self.sums.add(name, value_sum, count)

    def scalars(self, env, info, *, bad_steps: "BadSteps", tokens_seen: int) -> dict[str, float]:
        """The window's means reduced over ranks, plus the last step's lr/grad norm/loss scale, the bad-step count,
        the rates and the largest data-wait fraction of any rank. The device's figures (metric sums, lr, grad norm,
        bad-step counters) come in one transfer, and everything crosses the ranks in one all-reduce."""
        t0, samples, tokens, wait_s, paused_s = (self.t0, 0, 0, 0.0, 0.0)
        if self.started is not None and self.samples > self.started[1]:  # steps after the start-up's: over them
            t0, samples, tokens, wait_s, paused_s = self.started
        elapsed = time.perf_counter() - t0 - (self.paused_s - paused_s)
        self.sums.set("lr", info.lr)
        self.sums.set("grad_norm", info.grad_norm)
        bad_steps.stage(self.sums)
        # set: the mean over ranks, so x world size is their sum (ranks' real tokens differ)
        for key, count in zip(self.COUNTS, (self.samples - samples, self.tokens - tokens, tokens_seen)):
            self.sums.set(key, count)
        # every rank's own wait fraction, in the same all-reduce: the step waits for the slowest rank's data
        out = self.sums.reduce(env, per_rank={"data_wait_frac": (self.data_wait_s - wait_s) / elapsed})
        total = bad_steps.settle(out)
        samples, tokens, seen = (round(out.pop(key) * env.world_size) for key in self.COUNTS)
        wait_frac = max(out.pop("data_wait_frac"))
        out.update(loss_scale=info.loss_scale, bad_steps=total, samples_per_s=samples / elapsed,
                   tokens_per_s=tokens / elapsed, tokens_seen=seen, data_wait_frac=wait_frac)
        return out


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class BadSteps:
    """Steps whose update was skipped for a non-finite loss or gradient, counted where the step decided that (a
    device tensor: no host sync) and read with the log line's one transfer: ``stage`` puts the counters among the
    window's sums, ``settle`` takes them back out of the fetched figures (or fetches them itself, before a
    checkpoint), adds them to ``total`` and raises ``TrainingDiverged`` at ``limit`` consecutive bad steps, so at
    the next log line or checkpoint at the latest."""

    KEYS = ("bad.count", "bad.run_max", "bad.last_step")

    def __init__(self, limit: int, total: int, describe_stop) -> None:
        self.limit, self.total, self.describe_stop = limit, total, describe_stop
        """``describe_stop(run, last_step) -> str``: the message of the stop (names the last good checkpoint)."""
        self.run = 0.0
        """Consecutive bad steps up to the last one (carried across windows)."""
        self.count, self.run_max, self.last_step = 0.0, 0.0, 0.0

    def add(self, bad, step: int) -> None:
        """``bad``: this step's verdict (a 0-dim bool device tensor, or a Python bool where the host decided)."""
        b = torch.as_tensor(bad).to(torch.float64)
        self.run = (self.run + 1) * b
        self.count = self.count + b
        self.run_max = torch.maximum(torch.as_tensor(self.run_max, dtype=torch.float64, device=b.device), self.run)
        self.last_step = torch.where(b > 0, float(step), torch.as_tensor(self.last_step, dtype=torch.float64,
                                                                           device=b.device))

    def stage(self, sums: MetricSums) -> None:
        for key, value in zip(self.KEYS, (self.count, self.run_max, self.last_step)):
            sums.set(key, value)

    def settle(self, fetched: dict | None = None) -> int:
        """The counters since the last settle (from ``fetched``, the reduced figures ``stage`` went into, whose
        keys it removes; else one transfer of its own) -> ``total``; raises TrainingDiverged at ``limit``."""
        if fetched is None:
            counters = (self.count, self.run_max, self.last_step)
            device = next((v.device for v in counters if torch.is_tensor(v)), torch.device("cpu"))
            values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in counters]).tolist()
        else:
            values = [fetched.pop(key) for key in self.KEYS]
        count, run_max, last_step = (int(v) for v in values)
        self.total += count
        self.count, self.run_max = 0.0, self.run
        if run_max >= self.limit:
            raise TrainingDiverged(self.describe_stop(run_max, last_step))
        return self.total


class StarvationWatch:
    """Once per launch, after its first log window (worker start-up, at whatever step the launch resumed): a warning
    when the step waited for its data more than DATA_WAIT_WARN of the time (``data_wait_frac``: the rank that
    waited most)."""

    def __init__(self, log_every: int, num_workers: int) -> None:
        self.log_every, self.num_workers, self.warned = log_every, num_workers, False
        self.first_window = True

    def update(self, step: int, wait_frac: float) -> str | None:
        first, self.first_window = self.first_window, False
        if wait_frac <= DATA_WAIT_WARN or self.warned or first:
            return None
        self.warned = True
        return (f"warning: step {step} waited for data {wait_frac:.0%} of the time (the rank that waited most; > "
                f"{DATA_WAIT_WARN:.0%}): the data "
                f"pipeline is the bottleneck; raise data.num_workers (now {self.num_workers}) or use lighter "
                f"augmentations")


class Eta:
    """Seconds left to ``max_steps`` at the average time of this launch's steps, from the first step it is asked at
    on (the launch's first step holds the start-up: compilation, the loader's workers), validation and checkpoints
    included. Asked at a step before the last one it was asked at (a rollback), it measures afresh from there and
    keeps the steps measured before (the rollback's own time is not a step's); None until a step is measured."""

    def __init__(self, start_step: int, max_steps: int) -> None:
        self.start_step, self.max_steps = start_step, max_steps
        self.t0 = time.perf_counter()
        self.mark: tuple[float, int] | None = None
        """(time, step) of the first call, or of the first call after a rollback."""
        self.last_t, self.last_step = self.t0, start_step
        self.measured_s, self.measured_steps = 0.0, 0
        """Time and steps measured before ``mark`` (those of the stretches a rollback ended)."""

    def __call__(self, step: int) -> float | None:
        now = time.perf_counter()
        if self.mark is not None and step < self.last_step:  # rolled back: keep what was measured up to the last call
            self.measured_s += self.last_t - self.mark[0]
            self.measured_steps += self.last_step - self.mark[1]
            self.mark = None
        if self.mark is None:
            self.mark = (now, step)
        self.last_t, self.last_step = now, step
        seconds, steps = self.measured_s + now - self.mark[0], self.measured_steps + step - self.mark[1]
        if steps <= 0:
            return None
        return seconds / steps * max(0, self.max_steps - step)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def chance_losses(cfg, world_size: int) -> dict[str, float]:
    """The loss each contrastive term has when the embeddings carry no information (all candidates equally
    likely): NT-Xent ln(2m - 1) over the 2m views of the m sentences a term compares at once (a micro-step's, or
    under objective.gradient_cache the whole step's grad_accum micro-batches; every rank's when the negatives are
    gathered), InfoNCE and ArcCon ln(m) (data.pairs' hard negatives, which the config cannot see, not counted)."""
    out = {}
    o = cfg.objective
    n = cfg.train.micro_batch_size * (cfg.train.grad_accum if o.gradient_cache else 1)
    if o.nt_xent is not None:
        m = n * (world_size if o.nt_xent.gather else 1)
        if m > 1:
            out["nt_xent"] = math.log(2 * m - 1)
    for name in ("info_nce", "arccon"):
        term = getattr(o, name)
        if term is not None:
            m = n * (world_size if term.gather else 1)
            if m > 1:
                out[name] = math.log(m)
    return out


class CollapseWatch:
    """Warns once per contrastive term that has stayed within COLLAPSE_TOLERANCE of its chance loss for
    COLLAPSE_PATIENCE steps (checked at each log step)."""

    def __init__(self, cfg, world_size: int, *, patience: int = COLLAPSE_PATIENCE,
                 tolerance: float = COLLAPSE_TOLERANCE) -> None:
        self.chance = chance_losses(cfg, world_size)
        self.pooling = cfg.model.pooling
        self.patience, self.tolerance = patience, tolerance
        self.since: dict[str, int] = {}
        self.warned: set[str] = set()

    def update(self, step: int, scalars: dict[str, float]) -> list[str]:
        out = []
        for name, chance in self.chance.items():
            loss = scalars.get(name)
            if loss is None or not math.isfinite(loss) or abs(loss - chance) > self.tolerance * chance:
                self.since.pop(name, None)
                continue
            first = self.since.setdefault(name, step)
            if step - first >= self.patience and name not in self.warned:
                self.warned.add(name)
                cos_key = "cl_emb_cos" if name == "nt_xent" else f"{name}_emb_cos"
                cos = scalars.get(cos_key)
                seen = f" (the embeddings' mean cosine between different sentences is {cos:.4f})" if cos is not None \
                    else ""
                out.append(
                    f"warning: {name} has stayed within {self.tolerance:.0%} of its chance value {chance:.3f} since "
                    f"step {first} ({step - first} steps){seen}: the sentence embeddings do not depend on the input "
                    f"yet, so the contrastive gradient is near zero. With model.pooling={self.pooling}"
                    + (" and BERT's initialisation the [CLS] output is nearly input-independent until MLM mixes "
                       "context into it" if self.pooling.startswith("cls") else "")
                    + (". Try objective.nt_xent.mean_pool_warmup_steps=200 (mean pooling blended into the views' "
                       "embedding while [CLS] learns context: in docs/results.md it removed the delay and raised "
                       "[CLS] STS) or model.pooling=mean" if name == "nt_xent" else ". Try model.pooling=mean")
                    + " (README, 'When the contrastive loss sits at chance').")
        return out


def schedule_change(saved_cfg: dict, cfg, step: int) -> str | None:
    """A line saying how the LR schedule changes when a run resumes at ``step`` with other train.max_steps or
    optim.* schedule settings than the checkpoint's, with the lr at that step under both; None when equal."""
    old_optim_d, old_max = saved_cfg.get("optim"), (saved_cfg.get("train") or {}).get("max_steps")
    if not old_optim_d or old_max is None:
        return None
    try:
        old_optim = from_dict(OptimConfig, old_optim_d)
    except ValueError:
        return None
    keys = ("lr", "warmup_steps", "schedule", "min_lr_ratio")
    changes = [f"train.max_steps {old_max} -> {cfg.train.max_steps}"] if old_max != cfg.train.max_steps else []
    changes += [f"optim.{k} {getattr(old_optim, k)} -> {getattr(cfg.optim, k)}" for k in keys
                if getattr(old_optim, k) != getattr(cfg.optim, k)]
    if not changes:
        return None
    old_lr = old_optim.lr * lr_lambda(old_optim, old_max)(step)
    new_lr = cfg.optim.lr * lr_lambda(cfg.optim, cfg.train.max_steps)(step)
    return (f"resuming at step {step} with {', '.join(changes)}: the learning-rate schedule is recomputed for the "
            f"new settings; the lr at step {step} was {old_lr:.3g} under the checkpoint's schedule and is "
            f"{new_lr:.3g} now")


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def run_tokens(env, tokens_seen: int) -> int:
    """The run's real tokens: every rank's own ``tokens_seen`` summed (collective where distributed; the end of the
    run, no step waits for it), as the logged ``tokens_seen``. Ranks' counts differ: rank 0's x world size is not
    it."""
    if not env.is_distributed:
        return tokens_seen
    return int(all_reduce_host(torch.tensor([tokens_seen], dtype=torch.int64)).item())


def end_summary(run_dir: Path, *, step: int, max_steps: int, start_step: int, wall_s: float, tokens_seen: int,
                last_valid: dict, best_stsb: float | None, checkpoint: str | None) -> list[str]:
    """The lines printed when a run finishes: steps, tokens, wall time, final held-out figures, artifacts and
    what to run next."""
    lines = [f"done: step {step}/{max_steps} ({step - start_step} in this launch, {format_duration(wall_s)}); "
             f"{_count(tokens_seen)} tokens seen"]
    if last_valid:
        lines.append("held-out at the end: " + " | ".join(f"{k} {v:.4g}" for k, v in last_valid.items()))
    if best_stsb is not None and math.isfinite(best_stsb):
        lines.append(f"best STS-B dev: {best_stsb:.2f} (weights in {run_dir / 'best'})")
    arts = ["config.yaml", "metrics.jsonl", "tb/ (tensorboard --logdir " + str(run_dir / "tb") + ")"]
    if checkpoint:
        arts.insert(0, f"{checkpoint} (model.safetensors)")
    lines.append(f"artifacts in {run_dir}: " + ", ".join(arts))
    lines.append(f"next: pretrain-report {run_dir} --out {run_dir / 'report'} | pretrain-convert to-hf {run_dir} "
                 f"{run_dir / 'hf'} | pretrain-eval --model {run_dir} --out {run_dir / 'eval'}")
    return lines
