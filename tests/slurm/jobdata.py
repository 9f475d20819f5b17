"""What the Slurm tests train: a small corpus through the quickstart's own steps, and the tiny run's overrides."""

from __future__ import annotations

from pathlib import Path


def prepare(root: Path) -> dict:
    """A small corpus -> tokenizer -> train/valid shards under ``root`` (paths of each)."""
    from pretrain.data.embedded import write_embedded_corpus
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
