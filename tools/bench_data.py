"""Data-path benchmark: the sample index — cold build (+ cache write), warm start and per-process RSS.

Synthetic datasets of N sentences (sizes 5-40 tokens, documents of 1-60 sentences, shards of 5e7
sentences): real ``.idx`` files and a sparse ``.bin`` (no token data is written), so 1e8 sentences cost
~1.3 GB of index on disk. Each measurement runs in a fresh process: open the dataset, build or load the
sample index (``load_or_build_sample_index``), report wall time and the growth of anonymous RSS (not counting the page cache of the
memory-mapped files) over an empty dataset;
the same row also times the pure-Python packer on the first 1e7 sentences for the per-sentence ratio.

    python tools/bench_data.py --sentences 1e6 1e7 1e8 [--dir /tmp/bench-data] [--json PATH]

Not measured here yet (see tools/bench_augment.py for the sample pipeline): augmentation and loader
throughput, preprocessing MB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARD_SENTENCES = 50_000_000


def _rss_mib() -> float:
    """Anonymous resident memory (RSS minus file-backed pages: the memory-mapped index files are page
    cache, shared by every process on the node and reclaimable)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_synthetic(directory: Path, num_sentences: int, seed: int = 0) -> None:
    """manifest.json + shard-NNNNN.{idx,bin}: a valid dataset whose .bin files are sparse (all zeros)."""
    sys.path.insert(0, str(ROOT))
    from pretrain.data.indexed import _CODE_OF, _HEADER, MAGIC, VERSION
    from pretrain.data.shards import write_manifest

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for k, start in enumerate(range(0, num_sentences, SHARD_SENTENCES)):
        n = min(SHARD_SENTENCES, num_sentences - start)
        sizes = rng.integers(5, 41, size=n).astype("<i4")
        doc = np.concatenate([[0], np.cumsum(rng.integers(1, 61, size=n // 30 + 1))])
        doc = np.append(doc[doc < n], n).astype("<i8")
        offsets = np.zeros(n, dtype="<i8")
        np.cumsum(sizes[:-1], out=offsets[1:])
        num_tokens = int(offsets[-1] + sizes[-1])
        name = f"shard-{k:05d}"
        with open(directory / f"{name}.idx", "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[np.dtype(np.uint16)], n, len(doc) - 1, num_tokens))
            f.write(offsets.tobytes())
            f.write(doc.tobytes())
            f.write(sizes.tobytes())
        with open(directory / f"{name}.bin", "wb") as f:
            f.truncate(num_tokens * 2)
        shards.append({"name": name, "num_sequences": n, "num_documents": len(doc) - 1, "num_tokens": num_tokens})
    write_manifest(directory, {"tokenizer": {"sha256": "synthetic", "vocab_size": 30522, "path": "none"},
                               "dtype": "uint16", "shards": shards, "synthetic": True,
                               "num_sequences": num_sentences})


def measure_one(directory: str, budget: int) -> dict:
    """In this (fresh) process: open the dataset and its sample index; seconds and RSS growth."""
    sys.path.insert(0, str(ROOT))
    from pretrain.data.datasets import load_or_build_sample_index
    from pretrain.data.shards import ShardedDataset

    base = _rss_mib()
    t0 = time.perf_counter()
    src = ShardedDataset(directory)
    t_open = time.perf_counter() - t0
    first, end, path = load_or_build_sample_index(src, budget)
    n_samples = len(first)
    _ = int(first[n_samples // 2]) + int(end[-1])  # touch it, as a first batch would
    return {"seconds": time.perf_counter() - t0, "open_s": t_open, "rss_mib": _rss_mib() - base,
            "samples": n_samples, "cached": path is not None}


def python_ns_per_sentence(directory: str, budget: int, limit: int = 10_000_000) -> float:
    sys.path.insert(0, str(ROOT))
    from pretrain.data.datasets import build_sample_index_py
    from pretrain.data.shards import ShardedDataset

    shard = ShardedDataset(directory).shards[0]
    n = min(limit, len(shard))
    doc = np.asarray(shard.doc_idx)
    doc = np.append(doc[doc < n], n)
    t0 = time.perf_counter()
    build_sample_index_py(np.asarray(shard.sizes[:n]), doc, budget)
    return (time.perf_counter() - t0) / n * 1e9


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    p.add_argument("--dir", default="/tmp/pretrain-bench-data")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the synthetic datasets")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--python-ns", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    budget = args.max_len - 2
    if args.one:
        print(json.dumps(measure_one(args.one, budget)))
        return 0
    if args.python_ns:
        print(json.dumps({"ns": python_ns_per_sentence(args.python_ns, budget)}))
        return 0
    print(f"load average {os.getloadavg()[0]:.2f}; budget {budget} tokens; one fresh process per cell")
    rows = []
    for n in map(int, args.sentences):
        d = Path(args.dir) / f"n{n:.0e}".replace("+", "")
        shutil.rmtree(d, ignore_errors=True)
        write_synthetic(d, n)
        empty = _child(["--one", str(_empty_dataset(Path(args.dir)))])
        cold = _child(["--one", str(d)])
        warm = _child(["--one", str(d)])
        py_ns = _child(["--python-ns", str(d)])["ns"]
        rows.append({"sentences": n, "cold_s": cold["seconds"], "warm_s": warm["seconds"],
                     "open_s": warm["open_s"], "rss_mib": warm["rss_mib"] - empty["rss_mib"],
                     "cold_rss_mib": cold["rss_mib"] - empty["rss_mib"], "samples": cold["samples"],
                     "cold_ns_per_sentence": cold["seconds"] / n * 1e9, "python_ns_per_sentence": py_ns})
        r = rows[-1]
        print(f"{n:>12,} sentences: cold {r['cold_s']:.2f}s ({r['cold_ns_per_sentence']:.1f} ns/sentence; "
              f"Python packer {py_ns:.0f} ns/sentence), warm {r['warm_s']:.2f}s (of which dataset open "
              f"{r['open_s']:.2f}s), RSS +{r['rss_mib']:.0f} MiB warm / +{r['cold_rss_mib']:.0f} MiB cold",
              flush=True)
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    print("\n| sentences | cold build s | ns/sentence (C) | ns/sentence (Python) | warm start s | RSS MiB (warm) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['sentences']:.0e} | {r['cold_s']:.2f} | {r['cold_ns_per_sentence']:.1f} | "
              f"{r['python_ns_per_sentence']:.0f} | {r['warm_s']:.2f} | {r['rss_mib']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"index": rows}, indent=1))
    return 0


def _empty_dataset(root: Path) -> Path:
    d = root / "empty"
    if not (d / "manifest.json").is_file():
        write_synthetic(d, 30)
    return d


if __name__ == "__main__":
    raise SystemExit(main())
