"""The run's own state: what a checkpoint records about the run beside the engine's tensors.

``TrainState`` is written as ``trainer_state.json`` (checkpoint/store.py adds ``format_version``, ``step`` and
``tag``, and upgrades older versions on read) and read back through ``from_state_dict`` — the one place that
knows the keys and what a checkpoint written before a key existed means by its absence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(kw_only=True)
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    """Global samples consumed so far (all ranks): where the data resumes."""
    tokens_seen: int = 0
    """This rank's share of the run's real tokens: what it trained on since the launch plus its share of the
    checkpoint's total (``continued``), so that the ranks' shares sum to the run's total. trainer_state.json records
    that total (``state_dict(tokens_total=...)``, ``tokens_seen_scope: run``); before 2026-12-07 it recorded rank 0's
    own count, which ``from_state_dict`` reads as that times the rank count."""
    bad_steps_total: int = 0
    """Steps skipped for a non-finite loss or gradient (fp16 loss-scale overflows excluded)."""
    world_size: int
    micro_batch_size: int
    grad_accum: int
    requested_batch: tuple[int, int]
    """The config's (micro_batch_size, grad_accum) before a resume on another rank count adjusted them."""
    seed: int | None
    """The run's seed (the sample order and every sample's noise follow from it); None if never recorded."""
    sample_stream: str | None
    """How each sample's masking and views are drawn (the dataset's ``sample_stream``); None for the sentence stage."""
    sample_order: str
    """How the samples are ordered (data/loader.py: ORDER_RULES)."""
    data_identity: str | None = None
    """What the run trains on (``data.datasets.data_identity``: its datasets' manifests, weights and sample count);
    None where it cannot be told, and in checkpoints from before 2026-12-07."""
    rollbacks: list[dict] = dataclasses.field(default_factory=list)
    """Every rollback that led to this state (training/spikes.py): {step (the checkpoint's, where the run went on),
    trigger_step, reason, detail, skipped_samples [from, to) (global positions: ``consumed_samples`` jumped over
    them), skipped_steps, retry[, loss, baseline]}. Why consumed_samples may exceed step x global_batch."""
    spike_watch: dict = dataclasses.field(default_factory=dict)
    """The spike detector's window at this step (``SpikeWatch.state_dict``): a resume judges as the uninterrupted
    run would."""
    log_window: dict = dataclasses.field(default_factory=dict)
    """The metric sums of the log window this step is inside ({"micro_steps": ranks x grad_accum, "sums": {name:
    [sum, count]} over all ranks}, ``LogWindow.carry``; empty at a log step): a resume's first record covers the
    whole window, as the uninterrupted run's."""
    finished: bool = False
    """Whether this is the run's final checkpoint (written after its last validation, by ``Trainer._finish``): a
    relaunch at train.max_steps then has nothing to do. A checkpoint of that step saved before the end ran (a job
    killed between the last step's save and the final validation) is not: the relaunch validates and saves again.
    Checkpoints from before 2026-12-08 lack it and count as finished at max_steps, as they did."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    def state_dict(self, *, tokens_total: int | None = None) -> dict:
        """The state as trainer_state.json holds it; ``tokens_total``: the run's real tokens, all ranks (the sum of
        the ranks' ``tokens_seen``, collective to compute: ``progress.run_tokens``), recorded in place of this
        rank's share."""
        out = dataclasses.asdict(self)
        out["requested_batch"] = list(self.requested_batch)
        out["global_batch"] = self.global_batch
        if tokens_total is not None:
            out.update(tokens_seen=int(tokens_total), tokens_seen_scope="run")
        return out

    @classmethod
    def from_state_dict(cls, state: dict, *, saved: dict, world_size: int) -> TrainState:
        """A checkpoint's (upgraded) trainer_state. Keys older checkpoints lack are filled from what they mean:
        the batch split and the seed from the checkpoint's config.yaml (``saved``, as a dict), the rank count from
        this launch, the data position from the step."""
        saved_train = saved.get("train") or {}
        world = state.get("world_size", world_size)
        micro = state.get("micro_batch_size", saved_train.get("micro_batch_size"))
        accum = state.get("grad_accum", saved_train.get("grad_accum"))
        if micro is None or accum is None:
            raise ValueError("the checkpoint records no batch split (trainer_state.json and config.yaml lack "
                             "micro_batch_size / grad_accum); it cannot be resumed, only used as init_from")
        step = state["step"]
        return cls(step=step, consumed_samples=state.get("consumed_samples", step * micro * accum * world),
                   tokens_seen=_run_tokens(state, world), bad_steps_total=state.get("bad_steps_total", 0),
                   world_size=world, micro_batch_size=micro, grad_accum=accum,
                   requested_batch=tuple(state.get("requested_batch", (micro, accum))),
                   seed=state.get("seed", saved.get("seed")), sample_stream=state.get("sample_stream"),
                   sample_order=state["sample_order"], data_identity=state.get("data_identity"),
                   rollbacks=list(state.get("rollbacks", [])),
                   spike_watch=dict(state.get("spike_watch", {})), log_window=dict(state.get("log_window", {})),
                   finished=bool(state.get("finished", True)))

    def continued(self, *, world_size: int, micro_batch_size: int, grad_accum: int, rank: int = 0) -> TrainState:
        """This (``from_state_dict``) state continued as rank ``rank`` of ``world_size`` with the given split: the
        data position is global, the run's token total is divided into shares that sum to it (the remainder on rank
        0), the requested batch stays what the run was launched with."""
        share = self.tokens_seen // world_size + (self.tokens_seen % world_size if rank == 0 else 0)
        return dataclasses.replace(self, world_size=world_size, micro_batch_size=micro_batch_size,
                                   grad_accum=grad_accum, tokens_seen=share)


def _run_tokens(state: dict, world: int) -> int:
    """The run's real tokens at a checkpoint: its recorded total, or (written before 2026-12-07: rank 0's own count)
    that count times the rank count."""
    tokens = int(state.get("tokens_seen", 0))
    return tokens if state.get("tokens_seen_scope") == "run" else tokens * world
