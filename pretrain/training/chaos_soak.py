"""The chaos soak (issue 25 item 5): a multi-node torchrun training on this machine, relaunched after every fault
of a seeded schedule until it completes; then its per-step losses are compared bitwise with an uninterrupted
reference run, every checkpoint ever seen complete is accounted for, and every fault is listed with its outcome.

    run_soak(SoakConfig(work_dir=..., overrides=[...], max_steps=60, seed=1, minutes=1))

Launches (``SoakConfig.launcher``): "torchrun": 2 torchrun agents ("nodes") of 1 worker each on loopback (static
rendezvous), as Slurm's script runs them (``chaos_job.Job``); "slurm": attempts of one ``sbatch
slurm/pretrain.sbatch`` job on 2 nodes of the netns Slurm cluster of tests/slurm, signals and requeues delivered
by Slurm (``chaos_slurm.SlurmJob``, same interface). The run directory is on a tmpfs the soak mounts (for
disk_full), before the cluster starts so that its nodes' mount namespaces have it too.
"""

from __future__ import annotations

import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pretrain.checkpoint import store
from pretrain.prep.embedded import write_embedded_corpus
from pretrain.prep.preprocess import preprocess
from pretrain.prep.tokenizer import train_tokenizer
from pretrain.training import chaos_job as jobs
from pretrain.training import chaos_slurm
from pretrain.training.chaos import (
    CheckpointLedger,
    Fault,
    Schedule,
    compare_losses,
    last_losses,
    missing_kinds,
)

_RESUMED = re.compile(r"resumed from \S*/(step_\d+) at step (\d+)")
_STOPPED = re.compile(r"stop signal: checkpointed step (\d+)")
_EXPECTED_DAMAGE = "{tag} is damaged"


@dataclass(kw_only=True)
class SoakConfig:
    """What the soak trains and how hard it is hit."""

    work_dir: Path
    """Logs, the run's tmpfs (run_fs/), the reference run (ref/), soak.json."""
    overrides: list[str]
    """Trainer overrides (data, model, batch...) without run_dir / max_steps / checkpoint / timeout keys."""
    max_steps: int = 60
    ckpt_every: int = 4
    keep_last: int = 3
    seed: int = 0
    minutes: float = 1.0
    """Faults are drawn for this long (at least until every kind occurred); then the run is let finish."""
    nodes: int = 2
    nproc_per_node: int = 1
    timeout_s: int = 20
    """distributed.timeout_s: how long a survivor may wait for a dead peer."""
    tmpfs_size: str = "64m"
    reference: Path | None = None
    """A finished uninterrupted run of the same config to compare with; None: the soak runs one (work_dir/ref)."""
    launch_timeout_s: float = 600.0
    launcher: Literal["torchrun", "slurm"] = "torchrun"
    """torchrun: agents started here; slurm: sbatch jobs on the netns cluster handed to ``run_soak(cluster=...)``."""

    def __post_init__(self):
        self.work_dir = Path(self.work_dir)
        if self.launcher not in ("torchrun", "slurm"):
            raise ValueError(f"launcher={self.launcher!r}: must be 'torchrun' or 'slurm'")
        if self.max_steps < 6 * self.ckpt_every + 10:
            raise ValueError(f"max_steps={self.max_steps}: needs at least 6 * ckpt_every + 10 steps to place the "
                             f"faults")
        if self.keep_last < 3:
            raise ValueError(f"keep_last={self.keep_last}: needs >= 3 so a damaged newest checkpoint has an older "
                             f"one to fall back to")


@dataclass
class SoakResult:
    faults: list[Fault]
    problems: list[str] = field(default_factory=list)
    """Everything that went wrong: failed faults, lost checkpoints, loss mismatches, uncovered kinds."""
    summary: dict = field(default_factory=dict)


def trainer_overrides(cfg: SoakConfig, run_dir: Path) -> list[str]:
    return [*cfg.overrides, f"run_dir={run_dir}", f"train.max_steps={cfg.max_steps}",
            f"checkpoint.every={cfg.ckpt_every}", f"checkpoint.keep_last={cfg.keep_last}",
            f"distributed.timeout_s={cfg.timeout_s}"]


class Soak:
    """The soak's loop: launch, inject, judge, requeue; one instance per soak."""

    def __init__(self, cfg: SoakConfig, *, say=print, cluster=None):
        self.cfg, self.say = cfg, say
        self.launcher = build_launcher(cfg, cluster)
        self.logs = cfg.work_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.fs = cfg.work_dir / "run_fs"
        self.run_dir = self.fs / "run"
        self.ckpt = store.checkpoints_dir(self.run_dir)
        self.env = jobs.worker_env(f"chaos-soak-{cfg.seed}")
        self.schedule = Schedule(seed=cfg.seed, ckpt_every=cfg.ckpt_every)
        self.ledger = CheckpointLedger(cfg.keep_last)
        self.faults: list[Fault] = []
        self.problems: list[str] = []
        self.t0 = time.monotonic()
        self.no_disk = None

    # ---------------------------------------------------------------------------------------- the loop

    def run(self) -> SoakResult:
        self.no_disk = jobs.mount_tmpfs(self.fs, self.cfg.tmpfs_size)
        if self.no_disk:
            self.say(f"chaos: disk_full cannot be injected: {self.no_disk}")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.launcher.open()
            self.faults += [Fault(kind=kind, launch=0, outcome=why) for kind, why in self.launcher.not_injected]
            self._launches()
            shutil.copy(self.run_dir / "metrics.jsonl", self.cfg.work_dir / "soak_metrics.jsonl")
            self._final_checks()
            ref = self._reference()
        finally:
            self.launcher.close()
            if not self.no_disk:
                jobs.umount(self.fs)
        got = last_losses(self.cfg.work_dir / "soak_metrics.jsonl")
        mismatch = compare_losses(got, last_losses(ref / "metrics.jsonl"), self.cfg.max_steps)
        self.problems += [f"losses: {m}" for m in mismatch]
        self.problems += [f"fault kind never injected: {k}" for k in missing_kinds(self.faults)]
        self.problems += [f"checkpoint lost: {x}" for x in self.ledger.lost]
        self.problems += [f"{f.kind} at launch {f.launch}: {f.outcome}" for f in self.faults if f.ok is False]
        order = {"truncate_checkpoint": 0, "corrupt_checkpoint": 0, "requeue": 1}
        self.faults.sort(key=lambda f: (f.launch, order.get(f.kind, 2)))
        summary = {"seed": self.cfg.seed, "launches": 1 + max((f.launch for f in self.faults), default=0),
                   "faults": sum(f.ok is not None and f.kind != "requeue" for f in self.faults),
                   "requeues": sum(f.kind == "requeue" for f in self.faults),
                   "wall_s": round(time.monotonic() - self.t0, 1), "max_steps": self.cfg.max_steps,
                   "steps_compared": len(got), "losses_bitwise_equal": not mismatch,
                   "checkpoints_lost": list(self.ledger.lost), "problems": list(self.problems)}
        return SoakResult(self.faults, self.problems, summary)

    def _launches(self) -> None:
        launch, unplanned_failures = 0, 0
        while True:
            expected = self._expected_resume()
            start = int(expected.split("_")[1]) if expected else 0
            stop = self._next_stop(launch, start)
            tail = jobs.MetricsTail(self.run_dir / "metrics.jsonl")
            t_start = time.monotonic() - self.t0
            job = self.launcher.launch(trainer_overrides(self.cfg, self.run_dir), log_dir=self.logs,
                                       name=f"launch{launch:03d}", env=self.env)
            injected = self._watch(job, stop, launch, start, tail) if stop else False
            ended = job.wait(self.cfg.launch_timeout_s)
            if not ended:
                job.kill_all()
            out = job.output()
            self._judge_start(launch, out, expected, t_start)
            if stop is not None:
                self._judge_stop(stop, job, out, injected, ended)
            self._observe(f"after launch {launch}")
            codes = job.codes()
            if stop is None or not injected:
                if codes and all(c == 0 for c in codes):
                    return
                unplanned_failures += 1
                self.problems.append(f"launch {launch} failed with no fault injected: exit {codes} "
                                     f"(see {job.logs[0]})")
                if unplanned_failures >= 3:
                    raise RuntimeError(f"chaos: 3 launches failed on their own; last: {job.logs[0]}")
            if self.fs_filler().exists():
                self.fs_filler().unlink()
            launch += 1
            self._maybe_damage(launch)

    def _room(self, start: int) -> int:
        """Steps left to place a stop fault in a launch that starts at ``start`` (the last ones stay clear)."""
        return self.cfg.max_steps - start - 2

    def _next_stop(self, launch: int, start: int) -> Fault | None:
        """This launch's stop fault, or None (let it finish): faults are drawn while a kind is uncovered, then
        while time is left and steps remain. A disk_full that cannot be injected is listed as such (never
        skipped silently) and another kind drawn."""
        timed = time.monotonic() - self.t0 < 60 * self.cfg.minutes and self._room(start) > 3 * self.cfg.ckpt_every
        if self._room(start) < 3 or (self.schedule.covered() and not timed):
            return None
        stop = self.schedule.stop_fault(launch)
        while stop.kind == "disk_full" and self.no_disk:
            stop.outcome = self.no_disk
            if not any(f.kind == "disk_full" for f in self.faults):
                self.faults.append(stop)
            stop = self.schedule.stop_fault(launch)
        stop.after_steps = min(stop.after_steps, self._room(start) - 1)
        return stop

    def fs_filler(self) -> Path:
        return self.fs / "filler"

    # ---------------------------------------------------------------------------------------- injection

    def _watch(self, job: jobs.Job, fault: Fault, launch: int, start: int, tail: jobs.MetricsTail) -> bool:
        """Waits for the fault's step (``after_steps`` past the launch's resume step ``start``, and a save in
        flight if it asks for one), then injects it; False when the launch ended first (the kind is then handed
        out again)."""
        target = start + fault.after_steps
        give_up_save = target + 3 * self.cfg.ckpt_every
        deadline = time.monotonic() + self.cfg.launch_timeout_s
        while job.running() == list(range(self.cfg.nodes)) and time.monotonic() < deadline:
            step = tail.poll() or 0
            saving = any(p.name.startswith(".tmp-step_") for p in self.ckpt.iterdir()) if self.ckpt.is_dir() \
                else False
            if step >= target and (not fault.during_save or saving or step >= give_up_save):
                if fault.during_save and not saving:
                    fault.during_save = False  # none caught in flight: injected at a step instead
                self._inject(job, fault, step)
                return True
            self._observe(f"during launch {launch}")
            time.sleep(0.02)
        fault.outcome = f"the launch ended before step {target} (exit {job.codes()})"
        self.faults.append(fault)
        self.schedule.retry(fault.kind)
        return False

    def _inject(self, job: jobs.Job, fault: Fault, step: int) -> None:
        fault.at_step, fault.at_s = step, time.monotonic() - self.t0
        self.faults.append(fault)
        self._t_inject = time.monotonic()
        if fault.kind == "sigkill_rank":
            job.kill_worker(fault.node)
        elif fault.kind == "kill_node":
            job.kill_node(fault.node)
        elif fault.kind in ("sigterm", "sigusr1"):
            job.signal_job(signal.SIGTERM if fault.kind == "sigterm" else signal.SIGUSR1)
        elif fault.kind == "disk_full":
            jobs.fill(self.fs_filler())
        self.say(f"chaos: {fault.kind} injected at step {step} ({fault.at_s:.0f}s)")

    # ---------------------------------------------------------------------------------------- judging

    def _judge_stop(self, fault: Fault, job: jobs.Job, out: str, injected: bool, ended: bool) -> None:
        if not injected:
            return
        took = (getattr(job, "ended_at", None) or time.monotonic()) - self._t_inject
        codes = job.codes()
        bound = self.cfg.timeout_s + 90
        if not ended:
            fault.ok, fault.outcome = False, f"the job did not end within {self.cfg.launch_timeout_s:.0f}s: killed"
            return
        exits = job.exit_text()
        if fault.kind in ("sigterm", "sigusr1"):
            # The trainer's own line decides: torchrun's agent ends SIGTERM with its SignalException (exit 1).
            m = _STOPPED.search(out)
            fault.ok = bool(m) and "(exit 75)" in out
            fault.outcome = (f"checkpointed step_{int(m.group(1))}, trainer exit 75, {exits}" if m
                             else f"no stop checkpoint, {exits}")
        elif fault.kind in ("sigkill_rank", "kill_node"):
            fault.ok = all(c != 0 for c in codes) and took < bound
            host = f" ({job.killed_node})" if getattr(job, "killed_node", None) else ""
            who = f"a worker of node {fault.node}" if fault.kind == "sigkill_rank" else f"node {fault.node}{host}"
            fault.outcome = f"{who} killed; the job ended {took:.0f}s later, {exits}"
        elif fault.kind == "disk_full":
            tmp = [p.name for p in self.ckpt.iterdir() if p.name.startswith(".tmp-")] if self.ckpt.is_dir() else []
            said = "No space left on device" in out or "ENOSPC" in out
            fault.ok = job.exited_with(4) and said and not tmp
            fault.outcome = (f"{exits}, {'ENOSPC named' if said else 'ENOSPC NOT named'}, "
                             f"{'no partial checkpoint' if not tmp else 'left ' + ', '.join(tmp)}; filler removed")

    def _judge_start(self, launch: int, out: str, expected: str | None, t_start: float) -> None:
        """The requeue row of ``launch`` (launch 0 is the first start) and the outcome of the damage faults that
        preceded it."""
        m = _RESUMED.search(out)
        got = m.group(1) if m else None
        took_over = "took over the lock" in out
        for f in self.faults:
            if f.launch == launch and f.kind in ("truncate_checkpoint", "corrupt_checkpoint") and f.ok is None \
                    and f.at_step is not None:
                tag = store.tag_for_step(f.at_step)
                named = _EXPECTED_DAMAGE.format(tag=tag) in out
                f.ok = named and got == expected
                f.outcome += (f"; {'detected' if named else 'NOT detected'}, resumed from {got or 'nothing'}"
                              + ("" if got == expected else f" (expected {expected})"))
        if launch == 0:
            return
        row = Fault(kind="requeue", launch=launch, at_step=int(m.group(2)) if m else 0, at_s=t_start)
        row.ok = got == expected
        row.outcome = (f"resumed from {got or 'nothing'}" + ("" if got == expected else f" (expected {expected})")
                       + (", lock taken over" if took_over else ""))
        self.faults.append(row)

    def _expected_resume(self) -> str | None:
        return store.find_resumable(self.ckpt, say=lambda _: None) if self.ckpt.is_dir() else None

    # ---------------------------------------------------------------------------------------- checkpoints

    def _maybe_damage(self, launch: int) -> None:
        complete = store.list_complete(self.ckpt)
        fault = self.schedule.damage_fault(launch, len(complete))
        if fault is None:
            return
        tag = store.find_resumable(self.ckpt, say=lambda _: None)
        if tag is None or tag != complete[-1]:
            return
        files = jobs.damageable_files(self.ckpt / tag)
        target = files[self.schedule.rng.randrange(len(files))]
        if fault.kind == "truncate_checkpoint":
            what = jobs.truncate_file(target, self.schedule.rng.choice((0.0, 0.5, 0.9)))
        else:
            what = jobs.flip_byte(target, self.schedule.flip_offset(target.stat().st_size, store.SAMPLE_BLOCK))
        fault.at_step, fault.at_s = int(tag.split("_")[1]), time.monotonic() - self.t0
        fault.outcome = f"{tag}: {what}"
        self.ledger.mark_damaged(tag)
        self.faults.append(fault)
        self.say(f"chaos: {fault.kind}: {fault.outcome}")

    def _observe(self, when: str) -> None:
        if not self.ckpt.is_dir():
            return
        complete = store.list_complete(self.ckpt)
        self.ledger.observe(complete, when)
        if not when.startswith("during"):
            for tag in list(self.ledger.damaged):
                if tag in complete and not store.verify_checkpoint(self.ckpt / tag):
                    self.ledger.rewritten(tag)

    def _final_checks(self) -> None:
        """Every checkpoint left verifies in full (whole-file sha256), the last is max_steps, no partial one."""
        complete = store.list_complete(self.ckpt)
        for tag in complete:
            bad = store.verify_checkpoint(self.ckpt / tag, full=True)
            if bad:
                self.problems.append(f"final checkpoint {tag} damaged: {'; '.join(bad)}")
        if not complete or complete[-1] != store.tag_for_step(self.cfg.max_steps):
            self.problems.append(f"the newest checkpoint is {complete[-1:]} , not step {self.cfg.max_steps}")
        tmp = [p.name for p in self.ckpt.iterdir() if p.name.startswith(".tmp-")]
        if tmp:
            self.problems.append(f"partial checkpoints left at the end: {tmp}")

    def _reference(self) -> Path:
        if self.cfg.reference is not None:
            return Path(self.cfg.reference)
        ref = self.cfg.work_dir / "ref"
        shutil.rmtree(ref, ignore_errors=True)
        env = dict(self.env, PRETRAIN_JOB_ID=f"chaos-reference-{self.cfg.seed}")
        job = self.launcher.reference(trainer_overrides(self.cfg, ref), log_dir=self.logs, name="reference", env=env)
        if not job.wait(self.cfg.launch_timeout_s) or any(job.codes()):
            job.kill_all()
            raise RuntimeError(f"chaos: the reference run failed: exit {job.codes()} (see {job.logs[0]})")
        return ref


def run_soak(cfg: SoakConfig, *, say=print, cluster=None) -> SoakResult:
    """The soak of ``cfg``; ``cluster``: a NetnsCluster (not started: the soak starts and stops it) when
    ``cfg.launcher`` is "slurm"."""
    return Soak(cfg, say=say, cluster=cluster).run()


def build_launcher(cfg: SoakConfig, cluster=None):
    """What starts the soak's launches: agents on this machine, or jobs on ``cluster``."""
    if cfg.launcher == "torchrun":
        return jobs.TorchrunLauncher(nodes=cfg.nodes, nproc=cfg.nproc_per_node)
    if cluster is None:
        raise ValueError("launcher='slurm' needs the NetnsCluster to run on: run_soak(cfg, cluster=...)")
    return chaos_slurm.SlurmLauncher(cluster, nodes=cfg.nodes, nproc=cfg.nproc_per_node,
                                     config=cfg.work_dir / "soak_config.yaml")


def tiny_setup(corpus_dir: Path) -> list[str]:
    """A tiny corpus (the embedded one: Python's own docs) in ``corpus_dir`` (built once) and the overrides of a
    seconds-long tiny run on it: the soak's default workload."""
    corpus_dir = Path(corpus_dir)
    tok = corpus_dir / "tokenizer.json"
    if not (corpus_dir / "train" / "manifest.json").is_file():
        train_txt, _ = write_embedded_corpus(corpus_dir / "text", valid_every=10)
        train_tokenizer([str(train_txt)], str(tok), kind="wordpiece", vocab_size=2000)
        preprocess([str(train_txt)], str(corpus_dir / "train"), str(tok), num_workers=1)
    return tiny_overrides(str(tok), str(corpus_dir / "train"))


def tiny_overrides(tokenizer: str, train: str) -> list[str]:
    return [f"data.tokenizer={tokenizer}", f"data.sources=[{{name: docs, path: {train}}}]", "data.valid=[]",
            "data.max_len=64", "data.view_max_len=32", "data.num_workers=0", "model.hidden_size=32",
            "model.num_layers=2", "model.num_heads=2", "model.ffn_size=64", "model.max_position=64",
            "train.micro_batch_size=4", "train.log_every=1", "train.eval_every=0", "optim.lr=1e-3",
            "optim.warmup_steps=2"]
