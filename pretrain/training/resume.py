"""Every decision about resuming, made once before DeepSpeed starts: ``plan_resume`` -> ``ResumePlan`` (which
checkpoint, whether it loads through a universal copy, the batch split on this rank count, what may not change and
what is refused). It reads checkpoints and returns a plan; it changes no config. Also the checkpoint a lost node's
message names, and the precision ``train.precision=auto`` keeps when a CPU run resumes (``run_precision``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pretrain.checkpoint import store
from pretrain.config import RunConfig, TrainConfig
from pretrain.config.loader import to_dict
from pretrain.data.indexed import file_sha256
from pretrain.data.datasets import STREAM_FIXES
from pretrain.data.loader import ORDER_RULE, ORDER_RULES
from pretrain.distributed.env import detect_env
from pretrain.metrics.writer import print_progress
from pretrain.training.build import flat_params_apply
from pretrain.training.progress import schedule_change
from pretrain.training.state import TrainState


@dataclass(frozen=True)
class ResumePlan:
    train: TrainConfig
    """This launch's train config: the run config's, with the batch split that continues the checkpoint."""
    tag_dir: Path | None = None
    """The checkpoint to resume; None starts the run."""
    state: TrainState | None = None
    """The checkpoint's run state, continued on this launch's ranks (None when starting)."""
    universal: bool = False
    """The engine loads the checkpoint's universal copy (ZeRO 1-3 on another rank count re-splits the optimizer)."""
    notes: list[str] = field(default_factory=list)
    """Lines for rank 0 to print."""


def plan_resume(cfg: RunConfig, env, *, tokenizer_sha256: str, sample_stream: str | None,
                data_identity: str | None = None) -> ResumePlan:
    """What this launch does about the run directory's checkpoints (checkpoint.resume=auto: the newest that
    verifies). ValueError when the checkpoint does not fit this run, naming what differs and what to do.
    Collective: rank 0 verifies the checkpoints, every rank takes its choice."""
    tag = resumable_tag(cfg.run_dir, env) if cfg.checkpoint.resume == "auto" else None
    if tag is None:
        return ResumePlan(train=cfg.train)
    tag_dir = store.checkpoints_dir(cfg.run_dir) / tag
    saved = saved_config(tag_dir)
    old = TrainState.from_state_dict(store.read_trainer_state(tag_dir), saved=saved, world_size=env.world_size)
    refuse_incompatible(old, tag_dir, saved, cfg, env.world_size, tokenizer_sha256=tokenizer_sha256,
                        sample_stream=sample_stream, data_identity=data_identity)
    micro, accum, note = resume_batch_split(
        tag_dir=tag_dir, global_batch=old.global_batch, saved=(old.world_size, old.micro_batch_size, old.grad_accum),
        requested=old.requested_batch, config=(cfg.train.micro_batch_size, cfg.train.grad_accum),
        world=env.world_size)
    state = old.continued(world_size=env.world_size, micro_batch_size=micro, grad_accum=accum, rank=env.rank)
    ranks = f" (written by {n_ranks(old.world_size)})" if old.world_size != env.world_size else ""
    notes = [note, f"resumed from {tag_dir} at step {old.step}{ranks}"]
    if data_identity is not None and old.data_identity not in (None, data_identity):  # checkpoint.allow_other_data
        notes.append(f"warning: {tag_dir} was trained on another training set (checkpoint.allow_other_data=true): "
                     f"the run goes on at sample {old.consumed_samples:,} of this one's order")
    if data_identity is not None:
        state = dataclasses.replace(state, data_identity=data_identity)
    if old.sample_order != ORDER_RULE:
        notes.append(f"the checkpoint orders its samples by {old.sample_order!r}: this run continues that order "
                     f"(new runs use {ORDER_RULE!r})")
    notes.append(schedule_change(saved, cfg, old.step))
    # ZeRO 1-3 keep the optimizer state in one partition per rank: another rank count re-splits it through
    # DeepSpeed's universal checkpoint. ZeRO-0 keeps it whole and loads as it is.
    universal = old.world_size != env.world_size and cfg.distributed.zero_stage > 0
    flat, scope, note = checkpoint_param_layout(saved, cfg, tag_dir)
    notes.append(note)
    train = dataclasses.replace(cfg.train, micro_batch_size=micro, grad_accum=accum, flat_params=flat,
                                flat_scope=scope)
    return ResumePlan(train=train, tag_dir=tag_dir, state=state, universal=universal, notes=[n for n in notes if n])


def resumable_tag(run_dir, env) -> str | None:
    """Rank 0 picks the newest checkpoint that verifies (naming each damaged one), every rank takes it."""
    ckpt_dir = store.checkpoints_dir(run_dir)
    tag = store.find_resumable(ckpt_dir, say=print_progress) if env.is_main else None
    if env.is_distributed:
        box = [tag]
        torch.distributed.broadcast_object_list(box, src=0)
        tag = box[0]
    if tag is None and store.list_complete(ckpt_dir):
        raise store.CheckpointError(
            f"every checkpoint in {ckpt_dir} is damaged (pretrain-train --check {run_dir} says how); "
            f"refusing to start this run over on top of them. Move {ckpt_dir} away to start from scratch.")
    if env.is_main and tag is not None and tag != store.find_latest(ckpt_dir):
        print_progress(f"warning: resuming from {ckpt_dir / tag}, the newest checkpoint that is intact")
    return tag


def refuse_incompatible(old: TrainState, tag_dir: Path, saved: dict, cfg: RunConfig, world_size: int, *,
                        tokenizer_sha256: str, sample_stream: str | None, data_identity: str | None = None) -> None:
    """ValueError when the checkpoint cannot continue as this run: the rank count and the ZeRO stage both
    changed, another model or tokenizer, another precision, another seed, a sample order or stream this version
    lacks, another training set (unless checkpoint.allow_other_data)."""
    old_stage = (saved.get("distributed") or {}).get("zero_stage", cfg.distributed.zero_stage)
    if old.world_size != world_size and old_stage != cfg.distributed.zero_stage:
        raise ValueError(
            f"checkpoint {tag_dir} was written by {old.world_size} ranks under ZeRO-{old_stage}; this run has "
            f"{world_size} ranks and distributed.zero_stage={cfg.distributed.zero_stage}. Change "
            f"the rank count or the ZeRO stage, not both in one resume: relaunch with "
            f"distributed.zero_stage={old_stage}.")
    changed = changed_architecture(saved, tag_dir, cfg, tokenizer_sha256)
    if changed:
        raise ValueError(
            f"checkpoint {tag_dir} was trained with another model or tokenizer than this run's config: "
            + "; ".join(changed) + ". Resuming would load weights that do not fit. Either keep the "
            f"checkpoint's settings, or start a new run_dir: from scratch, or from these weights with "
            f"checkpoint.init_from={tag_dir} and the checkpoint's model settings (weights of another size or "
            f"vocabulary cannot be loaded into this model).")
    old_precision = (saved.get("train") or {}).get("precision", cfg.train.precision)
    if old_precision != cfg.train.precision:
        raise ValueError(
            f"checkpoint {tag_dir} was trained with train.precision={old_precision}; this run has "
            f"train.precision={cfg.train.precision}. DeepSpeed keeps the optimizer state in another layout per "
            f"precision, so it cannot be loaded across them: resume with train.precision={old_precision}, or start "
            f"a new run_dir with checkpoint.init_from={tag_dir} (weights only) to train on in "
            f"{cfg.train.precision}.")
    if old.seed is not None and old.seed != cfg.seed:
        raise ValueError(
            f"checkpoint {tag_dir} was trained with seed={old.seed}; this run has seed={cfg.seed}. The sample order and "
            f"every sample's noise follow from the seed, so the rest of the run would repeat some samples and skip "
            f"others: resume with seed={old.seed}, or start a new run_dir with checkpoint.init_from={tag_dir}.")
    if old.sample_order not in ORDER_RULES:
        raise ValueError(
            f"checkpoint {tag_dir} orders its samples by {old.sample_order!r}, which this pretrain version does not "
            f"know (it knows {', '.join(ORDER_RULES)}): finish the run with the pretrain version that wrote it.")
    if (data_identity is not None and old.data_identity not in (None, data_identity)
            and not cfg.checkpoint.allow_other_data):
        raise ValueError(
            f"checkpoint {tag_dir} was trained on another training set than this run's data (the datasets' "
            f"manifests, weights or sample counts differ: {old.data_identity} there, {data_identity} here; another "
            f"dataset at the same path?). Resuming would go on at its sample {old.consumed_samples:,} in another "
            f"order. Point data.* at the data it was trained on; to continue on this data anyway, set "
            f"checkpoint.allow_other_data=true, or start a new run_dir with checkpoint.init_from={tag_dir}.")
    if sample_stream is not None and old.sample_stream != sample_stream and old.sample_stream in STREAM_FIXES:
        print_progress(f"warning: checkpoint {tag_dir} was trained on the sample stream {old.sample_stream!r}; this "
                       f"pretrain version draws {sample_stream!r}, whose samples are the same except that "
                       f"{STREAM_FIXES[old.sample_stream]}: the run continues with the corrected views")
    elif sample_stream is not None and old.sample_stream != sample_stream:
        raise ValueError(
            f"checkpoint {tag_dir} was trained on the sample stream {old.sample_stream!r} (how each "
            f"sample's masking and views are drawn), this pretrain version draws {sample_stream!r}: resuming would "
            f"silently give every remaining sample different noise than the run it continues. Finish the run "
            f"with the pretrain version that wrote it, or start a new run_dir with "
            f"checkpoint.init_from={tag_dir} (weights only).")


def resume_batch_split(*, tag_dir: Path, global_batch: int, saved: tuple[int, int, int],
                       requested: tuple[int, int], config: tuple[int, int], world: int) -> tuple[int, int, str | None]:
    """(micro_batch_size, grad_accum, a line to print or None) that continue a checkpoint's global batch of
    ``global_batch`` sequences per step on ``world`` ranks; ValueError (listing the splits that work) when none
    is allowed.

    ``saved`` = (ranks, micro_batch_size, grad_accum) the checkpoint ran with, ``requested`` = the config values its
    run was launched with (before any adjustment), ``config`` = this launch's. The config's values are kept when
    they give the global batch. When they are the launch values but do not fit (the rank count changed), the split
    is chosen: first the one that keeps every micro-step's sequences (micro_batch_size x ranks) and grad_accum,
    so each micro-step is the same batch as before and the loss continues exactly; else the config's
    micro_batch_size with another grad_accum. A changed value that does not fit is an error, not overridden.
    """
    old_world, old_micro, old_accum = saved
    micro, accum = config
    step_batch = old_micro * old_world  # sequences per micro-step, over all ranks
    was = (f"checkpoint {tag_dir} was trained with a global batch of {global_batch} sequences (micro_batch_size "
           f"{old_micro} x grad_accum {old_accum} x {n_ranks(old_world)})")
    if global_batch % world:
        fits = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        raise ValueError(f"{was}; {n_ranks(world)} cannot split it evenly. Resume on a rank count that divides "
                         f"{global_batch} ({', '.join(map(str, fits))}), or start a new run_dir with "
                         f"checkpoint.init_from={tag_dir} (weights only) to train with another global batch.")
    per_rank = global_batch // world
    more = "more" if micro * world > step_batch else "fewer"
    changed_split = (f"; each micro-step now has {micro * world} sequences, not {step_batch}: contrastive terms get "
                     f"{more} in-batch negatives (their loss moves to another level) and every term is normalised "
                     f"per micro-step, so training goes on, not identical with a run that kept the split")
    if micro * accum == per_rank:
        if micro * world == step_batch:
            return micro, accum, None
        return micro, accum, (f"resuming a {old_world}-rank checkpoint on {n_ranks(world)} with micro_batch_size "
                              f"{micro} x grad_accum {accum}" + changed_split)
    fits = [f"{m} x {per_rank // m}" for m in range(per_rank, 0, -1) if per_rank % m == 0]
    hint = (f"On {n_ranks(world)}, train.micro_batch_size x train.grad_accum must be {per_rank}: "
            f"{', '.join(fits[:12])}{' ...' if len(fits) > 12 else ''}")
    if (micro, accum) != tuple(requested):
        raise ValueError(f"{was}; this run's train.micro_batch_size={micro} x train.grad_accum={accum} x "
                         f"{n_ranks(world)} gives {micro * accum * world}. Resuming keeps the global batch. {hint}, "
                         f"or leave both at the values the run was launched with ({requested[0]} and "
                         f"{requested[1]}) to have them chosen.")
    head = f"resuming a {old_world}-rank checkpoint on {n_ranks(world)}:"
    if step_batch % world == 0:  # then micro_batch_size step_batch / world with the old grad_accum fits
        new_micro = step_batch // world
        note = (f"{head} train.micro_batch_size {micro} -> {new_micro} (grad_accum {old_accum}) keeps every "
                f"micro-step's {step_batch} sequences and the global batch {global_batch}: the same batches as before")
        if new_micro > micro and per_rank % micro == 0:
            note += (f". That is {new_micro / micro:g}x the activations per rank; if it does not fit, relaunch with "
                     f"train.grad_accum={per_rank // micro} (the losses then differ slightly: each micro-step has "
                     f"{micro * world} sequences)")
        return new_micro, old_accum, note
    if per_rank % micro == 0:
        new_accum = per_rank // micro
        return micro, new_accum, (f"{head} train.grad_accum {accum} -> {new_accum} keeps the global batch "
                                  f"{global_batch}" + changed_split)
    raise ValueError(f"{was}; no split with this run's micro_batch_size {micro} keeps it on {n_ranks(world)}. {hint}.")


def checkpoint_param_layout(saved: dict, cfg: RunConfig, tag_dir: Path) -> tuple[bool, str, str]:
    """(train.flat_params and train.flat_scope for this launch, a note or ""): a resumed run keeps the parameter
    layout its checkpoint was written with (DeepSpeed's optimizer state follows it; a checkpoint from before
    train.flat_params is per tensor, one from before train.flat_scope flat a layer). ValueError where this launch's
    ZeRO stage cannot hold the checkpoint's flat layout (ZeRO-3)."""
    old_train, old_dist = saved.get("train") or {}, saved.get("distributed") or {}
    was_flat = bool(old_train.get("flat_params", False)) and old_dist.get("zero_stage", 0) < 3
    if was_flat and cfg.distributed.zero_stage == 3:
        raise ValueError(
            f"checkpoint {tag_dir} holds its encoder layers' parameters flat (train.flat_params, ZeRO 0-2), which "
            f"ZeRO-3 cannot load: resume with distributed.zero_stage={old_dist.get('zero_stage', 2)}, or start a new "
            f"run_dir with checkpoint.init_from={tag_dir} (weights only).")
    was_scope = old_train.get("flat_scope", "layer") if was_flat else cfg.train.flat_scope
    head = "the checkpoint holds the encoder layers' parameters"
    if was_flat != flat_params_apply(cfg.train, cfg.distributed):
        layout = "flat" if was_flat else "per-tensor"
        return was_flat, was_scope, (f"{head} {layout} (train.flat_params={str(was_flat).lower()}): this run "
                                     "continues so")
    if was_scope != cfg.train.flat_scope:
        return True, was_scope, f"{head} flat with train.flat_scope={was_scope}: this run continues so"
    return cfg.train.flat_params, cfg.train.flat_scope, ""


def n_ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def run_precision(cfg: RunConfig, mine: str) -> str | None:
    """``load_run_config``'s ``run_precision`` for ``train.precision=auto`` (``mine``: what this machine would pick):
    on a machine without a GPU, the fp32 or bf16 recorded in the config.yaml of the run directory's newest complete
    checkpoint when this launch resumes (checkpoint.resume=auto), said on the main rank when it is not ``mine``;
    None without one, when it cannot be read (the resume then verifies and names the damage), or on a GPU. A CPU
    run on ``auto`` keeps the precision it started in when a requeue lands on a node that would pick the other (a
    partition mixing CPUs with and without AMX-BF16): DeepSpeed's optimizer state cannot be loaded across
    precisions, so ``refuse_incompatible`` would stop it, and a CPU runs either (bf16 slowly without AMX; the banner
    says so). A GPU without bf16 cannot run a bf16 run on: there the refusal and its advice stay."""
    if cfg.checkpoint.resume != "auto" or torch.cuda.is_available():
        return None
    ckpt_dir = store.checkpoints_dir(cfg.run_dir)
    tag = store.find_latest(ckpt_dir) if ckpt_dir.is_dir() else None
    saved = saved_config(ckpt_dir / tag) if tag is not None else None
    train = saved.get("train") if isinstance(saved, dict) else None
    precision = train.get("precision") if isinstance(train, dict) else None
    if precision not in ("fp32", "bf16"):
        return None
    if precision != mine and detect_env().is_main:
        print_progress(f"train.precision=auto: {precision}, the precision {cfg.run_dir}'s checkpoints were trained in "
                       f"(this machine alone would pick {mine}); a resume cannot change it")
    return precision


def saved_config(tag_dir: Path) -> dict:
    """The checkpoint's resolved config.yaml as a dict ({} when it has none or it is unreadable)."""
    import yaml

    try:
        return yaml.safe_load((tag_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}


def changed_architecture(old: dict, tag_dir: Path, cfg: RunConfig, tokenizer_sha256: str) -> list[str]:
    """``key: A in the checkpoint, B now`` for every model.* setting and the tokenizer that differ between the
    checkpoint's saved config ``old`` (``saved_config``; {} for an old checkpoint without one: the shape check at
    load time applies) + its tokenizer copy and this run. Settings safe to change on resume (steps, logging,
    evaluation and checkpoint cadence, LR schedule, data workers) are not compared."""
    now_model, old_model = to_dict(cfg.model), old.get("model") or {}
    changed = [f"model.{k}: {old_model[k]!r} in the checkpoint, {now_model[k]!r} now"
               for k in sorted(now_model) if k in old_model and old_model[k] != now_model[k]]
    tok = tag_dir / "tokenizer.json"
    if tok.is_file() and file_sha256(str(tok)) != tokenizer_sha256:
        changed.append(f"data.tokenizer: {cfg.data.tokenizer} is not the tokenizer the checkpoint was trained "
                       f"with (its copy: {tok})")
    return changed


def last_good_checkpoint(run_dir: Path) -> str:
    """For the lost-node message: the checkpoint a resume would start from."""
    ckpt_dir = store.checkpoints_dir(run_dir)
    tag = store.find_resumable(ckpt_dir, say=lambda _: None)
    return f"The last good checkpoint is {ckpt_dir / tag}" if tag else f"There is no checkpoint in {ckpt_dir} yet"
