"""What the Slurm tests train: a small corpus through the quickstart's own steps, and the tiny run's overrides."""

from __future__ import annotations

import json
from pathlib import Path


def prepare(root: Path) -> dict:
    """A small corpus -> tokenizer -> train/valid shards under ``root`` (paths of each)."""
    from pretrain.prep.embedded import write_embedded_corpus
    from pretrain.quickstart import prepare as quickstart_prepare

    train_txt, _ = write_embedded_corpus(root / "corpus", valid_every=10)
    train_txt.write_text("\n".join(train_txt.read_text().splitlines()[:3000]) + "\n")
    return quickstart_prepare(root, vocab_size=1000, num_workers=1)


def overrides(paths: dict, *, max_steps: int, checkpoint_every: int = 0, keep_last: int = 3,
              extra: tuple[str, ...] = ()) -> list[str]:
    """Dotted overrides of a seconds-long tiny run on ``prepare``'s data, logging every step."""
    return [
        f"data.tokenizer={paths['tokenizer']}",
        f"data.sources=[{{name: docs, path: {paths['train']}}}]",
        f"data.valid=[{{name: docs, path: {paths['valid']}}}]",
        f"train.max_steps={max_steps}", "train.micro_batch_size=8", "train.log_every=1",
        "train.eval_every=0", "train.eval_batches=0", "data.max_len=64", "data.view_max_len=32",
        "data.num_workers=0", f"checkpoint.every={checkpoint_every}", f"checkpoint.keep_last={keep_last}", *extra,
    ]


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the run's train records; a step logged twice keeps its last record."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split", "train") == "train" and "loss" in rec:
            losses[rec["step"]] = rec["loss"]
    return losses


def num_steps(run_dir: Path) -> int:
    """Steps logged so far (0 before the run wrote any, or while a line is half-written)."""
    try:
        return len(train_losses(run_dir))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
