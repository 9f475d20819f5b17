"""The universal copy of a checkpoint: its ZeRO optimizer state in DeepSpeed's universal layout (every
parameter's fp32 weights and Adam moments whole), converted once for resuming it on another number of ranks.

``checkpoints/universal/<tag>/`` is derived from ``checkpoints/<tag>/``, never the other way: made by rank 0 in a
temporary directory, published by one rename with ``source.json`` (the checkpoint it was made from and its own
files' digests) written last; a copy that is absent, partial, damaged or stale is rebuilt, never used; it is
removed with its checkpoint (``prune``, after each save). This module builds on ``store``, never the reverse.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import torch

from pretrain.checkpoint.files import atomic_write_text
from pretrain.checkpoint.store import (
    FILES_FILE,
    STATE_FILE,
    CheckpointError,
    check_files,
    file_digests,
    list_complete,
)
from pretrain.distributed.comm import all_reduce_host
from pretrain.distributed.engine import convert_to_universal
from pretrain.fsutil import replace_dir

UNIVERSAL_DIR = "universal"
"""``checkpoints/universal/<tag>``: the universal form of a checkpoint, converted once for resuming it on another
number of ranks."""
UNIVERSAL_SOURCE = "source.json"
"""In a universal copy: which checkpoint it was made from and its own files' sizes and sampled sha256 (written
last, before the copy is published by a rename)."""


def universal_dir(tag_dir: Path) -> Path:
    """Where the universal copy of checkpoint ``tag_dir`` lives: ``checkpoints/universal/<tag>``."""
    return tag_dir.parent / UNIVERSAL_DIR / tag_dir.name


def prepare(env, tag_dir: Path, *, say=print) -> Path:
    """Collective: the checkpoint's ZeRO optimizer state in DeepSpeed's universal layout (every parameter's fp32
    weights and Adam moments whole, loadable on any number of ranks); returns its directory.

    Rank 0 converts it once (DeepSpeed's ds_to_universal, reading the checkpoint's own files) into a temporary
    directory and publishes it by one rename, with ``source.json`` naming the checkpoint it was made from and its
    files' digests; the other ranks wait. A copy that is absent, partial, damaged or made from another
    checkpoint of the same step is (re)built, never used. The checkpoint itself is only read."""
    out = universal_dir(tag_dir)
    ranks = f"{env.world_size} rank{'s' if env.world_size > 1 else ''}"

    def build() -> None:
        problems = _universal_problems(out, tag_dir)
        if not problems:
            return
        if out.exists():
            say(f"rebuilding {out}: {'; '.join(problems)}")
        say(f"converting checkpoint {tag_dir} to DeepSpeed's universal layout for {ranks} (once: kept in {out})")
        _convert_universal(tag_dir, out)

    error = _on_main_rank(env, build)
    if error is not None:
        raise CheckpointError(
            f"converting checkpoint {tag_dir} to DeepSpeed's universal layout (to resume it on {ranks}) failed: "
            f"{error}. The checkpoint itself is unchanged: resume it with the number of ranks it was written with "
            f"(world_size in its {STATE_FILE}), or start a new run_dir with checkpoint.init_from={tag_dir} "
            f"(weights only)."
        )
    return out


def _source_id(tag_dir: Path) -> str:
    """What identifies a checkpoint's contents: the sha256 of its files.json (of trainer_state.json without one)."""
    manifest = tag_dir / FILES_FILE
    return hashlib.sha256((manifest if manifest.is_file() else tag_dir / STATE_FILE).read_bytes()).hexdigest()


def _universal_problems(out: Path, tag_dir: Path) -> list[str]:
    """Why the universal copy ``out`` cannot be used for ``tag_dir`` ([] = it can)."""
    try:
        source = json.loads((out / UNIVERSAL_SOURCE).read_text(encoding="utf-8"))
        made_from, recorded = source["checkpoint"], source["files"]
    except FileNotFoundError:
        return ["it does not exist" if not out.exists() else f"it has no {UNIVERSAL_SOURCE} (incomplete)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{UNIVERSAL_SOURCE} is unreadable ({type(e).__name__})"]
    if made_from != _source_id(tag_dir):
        return [f"it was made from another checkpoint {tag_dir.name} than the one there now"]
    return check_files(out, recorded, full=False, manifest=UNIVERSAL_SOURCE)


def _convert_universal(tag_dir: Path, out: Path) -> None:
    """Rank 0: ds_to_universal into ``universal/.tmp-<tag>/<tag>``, digests recorded, published by os.replace."""
    tmp_root = out.parent / (".tmp-" + out.name)
    shutil.rmtree(tmp_root, ignore_errors=True)  # what a conversion that died half-way left
    tmp_root.mkdir(parents=True)
    tmp = tmp_root / out.name
    log_path = tmp_root / "convert.log"
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            convert_to_universal(str(tag_dir), str(tmp), log=log)
    except Exception as e:  # noqa: BLE001 - DeepSpeed's converter raises anything from asserts to KeyError
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        shutil.rmtree(tmp_root, ignore_errors=True)
        said = f" (DeepSpeed's output ended: {' | '.join(tail)})" if tail else ""
        raise CheckpointError(f"{type(e).__name__}: {e}{said}") from None
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    source = {"checkpoint": _source_id(tag_dir), "files": {n: file_digests(tmp / n, full=False) for n in names}}
    atomic_write_text(tmp / UNIVERSAL_SOURCE, json.dumps(source, indent=1))
    replace_dir(tmp, out)  # a stale or damaged copy is swapped out, never absent while replaced
    shutil.rmtree(tmp_root, ignore_errors=True)


def prune(ckpt_dir: Path) -> None:
    """Removes universal copies whose checkpoint is gone (retention) or was replaced (a redone step: the copy
    was made from other contents), and leftovers of interrupted conversions."""
    root = ckpt_dir / UNIVERSAL_DIR
    if not root.is_dir():
        return
    keep = set(list_complete(ckpt_dir))
    for p in root.iterdir():
        if p.name not in keep or not _made_from(p, ckpt_dir / p.name):
            shutil.rmtree(p, ignore_errors=True)


def _made_from(out: Path, tag_dir: Path) -> bool:
    try:
        return json.loads((out / UNIVERSAL_SOURCE).read_text(encoding="utf-8"))["checkpoint"] == _source_id(tag_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _on_main_rank(env, fn) -> str | None:
    """Runs ``fn()`` on rank 0 while the other ranks wait; returns, on every rank, rank 0's error as
    "Type: message" or None. The wait is one small all-reduce per second rather than one barrier: the work
    may take longer than distributed.timeout_s, and a rank 0 that dies still ends the wait within it."""
    box: dict = {}

    def call() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank, which then raises CheckpointError
            box["error"] = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"

    if not env.is_distributed:
        call()
        return box.get("error")

    worker = threading.Thread(target=call, name="universal-checkpoint", daemon=True) if env.is_main else None
    if worker is not None:
        worker.start()
    while True:
        if worker is not None:
            worker.join(timeout=1.0)
        done = worker is not None and not worker.is_alive()
        if all_reduce_host(torch.tensor([int(done)], dtype=torch.int64)).item():
            break
    box_list = [box.get("error")]
    torch.distributed.broadcast_object_list(box_list, src=0)
    return box_list[0]
