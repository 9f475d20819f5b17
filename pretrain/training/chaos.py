"""The chaos soak's pure parts: the seeded fault schedule, the ledger of checkpoints that must not be lost, the
bitwise loss comparison and the fault table. The processes (launching, killing, filling the disk) are in
``chaos_job.py``; the loop that ties them together is ``chaos_soak.py`` (CLI: ``tools/chaos_soak.py``).

Fault kinds (issue 25 item 5), each drawn at least once per soak:

- stop faults, injected while a launch trains, at a step (or while a checkpoint is being written):
  ``sigkill_rank`` (one worker), ``sigterm`` / ``sigusr1`` (every process of the job, as Slurm signals a job
  step), ``disk_full`` (the run directory's tmpfs filled), ``kill_node`` (one torchrun agent and its workers);
- damage faults, between launches, on the newest complete checkpoint: ``truncate_checkpoint``,
  ``corrupt_checkpoint`` (bytes flipped inside the block the resume's sampled sha256 reads);
- ``requeue``: the relaunch after every stop, same ranks, same config, same job id (the lock is taken over).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

STOP_FAULTS = ("sigkill_rank", "sigterm", "sigusr1", "disk_full", "kill_node")
DAMAGE_FAULTS = ("truncate_checkpoint", "corrupt_checkpoint")
FAULT_KINDS = (*STOP_FAULTS, *DAMAGE_FAULTS, "requeue")


@dataclass(kw_only=True)
class Fault:
    """One injected (or planned) fault and what became of it."""

    kind: str
    launch: int
    """Index of the launch it hits (a damage fault: the launch that starts after it)."""
    after_steps: int = 0
    """Stop faults: inject once this many steps past the launch's start step are logged."""
    during_save: bool = False
    """Stop faults: inject while a ``.tmp-step_*`` checkpoint is being written (after ``after_steps``)."""
    node: int = 0
    """kill_node / sigkill_rank: which node (torchrun agent) is hit."""
    at_step: int | None = None
    """The last step logged when it was injected (damage faults: the damaged checkpoint's step)."""
    at_s: float | None = None
    """Seconds since the soak started when it was injected."""
    outcome: str = "not injected"
    ok: bool | None = None
    """True: the system did what it should; False: it did not (a bug); None: not injected (the outcome says why)."""


@dataclass(kw_only=True)
class Schedule:
    """Seeded draws of the soak's faults: the first launches cover every stop fault once (in a seeded order), the
    first gaps between launches every damage fault once; later draws are free. Same seed, same faults."""

    seed: int
    ckpt_every: int
    rng: random.Random = field(init=False)
    _first_stops: list = field(init=False)
    _first_damages: list = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self._first_stops = self.rng.sample(STOP_FAULTS, len(STOP_FAULTS))
        self._first_damages = self.rng.sample(DAMAGE_FAULTS, len(DAMAGE_FAULTS))

    def covered(self) -> bool:
        """Every fault kind has been handed out at least once."""
        return not self._first_stops and not self._first_damages

    def stop_fault(self, launch: int) -> Fault:
        """The stop fault of ``launch``: its kind, the step offset it waits for, a save in flight or not, the node."""
        kind = self._first_stops.pop(0) if self._first_stops else self.rng.choice(STOP_FAULTS)
        after = self.rng.randint(2, 2 * self.ckpt_every + 2)
        during_save = kind in ("sigkill_rank", "kill_node", "sigterm") and self.rng.random() < 0.5
        return Fault(kind=kind, launch=launch, after_steps=after, during_save=during_save,
                     node=self.rng.randrange(2))

    def retry(self, kind: str) -> None:
        """``kind`` was drawn but could not be injected (the launch ended first): hand it out next."""
        self._first_stops.insert(0, kind)

    def damage_fault(self, launch: int, num_complete: int) -> Fault | None:
        """A damage fault before ``launch``, or None: one is due while a kind is still uncovered (else with
        probability 0.3), and only when an older complete checkpoint is left to fall back to."""
        if num_complete < 2:
            return None
        if self._first_damages and (self.rng.random() < 0.6 or not self._first_stops):
            return Fault(kind=self._first_damages.pop(0), launch=launch)
        if not self._first_damages and self.rng.random() < 0.3:
            return Fault(kind=self.rng.choice(DAMAGE_FAULTS), launch=launch)
        return None

    def flip_offset(self, size: int, block: int) -> int:
        """Where a corrupt_checkpoint flips a byte: inside the first ``block`` bytes, which the sampled sha256
        always reads."""
        return self.rng.randrange(max(1, min(size, block)))


# ------------------------------------------------------------------------------------------- checks


def last_losses(metrics_file: Path, split: str = "train") -> dict[int, float]:
    """{step: loss} of metrics.jsonl, the last record of each step winning (a step redone after a resume from an
    older checkpoint is logged again)."""
    out = {}
    for line in Path(metrics_file).read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("split") == split:
            out[rec["step"]] = rec["loss"]
    return out


def compare_losses(got: dict[int, float], ref: dict[int, float], max_steps: int) -> list[str]:
    """What differs between the soak's per-step losses and the reference's, bitwise ([] = identical): steps
    1..max_steps must all be present in both and every float equal."""
    problems = []
    want = set(range(1, max_steps + 1))
    for name, losses in (("soak", got), ("reference", ref)):
        missing = sorted(want - set(losses))
        if missing:
            problems.append(f"{name} lacks steps {_ranges(missing)}")
    differ = [s for s in sorted(want & set(got) & set(ref)) if got[s] != ref[s]]
    if differ:
        s = differ[0]
        problems.append(f"{len(differ)} step(s) differ from the reference, first step {s}: "
                        f"{got[s]!r} != {ref[s]!r}")
    return problems


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    spans, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            spans.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(spans)


@dataclass
class CheckpointLedger:
    """"No completed checkpoint is lost", checked at every look at the checkpoint directory: a checkpoint once
    seen complete may disappear only by keep_last rotation, i.e. when at least ``keep_last`` complete checkpoints
    of later steps are there at that look; one the soak damaged on purpose is exempt until it is rewritten."""

    keep_last: int
    seen: set = field(default_factory=set)
    damaged: set = field(default_factory=set)
    lost: list = field(default_factory=list)

    def observe(self, complete: list[str], when: str) -> None:
        """``complete``: the complete tags now there (step_NNNNNNNN); records every loss with ``when``."""
        now = set(complete)
        for tag in sorted(self.seen - now - self.damaged):
            newer = [t for t in now if _step(t) > _step(tag)]
            if len(newer) < self.keep_last:
                self.lost.append(f"{tag} vanished {when} with only {len(newer)} newer complete checkpoint(s)")
        self.seen = now

    def mark_damaged(self, tag: str) -> None:
        self.damaged.add(tag)

    def rewritten(self, tag: str) -> None:
        """The damaged ``tag`` was published again (the resumed run reached its step): it counts again."""
        self.damaged.discard(tag)


def _step(tag: str) -> int:
    return int(tag.split("_")[1])


# ------------------------------------------------------------------------------------------- the table


def fault_table(faults: list[Fault]) -> list[str]:
    """The soak's faults as markdown table lines: kind, launch, step, time, outcome."""
    lines = ["| # | fault | launch | at step | at s | outcome |", "|---|---|---|---|---|---|"]
    for i, f in enumerate(faults, 1):
        what = f.kind + (f" (node {f.node})" if f.kind in ("kill_node", "sigkill_rank") else "") + \
            (", saving" if f.during_save else "")
        mark = {True: "", False: "**FAILED**: ", None: "not injected: "}[f.ok]
        step = "" if f.at_step is None else str(f.at_step)
        at = "" if f.at_s is None else f"{f.at_s:.0f}"
        lines.append(f"| {i} | {what} | {f.launch} | {step} | {at} | {mark}{f.outcome} |")
    return lines


def write_report(path: Path, faults: list[Fault], summary: dict) -> None:
    """The table as JSON: {"summary": ..., "faults": [...]}."""
    Path(path).write_text(json.dumps({"summary": summary, "faults": [asdict(f) for f in faults]}, indent=1),
                          encoding="utf-8")


def missing_kinds(faults: list[Fault]) -> list[str]:
    """Fault kinds with no injected occurrence (ok is not None)."""
    injected = {f.kind for f in faults if f.ok is not None}
    return [k for k in FAULT_KINDS if k not in injected]
