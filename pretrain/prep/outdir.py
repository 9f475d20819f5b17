"""The output directory of ``pretrain-preprocess``: what ``--overwrite`` may replace, the temporary sibling the
dataset is built in (published whole by ``fsutil.replace_dir``), and the partial directories killed runs left."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from pretrain.data.shards import INDEX_CACHE_DIR, MANIFEST
from pretrain.distributed.env import host_name, pid_alive, unique_suffix


DATASET_FILE = re.compile(r"shard-\d{5}\.(bin|idx)(\.tmp)?|manifest\.json(\.tmp)?|token_freq\.npy|"
                          + re.escape(INDEX_CACHE_DIR))
"""Names a dataset directory holds (pretrain/data/FORMAT.md; the index cache training adds to it):
``--overwrite`` replaces only such a directory."""


def prepare_out_dir(out_dir: Path, overwrite: bool, files: list[str] = ()) -> Path:
    """The fresh temporary sibling to build the dataset in. Refuses an ``out_dir`` that holds anything but a
    dataset (``--overwrite`` would delete it: e.g. the corpus itself), or a dataset without ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory; choose another --out")
    where = out_dir.resolve()
    inside = [f for f in files if where in Path(f).resolve().parents]
    if inside:
        raise ValueError(f"input {inside[0]} lies inside the output directory {out_dir}, which is replaced as a "
                         f"whole; choose another --out")
    names = sorted(os.listdir(out_dir)) if out_dir.is_dir() else []
    foreign = [n for n in names if not DATASET_FILE.fullmatch(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"output directory {out_dir} holds files that are not part of a dataset ({shown}); "
                         f"--overwrite replaces only a dataset: choose another --out (or move those files away)")
    if names and not overwrite:
        what = "a complete dataset" if (out_dir / MANIFEST).exists() else "an incomplete dataset (no manifest.json)"
        raise ValueError(f"output directory {out_dir} already holds {what}; pass --overwrite or choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{unique_suffix()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def remove_stale_partials(out_dir: Path) -> None:
    """Remove the ``.<name>.partial-<host>-<pid>-<hex>`` directories that runs on this host left when killed
    (SIGKILL, OOM, a node failure: no ``except`` ran) — a whole run's shards otherwise stay there for good.
    A partial directory of a live process is another run writing the same output: refused. Those of other
    hosts (a shared filesystem) are named, not touched."""
    host = host_name()
    for d in sorted(out_dir.parent.glob(f".{out_dir.name}.partial-*")):
        parts = d.name[len(f".{out_dir.name}.partial-"):].rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        if parts[0] != host:
            warnings.warn(f"{d} is left by a run on host {parts[0]}; if that run is over, remove it (rm -r {d})",
                          stacklevel=3)
        elif pid_alive(int(parts[1])):
            raise ValueError(f"another pretrain-preprocess (pid {parts[1]}) is writing {out_dir} now (into {d}); "
                             f"wait for it to finish or choose another --out")
        else:
            warnings.warn(f"removing {d}, the unfinished output of an earlier run (pid {parts[1]}) that was killed",
                          stacklevel=3)
            shutil.rmtree(d, ignore_errors=True)
