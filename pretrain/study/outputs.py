"""What a study step's outputs say, read by the driver (``driver.py``) to decide what to run: whether a step is done
(``is_done``, ``final_step``), the stamps that tie a result to the inputs it was made from (``stamp``,
``weights_digest``), whether a run was trained with the recipe the study resolves now (``recipe_changes``), and
whether a run diverged (``divergence``); and removing a stale output, only inside the study's directory
(``remove_output``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from pretrain.checkpoint import store
from pretrain.study.plan import EVAL_RESULTS, Step, StudyError

# ------------------------------------------------------------------------------------------------ done, stamps

def final_step(run_dir: Path) -> tuple[int, int]:
    """(newest complete checkpoint's step, the run's train.max_steps); (-1, 0) without them."""
    import yaml


    config = run_dir / "config.yaml"
    ckpt_dir = store.checkpoints_dir(run_dir)
    tag = store.find_intact(ckpt_dir)[0] if ckpt_dir.is_dir() else None  # a damaged newer one: a resume redoes it
    if tag is None or not config.is_file():
        return -1, 0
    max_steps = ((yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("train") or {}).get("max_steps", 0)
    try:
        return int(store.read_trainer_state(ckpt_dir / tag)["step"]), int(max_steps)
    except store.CheckpointError:
        return -1, int(max_steps)


RECIPE_BLOCKS = ("objective", "optim")
"""Blocks of a run's config.yaml that hold the config as it was loaded (the trainer rewrites model.* from the
tokenizer or init_from and train.* on a resume): compared with the study's resolved config to catch a config file
(a recipe, read by path, so the command stays the same) edited since the run was trained."""


def recipe_changes(recorded: dict, planned: dict) -> list[str]:
    """'KEY=RECORDED, now PLANNED' for each key of RECIPE_BLOCKS that both configs hold and that differs (a block
    one of them sets to null counts; a key only one holds, e.g. a setting added to pretrain since, does not)."""
    then = dict(flat_keys({k: recorded.get(k) for k in RECIPE_BLOCKS if k in recorded}))
    now = dict(flat_keys({k: planned.get(k) for k in RECIPE_BLOCKS if k in planned}))

    def leaf(flat: dict, key: str):
        parts = key.split(".")
        for i in range(len(parts), 0, -1):  # the key, else a block above it that is null
            k = ".".join(parts[:i])
            if k in flat and (i == len(parts) or flat[k] is None):
                return flat[k]
        return _ABSENT

    changes = []
    for key in sorted(set(then) | set(now)):
        a, b = leaf(then, key), leaf(now, key)
        if a is not _ABSENT and b is not _ABSENT and json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            changes.append(f"{key}={json.dumps(a)}, now {json.dumps(b)}")
    return changes


_ABSENT = object()


def is_done(step: Step) -> bool:
    if step.kind == "prep":
        return (step.output / step.complete if step.complete else step.output).exists()
    if step.kind == "train":
        done, max_steps = final_step(step.output)
        return max_steps > 0 and done >= max_steps
    if step.kind == "eval":
        return (step.output / EVAL_RESULTS[step.tool]).is_file()
    return (step.output / "report.md").is_file()


def weights_digest(path: Path, cache: dict | None = None) -> str:
    """sha256 of a safetensors file's tensors: the header with its keys sorted (the writer's metadata order
    varies between processes), then the data. ``cache`` maps path -> [size, mtime_ns, digest]."""
    st = path.stat()
    key = str(path)
    if cache is not None and cache.get(key, [None])[:2] == [st.st_size, st.st_mtime_ns]:
        return cache[key][2]
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= st.st_size - 8:  # checked before it is read: a header size is never allocated unchecked
            raise StudyError(f"{path} is not a safetensors file (its header claims {n} bytes, the file has "
                             f"{st.st_size}): damaged; pretrain-train --check on its run names what is wrong")
        h = hashlib.sha256(json.dumps(json.loads(f.read(n)), sort_keys=True).encode())
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if cache is not None:
        cache[key] = [st.st_size, st.st_mtime_ns, h.hexdigest()]
    return h.hexdigest()


def stamp(step: Step, cache: dict | None = None) -> str:
    """What a finished step produced, as a short hash: a run's weights (final and best/), an evaluation's or a
    preparation step's output. A step whose inputs' stamps changed since it ran is out of date."""
    h = hashlib.sha256()
    if step.kind == "train":

        ckpt_dir = store.checkpoints_dir(step.output)
        tag = store.find_intact(ckpt_dir)[0]  # the weights the evaluations read (the newest that verifies)
        h.update(f"{tag}:{weights_digest(ckpt_dir / tag / store.WEIGHTS_FILE, cache)}".encode())
        best = step.output / "best" / store.WEIGHTS_FILE
        if best.is_file():
            h.update(f"best:{weights_digest(best, cache)}".encode())
    elif step.kind == "eval":
        h.update((step.output / EVAL_RESULTS[step.tool]).read_bytes())
    else:
        target = step.output / step.complete if step.complete else step.output
        target = target / "report.md" if step.kind == "report" else target
        if target.is_file():
            h.update(target.read_bytes())
        else:
            for f in sorted(target.rglob("*")):
                if f.is_file():
                    h.update(f"{f.relative_to(target)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def recorded_step(status_json: Path, sid: str) -> dict:
    """Another study's status.json record of step ``sid``; {} where it has none or the file cannot be read."""
    try:
        rec = (json.loads(status_json.read_text(encoding="utf-8")).get("steps") or {}).get(sid)
    except (OSError, ValueError, AttributeError):
        return {}
    return rec if isinstance(rec, dict) else {}


# ------------------------------------------------------------------------------------------------ divergence

DIVERGED_EXIT = 3
"""``pretrain-train``'s exit code for a run that diverged (TrainingDiverged after train.max_bad_steps non-finite
steps, or a spike train.spike.max_rollbacks rollbacks did not undo): recorded as a result, not a failure."""

_AT_STEP = re.compile(r"\bat step (\d+)")


def divergence(log: Path, run_dir: Path) -> tuple[int | None, str]:
    """(the step a run diverged at, the trainer's message) after its exit 3: the last ``pretrain-train: ...`` line
    of the log's last launch names the step ("... at step N ..."); else the newest rollback record of its
    metrics.jsonl (the spike it could not undo); None where neither says."""
    launch = log.read_text(encoding="utf-8", errors="replace").rsplit("\n=== ", 1)[-1]
    said = [ln.strip() for ln in launch.splitlines() if ln.startswith("pretrain-train: ")]
    message = said[-1].removeprefix("pretrain-train: ") if said else last_line(log)
    message = message if len(message) <= 300 else message[:297] + "..."
    m = _AT_STEP.search(message) if said else None
    return (int(m.group(1)) if m else _last_rollback(run_dir / "metrics.jsonl")), message


def _last_rollback(metrics: Path) -> int | None:
    """The trigger step of the newest rollback record in the last 64 KiB of ``metrics`` (None: none there)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line
        if isinstance(rec, dict) and rec.get("split") == "rollback" and isinstance(rec.get("trigger_step"), int):
            return rec["trigger_step"]
    return None


def diverged_stamp(rec: dict) -> str:
    """A diverged run's stamp (it has no final weights): which divergence, so a report drawn from it is redone when
    the run is retried."""
    return hashlib.sha256(f"diverged:{rec.get('diverged_at')}:{rec.get('finished')}".encode()).hexdigest()[:16]


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    line = lines[-1] if lines else "(empty log)"
    return line if len(line) <= 200 else line[:197] + "..."


def flat_keys(d, prefix=""):
    """(dotted key, value) of every leaf of nested dicts ``d`` (an empty dict is a leaf)."""
    if isinstance(d, dict) and d:
        for k, v in d.items():
            yield from flat_keys(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], d


def remove_output(path: Path, root: Path) -> None:
    """Remove a stale step output, only inside the study directory ``root`` (the plan refuses others; this holds
    even for a path a symlink leads out of)."""
    inside = path.resolve(), root.resolve()
    if inside[0] == inside[1] or inside[1] not in inside[0].parents:
        raise StudyError(f"refusing to remove {path}: it is not inside the study's directory {root}")

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
