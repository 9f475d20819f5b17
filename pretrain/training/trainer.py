"""The training loop: load -> step -> log -> validate -> checkpoint.

``Trainer`` composes the parts (tokenizer, model, objective, data, DeepSpeed engine,
checkpoints, metrics); ``train_step`` is forward -> loss -> backward -> step -> metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch

from pretrain.checkpoint import store
from pretrain.checkpoint import universal as universal_copy
from pretrain.config import RunConfig, to_yaml
from pretrain.data.datasets import build_dataset
from pretrain.data.loader import ORDER_RULE, ORDER_RULES, build_loader
from pretrain.distributed.comm import all_reduce_host
from pretrain.distributed.engine import Engine
from pretrain.distributed.peers import PeerWatch
from pretrain.distributed.signals import StopSignal
from pretrain.metrics.accumulate import MetricSums
from pretrain.metrics.writer import MetricsWriter, format_progress, print_progress
from pretrain.objective.forward import mean_pool_mix
from pretrain.training.banner import banner_lines
from pretrain.training.build import (
    build_train_module,
    model_config,
    open_init_weights,
    preflight,
    stage_parts,
)
from pretrain.training.evaluation import StsbKeepBest
from pretrain.training.optim import build_param_groups, lr_lambda
from pretrain.training.progress import CollapseWatch, Eta, end_summary, schedule_change
from pretrain.training.resume import (
    changed_architecture,
    last_good_checkpoint,
    n_ranks,
    resume_batch_split,
    saved_config,
)
from pretrain.training.run_lock import LOCK_NAME, RunDirLocked, RunLock

DATA_WAIT_WARN = 0.10
"""Warn (once) when the step spends more than this fraction of its time waiting for the next batch."""

REQUEUE_EXIT_CODE = 75
"""Exit status after a signal-triggered checkpoint (EX_TEMPFAIL): the launcher requeues the job."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


class Trainer:
    def __init__(self, cfg: RunConfig, env, *, stop_signal: StopSignal | None = None):
        self.cfg, self.env = cfg, env
        self.stop_signal = stop_signal or StopSignal(install=False)
        self.run_dir = Path(cfg.run_dir)
        self.lock = _lock_run_dir(self.run_dir, env)  # one trainer per run_dir, before anything is written
        # Multi-node: a lost node ends every rank within distributed.peer_timeout_s, naming it and the checkpoint.
        self.peers = PeerWatch(env, timeout_s=cfg.distributed.peer_timeout_s, on_lost=self._release_lock,
                               last_checkpoint=lambda: last_good_checkpoint(self.run_dir))
        try:
            self.peers.start()
            self._setup(cfg, env)
        except BaseException:
            self.peers.stop()
            self._release_lock()
            raise

    def _setup(self, cfg: RunConfig, env) -> None:
        preflight(cfg)
        load_tok, build_train_set, self._build_train_loader = stage_parts(cfg)
        self.tokenizer = load_tok(cfg.data.tokenizer)
        init = open_init_weights(cfg)  # opened (and verified) once: its architecture now, its weights below
        self.cfg = cfg = dataclasses.replace(cfg, model=model_config(cfg, self.tokenizer, init))

        # The datasets open before the model and DeepSpeed (a bad dataset fails fast, and SARCSE's frequencies
        # come from the training set). Rank 0 first, building and caching the sample indexes; the others wait,
        # then memory-map the cached files (data/sample_index.py: load_or_build_sample_index).
        with _main_rank_first(env):
            self.train_set = build_train_set(cfg, self.tokenizer)
            self.valid_set = build_dataset(cfg.data, self.tokenizer, seed=cfg.seed, split="valid") \
                if cfg.data.valid else None
        # STS-B dev evaluation opens its data now too: a missing directory fails before DeepSpeed starts.
        self.stsb = None
        if cfg.eval.stsb_every:

            self.stsb = StsbKeepBest(cfg.eval, run_dir=self.run_dir, tokenizer=self.tokenizer,
                                     tokenizer_path=cfg.data.tokenizer, model_pooling=cfg.model.pooling,
                                     zero_stage=cfg.distributed.zero_stage)

        if cfg.train.compile and cfg.distributed.zero_stage == 3:
            raise ValueError("train.compile=true is not supported with distributed.zero_stage=3 (ZeRO-3 "
                             "gathers parameters in module hooks); use ZeRO 0-2 or train.compile=false")
        # The checkpoint to resume is chosen before DeepSpeed starts: on another number of ranks it decides the
        # batch split (the global batch stays) and whether the engine loads a universal checkpoint.
        self.requested_batch = (cfg.train.micro_batch_size, cfg.train.grad_accum)
        """The config's (micro_batch_size, grad_accum) before any resume adjusted them (kept in checkpoints)."""
        resume_dir, universal, saved = self._choose_resume()
        cfg = self.cfg
        self.module = build_train_module(cfg, env, self.tokenizer, self.train_set, init)
        self.engine = Engine(
            self.module, build_param_groups(self.module, cfg.optim.weight_decay), optim=cfg.optim,
            train=cfg.train, dist=cfg.distributed, env=env,
            lr_lambda=lr_lambda(cfg.optim, cfg.train.max_steps), load_universal=universal,
        )
        self.global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * env.world_size

        self.step = 0
        self.consumed_samples = 0
        """Global samples consumed so far (all ranks): where the data resumes."""
        self.data_wait_s = 0.0
        """Seconds the loop has waited in next(loader) since the last log line (data_wait_frac)."""
        self._warned_starved = False
        self.tokens_seen = 0
        self.bad_steps_total = 0
        self.order_rule = ORDER_RULE
        """How the training samples are ordered (data/loader.py: SampleOrder); a resume keeps its checkpoint's."""
        self._resume_or_start(resume_dir, universal, saved)
        self.writer = MetricsWriter(self.run_dir, enabled=env.is_main, resume_step=self.step)

    # -- setup -------------------------------------------------------------------------------
    def _choose_resume(self) -> tuple[Path | None, bool, dict]:
        """(tag dir of the checkpoint to resume or None, whether it loads through a universal checkpoint, its saved
        config). Checks that it fits this run, and sets self.cfg.train's batch split for this run's rank count."""
        ckpt_dir = store.checkpoints_dir(self.run_dir)
        tag = self._resumable_tag(ckpt_dir) if self.cfg.checkpoint.resume == "auto" else None
        if tag is None:
            return None, False, {}
        tag_dir = ckpt_dir / tag
        state = store.read_trainer_state(tag_dir)
        saved = saved_config(tag_dir)
        self._check_compatible(state, tag_dir, saved)
        saved_train = saved.get("train") or {}
        old_world = state.get("world_size", self.env.world_size)
        micro = state.get("micro_batch_size", saved_train.get("micro_batch_size", self.cfg.train.micro_batch_size))
        accum = state.get("grad_accum", saved_train.get("grad_accum", self.cfg.train.grad_accum))
        micro, accum, note = resume_batch_split(
            tag_dir=tag_dir, global_batch=state.get("global_batch", micro * accum * old_world),
            saved=(old_world, micro, accum), requested=tuple(state.get("requested_batch", (micro, accum))),
            config=self.requested_batch, world=self.env.world_size)
        if note and self.env.is_main:
            print_progress(note)
        train = dataclasses.replace(self.cfg.train, micro_batch_size=micro, grad_accum=accum)
        self.cfg = dataclasses.replace(self.cfg, train=train)
        # ZeRO 1-3 keep the optimizer state in one partition per rank: another rank count re-splits it through
        # DeepSpeed's universal checkpoint. ZeRO-0 keeps it whole and loads as it is.
        universal = old_world != self.env.world_size and self.cfg.distributed.zero_stage > 0
        return tag_dir, universal, saved

    def _resume_or_start(self, tag_dir: Path | None, universal: bool, saved: dict) -> None:
        if tag_dir is not None:
            engine_dir = universal_copy.prepare(self.env, tag_dir, say=print_progress) if universal else None
            state = store.load_checkpoint(self.engine, self.env, tag_dir, engine_dir=engine_dir)
            self.step = state["step"]
            # The data position is global: every rank reads its slice of each global batch from here on, however
            # many ranks wrote the checkpoint.
            self.consumed_samples = state.get("consumed_samples", self.step * self.global_batch)
            old_world = state.get("world_size", self.env.world_size)
            self.tokens_seen = state.get("tokens_seen", 0) * old_world // self.env.world_size  # counted per rank
            self.bad_steps_total = state.get("bad_steps_total", 0)
            self.order_rule = state["sample_order"]  # permutation-v1 for checkpoints before feistel-v1 (store)
            if self.env.is_main:
                ranks = f" (written by {n_ranks(old_world)})" if old_world != self.env.world_size else ""
                print_progress(f"resumed from {tag_dir} at step {self.step}{ranks}")
                if self.order_rule != ORDER_RULE:
                    print_progress(f"the checkpoint orders its samples by {self.order_rule!r}: this run continues "
                                   f"that order (new runs use {ORDER_RULE!r})")
                note = schedule_change(saved, self.cfg, self.step)
                if note:
                    print_progress(note)
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg), encoding="utf-8")

    def _resumable_tag(self, ckpt_dir: Path) -> str | None:
        """Rank 0 picks the newest checkpoint that verifies (naming each damaged one), every rank takes it."""
        tag = store.find_resumable(ckpt_dir, say=print_progress) if self.env.is_main else None
        if self.env.is_distributed:
            box = [tag]
            torch.distributed.broadcast_object_list(box, src=0)
            tag = box[0]
        if tag is None and store.list_complete(ckpt_dir):
            raise store.CheckpointError(
                f"every checkpoint in {ckpt_dir} is damaged (pretrain-train --check {self.run_dir} says how); "
                f"refusing to start this run over on top of them. Move {ckpt_dir} away to start from scratch.")
        if self.env.is_main and tag is not None and tag != store.find_latest(ckpt_dir):
            print_progress(f"warning: resuming from {ckpt_dir / tag}, the newest checkpoint that is intact")
        return tag

    def _check_compatible(self, state: dict, tag_dir: Path, saved: dict) -> None:
        old_world = state.get("world_size", self.env.world_size)
        old_stage = (saved.get("distributed") or {}).get("zero_stage", self.cfg.distributed.zero_stage)
        if old_world != self.env.world_size and old_stage != self.cfg.distributed.zero_stage:
            raise ValueError(
                f"checkpoint {tag_dir} was written by {old_world} ranks under ZeRO-{old_stage}; this run has "
                f"{self.env.world_size} ranks and distributed.zero_stage={self.cfg.distributed.zero_stage}. Change "
                f"the rank count or the ZeRO stage, not both in one resume: relaunch with "
                f"distributed.zero_stage={old_stage}."
            )
        changed = changed_architecture(saved, tag_dir, self.cfg, self.tokenizer.sha256)
        if changed:
            raise ValueError(
                f"checkpoint {tag_dir} was trained with another model or tokenizer than this run's config: "
                + "; ".join(changed) + ". Resuming would load weights that do not fit. Either keep the "
                f"checkpoint's settings, or start a new run_dir (with checkpoint.init_from={tag_dir} to start "
                f"from its weights where their shapes fit)."
            )
        order = state.get("sample_order")
        if order not in ORDER_RULES:
            raise ValueError(
                f"checkpoint {tag_dir} orders its samples by {order!r}, which this pretrain version does not know "
                f"(it knows {', '.join(ORDER_RULES)}): finish the run with the pretrain version that wrote it.")
        stream = getattr(self.train_set, "sample_stream", None)
        if stream is not None and state.get("sample_stream") != stream:
            raise ValueError(
                f"checkpoint {tag_dir} was trained on the sample stream {state.get('sample_stream')!r} (how each "
                f"sample's masking and views are drawn), this pretrain version draws {stream!r}: resuming would "
                f"silently give every remaining sample different noise than the run it continues. Finish the run "
                f"with the pretrain version that wrote it, or start a new run_dir with "
                f"checkpoint.init_from={tag_dir} (weights only)."
            )

    def _loader(self, dataset, start_sample: int):
        c = self.cfg
        train = dataset is self.train_set
        build = self._build_train_loader if train else build_loader
        return build(dataset, seed=c.seed, rank=self.env.rank, world_size=self.env.world_size,
                     micro_batch_size=c.train.micro_batch_size, start_sample=start_sample,
                     num_workers=c.data.num_workers, pad_id=self.tokenizer.pad_id,
                     prefetch_factor=c.data.prefetch_factor, order_rule=self.order_rule if train else ORDER_RULE)

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> int:
        """Runs to train.max_steps (or a stop signal). Returns the process exit code."""
        c = self.cfg
        loader = iter(self._loader(self.train_set, self.consumed_samples))
        sums = MetricSums()
        consecutive_bad = 0
        if self.env.is_main:
            for line in banner_lines(c, self.env.world_size, self.module, self.train_set, self.valid_set):
                print_progress(line)
        if self.step == 0:
            self.validate()  # the untrained baseline, so the held-out curve starts at step 0
        self.engine.train()
        start_step = self.step
        eta = Eta(start_step, c.train.max_steps)
        collapse = CollapseWatch(c, self.env.world_size)
        t_last, samples_last, tokens_last = time.perf_counter(), 0, 0
        self.data_wait_s = 0.0
        while self.step < c.train.max_steps:
            info, bad, n_samples, n_tokens = self.train_step(loader, sums)
            self.step += 1
            self.consumed_samples += self.global_batch
            self.tokens_seen += n_tokens
            samples_last += n_samples
            tokens_last += n_tokens
            consecutive_bad = consecutive_bad + 1 if bad else 0
            self.bad_steps_total += int(bad)
            if consecutive_bad >= c.train.max_bad_steps:
                raise TrainingDiverged(
                    f"{consecutive_bad} consecutive steps with a non-finite loss or gradient "
                    f"(last at step {self.step}); "
                    f"stopping. The last good checkpoint is {store.find_latest(store.checkpoints_dir(self.run_dir))}; "
                    f"lower optim.lr or check the data before resuming."
                )
            log_step = self.step % c.train.log_every == 0 or self.step == c.train.max_steps
            # The first step of a launch is shown on the console at once; it is not a logged window (the window
            # runs on to the next log step, so logged figures are the same whether or not the run was resumed).
            first_step = self.step == start_step + 1 and not log_step
            if log_step or first_step:
                elapsed = time.perf_counter() - t_last
                scalars = sums.reduce(self.env)
                scalars.update(lr=info.lr, grad_norm=info.grad_norm, loss_scale=info.loss_scale,
                               bad_steps=self.bad_steps_total,
                               samples_per_s=samples_last * self.env.world_size / elapsed,
                               tokens_per_s=tokens_last * self.env.world_size / elapsed,
                               tokens_seen=self.tokens_seen * self.env.world_size,
                               data_wait_frac=self.data_wait_s / elapsed)
                if self.env.is_main:
                    print_progress(format_progress(self.step, c.train.max_steps, scalars, eta_s=eta(self.step)))
            if log_step:
                self.writer.log(self.step, scalars)
                if self.env.is_main:
                    self._warn_if_starved(scalars["data_wait_frac"])
                    for warning in collapse.update(self.step, scalars):
                        print_progress(warning)
                sums.reset()
                t_last, samples_last, tokens_last = time.perf_counter(), 0, 0
                self.data_wait_s = 0.0
            if c.train.eval_every and self.step % c.train.eval_every == 0 and self.step < c.train.max_steps:
                self.validate()
            if self.stsb is not None and (self.step % c.eval.stsb_every == 0 or self.step == c.train.max_steps):
                self.evaluate_stsb()
            if c.checkpoint.every and self.step % c.checkpoint.every == 0 and self.step < c.train.max_steps:
                self.save()
            if self._should_stop():
                path = self.save()
                code = self.stop_signal.exit_code  # 130 after Ctrl-C on this rank, else 75 (requeue)
                if self.env.is_main:
                    why = ("stopped by Ctrl-C: resume with the same command" if code != REQUEUE_EXIT_CODE
                           else "exiting so the job is requeued")
                    print_progress(f"stop signal: checkpointed step {self.step} ({path}); {why} (exit {code})")
                return code
        last_valid = self.validate()
        path = self.save()
        if self.env.is_main:
            for line in end_summary(self.run_dir, step=self.step, max_steps=c.train.max_steps, start_step=start_step,
                                    wall_s=eta.elapsed(), tokens_seen=self.tokens_seen * self.env.world_size,
                                    last_valid=last_valid, best_stsb=self.stsb.best if self.stsb else None,
                                    checkpoint=str(path) if path else None):
                print_progress(line)
        return 0

    def train_step(self, loader, sums: MetricSums):
        """One optimizer step over grad_accum micro-batches: forward -> loss -> backward -> step -> metrics."""
        c, env = self.cfg, self.env
        loss_ok, n_samples, n_tokens = True, 0, 0
        self._set_view_mean_mix()
        # Dropout noise is a function of (seed, step, rank): exact resume needs no RNG replay.
        with dropout_rng(c.seed, self.step, env.rank, self.engine.device):
            for _ in range(c.train.grad_accum):
                batch = self._next_batch(loader)  # counted on the host, then moved: no device sync
                n_samples += batch["input_ids"].shape[0]
                n_tokens += count_tokens(batch)
                batch = _to_device(batch, self.engine.device)
                loss, metrics = self.engine.forward(batch)
                finite = _all_finite(loss, env)  # all ranks agree: a bad micro-batch anywhere skips the step
                if finite:
                    sums.update(metrics)
                    sums.add("loss", loss.detach().item(), 1)  # x world size: the rank mean is the global loss
                loss_ok &= finite
                self.engine.micro_step(loss, finite=finite)
        info = self.engine.step()  # skipped when the gradients are non-finite
        # fp16's loss-scale overflows are routine skips, not bad steps.
        bad = not loss_ok or (info.skipped and c.train.precision != "fp16")
        return info, bad, n_samples, n_tokens

    def _warn_if_starved(self, wait_frac: float) -> None:
        """Once per run: say so when the step waits for its data more than DATA_WAIT_WARN of the time."""
        if wait_frac > DATA_WAIT_WARN and not self._warned_starved and self.step > self.cfg.train.log_every:
            self._warned_starved = True
            print_progress(f"warning: step {self.step} waited for data {wait_frac:.0%} of the time "
                           f"(> {DATA_WAIT_WARN:.0%}): the data pipeline is the bottleneck; raise data.num_workers "
                           f"(now {self.cfg.data.num_workers}) or use lighter augmentations")

    def _next_batch(self, loader) -> dict:
        t_wait = time.perf_counter()
        batch = next(loader)
        self.data_wait_s += time.perf_counter() - t_wait
        return batch

    def _set_view_mean_mix(self) -> None:
        """objective.nt_xent.mean_pool_warmup_steps: the views' share of mean pooling at this step."""
        nt = self.cfg.objective.nt_xent
        if nt is not None and nt.mean_pool_warmup_steps:
            self.module.objective.ctx.view_mean_mix = mean_pool_mix(self.step, nt.mean_pool_warmup_steps)

    @torch.no_grad()
    def validate(self) -> dict:
        if self.valid_set is None or self.cfg.train.eval_batches == 0:
            return {}
        self.engine.eval()
        self._set_view_mean_mix()
        sums = MetricSums()
        loader = iter(self._loader(self.valid_set, 0))
        for _ in range(self.cfg.train.eval_batches):
            batch = _to_device(next(loader), self.engine.device)
            _, metrics = self.engine.forward(batch)
            sums.update(metrics)
        scalars = sums.reduce(self.env)
        self.writer.log(self.step, scalars, split="valid")
        if self.env.is_main:
            print_progress(f"valid @ {self.step}: " + " | ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
        self.engine.train()
        return scalars

    def evaluate_stsb(self) -> dict:
        scores = self.stsb(self.module.model, step=self.step, config_yaml=to_yaml(self.cfg), is_main=self.env.is_main)
        self.writer.log(self.step, scores, split="eval")
        if self.env.is_main:
            print_progress(f"eval @ {self.step}: STS-B dev {scores['stsb_dev_spearman']:.2f} "
                           f"(best {scores['stsb_dev_best']:.2f})")
        return scores

    def save(self) -> Path:
        state = {
            "tokens_seen": self.tokens_seen,
            "consumed_samples": self.consumed_samples,
            "global_batch": self.global_batch,
            "world_size": self.env.world_size,
            "micro_batch_size": self.cfg.train.micro_batch_size,
            "grad_accum": self.cfg.train.grad_accum,
            "requested_batch": list(self.requested_batch),
            "bad_steps_total": self.bad_steps_total,
            "seed": self.cfg.seed,
            "sample_stream": getattr(self.train_set, "sample_stream", None),
            "sample_order": self.order_rule,
        }
        path = store.save_checkpoint(self.engine, self.env, self.run_dir, step=self.step, trainer_state=state,
                                     config_yaml=to_yaml(self.cfg), tokenizer_path=self.cfg.data.tokenizer,
                                     keep_last=self.cfg.checkpoint.keep_last)
        if self.env.is_main:
            universal_copy.prune(path.parent)
            print_progress(f"checkpoint {path}")
        return path

    def _should_stop(self) -> bool:
        flags = torch.tensor([int(self.stop_signal.requested), int(self.lock is not None and self.lock.lost)])
        if self.env.is_distributed:
            flags = all_reduce_host(flags)
        if flags[1]:  # another trainer took the run directory over: stop without writing anything more
            raise RunDirLocked(f"the lock of run directory {self.run_dir} was taken over by another trainer "
                               f"({self.run_dir / LOCK_NAME}); stopping at step {self.step} without saving")
        return bool(flags[0])

    def close(self) -> None:
        self.peers.stop()
        self.writer.close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _lock_run_dir(run_dir: Path, env) -> RunLock | None:
    """Rank 0 takes ``run_dir/run.lock``; every rank stops (RunDirLocked) when it cannot be had."""
    lock, error = None, ""
    if env.is_main:
        lock = RunLock(run_dir)
        try:
            warning = lock.acquire()
        except RunDirLocked as e:
            lock, error = None, str(e)
        else:
            if warning:
                print_progress(warning)
    failed = bool(error)
    if env.is_distributed:
        failed = bool(all_reduce_host(torch.tensor([int(failed)])).item())
    if failed:
        raise RunDirLocked(error or f"rank 0 could not lock the run directory {run_dir} (see its message)")
    return lock


@contextlib.contextmanager
def _main_rank_first(env):
    """Run the block on rank 0 first, then on the other ranks (which wait at a barrier meanwhile)."""
    if env.is_distributed and not env.is_main:
        torch.distributed.barrier()
    try:
        yield
    finally:
        if env.is_distributed and env.is_main:
            torch.distributed.barrier()


@contextlib.contextmanager
def dropout_rng(seed: int, step: int, rank: int, device):
    """Dropout (and any other RNG use inside) keyed by (seed, step, rank), scoped: the process-global RNG
    state (CPU, and the device's on CUDA) is restored on exit."""
    on_cuda = torch.device(device).type == "cuda"
    devices = [torch.device(device).index or 0] if on_cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((seed * 1_000_003 + step * 1009 + rank) % (2**63))
        yield


def count_tokens(batch: dict) -> int:
    """Real (non-padding) tokens of a batch: the sequence and both views."""
    return int(sum(batch[k].sum() for k in ("attention_mask", "view_a_mask", "view_b_mask") if k in batch))


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _all_finite(loss: torch.Tensor, env) -> bool:
    ok = torch.tensor([1 if bool(torch.isfinite(loss.detach()).all()) else 0])
    if env.is_distributed:
        ok = all_reduce_host(ok, torch.distributed.ReduceOp.MIN)
    return bool(ok.item())


