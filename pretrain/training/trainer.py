"""The training loop: step -> log -> validate -> STS-B -> checkpoint -> stop.

``Trainer`` gets its parts from ``build.prepare_run`` and its resume decisions from ``resume.plan_resume``; the run's
own state is ``state.TrainState``. ``train_step`` is forward -> loss -> backward -> step -> metrics.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path

import torch

from pretrain.checkpoint import store
from pretrain.checkpoint import universal as universal_copy
from pretrain.checkpoint.writer import CheckpointWriter, snapshot_job
from pretrain.config import RunConfig, to_yaml
from pretrain.data.datasets import data_identity
from pretrain.data.loader import ORDER_RULE, build_loader
from pretrain.distributed.comm import all_reduce_host
from pretrain.distributed.engine import Engine
from pretrain.distributed.peers import PeerWatch
from pretrain.distributed.signals import StopSignal
from pretrain.metrics.accumulate import MetricSums
from pretrain.metrics.writer import (
    MetricsWriteError,
    MetricsWriter,
    format_progress,
    print_progress,
)
from pretrain.objective.forward import mean_pool_mix
from pretrain.training.banner import banner_lines
from pretrain.training.build import apply_param_layout, prepare_run, train_loader_builder
from pretrain.training.cached_step import cached_optimizer_step
from pretrain.training.evaluation import StsbKeepBest
from pretrain.training.heap import set_mmap_threshold
from pretrain.training.optim import build_param_groups, lr_lambda
from pretrain.training.progress import (
    BadSteps,
    CollapseWatch,
    Eta,
    LogWindow,
    StarvationWatch,
    end_summary,
    every,
    run_tokens,
)
from pretrain.training.resume import last_good_checkpoint, plan_resume
from pretrain.training.run_lock import LOCK_NAME, RunDirLocked, lock_run_dir
from pretrain.training.spikes import (
    SpikeWatch,
    plan_rollback,
    rollback_line,
)
from pretrain.training.state import TrainState
from pretrain.training.stop_record import STOP_RECORD, write_stop_record
from pretrain.training.step import Buckets, HostFacts, optimizer_step, to_device

REQUEUE_EXIT_CODE = 75
"""Exit status after a signal-triggered checkpoint (EX_TEMPFAIL): the launcher requeues the job."""


class Trainer:
    def __init__(self, cfg: RunConfig, env, *, stop_signal: StopSignal | None = None):
        self.cfg, self.env = cfg, env
        self.stop_signal = stop_signal or StopSignal(install=False)
        self.run_dir = Path(cfg.run_dir)
        self.lock = lock_run_dir(self.run_dir, env)  # one trainer per run_dir, before anything is written
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
        set_mmap_threshold(cfg.train.malloc_mmap_threshold_kib)  # before the first activation is allocated
        parts = prepare_run(cfg, env)
        self.tokenizer, self.train_set, self.valid_set, self.module = (parts.tokenizer, parts.train_set,
                                                                       parts.valid_set, parts.module)
        # STS-B dev evaluation opens its data now: a missing directory fails before DeepSpeed starts.
        self.stsb = StsbKeepBest(parts.cfg.eval, run_dir=self.run_dir, tokenizer=self.tokenizer,
                                 tokenizer_path=cfg.data.tokenizer, model_pooling=parts.cfg.model.pooling,
                                 zero_stage=cfg.distributed.zero_stage, is_main=env.is_main,
                                 autoencoder="autoencoder" in self.module.heads) if cfg.eval.stsb_every else None
        stream = getattr(self.train_set, "sample_stream", None)
        # Before DeepSpeed starts: on another number of ranks the plan decides the batch split (the global batch
        # stays) and whether the engine loads a universal checkpoint.
        identity = data_identity(self.train_set)
        plan = plan_resume(parts.cfg, env, tokenizer_sha256=self.tokenizer.sha256, sample_stream=stream,
                           data_identity=identity)
        self.cfg = cfg = dataclasses.replace(parts.cfg, train=plan.train)
        self._universal_tag = plan.tag_dir if plan.universal else None
        apply_param_layout(self.module, cfg.train, cfg.distributed)  # the checkpoint's layout on resume (plan)
        embeddings = getattr(self.module.model.encoder, "embeddings", None)
        self.buckets = Buckets(cfg.train.compile_bucket, cfg.train.compile_bucket,
                               getattr(embeddings, "max_tokens", None)) if cfg.step_bucketed else None
        """train.compile_shapes=bucketed: the compiled step's shapes (training/step.py: Buckets)."""
        self.engine = Engine(self.module, build_param_groups(self.module, cfg.optim.weight_decay), optim=cfg.optim,
                             train=cfg.train, dist=cfg.distributed, env=env,
                             lr_lambda=lr_lambda(cfg.optim, cfg.train.max_steps), load_universal=plan.universal)
        self.unpadded = cfg.train.unpadded_layout(self.module.model.cfg.arch)
        """The step's ``unpadded``: False (padded) or its attention layout (train.unpadded_attention)."""
        if plan.tag_dir is None:
            self.state = TrainState(world_size=env.world_size, micro_batch_size=cfg.train.micro_batch_size,
                                    grad_accum=cfg.train.grad_accum, seed=cfg.seed, sample_stream=stream,
                                    requested_batch=(cfg.train.micro_batch_size, cfg.train.grad_accum),
                                    sample_order=ORDER_RULE, data_identity=identity)
        else:
            engine_dir = universal_copy.prepare(env, plan.tag_dir, say=print_progress) if plan.universal else None
            store.load_checkpoint(self.engine, env, plan.tag_dir, engine_dir=engine_dir)
            self.state = plan.state
        if env.is_main:
            for note in plan.notes:
                print_progress(note)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
        self._build_train_loader = train_loader_builder(cfg)
        self.starved = StarvationWatch(cfg.train.log_every, cfg.data.num_workers)
        self.window = LogWindow()
        self.bad = BadSteps(cfg.train.max_bad_steps, self.state.bad_steps_total, self._diverged)
        self.spikes = SpikeWatch(cfg.train.spike, self.state.spike_watch)
        self.writer = MetricsWriter(self.run_dir, enabled=env.is_main, resume_step=self.state.step)
        self._saved: tuple[int, Path] | None = None  # (step, tag dir) of this launch's last save
        self.saver = CheckpointWriter(env, on_published=self._published if env.is_main else None)
        self._save_due = False  # checkpoint.every_minutes passed (agreed by every rank in _should_stop)
        self._last_save_t = time.monotonic()

    def _loader(self, dataset, start_sample: int):
        c = self.cfg
        train = dataset is self.train_set
        build = self._build_train_loader if train else build_loader
        return build(dataset, seed=c.seed, rank=self.env.rank, world_size=self.env.world_size,
                     micro_batch_size=c.train.micro_batch_size, start_sample=start_sample,
                     num_workers=c.data.num_workers, pad_id=self.tokenizer.pad_id,
                     prefetch_factor=c.data.prefetch_factor, timeout_s=c.data.timeout_s,
                     order_rule=self.state.sample_order if train else ORDER_RULE,
                     prepare=self._step_facts() if train else None)

    def _step_facts(self) -> HostFacts:
        """What the train step does to each batch on the host (``step.host_facts``), done by the loader's workers."""
        if self.cfg.objective.gradient_cache:
            return HostFacts(self.unpadded)  # as cached_optimizer_step
        return HostFacts(self.unpadded, self.module.objective.ctx.joint_pass, self.buckets)

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> int:
        """Runs to train.max_steps (or a stop signal). Returns the process exit code."""
        c, st = self.cfg, self.state
        if st.step and st.step >= c.train.max_steps:  # resumed where the run ended
            if st.finished:
                return self._already_finished()
            if self.env.is_main:
                print_progress(f"resumed at step {st.step} of train.max_steps={c.train.max_steps} from a checkpoint "
                               f"saved before the run's end: its final validation and checkpoint follow")
        self.train_loader = self._loader(self.train_set, st.consumed_samples)
        loader = iter(self.train_loader)
        if self.env.is_main:
            for line in banner_lines(c, self.env.world_size, self.module, self.train_set, self.valid_set):
                print_progress(line)
        if st.step == 0:
            self.validate()  # the untrained baseline, so the held-out curve starts at step 0
        self.engine.train()
        start_step = st.step
        self._last_save_t = time.monotonic()
        eta, collapse = Eta(start_step, c.train.max_steps), CollapseWatch(c, self.env.world_size)
        self.window.reset()
        self.window.resume(st.log_window, self.env, st.world_size * st.grad_accum)  # a cut window goes on
        while st.step < c.train.max_steps:
            info, bad = self.train_step(loader)
            self.bad.add(bad, st.step)
            last = st.step == c.train.max_steps
            # The first step of a launch is shown at once; it is not a logged window (that runs on to the next
            # log step, so the logged figures are the same whether or not the run was resumed).
            log_now = every(c.train.log_every, st.step, last=last) or st.step == start_step + 1
            save_now = (every(c.checkpoint.every, st.step) or self._save_due) and not last
            # Losses are judged where the host reads anyway: log steps, and before every checkpoint (spikes.py).
            if self._rolled_back(judge=log_now or save_now or last):
                loader, st = iter(self.train_loader), self.state
                continue
            if log_now:
                self.log(info, eta, collapse, window_ends=every(c.train.log_every, st.step, last=last))
            with self.window.paused():  # not training time: out of the next window's samples/s
                if every(c.train.eval_every, st.step) and not last:
                    self.validate()
                if self.stsb is not None and every(c.eval.stsb_every, st.step, last=last):
                    self.evaluate_stsb()
                if save_now:
                    self.save()
            stop = self._should_stop()
            if stop == "metrics":
                self._stop_for_metrics()  # raises MetricsWriteError after a checkpoint: exit 4
            if stop == "signal":
                return self._stop_for_signal()
        return self._finish(start_step, eta)

    def train_step(self, loader):
        """One optimizer step (``step.optimizer_step``) and its bookkeeping. Returns (StepInfo, whether it was bad)."""
        st = self.state
        self._set_view_mean_mix()
        step_fn = (partial(cached_optimizer_step, trim_heap=self.cfg.train.malloc_trim_chunks)
                   if self.cfg.objective.gradient_cache
                   else partial(optimizer_step, buckets=self.buckets, joint=self.module.objective.ctx.joint_pass))
        result = step_fn(self.engine, lambda: self._next_batch(loader), self.window.sums, env=self.env,
                         grad_accum=self.cfg.train.grad_accum, seed=self.cfg.seed, step=st.step,
                         precision=self.cfg.train.precision, unpadded=self.unpadded,
                         pin_memory=self.cfg.train.pin_memory)
        st.step += 1
        self.spikes.record(st.step, result.loss, result.bad)  # device scalars, read when they are judged
        st.consumed_samples += st.global_batch
        st.tokens_seen += result.tokens
        self.window.add(result.samples, result.tokens)
        return result.info, result.bad

    def _diverged(self, consecutive: int, last_step: int) -> str:
        try:
            self.saver.wait()  # the save in flight is the last good checkpoint once it is published
        except store.CheckpointError as e:
            print_progress(f"warning: {e}")
        return (f"{consecutive} consecutive steps with a non-finite loss or gradient (last at step {last_step}); "
                f"stopping. The last good checkpoint is {store.find_intact(store.checkpoints_dir(self.run_dir))[0]}; "
                f"lower optim.lr or check the data before resuming.")

    def _rolled_back(self, *, judge: bool) -> bool:
        """The spike rules over the steps kept since they were last judged (``spikes.SpikeWatch``), where ``judge``
        (a log step, a checkpoint, the end: the host reads there anyway); on a trigger, the rollback."""
        if not judge:
            return False
        self.state.bad_steps_total = self.bad.settle()  # train.max_bad_steps consecutive ones stop the run first
        trigger = self.spikes.judge(self.env)
        if trigger is not None:
            self.roll_back(trigger)
        return trigger is not None

    def roll_back(self, trigger) -> Path:
        """Back to the last good checkpoint with the data position past the samples since (``spikes.plan_rollback``),
        the skip recorded in that checkpoint; a console line and a ``rollback`` record in metrics.jsonl."""
        spike_cfg = self.cfg.train.spike
        self.saver.wait()  # the save in flight may be the last good checkpoint
        tag_dir, state, record = plan_rollback(self.run_dir, self.env, self.state, trigger, spike_cfg)
        universal = tag_dir == self._universal_tag  # the checkpoint this launch resumed from on another rank count
        engine_dir = universal_copy.prepare(self.env, tag_dir, say=print_progress) if universal else None
        store.load_checkpoint(self.engine, self.env, tag_dir, engine_dir=engine_dir)
        store.record_trainer_state(self.env, tag_dir,
                                   state.state_dict(tokens_total=run_tokens(self.env, state.tokens_seen)))
        self.state, self.spikes, self._saved = state, SpikeWatch(spike_cfg, state.spike_watch), None
        self.bad = BadSteps(self.cfg.train.max_bad_steps, state.bad_steps_total, self._diverged)
        self.train_loader.consumed_samples = state.consumed_samples  # the next iterator starts there
        self.window.reset()
        self.window.resume(state.log_window, self.env, state.world_size * state.grad_accum)
        self.writer.rewind(state.step)
        self.writer.log(state.step, record, split="rollback")
        if self.env.is_main:
            print_progress(rollback_line(tag_dir, state, record, spike_cfg))
        return tag_dir

    def log(self, info, eta: Eta, collapse: CollapseWatch, *, window_ends: bool) -> None:
        """The console line; at the end of a log window also metrics.jsonl/TensorBoard and the warnings."""
        st = self.state
        scalars = self.window.scalars(self.env, info, bad_steps=self.bad, tokens_seen=st.tokens_seen)
        st.bad_steps_total = self.bad.total
        if self.env.is_main:
            print_progress(format_progress(st.step, self.cfg.train.max_steps, scalars, eta_s=eta(st.step)))
        if not window_ends:
            return
        self.writer.log(st.step, scalars)
        if self.env.is_main:
            for warning in [self.starved.update(st.step, scalars["data_wait_frac"]), *collapse.update(st.step, scalars)]:
                if warning:
                    print_progress(warning)
        self.window.reset()

    def _checkpoint_now(self, *, in_flight_will_do: bool = False) -> tuple[int, Path]:
        """(step, tag dir) of a published checkpoint to stop at. Steps not judged yet are judged before they are
        saved; a rollback's checkpoint is then the one to resume. A save of this step (just made, perhaps still
        being written) is finished, not started again; with ``in_flight_will_do`` (a stop signal: time counts
        before the job is killed) so is one of an earlier step still being written — the steps since are redone
        on resume, exactly."""
        trigger = self.spikes.judge(self.env)
        if trigger is not None:
            path = self.roll_back(trigger)
            return self.state.step, path
        in_flight = self.saver.in_flight is not None
        if self._saved is not None and (self._saved[0] == self.state.step or (in_flight and in_flight_will_do)):
            self.saver.wait()
            return self._saved
        self.save(wait=True)
        return self._saved

    def _stop_for_signal(self) -> int:
        step, path = self._checkpoint_now(in_flight_will_do=True)
        code = self.stop_signal.exit_code  # 130 after Ctrl-C on this rank, else 75 (requeue)
        if self.env.is_main:
            try:  # for a launcher that sees another code (srun --kill-on-bad-exit): the stop itself is done
                write_stop_record(self.run_dir, code=code, step=step, checkpoint=str(path))
            except OSError as e:
                print_progress(f"warning: could not write {self.run_dir / STOP_RECORD} ({e}); the checkpoint is "
                               f"complete")
            why = ("stopped by Ctrl-C: resume with the same command" if code != REQUEUE_EXIT_CODE
                   else "exiting so the job is requeued")
            print_progress(f"stop signal: checkpointed step {step} ({path}); {why} (exit {code})")
        return code

    def _stop_for_metrics(self) -> None:
        """metrics.jsonl or TensorBoard could not be written (disk full, quota): checkpoint, then stop with exit 4
        (a failing checkpoint raises its own CheckpointError, also exit 4)."""
        step, path = self._checkpoint_now()
        why = self.writer.failure or "rank 0 could not write metrics.jsonl or TensorBoard events (see its message)"
        raise MetricsWriteError(f"{why}; checkpointed step {step} ({path}). Free space in "
                                f"{self.run_dir} and resume with the same command: it continues from that checkpoint "
                                f"(metrics of the steps since the failure are not recorded)")

    def _finish(self, start_step: int, eta: Eta) -> int:
        if self.stsb is not None and self.state.step == start_step:  # resumed at the end: the STS-B evaluation
            self.evaluate_stsb()  # (best/) the loop gives the last step
        last_valid = self.validate()
        path = self.save(wait=True, final=True)
        if self._should_stop() == "metrics":  # the last steps' or the final validation's records failed
            self._stop_for_metrics()
        tokens = run_tokens(self.env, self.state.tokens_seen)  # collective: every rank's own count
        if self.env.is_main:
            for line in end_summary(self.run_dir, step=self.state.step, max_steps=self.cfg.train.max_steps,
                                    start_step=start_step, wall_s=eta.elapsed(), tokens_seen=tokens,
                                    last_valid=last_valid,
                                    best_stsb=self.stsb.best if self.stsb else None,
                                    checkpoint=str(path) if path else None):
                print_progress(line)
        return 0

    def _already_finished(self) -> int:
        """A launch that resumed at (or past) train.max_steps from the run's final checkpoint (``finished``): the
        run's last launch validated, evaluated and saved there already. A resubmitted or chained job, or a requeue
        after the end, repeated that (a second final record in metrics.jsonl and TensorBoard, the final checkpoint
        written again); now it says so and ends 0."""
        if self.env.is_main:
            print_progress(f"done already: {self.run_dir} is at step {self.state.step} of train.max_steps="
                           f"{self.cfg.train.max_steps}, validated and saved there; nothing to train (raise "
                           f"train.max_steps to train on)")
        return 0

    def _next_batch(self, loader) -> dict:
        t_wait = time.perf_counter()
        batch = next(loader)
        self.window.data_wait_s += time.perf_counter() - t_wait
        return batch

    def _set_view_mean_mix(self) -> None:
        """objective.nt_xent.mean_pool_warmup_steps: the views' share of mean pooling at this step."""
        nt = self.cfg.objective.nt_xent
        if nt is not None and nt.mean_pool_warmup_steps:
            self.module.set_view_mean_mix(mean_pool_mix(self.state.step, nt.mean_pool_warmup_steps))

    @torch.no_grad()
    def validate(self) -> dict:
        if self.valid_set is None or self.cfg.train.eval_batches == 0:
            return {}
        self.engine.eval()
        self._set_view_mean_mix()
        sums = MetricSums()
        valid_loader = self._loader(self.valid_set, 0)
        try:
            loader = iter(valid_loader)
            for _ in range(self.cfg.train.eval_batches):
                batch = to_device(next(loader), self.engine.device, pin=self.cfg.train.pin_memory)
                _, metrics = self.engine.forward(batch)
                sums.update(metrics)
        finally:
            valid_loader.close()  # its workers, now: a new loader is built at the next validation
        scalars = sums.reduce(self.env)
        self.writer.log(self.state.step, scalars, split="valid")
        if self.env.is_main:
            print_progress(f"valid @ {self.state.step}: " + " | ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
        self.engine.train()
        return scalars

    def evaluate_stsb(self) -> dict:
        scores = self.stsb(self.module.model, step=self.state.step, config_yaml=to_yaml(self.cfg),
                           is_main=self.env.is_main, heads=self.module.heads)
        self.writer.log(self.state.step, scores, split="eval")
        if self.env.is_main:
            print_progress(f"eval @ {self.state.step}: STS-B dev {scores['stsb_dev_spearman']:.2f} "
                           f"(best {scores['stsb_dev_best']:.2f})")
        return scores

    def save(self, *, wait: bool = False, final: bool = False) -> Path:
        """Checkpoint this step: a snapshot in memory, then training goes on while ``self.saver`` writes and
        publishes it (``wait`` or checkpoint.background=false: published before this returns). ``final``: the run's
        end (``_finish``), recorded as ``finished`` (every other save records false, whatever state a resume or
        rollback started from). The previous save is waited for first; a failed one raises its CheckpointError
        here. metrics.jsonl gets a "checkpoint" record: the seconds training stood still here (``pause_s``), of them
        waiting for the previous save (``wait_prev_s``)."""
        t0 = time.perf_counter()
        self.saver.wait()
        waited = time.perf_counter() - t0
        # The skipped steps so far are part of the state; a diverged run stops here, before it writes.
        self.state.bad_steps_total = self.bad.settle()
        self.state.spike_watch = self.spikes.state_dict()
        self.state.log_window = self.window.carry(self.env, self.state.world_size * self.state.grad_accum)
        self.state.finished = final
        c = self.cfg
        tokens = run_tokens(self.env, self.state.tokens_seen)  # collective, as the save: the ranks' shares summed
        job = snapshot_job(self.engine, self.env, self.run_dir, step=self.state.step,
                           trainer_state=self.state.state_dict(tokens_total=tokens), config_yaml=to_yaml(c),
                           tokenizer_path=c.data.tokenizer, keep_last=c.checkpoint.keep_last,
                           keep_every=c.checkpoint.keep_every, timeout_s=c.distributed.timeout_s)
        path = self.saver.start(job)
        self._saved, self._save_due, self._last_save_t = (self.state.step, path), False, time.monotonic()
        if wait or not c.checkpoint.background:
            self.saver.wait()
        self.writer.log(self.state.step, {"pause_s": time.perf_counter() - t0, "wait_prev_s": waited},
                        split="checkpoint")
        # Events up to a checkpoint are never logged again once a relaunch resumes from it: on disk now (with
        # TensorFlow installed, TensorBoard's writer buffers up to 120 s that a SIGKILL after a stop would lose).
        self.writer.flush()
        return path

    def _published(self, path: Path) -> None:
        """Rank 0, in the checkpoint writer's thread, once ``path`` is published."""
        universal_copy.prune(path.parent)
        print_progress(f"checkpoint {path}")

    def _time_to_save(self) -> bool:
        """checkpoint.every_minutes passed since the last save (rank 0's clock decides)."""
        minutes = self.cfg.checkpoint.every_minutes
        return bool(minutes) and self.env.is_main and time.monotonic() - self._last_save_t >= 60 * minutes

    def _should_stop(self) -> str | None:
        """Why every rank stops now: "metrics" (rank 0's metrics writer failed), "signal", or None. The same
        all-reduce agrees whether checkpoint.every_minutes is due (``_save_due``, for the next step)."""
        flags = torch.tensor([int(self.stop_signal.requested), int(self.lock is not None and self.lock.lost),
                              int(self.writer.failure is not None), int(self._time_to_save())])
        if self.env.is_distributed:
            flags = all_reduce_host(flags)
        self._save_due = self._save_due or bool(flags[3])
        if flags[1]:  # another trainer took the run directory over: stop without writing anything more
            self._lock_taken = True  # close() abandons a save in flight instead of finishing it
            raise RunDirLocked(f"the lock of run directory {self.run_dir} was taken over by another trainer "
                               f"({self.run_dir / LOCK_NAME}); stopping at step {self.state.step} without saving")
        return "metrics" if flags[2] else "signal" if flags[0] else None

    def abandon_save(self) -> tuple[int | None, Path | None]:
        """A second Ctrl-C: the save in flight is not finished but removed (``CheckpointWriter.abandon``). Returns
        (its step, or None when none was in flight; the tag dir it had published already on rank 0, else None).
        ``close`` comes after, as always."""
        saver = getattr(self, "saver", None)
        if saver is None or saver.in_flight is None:
            return None, None
        return saver.in_flight, saver.abandon()

    def cancel_save(self) -> int | None:
        """What a Ctrl-C does while the trainer closes (``StopSignal.closing``): a save in flight stops before its
        next file, without waiting here (a signal handler calls it). Its step, or None when none was in flight."""
        saver = getattr(self, "saver", None)
        step = saver.in_flight if saver is not None else None
        if step is not None:
            saver.cancel()
        return step

    def close(self) -> None:
        if getattr(self, "_lock_taken", False):  # the run directory is another trainer's now: publish nothing
            step, _ = self.abandon_save()
            if step is not None and self.env.is_main:
                print_progress(f"the save of step {step} in flight was abandoned: another trainer holds "
                               f"{self.run_dir} now")
        saver = getattr(self, "saver", None)
        error = saver.close() if saver is not None else None  # a save in flight is finished, not abandoned
        if error is not None:
            print_progress(f"warning: the checkpoint being written when the run ended failed "
                           f"({store.describe_error(error)}); the previous one is intact")
        loader = getattr(self, "train_loader", None)
        if loader is not None:  # its workers stop now, not when (or whether) the loader is collected
            loader.close()
        self.peers.stop()
        self.writer.close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
