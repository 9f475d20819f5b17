"""What a resumed run continues with: the batch split on another number of ranks, the checkpoint's saved config and
what may not change, and the checkpoint a lost node's message names. Pure functions over a checkpoint directory;
the trainer decides and prints."""

from __future__ import annotations

from pathlib import Path

from pretrain.checkpoint import store
from pretrain.config import RunConfig
from pretrain.config.loader import to_dict
from pretrain.data.indexed import file_sha256


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


def n_ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


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
