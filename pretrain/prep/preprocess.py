"""Raw text → sharded binary dataset (``pretrain-preprocess``).

The main process cuts every input file into parts of about ``chunk_chars`` bytes, only where its reader starts
afresh (``readers.plan_parts``: byte ranges of text, row ranges of parquet or Arrow files, a whole
compressed stream), and hands them to a ``multiprocessing`` pool (bounded window, results
consumed in submission order) whose workers read, parse, split sentences and tokenize their ranges themselves.
The main process writes shards in order, so the output is byte-identical for any worker count (and to reading
each file whole).
Everything is written into a hidden ``.<name>.partial-<host>-<pid>-<hex>`` directory which becomes ``out_dir``
only after ``manifest.json`` is written; a failed run leaves no dataset behind.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pretrain.console import one_line_warnings, show_progress
from pretrain.data.indexed import SAMPLING, IndexedDatasetBuilder, best_dtype
from pretrain.data.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    TOKEN_FREQ,
    file_sha256,
    verify_dataset,
    write_manifest,
)
from pretrain.fsutil import replace_dir
from pretrain.prep.outdir import prepare_out_dir
from pretrain.prep.readers import (
    COLUMNAR,
    FORMATS,
    Part,
    ReadStats,
    check_input,
    expand_inputs,
    iter_parts,
    open_input,
    read_part,
)
from pretrain.prep.sentence_split import sentence_spans, split_sentences  # noqa: F401 (re-exported)
from pretrain.prep.tokenizer import Tokenizer, load_tokenizer

# ----------------------------------------------------------------------------------------------------------
# Worker side: chunk of documents → flat token ids + per-sentence sizes + per-document sentence counts


@dataclass
class ChunkResult:
    flat_ids: np.ndarray      # int32 [T] all tokens of the chunk
    sizes: np.ndarray         # int32 [S] tokens per sentence
    doc_sentences: np.ndarray  # int64 [docs] sentences per document (0 = document dropped)
    num_chars: int
    short_sentences: int
    empty_sentences: int


class ChunkProcessor:
    """Sentence-splits and tokenizes chunks; one instance per worker process (or in-process)."""

    def __init__(self, tokenizer: Tokenizer, min_sentence_chars: int) -> None:
        self.tokenizer = tokenizer
        self.min_sentence_chars = min_sentence_chars

    def __call__(self, docs: list[list[str]]) -> ChunkResult:
        paragraphs = [p for doc in docs for p in doc]
        spans = [sentence_spans(p) for p in paragraphs]
        per_paragraph = np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))
        owner = np.repeat(np.repeat(np.arange(len(docs)), [len(doc) for doc in docs]), per_paragraph)
        chars = np.fromiter((b - a for sp in spans for a, b in sp), dtype=np.int64, count=len(owner))
        # Short sentences are cut out after tokenizing: whole paragraphs are encoded anyway (see encode_sentences).
        flat, sizes = self.tokenizer.encode_sentences(paragraphs, spans)
        long_enough = chars >= self.min_sentence_chars
        keep = long_enough & (sizes > 0)
        flat = flat[np.repeat(keep, sizes)]
        doc_sentences = np.bincount(owner[keep], minlength=len(docs))
        return ChunkResult(flat, sizes[keep].astype(np.int32), doc_sentences.astype(np.int64),
                           sum(map(len, paragraphs)), int((~long_enough).sum()),
                           int((long_enough & (sizes == 0)).sum()))


RangeTask = Part
"""What a worker reads, splits and tokenizes by itself (``readers.plan_parts``)."""


@dataclass
class Spilled:
    """The result of a part larger than a chunk (a compressed stream, a big row group), tokenized chunk by chunk:
    ``.npz`` files of ChunkResults, in order, in the output's temporary directory (read back and deleted one at a
    time by the main process)."""

    pieces: list[str]


def _run_task(task: RangeTask, processor: ChunkProcessor, read_kwargs: dict,
              spill: dict | None = None) -> tuple[ChunkResult | Spilled, dict]:
    """Read, split and tokenize one part: (its result, the lines it skipped by reason). A compressed stream (a
    part of any size), a columnar part larger than a chunk (a big row group) or a byte range much larger than one
    (a text file with no blank line to cut at: one sentence per line) is tokenized in chunks of about
    ``spill["chunk_chars"]`` characters (or one document, when larger), each but the last of a part that needs
    more than one written to ``spill["dir"]``, so that neither this process nor the main one holds a whole
    stream's tokens."""
    stats = ReadStats()
    docs = read_part(task, stats, **read_kwargs)
    in_one = spill is None or not (task.compression or task.kind in COLUMNAR
                                   or task.input_bytes > 2 * spill["chunk_chars"])
    if in_one:  # a byte range of about a chunk
        return processor([d.paragraphs for d in docs]), stats.skipped
    pieces: list[str] = []
    batch: list[list[str]] = []
    size = 0
    for doc in docs:
        if size >= spill["chunk_chars"]:  # more follows: this chunk goes to disk
            pieces.append(_spill(processor(batch), spill["dir"]))
            batch, size = [], 0
        batch.append(doc.paragraphs)
        size += sum(map(len, doc.paragraphs))
    if not pieces:  # the part was one chunk (a parquet part of small row groups): no spill
        return processor(batch), stats.skipped
    pieces.append(_spill(processor(batch), spill["dir"]))
    return Spilled(pieces), stats.skipped


def _spill(r: ChunkResult, directory: str) -> str:
    path = os.path.join(directory, f"spill-{os.getpid()}-{uuid.uuid4().hex}.npz")
    np.savez(path, flat_ids=r.flat_ids, sizes=r.sizes, doc_sentences=r.doc_sentences,
             counters=np.array([r.num_chars, r.short_sentences, r.empty_sentences], dtype=np.int64))
    return path


def _unspill(result: ChunkResult | Spilled) -> Iterator[ChunkResult]:
    """The ChunkResults of a result, a spilled one read back piece by piece (each file deleted once read)."""
    if isinstance(result, ChunkResult):
        yield result
        return
    for path in result.pieces:
        with np.load(path) as z:
            num_chars, short, empty = (int(x) for x in z["counters"])
            r = ChunkResult(z["flat_ids"], z["sizes"], z["doc_sentences"], num_chars, short, empty)
        os.unlink(path)
        yield r


_WORKER: dict = {}
"""Per-worker-process handle set by the pool initializer (the only process-level state here)."""


def _die_with(parent: int) -> None:
    """Linux: this worker is sent SIGTERM (which ends it without a word) when ``parent``, the process that started
    it, dies: a SIGKILLed or OOM-killed pretrain-preprocess otherwise left its workers finishing their parts (CPU for
    nothing) and then printing a BrokenPipeError traceback each, after the shell had its prompt back. Elsewhere,
    nothing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(0)


def _init_worker(tokenizer: Tokenizer, min_sentence_chars: int, read_kwargs: dict,
                 spill: dict | None = None, parent: int | None = None) -> None:
    """``tokenizer``: a forked worker gets the main process's object itself (fork passes the arguments without
    pickling; it has encoded nothing, so no thread pool is copied; loading it again cost each worker 0.06 s before
    its first part); a spawned one unpickles it, which loads the file and checks its SHA-256 (``Tokenizer``'s
    ``__setstate__``)."""
    if parent is not None:
        _die_with(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; avoid oversubscription
    _WORKER["processor"] = ChunkProcessor(tokenizer, min_sentence_chars)
    _WORKER["read_kwargs"] = read_kwargs
    _WORKER["spill"] = spill


def _run_in_worker(task: RangeTask) -> tuple[ChunkResult | Spilled, dict]:
    return _run_task(task, _WORKER["processor"], _WORKER["read_kwargs"], _WORKER["spill"])


def _map_ordered(tasks: Iterator[RangeTask], processor: ChunkProcessor, num_workers: int, read_kwargs: dict,
                 spill: dict | None = None) -> Iterator[tuple[ChunkResult | Spilled, dict, RangeTask]]:
    """(result, skipped lines, task) in input order; at most 4 tasks per worker in flight (bounded memory). The
    workers read their ranges themselves: the main process only plans the cuts and writes the shards."""
    if num_workers <= 1:  # one core: the tokenizer's own thread pool would make it two
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            for task in tasks:
                yield (*_run_task(task, processor, read_kwargs, spill), task)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        return
    # The first part is planned before the workers fork: they inherit what planning imported (pyarrow for a
    # columnar file) instead of each importing it on its first read, and the first task is ready when they are.
    tasks = iter(tasks)
    first = next(tasks, None)
    if first is None:
        return
    tasks = itertools.chain([first], tasks)
    with mp.get_context().Pool(num_workers, initializer=_init_worker,
                               initargs=(processor.tokenizer, processor.min_sentence_chars, read_kwargs,
                                         spill, os.getpid())) as pool:
        window: deque = deque()
        for task in tasks:
            window.append((pool.apply_async(_run_in_worker, (task,)), task))
            if len(window) >= 4 * num_workers:
                result, task = window.popleft()
                yield (*result.get(), task)
        while window:
            result, task = window.popleft()
            yield (*result.get(), task)


# ----------------------------------------------------------------------------------------------------------
# Main side: chunking, shard writing, publishing


class _ShardWriter:
    """Writes documents into shard-NNNNN builders, starting a new shard past ``shard_size_tokens``."""

    def __init__(self, directory: Path, vocab_size: int, shard_size_tokens: int) -> None:
        self.directory, self.vocab_size, self.shard_size_tokens = directory, vocab_size, shard_size_tokens
        self.shards: list[dict] = []
        self.builder: IndexedDatasetBuilder | None = None

    def add(self, r: ChunkResult) -> None:
        """The chunk's documents, in order; a shard ends after the document that takes it to
        ``shard_size_tokens``. The documents that go into one shard are written in one call (the main process
        writes every worker's output: per document, its Python overhead grew with the number of documents)."""
        n = len(r.doc_sentences)
        sent_end = np.cumsum(r.doc_sentences)
        tok_end = np.concatenate([[0], np.cumsum(r.sizes, dtype=np.int64)])[sent_end]  # tokens up to each doc's end
        d0 = 0  # the first document not written yet
        while d0 < n:
            if self.builder is None:
                left = np.flatnonzero(r.doc_sentences[d0:])
                if not left.size:  # only dropped documents are left: no shard is started for them
                    return
                d0 += int(left[0])
                self.builder = IndexedDatasetBuilder(str(self.directory / f"shard-{len(self.shards):05d}"),
                                                     self.vocab_size)
            t0, s0 = (int(tok_end[d0 - 1]), int(sent_end[d0 - 1])) if d0 else (0, 0)
            # The document that takes the shard to its size goes in last.
            last = int(np.searchsorted(tok_end, t0 + self.shard_size_tokens - self.builder.num_tokens, side="left"))
            d1 = min(last + 1, n)
            self.builder.add_documents(r.flat_ids[t0:tok_end[d1 - 1]], r.sizes[s0:sent_end[d1 - 1]],
                                       r.doc_sentences[d0:d1])
            d0 = d1
            if self.builder.num_tokens >= self.shard_size_tokens:
                self._finish()

    def _finish(self) -> None:
        name = Path(self.builder.prefix).name
        self.shards.append({"name": name, **self.builder.finalize()})
        self.builder = None

    def close(self) -> list[dict]:
        if self.builder is not None and self.builder.num_sequences:
            self._finish()
        elif self.builder is not None:
            self.builder.abort()
        return self.shards

    def abort(self) -> None:
        if self.builder is not None:
            self.builder.abort()


def _tasks(files: list[str], stats: ReadStats, chunk_bytes: int, *, fmt: str, max_line_bytes: int,
           errors: str, text_field: str, num_workers: int = 1) -> Iterator[RangeTask]:
    """The parts of every input file (about chunk_bytes each, cut where the reader starts afresh); files are
    counted in ``stats`` here, their lines by the workers."""
    for path in files:
        if not open_input(path, stats):
            continue
        yield from iter_parts(path, chunk_bytes, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors,
                              text_field=text_field, max_slices=2 * num_workers if num_workers > 1 else 1)


def _checked_inputs(inputs: list[str], **read) -> list[str]:
    """The input files (``expand_inputs``), each checked for what would stop the run when its turn came
    (``check_input``), before any work."""
    files = expand_inputs(inputs)
    for path in files:
        check_input(path, **read)
    return files


def _finish_report(report: dict, stats: ReadStats, elapsed: float) -> None:
    """The reader's counts, the wall time and the read rate added to ``report``."""
    report.update(stats.as_dict())
    report["elapsed_s"] = round(elapsed, 3)
    report["mb_per_s"] = round(stats.bytes / 1e6 / max(elapsed, 1e-9), 3)


def preprocess(inputs: list[str], out_dir: str, tokenizer_path: str, *, num_workers: int = 1,
               shard_size_tokens: int = 50_000_000, min_sentence_chars: int = 8, max_line_bytes: int = 1_000_000,
               errors: str = "strict", fmt: str = "auto", text_field: str = "text", chunk_chars: int = 1 << 20,
               overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenize ``inputs`` (files/dirs) into ``out_dir``; returns the manifest (its ``report`` has the counts)."""
    if num_workers < 1 or shard_size_tokens < 1:
        raise ValueError(f"num_workers and shard_size_tokens must be >= 1, got {num_workers} and {shard_size_tokens}")
    files = _checked_inputs(inputs, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors, text_field=text_field)
    tok = load_tokenizer(tokenizer_path)
    out = Path(out_dir)
    tmp = prepare_out_dir(out, overwrite, files)
    from tqdm import tqdm

    total_bytes = sum(os.path.getsize(f) for f in files)
    stats = ReadStats()
    writer = _ShardWriter(tmp, tok.vocab_size, shard_size_tokens)
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    report = dict.fromkeys(REPORT_COUNTS, 0)
    t0 = time.perf_counter()
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="preprocess",
               disable=not show_progress(progress), mininterval=1.0, smoothing=0.1)
    try:
        tasks = _tasks(files, stats, chunk_chars, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors,
                       text_field=text_field, num_workers=num_workers)
        read_kwargs = {"max_line_bytes": max_line_bytes, "errors": errors, "text_field": text_field}
        spill = {"dir": str(tmp), "chunk_chars": chunk_chars}
        done_bytes = 0
        for result, skipped, task in _map_ordered(tasks, ChunkProcessor(tok, min_sentence_chars), num_workers,
                                                  read_kwargs, spill):
            for reason, n in skipped.items():
                stats.count(reason, n)
            for r in _unspill(result):
                writer.add(r)
                _tally(report, counts, r)
            done_bytes += task.input_bytes
            bar.update(max(0, done_bytes - bar.n))
        bar.update(max(0, total_bytes - bar.n))
        bar.close()
        shards = writer.close()
        if report["tokens"] == 0:
            raise ValueError(f"no sentences were produced from {inputs} (report: {stats.as_dict()}); "
                             f"check {_no_sentences_hint(stats.skipped)}")
        _finish_report(report, stats, time.perf_counter() - t0)
        np.save(tmp / TOKEN_FREQ, counts.astype(np.float64) / counts.sum(), allow_pickle=False)
        settings = {"fmt": fmt, "min_sentence_chars": min_sentence_chars, "max_line_bytes": max_line_bytes,
                    "errors": errors, "text_field": text_field, "shard_size_tokens": shard_size_tokens,
                    "chunk_chars": chunk_chars, "num_workers": num_workers}
        manifest = _manifest(tok, tmp, shards, files, settings, report)
        write_manifest(tmp, manifest)
        replace_dir(tmp, out)  # never absent: the old content is removed only after
    except BaseException:
        bar.close()
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _no_sentences_hint(skipped: dict) -> str:
    """What to check when nothing came out, by what the readers skipped."""
    hints = ["the input format and --min-sentence-chars"]
    if skipped.get("giant_line"):
        hints.append("--max-line-bytes (lines longer were skipped)")
    if skipped.get("null_text"):
        hints.append("--text-field (its values were null)")
    return ", ".join(hints)


REPORT_COUNTS = ("documents", "sentences", "tokens", "characters", "short_sentences", "empty_sentences")
"""What ``preprocess`` counts over the chunks (manifest.json's ``report``, with the readers' counts)."""


def _tally(report: dict, counts: np.ndarray, r: ChunkResult) -> None:
    """Adds one chunk's documents, sentences, tokens, characters and skipped sentences to ``report`` and its
    token ids to the frequency ``counts``."""
    counts += np.bincount(r.flat_ids, minlength=len(counts))
    report["documents"] += int((r.doc_sentences > 0).sum())
    report["sentences"] += len(r.sizes)
    report["tokens"] += len(r.flat_ids)
    report["characters"] += r.num_chars
    report["short_sentences"] += r.short_sentences
    report["empty_sentences"] += r.empty_sentences


def _manifest(tok, tmp: Path, shards: list[dict], files: list[str], settings: dict, report: dict) -> dict:
    """manifest.json's content (pretrain/data/FORMAT.md) for the shards written to ``tmp``."""
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "tokenizer": {"path": os.path.abspath(tok.path), "sha256": tok.sha256, "kind": tok.kind,
                      "vocab_size": tok.vocab_size, "lowercase": tok.lowercase},
        "dtype": best_dtype(tok.vocab_size).name,
        "num_sequences": sum(s["num_sequences"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
        "sampled_sha256": dict(SAMPLING),  # how the shards' bin/idx_sampled_sha256 were taken (finalize)
        "token_freq": {"file": TOKEN_FREQ, "sha256": file_sha256(str(tmp / TOKEN_FREQ))},
        "settings": settings,
        "inputs": [{"path": os.path.abspath(f), "bytes": os.path.getsize(f)} for f in files],
        "report": report,
    }


def format_report(manifest: dict) -> str:
    """Human-readable summary of a manifest's report."""
    r = manifest["report"]
    lines = [f"documents={r['documents']:,} sentences={r['sentences']:,} tokens={r['tokens']:,} "
             f"shards={len(manifest['shards'])} files={r['files']} input={r['bytes'] / 1e6:.1f} MB "
             f"in {r['elapsed_s']:.1f}s ({r['mb_per_s']:.2f} MB/s)",
             f"dropped sentences: short={r['short_sentences']:,} empty_after_tokenization={r['empty_sentences']:,}"]
    if r["skipped"]:
        lines.append("skipped lines: " + ", ".join(f"{k}={v:,}" for k, v in r["skipped"].items()))
    for path in r["empty_files"]:
        lines.append(f"warning: empty input file skipped: {path}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console script ``pretrain-preprocess``; ``--verify DIR`` re-checks a dataset and exits 1 on problems."""
    ap = argparse.ArgumentParser(prog="pretrain-preprocess", description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", help="files or directories (.txt, .jsonl, WikiExtractor output, books, "
                                              ".parquet, datasets save_to_disk directories; text formats also "
                                              "as .gz/.zst/.bz2/.xz)")
    ap.add_argument("--tokenizer", help="tokenizer.json written by pretrain-tokenizer")
    ap.add_argument("--out", help="output dataset directory")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="cores to use: worker processes, each with a single-threaded tokenizer (1: in-process, "
                         "one thread); default: the cores this process may run on")
    ap.add_argument("--shard-size-tokens", type=float, default=50_000_000)
    ap.add_argument("--min-sentence-chars", type=int, default=8)
    ap.add_argument("--max-line-bytes", type=int, default=1_000_000)
    ap.add_argument("--errors", choices=("strict", "replace", "skip"), default="strict",
                    help="invalid UTF-8: stop with the file and byte offset (strict), replace bad bytes, or skip the line")
    ap.add_argument("--format", dest="fmt", choices=FORMATS, default="auto",
                    help="input format (auto: parquet/arrow and compression by magic number, text formats by "
                         "extension and first line)")
    ap.add_argument("--text-field", default="text",
                    help="JSON field (.jsonl) or column (parquet, arrow/datasets) holding the text")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--verify", metavar="DIR", help="re-check checksums and structure of a dataset and exit")
    args = ap.parse_args(argv)

    one_line_warnings("pretrain-preprocess")
    if args.verify:
        problems = verify_dataset(args.verify)
        for p in problems:
            print(f"BAD: {p}", file=sys.stderr)
        print(f"{args.verify}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if not args.inputs or not args.tokenizer or not args.out:
        ap.error("INPUT..., --tokenizer and --out are required (or use --verify DIR)")
    try:
        manifest = preprocess(args.inputs, args.out, args.tokenizer, num_workers=args.workers,
                              shard_size_tokens=int(args.shard_size_tokens),
                              min_sentence_chars=args.min_sentence_chars, max_line_bytes=args.max_line_bytes,
                              errors=args.errors, fmt=args.fmt, text_field=args.text_field,
                              overwrite=args.overwrite, progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"pretrain-preprocess: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, an I/O error: the partial output is gone, any old dataset untouched
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        print(f"pretrain-preprocess: error: {e}; nothing was published ({args.out} is as it was) and the "
              f"unfinished output was removed; "
              + (f"free space on the disk of {Path(args.out).resolve().parent} or choose another --out, "
                 f"then run again" if full else "fix the cause, then run again"), file=sys.stderr)
        return 2
    print(format_report(manifest))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
