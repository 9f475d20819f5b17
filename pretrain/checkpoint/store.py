"""Checkpoints: complete or absent.

Layout under ``<run_dir>/checkpoints/``::

    step_00001000/            one DeepSpeed tag (all ranks' partitions) plus
        trainer_state.json    format_version, step, tokens_seen, data position, world size, ...
        config.yaml           the resolved run config
        tokenizer.json        a copy, so the checkpoint converts and evaluates on its own
        rng_rank<r>.pt        per-rank RNG states
        model.safetensors     the model's consolidated fp32 weights (what weight readers use: no pickle)
        files.json            every other file's size, sha256 and sampled sha256 (written before
                              trainer_state.json): what ``verify_checkpoint`` checks
    latest                    the tag of the newest complete checkpoint
    universal/step_00001000/  derived, only after a resume on another number of ranks under ZeRO 1-3: the
                              tag's optimizer state in DeepSpeed's universal layout (``universal.py``, which
                              builds on this module; its ``prune`` removes a copy with its tag)

A save (``writer.py``: snapshot in memory, written in the background) writes into ``.tmp-step_…`` and is
published by one ``os.replace`` of the directory, then ``latest`` is replaced atomically. ``trainer_state.json`` is written last inside the tag,
so a directory without it is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from pretrain.checkpoint.files import atomic_write_text, fsync_files, read_safetensors, save_safetensors
from pretrain.distributed.engine import fp32_state_dict_from_checkpoint
from pretrain.fsutil import SAMPLE_BLOCK, SAMPLE_BLOCKS, file_digests, fsync_dir, replace_dir  # noqa: F401
from pretrain.model.autoencoder import HEADS_FILE
from pretrain.model.flat import unflatten_state

FORMAT_VERSION = 3
"""2: trainer_state.json names the sample stream (``sample_stream``); a version-1 pretraining state is read as
stream 'generator-v1' (numpy Generators per sample), which this version does not resume into.
3: it names the sample order (``sample_order``, data/loader.py: ORDER_RULES); a version-2 state is read as order
'permutation-v1' (a numpy permutation per epoch), which a resume continues. A pretrain version that knows only
version 2 refuses a version-3 checkpoint instead of resuming it in another order."""
STATE_FILE = "trainer_state.json"
FILES_FILE = "files.json"
WEIGHTS_FILE = "model.safetensors"
LATEST_FILE = "latest"
FILES_RECORDED = "files_recorded"
"""A trainer_state.json key (written since 2026-12-07): the checkpoint's files are recorded in files.json, so one
that says so and has no files.json lost it (a partial copy) and is damaged, not a checkpoint from before
files.json existed, which is checked for its state file only."""
_UNRECORDED_WEIGHTS = (".pt", ".safetensors")
"""Suffixes of the files DeepSpeed's loaders and converters find by listing a tag (``zero_pp_rank_*``,
``*_model_states.pt``) and of our weights: one files.json does not record is a stale file from another save."""
FLAT_LAYOUT_FILE = "flat_layout.json"
"""In a checkpoint whose encoder layers' parameters are flat (train.flat_params, model/flat.py): which tensors
each of DeepSpeed's flat tensors holds, so that its files read back into per-tensor names."""
_TAG_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says what to do."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / STATE_FILE).is_file()


def list_complete(ckpt_dir: Path) -> list[str]:
    """Tags of complete checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if _TAG_RE.match(p.name) and is_complete(p)]
    return sorted(tags, key=lambda t: int(_TAG_RE.match(t).group(1)))


def find_latest(ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint tag (``latest`` if it is valid, else a scan)."""
    latest = ckpt_dir / LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        # `latest` names a tag of this directory or nothing: "../x" or an absolute path is never followed.
        if _TAG_RE.match(tag) and is_complete(ckpt_dir / tag):
            complete = list_complete(ckpt_dir)
            # A crash between publishing a tag and updating `latest` leaves a newer complete tag.
            return complete[-1] if complete and step_of(complete[-1]) > step_of(tag) else tag
    complete = list_complete(ckpt_dir)
    return complete[-1] if complete else None


def step_of(tag: str) -> int:
    """The step a checkpoint tag names (``step_00001000`` -> 1000; -1 for another name)."""
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else -1


def write_weights(tmp_dir: Path, step: int, *, in_thread: bool = False) -> None:
    """model.safetensors: the PretrainModel's fp32 weights consolidated from the DeepSpeed files just written
    (heads.safetensors: the objective's trainable heads, ``heads.*``, when it has any)
    (any ZeRO stage; our own files, read back once, by rank 0's background writer), so that no reader of the
    weights has to unpickle."""
    full = deepspeed_fp32_state(tmp_dir, in_thread=in_thread)
    state = {k[len("model."):]: v.detach().clone().contiguous() for k, v in full.items() if k.startswith("model.")}
    heads = {k: v.detach().clone().contiguous() for k, v in full.items() if k.startswith("heads.")}
    # The objective's trainable heads beside it (SARCSE's autoencoder: its Z is that recipe's embedding).
    for name, tensors in ((WEIGHTS_FILE, state), (HEADS_FILE, heads)):
        if tensors:
            tmp = tmp_dir / (name + ".tmp")
            save_safetensors(tensors, tmp, metadata={"format": "pt", "dtype": "float32", "step": str(step)})
            os.replace(tmp, tmp_dir / name)  # umask mode


def deepspeed_fp32_state(tag_dir: Path, *, in_thread: bool = False) -> dict:
    """The module's fp32 state (``model.*``, ``heads.*``) read from a checkpoint's DeepSpeed files, per tensor:
    flat layers' tensors split as its ``flat_layout.json`` records."""
    full = fp32_state_dict_from_checkpoint(str(tag_dir), in_thread=in_thread)
    layout_file = Path(tag_dir) / FLAT_LAYOUT_FILE
    if not layout_file.is_file():
        return full
    return unflatten_state(full, json.loads(layout_file.read_text(encoding="utf-8")))


def record_files(tmp_dir: Path, digests: dict) -> None:
    """files.json of a checkpoint being published, by rank 0 once every rank's writer finished: ``digests`` are
    what the ranks wrote (each rank fsynced and hashed its own files: on NFS every writer must flush what it
    wrote before the publish rename); the files rank 0 added (config, tokenizer, weights, DeepSpeed's script)
    are fsynced and hashed here, then every directory of the tag is fsynced."""
    names = sorted(str(p.relative_to(tmp_dir)) for p in tmp_dir.rglob("*")
                   if p.is_file() and p.name not in (STATE_FILE, FILES_FILE) and not p.name.endswith(".tmp")
                   and not p.name.startswith("."))
    rest = [n for n in names if n not in digests]
    fsync_files(tmp_dir / n for n in rest)
    recorded = {n: digests[n] if n in digests else file_digests(tmp_dir / n) for n in names}
    for d in {(tmp_dir / n).parent for n in names} | {tmp_dir}:
        fsync_dir(d)
    atomic_write_text(tmp_dir / FILES_FILE, json.dumps({"files": recorded, "sample_block": SAMPLE_BLOCK,
                                                          "sample_blocks": SAMPLE_BLOCKS}, indent=1))


def verify_checkpoint(tag_dir: Path, *, full: bool = False, whole: tuple[str, ...] = (),
                      digests: bool = True) -> list[str]:
    """What is wrong with a checkpoint ([] = good): its state file, then every file files.json records — size
    always, then (``digests``) the sampled sha256 (``full=False``: at most 8 MiB read per file) or the whole sha256
    (always for the names in ``whole``: what a weight reader is about to read anyway) — and no weight or rank file
    it does not record. A checkpoint written before files.json existed is checked for its state file only."""
    try:
        state = read_trainer_state(tag_dir)
    except CheckpointError as e:
        return [str(e)]
    try:
        recorded = json.loads((tag_dir / FILES_FILE).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        if state.get(FILES_RECORDED):
            return [f"{FILES_FILE} is missing (its {STATE_FILE} says the checkpoint's files are recorded there: a "
                    f"partial copy?)"]
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{FILES_FILE} is unreadable ({type(e).__name__})"]
    problems = check_files(tag_dir, recorded, full=full, manifest=FILES_FILE, digests=digests)
    if not problems and not full and digests:
        problems = check_files(tag_dir, {n: recorded[n] for n in whole if "sha256" in recorded.get(n, {})},
                               full=True, manifest=FILES_FILE)
    stray = sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*")
                   if p.suffix in _UNRECORDED_WEIGHTS and not p.name.startswith(".") and p.is_file())
    problems += [f"{name} is not one of the files the checkpoint was written with (a stale file from another save or "
                 f"rank count?): move it out of {tag_dir} to use this checkpoint"
                 for name in stray if name not in recorded]
    return problems


def check_files(directory: Path, recorded: dict, *, full: bool, manifest: str, digests: bool = True) -> list[str]:
    """What differs between the files of ``directory`` and their recorded sizes and (``digests``) digests
    ([] = good)."""
    problems = []
    for name, want in sorted(recorded.items()):
        path = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{manifest} names {name!r}, outside the checkpoint")
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"{name} has {size} bytes, {want.get('bytes')} when it was written (truncated?)")
            continue
        if not digests:
            continue
        got = file_digests(path, full=full)
        key = "sha256" if full else "sampled_sha256"
        if got[key] != want.get(key):
            problems.append(f"{name}: {'sha256' if full else 'sampled sha256'} differs from when it was written "
                            f"(the file changed or is corrupt)")
    return problems


def find_resumable(ckpt_dir: Path, *, say=print) -> str | None:
    """The newest checkpoint that verifies (sizes + sampled sha256); each damaged newer one is named with why."""
    tag, damaged = find_intact(ckpt_dir)
    named = list(damaged)
    for i, (bad, problems) in enumerate(damaged.items()):
        nxt = named[i + 1] if i + 1 < len(named) else tag
        say(f"warning: checkpoint {ckpt_dir / bad} is damaged: {'; '.join(problems)}. "
            f"{'Trying the previous one, ' + nxt if nxt else 'No older checkpoint is left'}.")
    return tag


def find_intact(ckpt_dir: Path) -> tuple[str | None, dict[str, list[str]]]:
    """(the newest checkpoint that verifies, {each newer damaged tag: what is wrong with it}, newest first); the
    tag is None when none verifies. The candidates: the complete checkpoints and the one ``latest`` names. What a
    resume (``find_resumable``) and a reader of a run's latest weights (export.resolve's select_checkpoint) take."""
    complete = list_complete(ckpt_dir)
    newest = find_latest(ckpt_dir)
    if newest is not None and newest not in complete:
        complete.append(newest)
    damaged = {}
    for tag in sorted(complete, key=step_of, reverse=True):
        problems = verify_checkpoint(ckpt_dir / tag)
        if not problems:
            return tag, damaged
        damaged[tag] = problems
    return None, damaged


def set_aside_newer(ckpt_dir: Path, tag: str) -> list[str]:
    """Rank 0, when a rollback falls back to ``tag`` past newer checkpoints that verify: each is renamed
    ``abandoned_<tag>`` (kept, out of every listing) and ``latest`` names ``tag``, so that the next launch resumes
    from the fallback and not from the checkpoint it gave up on. The names set aside."""
    moved = []
    for old in list_complete(ckpt_dir):
        if step_of(old) > step_of(tag):
            dest = ckpt_dir / f"abandoned_{old}"
            shutil.rmtree(dest, ignore_errors=True)  # set aside by an earlier fallback
            os.replace(ckpt_dir / old, dest)
            moved.append(old)
    if moved:
        atomic_write_text(ckpt_dir / LATEST_FILE, tag + "\n")
        fsync_dir(ckpt_dir)
    return moved


def record_trainer_state(env, tag_dir: Path, trainer_state: dict) -> None:
    """Collective: replace a published checkpoint's trainer_state.json (atomically; files.json does not cover it)
    — a rollback records there the samples it skips, so that resuming from this checkpoint skips them too."""
    if env.is_main:
        old = read_trainer_state(tag_dir)
        state = dict(trainer_state, format_version=FORMAT_VERSION, step=old["step"], tag=tag_dir.name)
        if FILES_RECORDED in old:
            state[FILES_RECORDED] = old[FILES_RECORDED]
        atomic_write_text(tag_dir / STATE_FILE, json.dumps(state, indent=2))
    _barrier(env)


def publish(ckpt_dir: Path, tmp_dir: Path, tag: str, keep_last: int, keep_every: int = 0) -> None:
    """The complete ``tmp_dir`` becomes ``tag`` and ``latest`` (each by an atomic rename); of the checkpoints up to
    ``tag``'s step, those older than the newest ``keep_last`` *intact* ones (``tag`` among them) go. A damaged one
    does not count (``retention_problems``): counted, a run whose older checkpoints lost files would keep fewer
    checkpoints to fall back on than it asked for, down to none but ``tag``; it is left while it is among the newest
    and goes with the rest once ``keep_last`` intact ones are newer. Tags of later steps are left alone: the run went
    back from them (a damaged one the resume or a rollback skipped), and counted by step they would outrank ``tag``
    and have it removed the moment it was published. A step that is a multiple of ``keep_every`` (> 0) is never
    removed (a milestone)."""
    # An older copy of this step (a step redone after a resume or rollback, which `latest` may name) is swapped
    # out, not removed first: the tag is never absent. replace_dir's fsync makes it durable before `latest` names it.
    replace_dir(tmp_dir, ckpt_dir / tag)
    atomic_write_text(ckpt_dir / LATEST_FILE, tag + "\n")
    fsync_dir(ckpt_dir)
    _VERIFIED[ckpt_dir / tag] = _signature(ckpt_dir / tag)  # just written and hashed by its writers
    intact = 0
    for old in reversed([t for t in list_complete(ckpt_dir) if step_of(t) <= step_of(tag)]):
        if intact < keep_last:
            intact += not retention_problems(ckpt_dir / old)
        elif not (keep_every and step_of(old) % keep_every == 0):
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
            _VERIFIED.pop(ckpt_dir / old, None)


_VERIFIED: dict[Path, tuple] = {}
"""Checkpoints this process published or verified whole (sampled digests), with their files.json and state file's
(size, mtime): ``retention_problems`` checks those by their files' sizes only."""


def _signature(tag_dir: Path) -> tuple:
    out = []
    for name in (FILES_FILE, STATE_FILE):
        try:
            st = (tag_dir / name).stat()
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def retention_problems(tag_dir: Path) -> list[str]:
    """What is wrong with a checkpoint, as retention counts it ([] = intact): ``verify_checkpoint`` (sizes and
    sampled digests, what a resume checks) the first time this process sees it, then without the digests (a stat
    of each file: one lost or truncated since) while its files.json and state file are unchanged — so a save does
    not reread its older checkpoints' sampled blocks (1 GB at 64 ranks) every time."""
    known = _VERIFIED.get(tag_dir) == _signature(tag_dir)
    problems = verify_checkpoint(tag_dir, digests=not known)
    if not problems:
        _VERIFIED[tag_dir] = _signature(tag_dir)
    return problems


def describe_error(e: BaseException) -> str:
    """An exception as one line: its type and the last line of its message."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"


def latest_trainer_state(run_dir: str | os.PathLike) -> dict | None:
    """The (upgraded) trainer_state of a run directory's newest checkpoint that verifies, the one a resume continues
    from (newer damaged ones, whose state may be unreadable, are passed over as a resume passes them); None when it
    has none; CheckpointError when every one is damaged."""
    ckpt_dir = checkpoints_dir(run_dir)
    tag, damaged = find_intact(ckpt_dir) if ckpt_dir.is_dir() else (None, {})
    if tag is None and damaged:  # as a resume refuses to start over on top of them
        raise CheckpointError(f"every checkpoint in {ckpt_dir} is damaged: " + "; ".join(
            f"{name}: {', '.join(problems)}" for name, problems in damaged.items()))
    return read_trainer_state(ckpt_dir / tag) if tag is not None else None


def read_trainer_state(tag_dir: Path) -> dict:
    try:
        state = json.loads((tag_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{tag_dir}/{STATE_FILE} is unreadable ({e}): the checkpoint is damaged (a resume "
                              f"passes over it to the previous one)") from None
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        state = upgrade_state(state)
    return state


def upgrade_state(state: dict) -> dict:
    """Versioned upgrades of trainer_state.json to the current version."""
    version = state.get("format_version")
    if version is None or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format_version {version!r} is not supported by this pretrain version "
            f"(supports <= {FORMAT_VERSION}); upgrade pretrain to read it"
        )
    if version == 1:  # written before the sample stream was recorded: the Generator-per-sample stream
        state = dict(state, format_version=2, sample_stream=state.get("sample_stream", "generator-v1"))
    if state["format_version"] == 2:  # written before the sample order was recorded: a permutation per epoch
        state = dict(state, format_version=3, sample_order=state.get("sample_order", "permutation-v1"))
    return state


def load_checkpoint(engine, env, tag_dir: Path, *, engine_dir: Path | None = None) -> dict:
    """Collective load of engine state + this rank's RNG; returns trainer_state. ``engine_dir``: where the engine
    state comes from instead of ``tag_dir`` — the checkpoint's universal copy (``universal.prepare``; the engine
    was built to load one), which re-splits ZeRO's optimizer partitions over this run's ranks. A rank the
    checkpoint did not have keeps its RNG (nothing in training draws from it: data noise and dropout are keyed)."""
    state = read_trainer_state(tag_dir)
    source = engine_dir or tag_dir
    engine.load(str(source.parent), source.name)
    rng = load_rng_state(tag_dir / f"rng_rank{env.rank}.pt")
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def load_rng_state(rng_file: Path) -> dict | None:
    """A rank's saved RNG states (tensors only: ``weights_only=True``, so a planted pickle runs no code)."""
    if not rng_file.is_file():
        return None
    try:
        rng = torch.load(rng_file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError for anything but tensors, or a damaged file
        raise CheckpointError(f"{rng_file} is not a plain RNG-state file ({type(e).__name__}); the checkpoint is "
                              f"damaged or was not written by pretrain-train: resume from another checkpoint") from None
    if not isinstance(rng, dict) or not torch.is_tensor(rng.get("torch")):
        raise CheckpointError(f"{rng_file} holds no RNG state; the checkpoint is damaged")
    return rng


def resolve_tag_dir(path: str | os.PathLike) -> Path:
    """A run dir, its checkpoints/ dir, or a tag dir -> the tag dir of a complete checkpoint."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {p} does not exist")
    if is_complete(p):
        return p
    for ckpt_dir in (p, p / "checkpoints"):
        tag = find_latest(ckpt_dir) if ckpt_dir.is_dir() else None
        if tag:
            return ckpt_dir / tag
    raise FileNotFoundError(
        f"{p} holds no complete checkpoint (looked for {STATE_FILE} in it, its checkpoints/ and their 'latest')"
    )


def load_model_state(path: str | os.PathLike, *, trust: bool = False) -> tuple[dict, dict]:
    """(fp32 state dict of the PretrainModel, resolved run config dict) from any of our checkpoints.

    Read from the checkpoint's model.safetensors (nothing unpickled); a checkpoint without one (written before
    2026-11-22) is read from DeepSpeed's pickled files only with ``trust`` (``--trust-checkpoint`` /
    ``checkpoint.trust``), since unpickling runs whatever code the files carry. ``config["data"]["tokenizer"]``
    points at the checkpoint's own tokenizer copy.
    """
    import yaml


    tag_dir = resolve_tag_dir(path)
    # The weights wholly (the sampled sha256 reads 8 MiB of a file: a flipped byte between its blocks would go
    # into the export unseen); the reader reads the file next anyway.
    problems = verify_checkpoint(tag_dir, whole=(WEIGHTS_FILE, HEADS_FILE))
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir} is damaged: {'; '.join(problems)}. Use an older checkpoint "
                              f"of the run (pretrain-train --check {tag_dir.parent.parent} lists them).")
    if (tag_dir / WEIGHTS_FILE).is_file():
        state = read_safetensors(tag_dir / WEIGHTS_FILE, fix=_older_checkpoint(tag_dir), error=CheckpointError)
    elif trust:
        full = deepspeed_fp32_state(tag_dir)
        state = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    else:
        raise CheckpointError(
            f"{tag_dir} has no {WEIGHTS_FILE} (written by a pretrain from before 2026-11-22, or not by "
            f"pretrain-train): its weights can only be read by unpickling DeepSpeed's files, which runs any code "
            f"they carry. If you trust where this checkpoint comes from, pass --trust-checkpoint (pretrain-convert, "
            f"pretrain-eval, pretrain-finetune-glue) or checkpoint.trust=true (checkpoint.init_from, RankCSE "
            f"teachers).")
    if not state:
        raise CheckpointError(f"{tag_dir} holds no 'model.*' weights; it was not written by pretrain-train")
    config = yaml.safe_load((tag_dir / "config.yaml").read_text(encoding="utf-8"))
    tok = tag_dir / "tokenizer.json"
    if tok.is_file():
        config.setdefault("data", {})["tokenizer"] = str(tok)
    return state, config


def _older_checkpoint(tag_dir: Path) -> str:
    """What to do about a checkpoint whose weights file does not read (``read_safetensors``'s ``fix``)."""
    return f"use an older checkpoint of the run (pretrain-train --check {tag_dir.parent.parent} lists them)"


def load_heads_state(path, *, trust: bool = False) -> dict:
    """The objective's trainable heads of a checkpoint (``heads.*`` keys, fp32): its heads.safetensors, or with
    ``trust`` its DeepSpeed files (a checkpoint from before heads.safetensors); {} when it has none. The caller has
    verified the checkpoint (``load_model_state``)."""
    tag_dir = resolve_tag_dir(path)
    if (tag_dir / HEADS_FILE).is_file():
        return read_safetensors(tag_dir / HEADS_FILE, fix=_older_checkpoint(tag_dir), error=CheckpointError)
    if trust and not (tag_dir / WEIGHTS_FILE).is_file():
        return {k: v for k, v in deepspeed_fp32_state(tag_dir).items() if k.startswith("heads.")}
    return {}


def _barrier(env) -> None:
    if env.is_distributed:
        torch.distributed.barrier()
