"""Directories replaced whole and made durable: the one low-level home of the swap every writer of a published
directory uses (checkpoint tags, ``best/``, exports, universal copies, preprocessed datasets), below every layer
that writes one."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
from pathlib import Path

from pretrain.distributed.env import unique_suffix

SAMPLE_BLOCK = 1 << 20
SAMPLE_BLOCKS = 8
"""The sampled checksum of a file: sha256 of its size and of SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes evenly
spread from its first to its last byte (the whole file when smaller): at most 8 MiB read per file (checkpoints'
files.json; a dataset's shards sample fewer, smaller blocks)."""


def file_digests(path: Path, *, full: bool = True, block: int = SAMPLE_BLOCK, blocks: int = SAMPLE_BLOCKS) -> dict:
    """{"bytes", "sampled_sha256"[, "sha256"]} of one file: the sampled digest reads ``blocks`` blocks of ``block``
    bytes, the first at the file's start and the last ending at its last byte (so a cut or zero-filled end changes
    it)."""
    size = os.stat(path).st_size
    sampled = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= block * blocks:
            sampled.update(f.read())
        else:
            for i in range(blocks):
                f.seek(round(i * (size - block) / (blocks - 1)))
                sampled.update(f.read(block))
        out = {"bytes": size, "sampled_sha256": sampled.hexdigest()}
        if full:
            f.seek(0)
            whole = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 23), b""):
                whole.update(chunk)
            out["sha256"] = whole.hexdigest()
    return out


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (a rename into it, a new file) durable, or a file's data; a no-op where
    the OS cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the complete directory ``new`` in place of ``target`` so that at every instant the name ``target`` holds
    the old complete directory or the new one, never neither: one atomic exchange of the two names where the OS
    offers it (Linux renameat2), else the old one renamed to a trash sibling, the new one renamed in, the trash
    removed (a failure between the renames puts the old one back; a kill there leaves it for ``recover_dir``)."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.replace(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # now the old directory
    else:
        trash = target.with_name(f".{target.name}.old-{unique_suffix()}")
        os.replace(target, trash)
        try:
            os.replace(new, target)
        except BaseException:
            os.replace(trash, target)
            raise
        fsync_dir(target.parent)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(target.parent)


def recover_dir(target: str | os.PathLike) -> None:
    """Start-up after ``replace_dir`` was killed: an old copy left under a trash name goes back to ``target`` when
    ``target`` is missing, any other leftover (old copies, unfinished ``.<name>.tmp-*`` directories) is removed.
    Only for a directory that one process writes (the run's ``best/``, under the run lock)."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    olds = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not target.exists():
        os.replace(olds.pop(), target)
        fsync_dir(target.parent)
    for leftover in [*olds, *target.parent.glob(f".{target.name}.tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step (renameat2 RENAME_EXCHANGE); False where the C library,
    kernel or filesystem cannot (then the caller renames twice)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def inside(directory: str | os.PathLike, name: str, *, listed_in: str, links: bool = True) -> Path:
    """``directory / name`` for a path read from one of the directory's own files (``listed_in``: which), or a
    ValueError when it leads outside the directory: an absolute path, "..", or (``links``) a symlink out of it.
    Directories handed to us (datasets, models) are untrusted; what they list must be their own files.
    ``links=False`` for model files, which a Hugging Face cache snapshot links to its ../../blobs."""
    directory = Path(directory)
    path = directory / name
    if (os.path.isabs(name) or ".." in Path(name).parts
            or links and not path.resolve().is_relative_to(directory.resolve())):
        raise ValueError(f"{directory / listed_in} names {name!r}, outside {directory}; refusing it (a directory "
                         f"must hold the files it lists: copy it whole, symlinks resolved)")
    return path
