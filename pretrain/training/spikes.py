"""Loss spikes and bursts of non-finite steps: ``SpikeWatch`` detects them, ``plan_rollback`` says how the trainer
undoes one (back to the last good checkpoint, the samples since then skipped, the skip recorded in that checkpoint).

When the loss is read: a step's loss stays a device scalar (kept in ``SpikeWatch``, not read), and ``judge`` reads
the kept ones in one transfer, reduced over the ranks so that every rank decides the same, only when the trainer
asks — at log steps and before every checkpoint, which sync anyway. Reading it every step would cost a host-device
sync per step on a GPU (the step is built to force none); judging at the log step delays a rollback by at most
``train.log_every`` steps, which only re-runs those steps, and judging before every save means a checkpoint never
holds a step that was not judged, so the newest checkpoint is always one before the spike. Whether a step's update
was skipped (non-finite) is a device bool too (the Engine decides it on the device) and is judged with the losses,
in the same transfer; a burst is found at its last step, at the next log step or checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pretrain.checkpoint import store
from pretrain.config import SpikeConfig
from pretrain.distributed.comm import all_reduce_host
from pretrain.training.resume import resumable_tag, saved_config
from pretrain.training.state import TrainState


from pretrain.training.progress import TrainingDiverged  # noqa: F401  (raised here too: one exception, exit 3)


@dataclass(frozen=True)
class Trigger:
    step: int
    """The step at which the rule tripped (its loss, or the last bad step of the burst)."""
    reason: str
    """"loss spike" or "non-finite steps"."""
    detail: str
    """What was seen, in words, with the setting that decided."""
    loss: float | None = None
    baseline: float | None = None
    """The loss and what it was compared with (the window's median, or its mean for zscore)."""


def judge_loss(history: list[float], loss: float, cfg: SpikeConfig) -> tuple[str, float] | None:
    """(detail, baseline) when ``loss`` is a spike against ``history`` (the previous finite losses, oldest first),
    else None: above the ratio or z-score and at least ``min_rise`` nats above the baseline. Not judged: a
    non-finite loss (the bad-step rule's), or fewer than ``min_history`` losses."""
    if cfg.detector == "none" or not math.isfinite(loss) or len(history) < cfg.min_history:
        return None
    h = np.asarray(history, dtype=np.float64)
    if cfg.detector == "ratio":
        median = float(np.median(h))
        if median > 0 and loss > cfg.ratio * median and loss - median >= cfg.min_rise:
            return (f"loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of the previous {len(h)} steps "
                    f"(train.spike.ratio={cfg.ratio:g})"), median
        return None
    mean, std = float(h.mean()), float(h.std())
    if std > 0 and (loss - mean) / std > cfg.zscore and loss - mean >= cfg.min_rise:
        return (f"loss {loss:.4g} is {(loss - mean) / std:.1f} standard deviations above the mean {mean:.4g} of the "
                f"previous {len(h)} steps (train.spike.zscore={cfg.zscore:g})"), mean
    return None


class SpikeWatch:
    """The detector's window: the last finite losses judged (``losses``) and the steps that were bad within the
    window (``bad_steps``); ``state_dict`` goes into the checkpoint, so a resume judges as the uninterrupted run."""

    def __init__(self, cfg: SpikeConfig, state: dict | None = None) -> None:
        self.cfg = cfg
        state = state or {}
        self.losses: list[float] = [float(x) for x in state.get("losses", [])][-cfg.window:]
        self.bad_steps: list[int] = [int(s) for s in state.get("bad_steps", [])]
        self._pending: list[tuple[int, torch.Tensor]] = []

    def record(self, step: int, loss: torch.Tensor, bad) -> None:
        """Keep step ``step``'s loss (a device scalar, this rank's mean over its micro-batches) and whether its update
        was skipped (a device bool, or a host bool where the host decided): no host sync."""
        if self.cfg.detector != "none" or self.cfg.bad_in_window:
            self._pending.append((step, loss, bad))

    def judge(self, env) -> Trigger | None:
        """The kept steps judged, oldest first, by both rules (a burst of non-finite steps within the window, a loss
        spike): one transfer, plus a summing all-reduce when distributed (every rank judges the same global
        losses). The first trigger is returned; the steps after it are dropped (the rollback redoes them)."""
        if not self._pending:
            return None
        steps = [s for s, _, _ in self._pending]
        t = torch.stack([torch.stack([torch.as_tensor(loss).detach().reshape(()).to(torch.float64),
                                      torch.as_tensor(bad, device=torch.as_tensor(loss).device).to(torch.float64)])
                         for _, loss, bad in self._pending])
        self._pending.clear()
        if env.is_distributed:
            t = all_reduce_host(t.cpu()) / env.world_size
        for s, (loss, bad) in zip(steps, t.tolist()):  # the one device -> host transfer
            trigger = self._bad_rule(s, bad > 0) or self._spike_rule(s, loss, bad > 0)
            if trigger is not None:
                return trigger
        return None

    def _bad_rule(self, step: int, bad: bool) -> Trigger | None:
        if bad:
            self.bad_steps.append(step)
        self.bad_steps = [s for s in self.bad_steps if s > step - self.cfg.window]
        n_bad = self.cfg.bad_in_window
        if not n_bad or len(self.bad_steps) < n_bad:
            return None
        return Trigger(step=step, reason="non-finite steps",
                       detail=(f"{len(self.bad_steps)} steps with a non-finite loss or gradient within the last "
                               f"{self.cfg.window} steps (at {', '.join(map(str, self.bad_steps[-8:]))}; "
                               f"train.spike.bad_in_window={n_bad})"))

    def _spike_rule(self, step: int, loss: float, bad: bool) -> Trigger | None:
        if self.cfg.detector == "none" or bad:
            return None
        spike = judge_loss(self.losses, loss, self.cfg)
        if spike is not None:
            return Trigger(step=step, reason="loss spike", detail=spike[0], loss=loss, baseline=spike[1])
        if math.isfinite(loss):
            self.losses = (self.losses + [loss])[-self.cfg.window:]
        return None

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "bad_steps": list(self.bad_steps)}


def plan_rollback(run_dir: Path, env, state: TrainState, trigger: Trigger, cfg: SpikeConfig) -> tuple[Path, TrainState,
                                                                                                     dict]:
    """(checkpoint to load, the run state to continue with, the rollback record) for ``trigger`` at ``state``.

    The checkpoint is the newest that verifies (the trainer judges before every save, so it precedes the spike).
    The new state is the checkpoint's, with the data position moved on to where ``state`` is: the samples of the
    steps since the checkpoint, the spike's among them, are skipped (as PaLM and OPT did). When ``cfg.max_rollbacks``
    rollbacks to it have not got past the spike, the damage may be older than that checkpoint (a bad batch whose
    effect shows only after the next save): the run falls back to the newest older checkpoint kept
    (``checkpoint.keep_last``) that has rollbacks left, skipping everything since it (PaLM restarted ~100 steps
    before a spike). TrainingDiverged when there is no checkpoint, or none with rollbacks left."""
    ckpt_dir = store.checkpoints_dir(run_dir)
    what = f"{trigger.reason} at step {trigger.step}: {trigger.detail}"
    newest = resumable_tag(run_dir, env)
    if newest is None:
        raise TrainingDiverged(f"{what}; there is no checkpoint to roll back to yet (checkpoint.every sets the "
                               f"first). Stopping: lower optim.lr or check the data, then start again.")
    tag = _with_rollbacks_left(ckpt_dir, newest, env, cfg.max_rollbacks)
    if tag is None:
        raise TrainingDiverged(
            f"{what}; the run was rolled back to {newest} {cfg.max_rollbacks} times already (train.spike.max_rollbacks="
            f"{cfg.max_rollbacks}), skipping other samples each time, and to every older checkpoint kept as often, "
            f"and it came back: it is not the data's. Stopping. The last good checkpoint is {ckpt_dir / newest}; "
            f"lower optim.lr (or raise train.spike.ratio / train.spike.zscore if these are not spikes) before "
            f"resuming.")
    tag_dir = ckpt_dir / tag
    old = TrainState.from_state_dict(store.read_trainer_state(tag_dir), saved=saved_config(tag_dir),
                                     world_size=env.world_size)
    if old.step >= trigger.step or old.consumed_samples > state.consumed_samples:
        raise TrainingDiverged(f"{what}; the newest checkpoint ({tag}) is not older than the spike, so it cannot "
                               f"undo it. Stopping: resume from an older checkpoint by hand.")
    record = {"trigger_step": trigger.step, "reason": trigger.reason, "detail": trigger.detail,
              "skipped_samples": [old.consumed_samples, state.consumed_samples],
              "skipped_steps": [old.step + 1, state.step], "retry": _retries(old.rollbacks, old.step) + 1}
    if tag != newest:
        record["fallback_from"] = newest
        if env.is_main:  # a requeue must not resume from the checkpoint given up on (the barrier: the trainer's)
            store.set_aside_newer(ckpt_dir, tag)
    if trigger.loss is not None:
        record.update(loss=trigger.loss, baseline=trigger.baseline)
    new = dataclasses.replace(old, consumed_samples=state.consumed_samples,
                              rollbacks=[*old.rollbacks, {"step": old.step, **record}])
    new = new.continued(world_size=state.world_size, micro_batch_size=state.micro_batch_size,
                        grad_accum=state.grad_accum, rank=env.rank)
    return tag_dir, new, record


def _retries(rollbacks: list[dict], step: int) -> int:
    """Rollbacks to the checkpoint of ``step`` so far (its trainer_state.json's ``rollbacks``)."""
    return sum(1 for r in rollbacks if r.get("step") == step)


def _with_rollbacks_left(ckpt_dir: Path, newest: str, env, max_rollbacks: int) -> str | None:
    """Collective: ``newest`` when fewer than ``max_rollbacks`` rollbacks went to it, else the newest older
    checkpoint that verifies and has rollbacks left (rank 0 decides, every rank takes it); None when none has."""
    choice = None
    if env.is_main:
        older = sorted((t for t in store.list_complete(ckpt_dir) if store.step_of(t) < store.step_of(newest)),
                       key=store.step_of, reverse=True)
        for tag in [newest, *older]:
            if tag != newest and store.verify_checkpoint(ckpt_dir / tag):
                continue  # a damaged older checkpoint is passed over
            try:  # rank 0 alone reads: an error here must not leave the other ranks waiting in the broadcast
                state = store.read_trainer_state(ckpt_dir / tag)
            except (store.CheckpointError, OSError, ValueError, KeyError):
                continue
            if _retries(state.get("rollbacks", []), state["step"]) < max_rollbacks:
                choice = tag
                break
    if env.is_distributed:
        box = [choice]
        torch.distributed.broadcast_object_list(box, src=0)
        choice = box[0]
    return choice


def rollback_line(tag_dir: Path, new: TrainState, record: dict, cfg: SpikeConfig) -> str:
    (a, b), (first, last) = record["skipped_samples"], record["skipped_steps"]
    older = (f" (an older checkpoint: {record['fallback_from']} was rolled back to {cfg.max_rollbacks} times and the "
             f"spike came back, so the damage may predate it)" if "fallback_from" in record else "")
    return (f"rollback: {record['reason']} at step {record['trigger_step']}: {record['detail']}. Back to {tag_dir} "
            f"(step {new.step}){older}, skipping samples {a}-{b - 1} (those of steps {first}-{last}); retry "
            f"{record['retry']} of {cfg.max_rollbacks}")
