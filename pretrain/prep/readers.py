"""Text sources → documents of paragraphs, streamed with bounded memory.

Formats (auto-detected per file, or forced with ``fmt``):
  text           blank lines separate documents; every line is a paragraph (one or more sentences).
  gutenberg      a ``.txt`` with ``*** START OF`` / ``*** END OF`` markers: header/footer dropped, the book
                 is one document, hard-wrapped lines are joined into paragraphs (a paragraph ends at a blank line).
  wikiextractor  ``<doc …>`` … ``</doc>``: one article = one document, one paragraph per line. The title line
                 right after ``<doc>`` is dropped (it repeats the ``title`` attribute) and so are section headings
                 (short lines ending in the only ``.`` of the line, e.g. ``History.``).
  jsonl          one JSON object per line; its ``text`` field is one document, newlines separate paragraphs.
  parquet        a parquet file (``columnar.py``): each row's ``text`` column is one document, its lines paragraphs.
  arrow          an Arrow file, e.g. of a ``datasets`` ``save_to_disk`` directory (given as the directory), as parquet.
Any text format may come compressed (gzip, zstd, bzip2, xz: ``containers.py``, by magic number); the format inside is
named by the file name without its ``.gz``/``.zst``/``.bz2``/``.xz``. Binary files are refused by what they are.
Bad input never crashes the stream silently: every skipped line is counted by reason in a ``ReadStats``.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from pretrain.data.containers import HEAD_BYTES, STREAM_ERRORS, identify, open_stream, read_or_raise, stream_error
from pretrain.prep import columnar
from pretrain.prep.formats import (
    _GUTENBERG_SCAN_LINES,
    Document,
    ReadStats,
    _iter_lines,
    _read_gutenberg,
    _read_jsonl,
    _read_text,
    _read_wikiextractor,
    _split_oversized,
    check_jsonl_head,
    detect_format,
)

FORMATS = ("auto", "text", "gutenberg", "wikiextractor", "jsonl", "parquet", "arrow")
COLUMNAR = ("parquet", "arrow")

_DOCS = re.compile(r"^(readme|licen[cs]e|copying|changelog|changes|citation|notice|authors|contributing)"
                   r"(\.[a-z0-9]+)?$", re.IGNORECASE)
"""A directory's own documentation (README.md, LICENSE, CITATION.cff, ...): not its text. A downloaded dataset
directory holds them beside its data files."""


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files and directories (recursed, sorted, hidden files and a directory's documentation (``_DOCS``) skipped,
    the latter with a warning naming them) → sorted list of files. A ``datasets`` ``save_to_disk`` directory
    (anywhere below) stands for its Arrow files, in its own order. A file given by name is always read."""
    files: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            docs = [f for f in found if _DOCS.match(Path(f).name)]
            if docs:
                warnings.warn(f"skipping {len(docs)} documentation file(s) in input directory {item}: "
                              f"{', '.join(docs[:5])}{', ...' if len(docs) > 5 else ''} (a dataset's README or "
                              f"license is not its text; pass such a file by name to read it)", stacklevel=2)
                skipped = set(docs)
                found = [f for f in found if f not in skipped]
            if not found:
                raise FileNotFoundError(f"input directory {item} contains no files"
                                        + (" besides documentation" if docs else ""))
            files.extend(_saved_datasets_expanded(p, found))
        elif p.is_file():
            files.append(str(p))
        else:
            raise FileNotFoundError(f"input {item} does not exist; pass existing files or directories")
    _refuse_repeats(files)
    return files


def _refuse_repeats(files: list[str]) -> None:
    """ValueError when one file is among ``files`` twice (given twice, a directory and a file in it, overlapping
    globs, a link to another input): its text would be in the dataset twice, silently."""
    seen: dict = {}
    for i, f in enumerate(files):
        st = os.stat(f)  # (a filesystem without inode numbers: by the resolved path)
        j = seen.setdefault((st.st_dev, st.st_ino) if st.st_ino else os.path.realpath(f), i)
        if j != i:
            first = files[j]
            raise ValueError(f"input file {f} is given twice" + (f" (also as {first})" if first != f else "")
                             + ": an input listed again, a directory and a file inside it, or a link to another "
                             "input; pass each file once (to weight a corpus, give its data.sources entry a weight)")


def _saved_datasets_expanded(root: Path, found: list[str]) -> list[str]:
    """``found`` (the sorted files under ``root``) with the files of each ``save_to_disk`` directory among them
    replaced, where the first of them was, by that directory's Arrow files (its JSON files are not text)."""
    known: dict[Path, list[str] | None] = {}
    out: list[str] = []
    for f in found:
        d = Path(f).parent
        while True:
            if d not in known:
                known[d] = columnar.saved_dataset_files(d)
            if known[d] is not None or d == root or root not in d.parents:
                break
            d = d.parent
        if known[d] is None:
            out.append(f)
        else:
            out.extend(known[d])
            known[d] = []  # listed once, at its first file
    return out


def check_input(path: str, *, fmt: str = "auto", max_line_bytes: int = 1_000_000, errors: str = "strict",
                text_field: str = "text") -> None:
    """ValueError for what reading ``path`` would refuse at its start (a binary file or an archive, lone-CR line
    ends, a jsonl file without a record, a columnar file without the text column), from its first bytes or its
    schema: every input is checked before the first is read, so that a bad one does not stop a run hours in.
    Empty files pass (they are skipped with a warning when read)."""
    _check_options(fmt, errors)
    if os.path.getsize(path) == 0:
        return
    kind, _ = sniff(path, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors, text_field=text_field)
    if kind in COLUMNAR:
        columnar.check_text_column(path, kind, text_field)


def _check_options(fmt: str, errors: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown input format {fmt!r}; choose one of {FORMATS}")
    if errors not in ("strict", "replace", "skip"):
        raise ValueError(f"errors must be 'strict', 'replace' or 'skip', got {errors!r}")


def sniff(path: str, *, fmt: str = "auto", max_line_bytes: int = 1_000_000,
          errors: str = "strict", text_field: str = "text") -> tuple[str, str]:
    """(format, compression) ``read_file`` reads ``path`` with. Columnar files (parquet, Arrow) and compression
    are told by magic number; a text format is ``fmt`` unless "auto", else from the extension (without a
    compression suffix) and the first valid non-empty line (a ``.txt`` with a ``*** START OF`` marker in its
    first lines is gutenberg). ValueError for binary files and archives, saying what they are, for lone-CR line
    endings, and for a jsonl file whose first lines hold no ``text_field`` (``check_jsonl_head``)."""
    container = identify(path)
    if container.columnar:
        if fmt not in ("auto", container.columnar):
            raise ValueError(f"{path} is a {container.columnar} file, not --format {fmt}; drop --format or pass "
                             f"--format {container.columnar}")
        return container.columnar, ""
    if fmt in COLUMNAR:
        raise ValueError(f"{path} is not a {fmt} file (its first bytes are not a {fmt} magic number)")
    comp = container.compression
    where = " of the decompressed stream" if comp else ""
    _refuse_lone_cr(path, comp)
    head: list[str] = []
    with open_stream(path, comp) as f:  # bad lines are counted when the file is read, not here
        try:
            pos = 0
            for line, pos in _iter_lines(f, path, ReadStats(), max_line_bytes=max_line_bytes, errors=errors,
                                         where=where):
                head.append(line)
                if line.strip() or len(head) >= _GUTENBERG_SCAN_LINES:
                    break
            first = next((x for x in head if x.strip()), "")
            kind = detect_format(container.inner_name, first) if fmt == "auto" else fmt
            if kind == "text" and fmt == "auto" and head:  # a marker in the lines after the first non-empty one
                seen = len(head)
                for line, _ in _iter_lines(f, path, ReadStats(), max_line_bytes=max_line_bytes, errors=errors,
                                           base=pos, where=where):
                    seen += 1
                    x = line.lstrip()
                    if x.startswith("*** START OF") or x.startswith("***START OF"):
                        return "gutenberg", comp
                    if seen >= _GUTENBERG_SCAN_LINES:
                        break
            if kind == "jsonl":  # a second pass from the start (the first stopped at the first non-empty line)
                with open_stream(path, comp) as g:
                    check_jsonl_head(_iter_lines(g, path, ReadStats(), max_line_bytes=max_line_bytes,
                                                 errors=errors, where=where), path, text_field)
        except STREAM_ERRORS as e:
            if not comp:
                raise
            raise stream_error(path, comp, e) from None
    return kind, comp


def _refuse_lone_cr(path: str, comp: str) -> None:
    """ValueError for text whose lines end in a lone CR (classic Mac OS): lines split at LF only, so the whole
    file would read as one line — its documents merged into one, or all of it skipped as a giant line."""
    with open_stream(path, comp) as f:
        head = read_or_raise(path, comp, f.read, HEAD_BYTES)
    num_cr = head.count(b"\r")
    if num_cr >= 2 and b"\n" not in head:
        after = f" after {comp} decompression" if comp else ""
        raise ValueError(f"{path} has lone CR (classic Mac) line endings: {num_cr} CRs and no LF in its "
                         f"first {len(head)} bytes{after}, so it would read as one line; convert them first "
                         f"(tr '\\r' '\\n' < FILE > FILE.txt)")


def sniff_format(path: str, *, fmt: str = "auto", max_line_bytes: int = 1_000_000, errors: str = "strict") -> str:
    """The format ``read_file`` reads ``path`` as (see ``sniff``)."""
    return sniff(path, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors)[0]


@dataclass(frozen=True)
class Part:
    """What one worker reads by itself: bytes ``start .. end`` of a plain text file, rows ``start .. end`` of a
    parquet or Arrow file, or a whole compressed stream (``compression``: read front to back)."""

    path: str
    start: int
    end: int
    kind: str
    ends_before_doc: bool = False
    compression: str = ""
    num_bytes: int = -1
    """Input file bytes this part accounts for (progress); -1: ``end - start``."""

    @property
    def input_bytes(self) -> int:
        return self.end - self.start if self.num_bytes < 0 else self.num_bytes


def plan_parts(path: str, target_bytes: int, *, fmt: str = "auto", max_line_bytes: int = 1_000_000,
               errors: str = "strict", text_field: str = "text", max_slices: int = 64) -> list[Part]:
    """The parts of one file, each about ``target_bytes``, that read one after another give exactly
    ``read_file``'s documents: byte ranges of a plain text file (``plan_ranges``), row ranges of a columnar file
    (``columnar.plan_parquet`` / ``plan_arrow``: a big row group cut into at most ``max_slices``), the whole
    stream of a compressed one. ``iter_parts`` gives them one at a time."""
    return list(iter_parts(path, target_bytes, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors,
                           text_field=text_field, max_slices=max_slices))


def iter_parts(path: str, target_bytes: int, *, fmt: str = "auto", max_line_bytes: int = 1_000_000,
               errors: str = "strict", text_field: str = "text", max_slices: int = 64) -> Iterator[Part]:
    """``plan_parts``, lazily: a columnar file's big row groups are cut (a pass over each one's text) only as
    their parts are reached, so preprocessing starts on the first part of a file of many big groups at once."""
    kind, comp = sniff(path, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors, text_field=text_field)
    if kind in COLUMNAR:
        plan = columnar.plan_parquet if kind == "parquet" else columnar.plan_arrow
        for a, b, n in plan(path, text_field, target_bytes, max_slices):
            yield Part(path, a, b, kind, num_bytes=n)
        return
    size = os.path.getsize(path)
    if comp:
        yield Part(path, 0, size, kind, compression=comp)
        return
    for a, b, before in plan_ranges(path, kind, target_bytes, max_line_bytes=max_line_bytes):
        yield Part(path, a, b, kind, before)


def read_part(part: Part, stats: ReadStats, *, max_line_bytes: int = 1_000_000, errors: str = "strict",
              text_field: str = "text", max_document_chars: int = 64_000_000) -> Iterator[Document]:
    """The documents of one part of ``plan_parts``; bad lines are counted in ``stats``."""
    if part.kind in COLUMNAR:
        read = columnar.read_parquet if part.kind == "parquet" else columnar.read_arrow
        rows = read(part.path, part.start, part.end, stats, text_field=text_field, errors=errors,
                    max_line_bytes=max_line_bytes)
        for doc in _split_oversized((Document(p, part.path, 0) for p in rows), stats, max_document_chars):
            doc.num_bytes = part.input_bytes
            yield doc
    elif part.compression:
        yield from _read_stream(part.path, part.kind, part.compression, stats, max_line_bytes=max_line_bytes,
                                errors=errors, text_field=text_field, max_document_chars=max_document_chars)
    else:
        yield from read_range(part.path, part.start, part.end, part.kind, stats, ends_before_doc=part.ends_before_doc,
                              max_line_bytes=max_line_bytes, errors=errors, text_field=text_field,
                              max_document_chars=max_document_chars)


def _read_stream(path: str, kind: str, compression: str, stats: ReadStats, **kwargs) -> Iterator[Document]:
    """A compressed text file's documents, decompressed front to back; a truncated or corrupt stream raises
    ``stream_error`` (the caller has not written anything of it: preprocessing aborts, leaving no dataset)."""
    with open_stream(path, compression) as f:
        try:
            yield from _documents(f, path, kind, stats, base=0, where=" of the decompressed stream", **kwargs)
        except STREAM_ERRORS as e:
            raise stream_error(path, compression, e) from None


def _documents(f, path: str, kind: str, stats: ReadStats, *, base: int, end: int = 0, ends_before_doc: bool = False,
               where: str = "", max_line_bytes: int = 1_000_000, errors: str = "strict", text_field: str = "text",
               max_document_chars: int = 64_000_000) -> Iterator[Document]:
    """The documents of the lines of ``f`` read as ``kind``; ``Document.num_bytes`` is the position after the
    document (``end`` for the last one of a range)."""
    lines = _iter_lines(f, path, stats, max_line_bytes=max_line_bytes, errors=errors, base=base, where=where)
    if kind == "wikiextractor":
        docs = _read_wikiextractor(lines, path, stats, ends_before_doc=ends_before_doc)
    elif kind == "gutenberg":
        docs = _read_gutenberg(lines, path)
    elif kind == "jsonl":
        docs = _read_jsonl(lines, path, stats, text_field)
    else:
        docs = _read_text(lines, path)
    for doc in _split_oversized(docs, stats, max_document_chars):
        if doc.num_bytes == 0:
            doc.num_bytes = end
        yield doc


class _Range:
    """A binary file read from its current position up to byte ``end`` (readline never crosses it)."""

    def __init__(self, f: BinaryIO, end: int):
        self.f, self.end = f, end

    def readline(self, size: int = -1) -> bytes:
        left = self.end - self.f.tell()
        if left <= 0:
            return b""
        return self.f.readline(left if size < 0 else min(size, left))


def plan_ranges(path: str, kind: str, target_bytes: int, *, max_line_bytes: int = 1_000_000) -> list[tuple[int, int, bool]]:
    """(start, end, ends_before_doc) byte ranges of about ``target_bytes`` covering the file, cut only where its
    reader starts afresh, so that reading the ranges one after another gives exactly ``read_file``'s documents:
    after a newline (jsonl), after a blank line (text), right before a ``<doc`` line (wikiextractor); a
    gutenberg book is one document, one range."""
    size = os.path.getsize(path)
    if kind == "gutenberg" or size <= target_bytes:
        return [(0, size, False)]
    out: list[tuple[int, int, bool]] = []
    start = 0
    with open(path, "rb") as f:
        while start < size:
            cut, before_doc = _next_cut(f, min(start + target_bytes, size), size, kind, max_line_bytes)
            out.append((start, cut, before_doc))
            start = cut
    return out


def _next_cut(f: BinaryIO, at: int, size: int, kind: str, max_line_bytes: int) -> tuple[int, bool]:
    """The first cut at or after byte ``at`` (see plan_ranges), or the end of the file."""
    if at >= size:
        return size, False
    f.seek(at - 1)
    if f.read(1) != b"\n":  # inside a line: skip the rest of it
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw or raw.endswith(b"\n"):
                break
    while True:
        line_start = f.tell()
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return size, False
        if kind == "jsonl":
            return line_start, False
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            # A giant line, which the reader skips whole: never a blank line or a <doc line, even when its first
            # bytes look like one (a run of spaces, "<doc " + 2 MB): to its end.
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(max_line_bytes + 1)
            continue
        if kind == "wikiextractor":
            head = raw.lstrip()
            if (head.startswith(b"<doc ") or head.startswith(b"<doc>")) and b"\x00" not in raw:  # (NUL: skipped)
                return line_start, True
        elif not raw.strip():  # text: a blank line ends the document before it
            return f.tell(), False


def read_range(path: str, start: int, end: int, kind: str, stats: ReadStats, *, ends_before_doc: bool = False,
               max_line_bytes: int = 1_000_000, errors: str = "strict", text_field: str = "text",
               max_document_chars: int = 64_000_000) -> Iterator[Document]:
    """The documents of bytes ``start .. end`` of a plain text file ``path`` read as ``kind`` (a range of
    ``plan_ranges``); bad lines are counted in ``stats``. ``Document.num_bytes`` is the file position after the
    document."""
    with open(path, "rb") as f:
        f.seek(start)
        yield from _documents(_Range(f, end), path, kind, stats, base=start, end=end, ends_before_doc=ends_before_doc,
                              max_line_bytes=max_line_bytes, errors=errors, text_field=text_field,
                              max_document_chars=max_document_chars)


def read_file(path: str, stats: ReadStats, *, fmt: str = "auto", max_line_bytes: int = 1_000_000,
              errors: str = "strict", text_field: str = "text",
              max_document_chars: int = 64_000_000) -> Iterator[Document]:
    """Stream one file as documents. Empty files are warned about and skipped (listed in ``stats``)."""
    _check_options(fmt, errors)
    if not open_input(path, stats):
        return
    kind, comp = sniff(path, fmt=fmt, max_line_bytes=max_line_bytes, errors=errors, text_field=text_field)
    kwargs = {"max_line_bytes": max_line_bytes, "errors": errors, "text_field": text_field,
              "max_document_chars": max_document_chars}
    if kind in COLUMNAR:  # the whole file as one part
        for part in iter_parts(path, 1 << 62, fmt=kind, text_field=text_field):
            yield from read_part(part, stats, **kwargs)
    elif comp:
        yield from _read_stream(path, kind, comp, stats, **kwargs)
    else:
        yield from read_range(path, 0, os.path.getsize(path), kind, stats, **kwargs)


def open_input(path: str, stats: ReadStats) -> bool:
    """Count an input file in ``stats``; False (with a warning, listed in ``stats``) when it is empty."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path} does not exist")
    size = os.path.getsize(path)
    stats.files += 1
    stats.bytes += size
    if size == 0:
        warnings.warn(f"skipping empty input file {path}", stacklevel=3)
        stats.empty_files.append(path)
        return False
    return True


def _chain(head: list[tuple[str, int]], rest: Iterator[tuple[str, int]]) -> Iterator[tuple[str, int]]:
    yield from head
    yield from rest


def iter_documents(inputs: list[str], stats: ReadStats | None = None, **kwargs) -> Iterator[Document]:
    """All documents of all inputs (files or directories), in sorted, deterministic order."""
    stats = stats if stats is not None else ReadStats()
    for path in expand_inputs(inputs):
        yield from read_file(path, stats, **kwargs)
