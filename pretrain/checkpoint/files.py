"""Artifact files: written whole or not at all, with the user's normal permissions.

Two writers give private modes behind our back: ``safetensors.torch.save_file`` writes a temporary file
(mode 0600) and renames it into place, and ``tempfile.mkdtemp``/``mkstemp`` create 0700/0600 entries. A
model.safetensors or a published directory must be readable as any other file the user writes (umask), so
every such write goes through here. Every read of a safetensors file a user hands over goes through
``read_safetensors``, so that a damaged one is one line naming it, never used.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from pretrain.distributed.env import unique_suffix


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable way to read it is to set it and put it back
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file (0644 under the usual umask 022)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode ``mkdir`` would give a new directory (0755 under umask 022)."""
    return 0o777 & ~current_umask()


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` with the file left at the user's normal mode, not 0600."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())


REEXPORT = "copy it again or re-export it"
"""What to do about a damaged safetensors file a user handed over (an export, an init dir, a run's best/)."""


def read_safetensors(path: str | os.PathLike, *, keep=None, fix: str = REEXPORT, error: type = ValueError) -> dict:
    """The tensors of a safetensors file that was handed to us (``keep``: only the names it accepts). A truncated
    copy or a file of another format is ``error`` naming the file, the reader's reason and ``fix``, not the
    reader's traceback: every CLI turns ValueError (and CheckpointError, which our checkpoints pass) into one line
    and exit 2. Flipped bytes inside tensor data pass: only a recorded digest (a checkpoint's files.json) sees
    them."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        if keep is None:
            return load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep(k)}
    except SafetensorError as e:
        raise error(f"{path} is damaged or not a safetensors file ({e}): {fix}") from None


def check_safetensors(path: str | os.PathLike, *, fix: str = REEXPORT, error: type = ValueError) -> None:
    """``read_safetensors``'s check without reading the tensors, for a file another library then loads: its header
    parses and its tensors cover the file (safetensors' own check on opening)."""
    read_safetensors(path, keep=lambda name: False, fix=fix, error=error)


def publish_dir(tmp_dir: str | os.PathLike) -> None:
    """Give a ``tempfile.mkdtemp`` directory (0700) the normal directory mode before it is renamed into place."""
    os.chmod(tmp_dir, dir_mode())


def fsync_files(paths) -> None:
    """Flush each file's data to the disk (a reader fd flushes the page cache's dirty pages of the file on a local
    filesystem; on NFS each client flushes its own, so every writer must call this on what it wrote)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``path`` durably and atomically: a temporary file beside it (fsynced), then one rename; a reader
    sees the old content or the new, never part of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{unique_suffix()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj, *, indent: int = 2) -> None:
    """``obj`` as JSON into ``path`` (parents created), the way HF and sentence-transformers files are written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent) + "\n", encoding="utf-8")


def strict_json(obj, *, indent: int | None = 1) -> str:
    """``obj`` as strict JSON (RFC 8259): a non-finite float (a NaN correlation, an infinite loss) becomes ``null``
    instead of Python's ``NaN``/``Infinity`` literals, which jq, JavaScript's JSON.parse and most non-Python readers
    refuse. Readers that need the number back treat ``null`` as NaN."""
    return json.dumps(_finite_or_none(obj), indent=indent, allow_nan=False)


def strict_number(value) -> float:
    """A number ``strict_json`` wrote, back: ``null`` (a non-finite one) as NaN."""
    return math.nan if value is None else value


def _finite_or_none(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj
