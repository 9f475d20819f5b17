"""Data-path benchmark: the sample pipeline, the loader hand-off, the sample index and preprocessing.

  augment     samples/s of masking + two CLEAR views + collate per augmentation (max_len 128, view_max_len 64,
              micro-batch 32, a 30522 WordPiece trained on the corpus), through ``build_loader`` in one process
  loader      the same through ``build_loader`` with 1 and 2 worker processes, per worker core, and the
              hand-off cost (1 - one worker / one process)
  handoff     (not by default) µs per task of the hand-off's own work in one process: shared-memory slots
              (``SlotRing``) beside pickled buffers (``PackedBatch``)
  prepare     (not by default) the training process's and the worker's CPU per sample through the loader with
              one worker (books, CLEAR's 128/64, BERT's WordPiece; --micro-batch, default 32; the recipe's 128
              with --micro-batch 128): the batch packed for the step (``training.step.host_facts``) in the
              training process, as before 2026-12-06, against packed by the worker (``HostFacts`` as the loader's
              ``prepare``) and received so
  index       the sample index (below)
  preprocess  ``pretrain-preprocess`` MB/s on 1 and on 2 cores beside raw ``tokenizers`` ``encode_batch``
              on the same lines and the same number of threads (each in a fresh process, interleaved); and the
              parquet column: the same wiki articles as one parquet file (one row per article, 1000 rows per row
              group), MB/s of its text beside raw ``encode_batch`` on the same rows' lines
  preprocess-rss  (not by default) peak RSS of ``pretrain-preprocess`` as the input grows (--rss-mb), for the
              wiki files as they are and, with --rss-formats, the same articles as parquet or one gzip stream

Index: synthetic datasets of N sentences (sizes 5-40 tokens, documents of 1-60 sentences, shards of 5e7
sentences): real ``.idx`` files and a sparse ``.bin`` (no token data is written), so 1e8 sentences cost
~1.3 GB of index on disk. Each measurement runs in a fresh process: open the dataset, build or load the
sample index (``load_or_build_sample_index``), report wall time and the growth of anonymous RSS (not counting
the page cache of the memory-mapped files) over an empty dataset; then, warm, the time and RSS to the first
training batch of the dataset blended 3:1 with itself through the sample order and ``build_loader``;
the same row also times the pure-Python packer on the first 1e7 sentences for the per-sentence ratio.

    python tools/bench_data.py [--parts augment loader index preprocess] [--sentences 1e6 1e7 1e8]
                               [--dir DIR] [--json PATH]

Run it on a quiet machine (it prints the load average): every figure is a rate of CPU-bound work.
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
    from pretrain.data.indexed import _CODE_OF, _HEADER, MAGIC, SAMPLING, VERSION, sampled_sha256
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
        shards.append({"name": name, "num_sequences": n, "num_documents": len(doc) - 1, "num_tokens": num_tokens,
                       **{f"{ext}_sampled_sha256": sampled_sha256(str(directory / f"{name}.{ext}"))
                          for ext in ("bin", "idx")}})  # checked at open, as a preprocessed dataset's
    write_manifest(directory, {"tokenizer": {"sha256": "synthetic", "vocab_size": 30522, "path": "none"},
                               "dtype": "uint16", "shards": shards, "sampled_sha256": dict(SAMPLING),
                               "synthetic": True, "num_sequences": num_sentences})


def measure_one(directory: str, budget: int, tokenizer: str = "") -> dict:
    """In this (fresh) process: open the dataset and its sample index; seconds and RSS growth. With a
    tokenizer, then on to the first training batch as the trainer gets it: the dataset blended 3:1 with
    itself (two sources, like wiki + books), the sample order, ``build_loader`` (no workers), one batch."""
    sys.path.insert(0, str(ROOT))
    from pretrain.data.sample_index import load_or_build_sample_index
    from pretrain.data.shards import ShardedDataset

    base = _rss_mib()
    t0 = time.perf_counter()
    src = ShardedDataset(directory)
    t_open = time.perf_counter() - t0
    index = load_or_build_sample_index(src, budget)
    n_samples = len(index)
    _ = index.ranges(np.array([n_samples // 2, n_samples - 1]))  # touch it, as a first batch would
    out = {"seconds": time.perf_counter() - t0, "open_s": t_open, "rss_mib": _rss_mib() - base,
           "samples": n_samples, "cached": index.path is not None}
    if tokenizer:
        from pretrain.config.data import DataConfig
        from pretrain.data.datasets import BlendedDataset, PretrainDataset
        from pretrain.data.loader import build_loader
        from pretrain.prep.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        cfg = DataConfig(max_len=budget + 2, view_max_len=64)
        parts = [PretrainDataset(ShardedDataset(directory), tok, cfg, seed=1) for _ in range(2)]
        blend = BlendedDataset(parts, [3.0, 1.0], seed=1)
        loader = build_loader(blend, seed=1, rank=0, world_size=1, micro_batch_size=32, start_sample=0,
                              num_workers=0, pad_id=tok.pad_id)
        batch = next(iter(loader))
        assert batch["input_ids"].shape[0] == 32
        out.update(first_batch_s=time.perf_counter() - t0, first_batch_rss_mib=_rss_mib() - base)
    return out


def _bench_tokenizer(root: Path) -> str:
    """A small WordPiece for the first-batch measurement (the synthetic shards hold token 0 only)."""
    sys.path.insert(0, str(ROOT))
    from pretrain.prep.tokenizer import train_tokenizer

    path = root / "first-batch-tokenizer.json"
    if not path.is_file():
        text = root / "first-batch-text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog . a sentence of words .\n" * 200)
        train_tokenizer([str(text)], str(path), kind="wordpiece", vocab_size=120, min_frequency=1)
    return str(path)


def python_ns_per_sentence(directory: str, budget: int, limit: int = 10_000_000) -> float:
    sys.path.insert(0, str(ROOT))
    from pretrain.data.sample_index import build_sample_index_py
    from pretrain.data.shards import ShardedDataset

    shard = ShardedDataset(directory).shards[0]
    n = min(limit, len(shard))
    doc = np.asarray(shard.doc_idx)
    doc = np.append(doc[doc < n], n)
    t0 = time.perf_counter()
    build_sample_index_py(np.asarray(shard.sizes[:n]), doc, budget)
    return (time.perf_counter() - t0) / n * 1e9


AUGMENT_METHODS = ("del-word", "del-span", "reorder", "del-span+reorder", "subs", "subs+del-span")
def _shared_corpus() -> Path:
    """corpus/ of the shared data, found by the rule every tool follows (pretrain.eval.find_data_dir:
    $PRETRAIN_DATA_DIR, else ../shared/data from here, then beside the repository)."""
    sys.path.insert(0, str(ROOT))
    from pretrain.eval import default_data_dir

    return Path(default_data_dir()) / "corpus"


SHARED = _shared_corpus()


def prepare_corpus(work: Path, corpus: str, vocab_size: int) -> tuple[str, str]:
    """(tokenizer path, dataset dir) for the augment/loader parts, built once under ``work``."""
    sys.path.insert(0, str(ROOT))
    from pretrain.prep.preprocess import preprocess
    from pretrain.prep.tokenizer import train_tokenizer

    tok, ds = work / f"tokenizer-{vocab_size}.json", work / f"dataset-{vocab_size}"
    if not tok.is_file():  # enough wiki text for the full vocabulary
        train_tokenizer([corpus, str(SHARED / "wiki")], str(tok), vocab_size=vocab_size, max_bytes=40_000_000)
    if not (ds / "manifest.json").is_file():
        preprocess([corpus], str(ds), str(tok), num_workers=1, progress=False, overwrite=True)
    return str(tok), str(ds)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loader_rate(tok_path: str, ds_dir: str, method: str, workers: int, batches: int, micro_batch: int) -> dict:
    """Samples per second (wall) through build_loader, after a warm-up that absorbs worker start-up, and the CPU
    seconds per sample of the process(es) that build the batches (the workers; the main process without) and of
    the main process: CPU time does not depend on what else shares the cores, so it prices the hand-off
    (packing + pickling in the worker, unpacking in the main process) where wall rates are noisy."""
    import itertools

    import torch

    from pretrain.config.data import AugmentConfig, DataConfig, SourceConfig
    from pretrain.data.datasets import build_dataset
    from pretrain.data.loader import build_loader
    from pretrain.prep.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(tok_path)
    cfg = DataConfig(tokenizer=tok_path, max_len=128, view_max_len=64, sources=[SourceConfig(name="c", path=ds_dir)],
                     augment=AugmentConfig(methods=method))
    dataset = build_dataset(cfg, tokenizer, seed=0)
    loader = build_loader(dataset, seed=0, rank=0, world_size=1, micro_batch_size=micro_batch, start_sample=0,
                          num_workers=workers, pad_id=tokenizer.pad_id)
    it = iter(loader)
    for _ in itertools.islice(it, 16):
        pass
    pids = [w.pid for w in getattr(loader.loader._iterator, "_workers", [])]
    cpu0, main0, t0 = [_cpu_s(p) for p in pids], time.process_time(), time.perf_counter()
    for _ in itertools.islice(it, batches):
        pass
    wall, main_cpu = time.perf_counter() - t0, time.process_time() - main0
    n = batches * micro_batch
    build_cpu = sum(_cpu_s(p) - c for p, c in zip(pids, cpu0)) if pids else main_cpu
    return {"rate": n / wall, "build_cpu_us": build_cpu / n * 1e6, "main_cpu_us": main_cpu / n * 1e6}


def preprocess_rate(tok_path: str, files: list[str], cores: int, out: str, mb: float | None = None) -> dict:
    """MB/s of ``pretrain-preprocess`` with ``cores`` workers (its own accounting of threads) and peak RSS (MiB)
    of the main process and of the largest worker. ``mb``: the input's MB of text when not its file sizes
    (parquet compresses)."""
    import resource

    from pretrain.prep.preprocess import preprocess

    mb = mb if mb is not None else sum(os.path.getsize(f) for f in files) / 1e6
    t0 = time.perf_counter()
    preprocess(files, out, tok_path, num_workers=cores, progress=False, overwrite=True)
    rate = mb / (time.perf_counter() - t0)
    return {"rate": rate, "rss_main_mib": _peak_rss_mib(),
            "rss_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def _peak_rss_mib() -> float:
    """This process's peak RSS since its exec (VmHWM). Not ru_maxrss: Linux carries the pre-exec high-water mark
    of the forked copy into it, so a cell started by a bench that had just written a 100 MB parquet file read
    ~270 MiB before it did anything."""
    import resource

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tokenizers_rate(tok_path: str, files: list[str]) -> float:
    """MB/s of raw ``tokenizers`` encode_batch over the files' lines (threads: RAYON_NUM_THREADS of the caller)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    lines = [ln for f in files for ln in Path(f).read_text(encoding="utf-8").splitlines() if ln.strip()]
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    t0 = time.perf_counter()
    for a in range(0, len(lines), 10_000):
        tok.encode_batch(lines[a:a + 10_000], add_special_tokens=False)
    return mb / (time.perf_counter() - t0)


def parquet_lines(path: str) -> list[str]:
    """The non-empty lines of the parquet file's text column (what raw ``tokenizers`` is timed on)."""
    import pyarrow.parquet as pq

    column = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return [ln for text in column for ln in text.split("\n") if ln.strip()]


def tokenizers_rate_lines(tok_path: str, lines: list[str], mb: float) -> float:
    """MB/s of raw ``tokenizers`` encode_batch over ``lines`` (``mb`` MB of text)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    t0 = time.perf_counter()
    for a in range(0, len(lines), 10_000):
        tok.encode_batch(lines[a:a + 10_000], add_special_tokens=False)
    return mb / (time.perf_counter() - t0)


def write_wiki_parquet(files: list[str], path: Path) -> float:
    """The wiki articles of ``files`` as one parquet file (``columnar.write_parquet``); returns its MB of text."""
    from pretrain.prep.columnar import write_parquet
    from pretrain.prep.readers import ReadStats, read_file

    total = 0

    def docs():  # streamed: 2 GB of input never sits in this process
        nonlocal total
        for f in files:
            for d in read_file(f, ReadStats()):
                total += len("\n".join(d.paragraphs).encode("utf-8"))
                yield d.paragraphs

    write_parquet(docs(), str(path), row_group_rows=1000)
    return total / 1e6


def write_wiki_gzip(files: list[str], path: Path) -> float:
    """The wiki articles of ``files`` as one gzip-compressed .txt stream (blank lines between articles, streamed);
    returns its MB of text."""
    import gzip

    from pretrain.prep.readers import ReadStats, read_file

    total = 0
    with gzip.open(path, "wb", compresslevel=6) as f:
        for name in files:
            for d in read_file(name, ReadStats()):
                data = ("\n".join(d.paragraphs) + "\n\n").encode("utf-8")
                total += len(data)
                f.write(data)
    return total / 1e6


def _child(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True,
                         env=None if env is None else {**os.environ, **env}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["augment", "loader", "index", "preprocess"],
                   choices=["augment", "loader", "handoff", "prepare", "index", "preprocess", "preprocess-rss"])
    p.add_argument("--corpus", default=str(SHARED / "books"), help="text for the augment/loader parts")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--methods", nargs="+", default=list(AUGMENT_METHODS))
    p.add_argument("--batches", type=int, default=400, help="micro-batches timed per cell")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per cell; the median is reported")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--preprocess-mb", type=float, default=20, help="MB of wiki text for the preprocess part")
    p.add_argument("--rss-mb", nargs="+", type=float, default=[100, 2000],
                   help="input sizes (MB) for the preprocess-rss part (not run by default: 2 GB take ~10 min)")
    p.add_argument("--rss-formats", nargs="+", default=["wiki"], choices=["wiki", "parquet", "gzip"],
                   help="inputs of the preprocess-rss part: the wiki files, one parquet file, one .txt.gz stream")
    p.add_argument("--sentences", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    p.add_argument("--dir", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrain"
                                        / "bench-data"), help="work directory (yours: refused if another user's)")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the synthetic datasets")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default="", help=argparse.SUPPRESS)
    p.add_argument("--python-ns", help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    budget = args.max_len - 2
    if args.one:
        print(json.dumps(measure_one(args.one, budget, args.tokenizer)))
        return 0
    if args.python_ns:
        print(json.dumps({"ns": python_ns_per_sentence(args.python_ns, budget)}))
        return 0
    if args.cell:
        print(json.dumps(_cell(json.loads(args.cell))))
        return 0
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores; one fresh process per cell")
    results: dict = {}
    import padding_share

    work = padding_share.work_dir(args.dir)
    if "augment" in args.parts or "loader" in args.parts:
        results.update(bench_pipeline(args, work))
    if "handoff" in args.parts:
        results["handoff"] = bench_handoff(args.micro_batch)
    if "prepare" in args.parts:
        results["prepare"] = bench_prepare(args.micro_batch)
    if "preprocess" in args.parts:
        results["preprocess"] = bench_preprocess(args, work)
    if "preprocess-rss" in args.parts:
        results["preprocess_rss"] = bench_preprocess_rss(args, work)
    if "index" in args.parts:
        results["index"] = bench_index(args, budget)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _cell(spec: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    if spec["kind"] == "loader":
        return loader_rate(spec["tok"], spec["ds"], spec["method"], spec["workers"], spec["batches"],
                           spec["micro_batch"])
    if spec["kind"] == "preprocess":
        return preprocess_rate(spec["tok"], spec["files"], spec["cores"], spec["out"], spec.get("mb"))
    if spec["kind"] == "tokenizers-parquet":
        return {"rate": tokenizers_rate_lines(spec["tok"], parquet_lines(spec["files"][0]), spec["mb"])}
    return {"rate": tokenizers_rate(spec["tok"], spec["files"])}


def bench_pipeline(args, work: Path) -> dict:
    tok, ds = prepare_corpus(work, args.corpus, args.vocab_size)
    base = {"kind": "loader", "tok": tok, "ds": ds, "batches": args.batches, "micro_batch": args.micro_batch}
    augment, loader = {}, {}
    print(f"\nsample pipeline: {Path(args.corpus).name}, vocab {args.vocab_size}, max_len 128, view_max_len 64, "
          f"micro-batch {args.micro_batch}; samples/s per core")
    print("| method | 1 process | 1 worker | 2 workers (per worker core) | hand-off cost (wall) | CPU µs/sample: "
          "1 process | worker | main with 1 worker | hand-off cost (CPU) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method in args.methods:
        def run(w: int) -> dict:
            cell = ["--cell", json.dumps({**base, "method": method, "workers": w})]
            cells = [_child(cell) for _ in range(args.repeats)]
            return {k: float(np.median([c[k] for c in cells])) for k in cells[0]}

        alone = run(0)
        augment[method] = alone["rate"]
        if "loader" in args.parts:
            one, two = run(1), run(2)
            w1, w2 = one["rate"], two["rate"] / 2
            cpu_cost = one["build_cpu_us"] / alone["build_cpu_us"] - 1
            loader[method] = {"workers_1": w1, "workers_2": w2, "cpu_us_1_process": alone["build_cpu_us"],
                              "cpu_us_worker": one["build_cpu_us"], "cpu_us_main": one["main_cpu_us"],
                              "handoff_cpu": cpu_cost}
        else:
            w1 = w2 = cpu_cost = float("nan")
            one = {"build_cpu_us": float("nan"), "main_cpu_us": float("nan")}
        print(f"| {method} | {augment[method]:,.0f} | {w1:,.0f} | {w2:,.0f} | {1 - w1 / augment[method]:.0%} | "
              f"{alone['build_cpu_us']:.0f} | {one['build_cpu_us']:.0f} | {one['main_cpu_us']:.0f} | {cpu_cost:.0%} |",
              flush=True)
    return {"augment": augment, **({"loader": loader} if "loader" in args.parts else {})}


def bench_handoff(micro_batch: int, tasks: int = 300) -> dict:
    """In one process, µs per task (CHUNK_SAMPLES samples of a max_len 128 / view 64 batch) of the worker's and
    the main process's shares of the hand-off: the shared-memory slot path (pack; copy out) beside the pickled
    PackedBatch path (pack + pickle; unpickle + unpack), without the queue itself."""
    import pickle

    import torch

    from pretrain.data.loader import CHUNK_SAMPLES, PackedBatch, SlotRing

    g = torch.Generator().manual_seed(0)

    def ids(t: int) -> torch.Tensor:
        return torch.randint(0, 30522, (micro_batch, t), generator=g)

    def batch() -> dict:
        def mask(t: int) -> torch.Tensor:
            return torch.ones(micro_batch, t, dtype=torch.bool)

        return {"input_ids": ids(128), "attention_mask": mask(128), "mlm_labels": ids(128),
                "view_a_ids": ids(64), "view_a_mask": mask(64), "view_b_ids": ids(64), "view_b_mask": mask(64),
                "source": torch.zeros(micro_batch, dtype=torch.int64)}

    batches = [batch() for _ in range(max(1, CHUNK_SAMPLES // micro_batch))]
    ring = SlotRing(1, 2)
    first = ring.pack(batches, 0)
    ring.unpack(first)
    timings = {"slot_worker": 0.0, "slot_main": 0.0, "packed_worker": 0.0, "packed_main": 0.0}
    for _ in range(tasks):
        t0 = time.perf_counter()
        chunk = pickle.loads(pickle.dumps(ring.pack(batches, 0)))  # what the queue carries: slot and layout
        t1 = time.perf_counter()
        ring.unpack(chunk)
        t2 = time.perf_counter()
        blob = pickle.dumps([PackedBatch(b) for b in batches])
        t3 = time.perf_counter()
        [p.unpack() for p in pickle.loads(blob)]
        t4 = time.perf_counter()
        for key, dt in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            timings[key] += dt / tasks * 1e6
    n = len(batches) * micro_batch
    print(f"\nhand-off work per task of {n} samples, one process (µs; the queue's pipe not included)")
    print("| path | worker: pack | main: receive | total | µs/sample |\n|---|---:|---:|---:|---:|")
    for name, key in (("shared-memory slot (SlotRing)", "slot"), ("pickled buffer (PackedBatch)", "packed")):
        w, m = timings[f"{key}_worker"], timings[f"{key}_main"]
        print(f"| {name} | {w:.0f} | {m:.0f} | {w + m:.0f} | {(w + m) / n:.2f} |")
    return timings


def bench_prepare(micro_batch: int, batches: int = 60, repeats: int = 5) -> dict:
    """Through ``build_loader`` with one worker, on the books (CLEAR's del-span+reorder views at 128/64, BERT's
    WordPiece; ``tools/padding_share.py``'s dataset) with the trainer's heap: CPU µs a sample of the training
    process and of the worker, and the wall rate, (a) the plain batch received and packed in the training process
    (``HostFacts`` called on it, as ``optimizer_step`` did before 2026-12-06) against (b) the batch the worker
    packed (``build_loader(prepare=HostFacts(...))``), received. Alternating, ``repeats`` fresh loaders each;
    medians."""
    import itertools

    import torch

    import padding_share
    from bench_step import set_heap
    from pretrain.config.data import AugmentConfig, DataConfig, SourceConfig
    from pretrain.data.datasets import build_dataset
    from pretrain.data.loader import build_loader
    from pretrain.prep.tokenizer import load_tokenizer
    from pretrain.training.step import HostFacts

    torch.set_num_threads(1)
    heap = set_heap("trainer")
    tok_path = padding_share.bert_tokenizer()
    ds = padding_share.prepare(padding_share.DEFAULT_WORK, tok_path, 20, ("books",))["books"]
    tok = load_tokenizer(tok_path)
    cfg = DataConfig(tokenizer=tok_path, max_len=128, view_max_len=64, sources=[SourceConfig(name="c", path=ds)],
                     augment=AugmentConfig(methods="del-span+reorder"))
    dataset = build_dataset(cfg, tok, seed=0)
    facts = HostFacts("groups", True)
    runs: dict = {"in_step": [], "by_worker": []}
    for _ in range(repeats):
        for arm in runs:
            loader = build_loader(dataset, seed=0, rank=0, world_size=1, micro_batch_size=micro_batch,
                                  start_sample=0, num_workers=1, pad_id=tok.pad_id,
                                  prepare=facts if arm == "by_worker" else None)
            it = iter(loader)
            for _ in itertools.islice(it, 8):  # the worker started, its slots mapped
                pass
            pids = [w.pid for w in loader.loader._iterator._workers]
            cpu0, main0, t0 = [_cpu_s(p) for p in pids], time.process_time(), time.perf_counter()
            for batch in itertools.islice(it, batches):
                if arm == "in_step":
                    facts(batch)
            wall, main = time.perf_counter() - t0, time.process_time() - main0
            n = batches * micro_batch
            worker = sum(_cpu_s(p) - c for p, c in zip(pids, cpu0))
            runs[arm].append((n / wall, main / n * 1e6, worker / n * 1e6))
            loader.close()
    med = {arm: [float(np.median([r[k] for r in rows])) for k in range(3)] for arm, rows in runs.items()}
    print(f"\nthe batch packed in the training process or by the worker: books, micro-batch {micro_batch}, CLEAR "
          f"128/64, one worker, {heap}; median of {repeats} loaders x {batches} batches")
    print("| packed | training process CPU µs/sample | ms/micro-batch | worker CPU µs/sample | samples/s (1 worker) |"
          "\n|---|---:|---:|---:|---:|")
    for arm, name in (("in_step", "in the step (before)"), ("by_worker", "by the worker")):
        rate, main, worker = med[arm]
        print(f"| {name} | {main:.1f} | {main * micro_batch / 1e3:.2f} | {worker:.1f} | {rate:,.0f} |")
    saved = med["in_step"][1] - med["by_worker"][1]
    print(f"training process: {saved:.1f} µs/sample less ({saved * micro_batch / 1e3:.2f} ms a micro-batch, "
          f"{saved / med['in_step'][1]:.0%})")
    return {arm: dict(zip(("rate", "main_cpu_us", "worker_cpu_us"), v)) for arm, v in med.items()}


def _wiki_files(mb: float) -> tuple[list[str], int]:
    """The first ~mb MB of the wiki corpus; past its end the same files again (inputs may repeat)."""
    every = sorted((SHARED / "wiki").rglob("wiki_*"))
    files, total = [], 0
    while total < mb * 1e6:
        f = every[len(files) % len(every)]
        files.append(str(f))
        total += f.stat().st_size
    return files, total


def bench_preprocess(args, work: Path) -> dict:
    """Interleaved repeats (preprocess, tokenizers, preprocess, ...) per core count; medians reported."""
    tok, _ = prepare_corpus(work, args.corpus, args.vocab_size)
    files, total = _wiki_files(args.preprocess_mb)
    out = str(work / "preprocessed")
    parquet = work / "wiki.parquet"
    parquet_mb = write_wiki_parquet(files, parquet)
    row = {"parquet_text_mb": round(parquet_mb, 2)}
    for cores in (1, 2):
        env = {"RAYON_NUM_THREADS": str(cores), "TOKENIZERS_PARALLELISM": "true" if cores > 1 else "false"}
        ours, raw, ours_pq, raw_pq = [], [], [], []
        for _ in range(args.repeats):
            ours.append(_child(["--cell", json.dumps({"kind": "preprocess", "tok": tok, "files": files,
                                                      "cores": cores, "out": out})])["rate"])
            raw.append(_child(["--cell", json.dumps({"kind": "tokenizers", "tok": tok, "files": files})],
                              env=env)["rate"])
            ours_pq.append(_child(["--cell", json.dumps({"kind": "preprocess", "tok": tok, "files": [str(parquet)],
                                                         "cores": cores, "out": out, "mb": parquet_mb})])["rate"])
            raw_pq.append(_child(["--cell", json.dumps({"kind": "tokenizers-parquet", "tok": tok,
                                                        "files": [str(parquet)], "mb": parquet_mb})], env=env)["rate"])
        row[f"cores_{cores}"], row[f"tokenizers_{cores}"] = float(np.median(ours)), float(np.median(raw))
        row[f"ratios_{cores}"] = [round(a / b, 3) for a, b in zip(ours, raw)]
        row[f"parquet_{cores}"], row[f"tokenizers_parquet_{cores}"] = float(np.median(ours_pq)), float(np.median(raw_pq))
        row[f"parquet_ratios_{cores}"] = [round(a / b, 3) for a, b in zip(ours_pq, raw_pq)]
    shutil.rmtree(out, ignore_errors=True)
    parquet.unlink(missing_ok=True)
    print(f"\npreprocess: {total / 1e6:.1f} MB of wiki, vocab {args.vocab_size}; MB/s, median of {args.repeats} "
          f"interleaved fresh processes")
    print("| cores | pretrain-preprocess | raw tokenizers encode_batch | ratio of medians | ratio per pair |\n"
          "|---:|---:|---:|---:|---|")
    for c in (1, 2):
        print(f"| {c} | {row[f'cores_{c}']:.2f} | {row[f'tokenizers_{c}']:.2f} | "
              f"{row[f'cores_{c}'] / row[f'tokenizers_{c}']:.0%} | "
              f"{', '.join(f'{r:.0%}' for r in row[f'ratios_{c}'])} |", flush=True)
    print(f"\npreprocess, parquet: the same articles, {parquet_mb:.1f} MB of text in one parquet file (1000 rows a "
          f"row group); MB of text/s\n"
          "| cores | pretrain-preprocess (parquet) | raw tokenizers on its lines | ratio of medians | ratio per pair |\n"
          "|---:|---:|---:|---:|---|")
    for c in (1, 2):
        print(f"| {c} | {row[f'parquet_{c}']:.2f} | {row[f'tokenizers_parquet_{c}']:.2f} | "
              f"{row[f'parquet_{c}'] / row[f'tokenizers_parquet_{c}']:.0%} | "
              f"{', '.join(f'{r:.0%}' for r in row[f'parquet_ratios_{c}'])} |", flush=True)
    return row


def bench_preprocess_rss(args, work: Path) -> list[dict]:
    """Peak RSS of pretrain-preprocess (2 workers) as the input grows (the wiki corpus repeated past its end)."""
    tok, _ = prepare_corpus(work, args.corpus, args.vocab_size)
    out = str(work / "preprocessed-rss")
    rows = []
    print("\npreprocess memory: 2 workers; peak RSS in MiB\n| input | input MB | MB/s | main process | "
          "largest worker |\n|---|---:|---:|---:|---:|")
    for fmt in args.rss_formats:
        for mb in args.rss_mb:
            files, total = _wiki_files(mb)
            text_mb = None
            if fmt == "parquet":
                text_mb = write_wiki_parquet(files, work / "rss.parquet")
                files = [str(work / "rss.parquet")]
            elif fmt == "gzip":
                text_mb = write_wiki_gzip(files, work / "rss.txt.gz")
                files = [str(work / "rss.txt.gz")]
            cell = _child(["--cell", json.dumps({"kind": "preprocess", "tok": tok, "files": files, "cores": 2,
                                                 "out": out, "mb": text_mb})])
            rows.append({"format": fmt, "input_mb": round(total / 1e6, 1), **cell})
            print(f"| {fmt} | {total / 1e6:,.0f} | {cell['rate']:.2f} | {cell['rss_main_mib']:.0f} | "
                  f"{cell['rss_worker_mib']:.0f} |", flush=True)
    for name in ("rss.parquet", "rss.txt.gz"):
        (work / name).unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    return rows


def bench_index(args, budget: int) -> list[dict]:
    print(f"\nsample index: budget {budget} tokens")
    rows = []
    tok = _bench_tokenizer(Path(args.dir))
    for n in map(int, args.sentences):
        d = Path(args.dir) / f"n{n:.0e}".replace("+", "")
        shutil.rmtree(d, ignore_errors=True)
        write_synthetic(d, n)
        os.sync()  # the synthetic files' writeback would otherwise slow the reads measured below
        empty = _child(["--one", str(_empty_dataset(Path(args.dir))), "--tokenizer", tok])
        cold = _child(["--one", str(d)])
        os.sync()
        warm = _child(["--one", str(d)])
        first = _child(["--one", str(d), "--tokenizer", tok])
        py_ns = _child(["--python-ns", str(d)])["ns"]
        rows.append({"sentences": n, "cold_s": cold["seconds"], "warm_s": warm["seconds"],
                     "open_s": warm["open_s"], "rss_mib": warm["rss_mib"] - empty["rss_mib"],
                     "cold_rss_mib": cold["rss_mib"] - empty["rss_mib"], "samples": cold["samples"],
                     "first_batch_s": first["first_batch_s"],
                     "first_batch_rss_mib": first["first_batch_rss_mib"] - empty["first_batch_rss_mib"],
                     "cold_ns_per_sentence": cold["seconds"] / n * 1e9, "python_ns_per_sentence": py_ns})
        r = rows[-1]
        print(f"{n:>12,} sentences: cold {r['cold_s']:.2f}s ({r['cold_ns_per_sentence']:.1f} ns/sentence; "
              f"Python packer {py_ns:.0f} ns/sentence), warm {r['warm_s']:.2f}s (of which dataset open "
              f"{r['open_s']:.2f}s), RSS +{r['rss_mib']:.0f} MiB warm / +{r['cold_rss_mib']:.0f} MiB cold; "
              f"first batch of a 3:1 blend {r['first_batch_s']:.2f}s, RSS +{r['first_batch_rss_mib']:.0f} MiB",
              flush=True)
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    print("\n| sentences | cold build s | ns/sentence (C) | ns/sentence (Python) | warm start s | RSS MiB (warm) "
          "| first batch s (warm, blend) | RSS MiB (first batch) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['sentences']:.0e} | {r['cold_s']:.2f} | {r['cold_ns_per_sentence']:.1f} | "
              f"{r['python_ns_per_sentence']:.0f} | {r['warm_s']:.2f} | {r['rss_mib']:.0f} | "
              f"{r['first_batch_s']:.2f} | {r['first_batch_rss_mib']:.0f} |")
    return rows


def _empty_dataset(root: Path) -> Path:
    d = root / "empty"
    if not (d / "manifest.json").is_file():
        write_synthetic(d, 30)
    return d


if __name__ == "__main__":
    raise SystemExit(main())
