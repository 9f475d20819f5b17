"""Throughput of the full sample pipeline (MLM masking + two CLEAR views + collate) per augmentation.

Trains a small WordPiece tokenizer on a text corpus (default: the shared Gutenberg books), preprocesses
it into shards once (cached under --work-dir), then for each method and worker count reads micro-batches
through ``build_loader`` and prints samples/s (after a warm-up that absorbs worker start-up).

    python tools/bench_augment.py [--corpus DIR] [--workers 0 1 2] [--batches 40]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch

from pretrain.config.data import AugmentConfig, DataConfig, SourceConfig
from pretrain.data.datasets import build_dataset
from pretrain.data.loader import build_loader
from pretrain.data.preprocess import preprocess
from pretrain.data.tokenizer import load_tokenizer, train_tokenizer

METHODS = ("del-word", "del-span", "reorder", "subs", "subs+del-span", "del-span+reorder")


def prepare(corpus: str, work_dir: Path, vocab_size: int) -> tuple[str, str]:
    """(tokenizer path, dataset dir), built once and reused from work_dir."""
    tok_path, ds_dir = work_dir / "tokenizer.json", work_dir / "books"
    if not tok_path.is_file():
        train_tokenizer([corpus], str(tok_path), vocab_size=vocab_size)
    if not (ds_dir / "manifest.json").is_file():
        preprocess([corpus], str(ds_dir), str(tok_path), num_workers=1, progress=False)
    return str(tok_path), str(ds_dir)


def bench(cfg: DataConfig, tokenizer, *, workers: int, batches: int, warmup: int,
          micro_batch: int) -> tuple[float, float]:
    """(samples per wall second, per main-process CPU second) of build_loader over ``batches``
    micro-batches after ``warmup`` ones. With 0 workers the CPU rate ignores contention from other jobs."""
    dataset = build_dataset(cfg, tokenizer, seed=0)
    loader = build_loader(dataset, seed=0, rank=0, world_size=1, micro_batch_size=micro_batch, start_sample=0,
                          num_workers=workers, pad_id=tokenizer.pad_id)
    it = iter(loader)
    for _ in itertools.islice(it, warmup):
        pass
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in itertools.islice(it, batches):
        pass
    n = batches * micro_batch
    return n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/data/corpus/books"))
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "pretrain_bench_augment"))
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    args = ap.parse_args(argv)
    if not Path(args.corpus).exists():
        raise FileNotFoundError(f"corpus {args.corpus} not found; pass --corpus DIR with .txt files")
    torch.set_num_threads(1)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tok_path, ds_dir = prepare(args.corpus, work, args.vocab_size)
    tokenizer = load_tokenizer(tok_path)
    print(f"corpus {args.corpus}  tokenizer vocab {tokenizer.vocab_size}  max_len {args.max_len}  "
          f"micro_batch {args.micro_batch}  batches {args.batches}")
    print(f"{'method':<18}" + "".join(f"{f'{w} workers':>12}" for w in args.workers)
          + f"{'0w per CPU-s':>14}   (samples/s)")
    for method in args.methods:
        cfg = DataConfig(tokenizer=tok_path, max_len=args.max_len, view_max_len=args.max_len,
                         sources=[SourceConfig(name="books", path=ds_dir)], augment=AugmentConfig(methods=method))
        rates = {w: bench(cfg, tokenizer, workers=w, batches=args.batches, warmup=args.warmup,
                          micro_batch=args.micro_batch) for w in args.workers}
        cpu = f"{rates[0][1]:>14.0f}" if 0 in rates else f"{'-':>14}"
        print(f"{method:<18}" + "".join(f"{rates[w][0]:>12.0f}" for w in args.workers) + cpu, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
