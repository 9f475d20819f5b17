"""What a user watches for weeks: metrics.jsonl and TensorBoard. Every key written is documented in
docs/architecture.md's table (and every row of the run's terms is written); TensorBoard holds the same values at
the same steps as metrics.jsonl, across a rollback and a mid-window resume; the figures that cross ranks (tokens,
the data wait, the end-of-run token count) are every rank's own, in the log's one all-reduce."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


# -- across ranks, simulated: rank 1's all-reduce input is added to rank 0's -----------------------------------------

def _env(rank: int, world: int = 2):
    return SimpleNamespace(rank=rank, world_size=world, is_distributed=True, is_main=rank == 0)


def _window(samples: int, tokens: int, wait_s: float, loss: float):
    from pretrain.training.progress import LogWindow

    w = LogWindow()
    w.add(samples, tokens)
    w.sums.add("loss", torch.tensor(loss, dtype=torch.float64), 1)
    w.t0, w.data_wait_s = time.perf_counter() - 10.0, wait_s  # a window of ~10 s of training
    return w


def test_log_window_sums_every_ranks_counts_and_takes_the_slowest_ranks_wait_in_one_all_reduce(monkeypatch):
    """Rank 0 waited 1 s of 10 for data, rank 1 4 s: the step waited for rank 1, so data_wait_frac is ~0.4 (was
    rank 0's own 0.1). Tokens and samples are each rank's own, summed. One all-reduce for all of it."""
    import pretrain.metrics.accumulate as accumulate
    from pretrain.training.progress import BadSteps

    info = SimpleNamespace(lr=1e-3, grad_norm=2.0, loss_scale=1.0)
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(accumulate, "all_reduce_host", lambda t, op=None: sent.append(t.clone()) or t)
    _window(4, 300, 4.0, 3.0).scalars(_env(1), info, bad_steps=BadSteps(9, 0, None), tokens_seen=1300)
    assert len(sent) == 1
    other = sent[0]
    calls = []
    monkeypatch.setattr(accumulate, "all_reduce_host", lambda t, op=None: calls.append(1) or t + other)
    out = _window(4, 100, 1.0, 1.0).scalars(_env(0), info, bad_steps=BadSteps(9, 0, None), tokens_seen=1100)
    assert len(calls) == 1  # the figures' one all-reduce, no other
    assert out["data_wait_frac"] == pytest.approx(0.4, rel=0.01)
    assert out["tokens_seen"] == 2400 and out["loss"] == pytest.approx(2.0)
    elapsed = 400 / out["tokens_per_s"]
    assert elapsed == pytest.approx(10.0, rel=0.01) and out["samples_per_s"] == pytest.approx(8 / elapsed)
    assert list(out)[-1] == "data_wait_frac"


def test_end_summary_counts_every_ranks_own_tokens(tmp_path, monkeypatch, capsys):
    """Rank 0 trained on 1,000 real tokens and rank 1 on 3,000: the summary says 4.00k (was rank 0's x 2 = 2.00k)."""
    import pretrain.training.progress as progress
    from pretrain.training.trainer import Trainer

    monkeypatch.setattr(progress, "all_reduce_host", lambda t, op=None: t + 3000, raising=False)
    trainer = SimpleNamespace(validate=lambda: {}, save=lambda wait, final=False: None, _should_stop=lambda: None,
                              stsb=None, env=_env(0), state=SimpleNamespace(step=4, tokens_seen=1000), run_dir=tmp_path,
                              cfg=SimpleNamespace(train=SimpleNamespace(max_steps=4)))
    assert Trainer._finish(trainer, 0, SimpleNamespace(elapsed=lambda: 5.0)) == 0
    assert "4.00k tokens seen" in capsys.readouterr().out


# -- the writer -------------------------------------------------------------------------------------------------------

def _tb(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's own reading of every event file under ``tb_dir`` (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_non_finite_figures_reach_tensorboard_as_in_metrics_jsonl(tmp_path):
    """A NaN loss (a window of skipped steps) is "nan" in metrics.jsonl and NaN in TensorBoard (was: no event, a
    silent gap in the curve)."""
    from pretrain.metrics.writer import MetricsWriter

    w = MetricsWriter(tmp_path)
    w.log(3, {"loss": math.nan, "grad_norm": math.inf, "lr": 1e-3})
    w.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (rec["loss"], rec["grad_norm"]) == ("nan", "inf")
    tb = _tb(tmp_path / "tb")
    assert sorted(tb) == ["train/grad_norm", "train/loss", "train/lr"]
    assert math.isnan(tb["train/loss"][0][1]) and tb["train/grad_norm"] == [(3, math.inf)]


def test_a_new_event_file_sorts_after_the_existing_ones(tmp_path):
    """TensorBoard reads event files in name order and a purge acts on what it read before: a writer opened (a
    resume, a rollback) in the same second as an earlier file must not sort before it (the name's counter: 10 <
    9; another pid)."""
    from pretrain.metrics.writer import MetricsWriter

    tb = tmp_path / "tb"
    tb.mkdir()
    earlier = tb / f"events.out.tfevents.{int(time.time()):010d}.~"  # sorts after any host.pid.counter
    earlier.write_bytes(b"")
    MetricsWriter(tmp_path, resume_step=4).close()
    assert sorted(p.name for p in tb.iterdir())[-1] != earlier.name


# -- a real tiny run: a rollback, a crash and a mid-window resume ------------------------------------------------------

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _Crash(RuntimeError):
    pass


def _sts_dev(root: Path) -> Path:
    """A 12-pair STS-B dev set (its format) for eval.stsb_every."""
    d = root / "sts" / "STSBenchmark"
    d.mkdir(parents=True)
    words = ["the", "a", "man", "is", "reading", "book", "woman", "playing", "music", "dog", "runs", "park"]
    lines = [f"main\tx\t2012\t{i:04d}\t{i % 6:.3f}\t{' '.join(words[i:] + words[:i][:3])}\t"
             f"{' '.join(words[::-1][i % 5:])}" for i in range(12)]
    (d / "sts-dev.csv").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory, tiny_overrides):
    """A run to step 10 (log_every=3, eval_every=3, STS-B every 5, checkpoints every 4) whose first launch meets a
    loss spike at step 7 (judged at the step-8 checkpoint: back to step 4, steps 5-7 skipped), trains on and dies
    before step 10; the relaunch resumes from step 8, inside the window 7-9, and finishes."""
    import pretrain.objective as objective_mod
    from pretrain.train import main
    from pretrain.training.trainer import Trainer

    root = tmp_path_factory.mktemp("monitoring")
    run = root / "run"
    argv = tiny_overrides(run, train__max_steps=10, train__log_every=3, train__eval_every=3, checkpoint__every=4,
                          eval__stsb_every=5, eval__data_dir=str(_sts_dev(root / "data")), eval__max_len=32,
                          eval__keep_best="false", train__spike__min_history=5, train__spike__window=10)
    saved = dict(os.environ)
    for k in _LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    orig_next, orig_step, orig_mlm = Trainer._next_batch, Trainer.train_step, objective_mod.OBJECTIVES["mlm"]
    hit = [False]

    def next_batch(self, loader):  # the micro-batch holding global sample 25 (step 7's) is poisoned
        batch = orig_next(self, loader)
        end = self.train_loader.consumed_samples
        hit[0] = end - batch["input_ids"].shape[0] <= 25 < end
        return batch

    def mlm(fwd, cfg, ctx):
        loss, count, metrics = orig_mlm(fwd, cfg, ctx)
        return (loss * 30.0 if hit[0] and fwd.model.training else loss), count, metrics

    def train_step(self, loader):
        if self.state.step + 1 == 10:
            raise _Crash("before step 10")
        return orig_step(self, loader)

    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Trainer, "_next_batch", next_batch)
            m.setattr(Trainer, "train_step", train_step)
            m.setitem(objective_mod.OBJECTIVES, "mlm", mlm)
            with pytest.raises(_Crash):
                main(argv)
        assert main(argv) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return run


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _documented() -> list[dict]:
    """docs/architecture.md's table of recorded keys: {key, records, written, unit}."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("### What the trainer records"):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            key, records, written, unit, _ = cells
            rows.append({"key": key.strip("`"), "records": [r.strip() for r in records.split(",")],
                         "written": written, "unit": unit})
    assert len(rows) > 40
    return rows


SPLITS = ("train", "valid", "eval", "checkpoint", "rollback")
ACTIVE = {"always", "objective.mlm", "objective.nt_xent", "loss spike"}
"""What the monitored run writes: every record, MLM + NT-Xent (the tiny run's terms), a loss-spike rollback."""


def test_every_key_written_is_documented_and_every_documented_key_of_the_run_is_written(monitored_run):
    rows = _documented()
    want: dict[str, set] = {s: set() for s in SPLITS}
    json_only: dict[str, set] = {s: set() for s in SPLITS}
    documented: dict[str, set] = {s: set() for s in SPLITS}
    for r in rows:
        for split in (SPLITS if r["records"] == ["all"] else r["records"]):
            assert split in SPLITS, r
            documented[split].add(r["key"])
            if r["written"] in ACTIVE:
                want[split].add(r["key"])
            if "JSON only" in r["unit"]:
                json_only[split].add(r["key"])
    got: dict[str, set] = {s: set() for s in SPLITS}
    for rec in _records(monitored_run):
        got[rec["split"]] |= set(rec)
    for split in SPLITS:
        assert got[split], f"the run wrote no {split} record"
        assert got[split] - documented[split] == set(), f"{split}: written, not in docs/architecture.md's table"
        assert want[split] - got[split] == set(), f"{split}: documented for this run, never written"
    numbers = {f"{rec['split']}/{k}" for rec in _records(monitored_run) for k, v in rec.items()
               if isinstance(v, (int, float, str)) and k not in json_only[rec["split"]]}
    assert set(_tb(monitored_run / "tb")) == numbers  # every other key is a TensorBoard tag, and only they


def test_tensorboard_and_metrics_jsonl_hold_the_same_values_at_the_same_steps(monitored_run):
    """After the rollback (steps 5-7 undone: their records and events gone) and the resume from step 8 (steps 9-10
    redone once), every TensorBoard scalar is metrics.jsonl's figure at the same step, in order, within float32."""
    recs = _records(monitored_run)
    assert [(r["step"], r["split"]) for r in recs if r["split"] in ("train", "rollback")] == [
        (3, "train"), (4, "rollback"), (6, "train"), (9, "train"), (10, "train")]
    assert sum(r["split"] == "eval" and r["step"] == 5 for r in recs) == 1  # the replayed step 5's only
    want: dict[str, list[tuple[int, float]]] = {}
    for rec in recs:
        for k, v in rec.items():
            if k not in ("step", "split", "time") and isinstance(v, (int, float, str)) and not isinstance(v, bool):
                if isinstance(v, str):
                    if v not in ("nan", "inf", "-inf"):
                        continue  # text (rollback's reason and detail)
                    v = float(v)
                want.setdefault(f"{rec['split']}/{k}", []).append((rec["step"], float(v)))
    got = _tb(monitored_run / "tb")
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, g), (_, w) in zip(got[tag], points):
            assert g == pytest.approx(float(torch.tensor(w, dtype=torch.float32)), rel=1e-6, nan_ok=True), tag



def test_a_checkpoint_records_the_runs_token_total_and_ranks_resume_with_shares_of_it():
    """trainer_state.json's tokens_seen is the run's total (the ranks' shares summed when saving); a resume on any
    rank count divides it into shares that sum to it exactly, so the logged tokens_seen and the end summary (sums
    of the shares) go on from the true total. Before 2026-12-07 it recorded rank 0's own count, and a resume gave
    every rank that count (x world size in the figures): such a checkpoint is read as rank 0's count x its ranks."""
    from pretrain.training.state import TrainState

    common = dict(world_size=4, micro_batch_size=2, grad_accum=1, requested_batch=(2, 1), seed=1, sample_stream=None,
                  sample_order="feistel-v1")
    own = [1000, 1300, 900, 1203]  # real tokens differ per rank
    saved = TrainState(step=5, tokens_seen=own[0], **common).state_dict(tokens_total=sum(own))
    assert saved["tokens_seen"] == 4403 and saved["tokens_seen_scope"] == "run"
    for world in (4, 3, 1):
        loaded = TrainState.from_state_dict(saved, saved={}, world_size=world)
        shares = [loaded.continued(world_size=world, micro_batch_size=2, grad_accum=1, rank=r).tokens_seen
                  for r in range(world)]
        assert sum(shares) == 4403 and max(shares) - min(shares) < world, shares
    old = dict(saved, tokens_seen=1000)
    del old["tokens_seen_scope"]
    assert TrainState.from_state_dict(old, saved={}, world_size=4).tokens_seen == 4000
