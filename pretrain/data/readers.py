"""Text sources → documents of paragraphs, streamed with bounded memory.

Formats (auto-detected per file, or forced with ``fmt``):
  text           blank lines separate documents; every line is a paragraph (one or more sentences).
  gutenberg      a ``.txt`` with ``*** START OF`` / ``*** END OF`` markers: header/footer dropped, the book
                 is one document, hard-wrapped lines are joined into paragraphs (a paragraph ends at a blank line).
  wikiextractor  ``<doc …>`` … ``</doc>``: one article = one document, one paragraph per line. The title line
                 right after ``<doc>`` is dropped (it repeats the ``title`` attribute) and so are section headings
                 (short lines ending in the only ``.`` of the line, e.g. ``History.``).
  jsonl          one JSON object per line; its ``text`` field is one document, newlines separate paragraphs.
Bad input never crashes the stream silently: every skipped line is counted by reason in a ``ReadStats``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

FORMATS = ("auto", "text", "gutenberg", "wikiextractor", "jsonl")
_BOM = b"\xef\xbb\xbf"
_GUTENBERG_END_NOTE = re.compile(r"end of (the )?project gutenberg", re.IGNORECASE)
_GUTENBERG_SCAN_LINES = 400
"""Lines scanned at the start of a text file for a ``*** START OF`` marker."""


@dataclass
class Document:
    paragraphs: list[str]
    """Non-empty, stripped paragraphs; sentences never cross paragraph boundaries."""
    source: str
    """File the document came from."""
    num_bytes: int = 0
    """Input bytes consumed up to and including this document (for progress)."""


@dataclass
class ReadStats:
    """Counts of what the readers saw and skipped; merged into the preprocessing report."""

    files: int = 0
    bytes: int = 0
    empty_files: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped/modified lines by reason: giant_line, nul_bytes, invalid_utf8, replaced_utf8, bad_json, …"""

    def count(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def as_dict(self) -> dict:
        return {"files": self.files, "bytes": self.bytes, "empty_files": list(self.empty_files),
                "skipped": dict(sorted(self.skipped.items()))}


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files and directories (recursed, sorted, hidden files skipped) → sorted list of files."""
    files: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise FileNotFoundError(f"input directory {item} contains no files")
            files.extend(found)
        elif p.is_file():
            files.append(str(p))
        else:
            raise FileNotFoundError(f"input {item} does not exist; pass existing files or directories")
    return files


def _iter_lines(f: BinaryIO, path: str, stats: ReadStats, *, max_line_bytes: int,
                errors: str) -> Iterator[tuple[str, int]]:
    """Decoded lines (without EOL) and the byte position after each; bad lines are skipped and counted."""
    pos = 0
    first = True
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        start = pos
        pos += len(raw)
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            # Giant line: skip the rest of it without ever buffering more than max_line_bytes.
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(max_line_bytes + 1)
                pos += len(raw)
            stats.count("giant_line")
            first = False
            continue
        if first and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
            start += len(_BOM)
        first = False
        if b"\x00" in raw:
            stats.count("nul_bytes")
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if errors == "strict":
                raise ValueError(
                    f"{path}: invalid UTF-8 at byte offset {start + e.start}; fix the file or re-run with "
                    f"errors='replace' (--errors replace) or 'skip' (--errors skip)") from None
            if errors == "skip":
                stats.count("invalid_utf8")
                continue
            line = raw.decode("utf-8", errors="replace")
            stats.count("replaced_utf8")
        yield line.rstrip("\r\n"), pos


def detect_format(path: str, first_line: str) -> str:
    """Format of a file from its extension and first non-empty line."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if first_line.lstrip().startswith("<doc "):
        return "wikiextractor"
    return "text"


def _is_wiki_heading(line: str) -> bool:
    return line.endswith(".") and line.count(".") == 1 and len(line.split()) <= 6


def _read_wikiextractor(lines: Iterator[tuple[str, int]], path: str, stats: ReadStats) -> Iterator[Document]:
    paragraphs: list[str] = []
    in_doc = False
    need_title = False
    for line, pos in lines:
        s = line.strip()
        if s.startswith("<doc ") or s.startswith("<doc>"):
            if in_doc:
                stats.count("unclosed_doc")
                if paragraphs:
                    yield Document(paragraphs, path, pos)
            paragraphs, in_doc, need_title = [], True, True
        elif s == "</doc>":
            if paragraphs:
                yield Document(paragraphs, path, pos)
            paragraphs, in_doc = [], False
        elif not s:
            continue
        elif need_title:
            need_title = False
        elif _is_wiki_heading(s):
            stats.count("wiki_heading")
        else:
            if not in_doc:
                stats.count("text_outside_doc")
            paragraphs.append(s)
    if paragraphs:
        stats.count("unclosed_doc")
        yield Document(paragraphs, path, 0)


def _read_text(lines: Iterator[tuple[str, int]], path: str) -> Iterator[Document]:
    paragraphs: list[str] = []
    for line, pos in lines:
        s = line.strip()
        if s:
            paragraphs.append(s)
        elif paragraphs:
            yield Document(paragraphs, path, pos)
            paragraphs = []
    if paragraphs:
        yield Document(paragraphs, path, 0)


def _read_gutenberg(lines: Iterator[tuple[str, int]], path: str) -> Iterator[Document]:
    """Everything after ``*** START OF`` up to ``*** END OF``; hard-wrapped lines joined per paragraph."""
    started = False
    paragraphs: list[str] = []
    current: list[str] = []
    for line, _pos in lines:
        s = line.strip()
        if not started:
            started = s.startswith("*** START OF") or s.startswith("***START OF")
            continue
        if s.startswith("*** END OF") or s.startswith("***END OF"):
            break
        if _GUTENBERG_END_NOTE.match(s):  # "End of (the) Project Gutenberg's …" just before the END marker
            continue
        if s:
            current.append(s)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    if paragraphs:
        yield Document(paragraphs, path, 0)


def _read_jsonl(lines: Iterator[tuple[str, int]], path: str, stats: ReadStats,
                text_field: str) -> Iterator[Document]:
    for line, pos in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            text = obj[text_field]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            stats.count("bad_json")
            continue
        paragraphs = [p.strip() for p in text.splitlines() if p.strip()]
        if paragraphs:
            yield Document(paragraphs, path, pos)


def _split_oversized(docs: Iterator[Document], stats: ReadStats, max_document_chars: int) -> Iterator[Document]:
    """Cut documents longer than max_document_chars at paragraph boundaries (bounds worker memory)."""
    for doc in docs:
        total = sum(len(p) for p in doc.paragraphs)
        if total <= max_document_chars:
            yield doc
            continue
        part: list[str] = []
        size = 0
        for p in doc.paragraphs:
            if part and size + len(p) > max_document_chars:
                stats.count("document_split")
                yield Document(part, doc.source, 0)
                part, size = [], 0
            part.append(p)
            size += len(p)
        if part:
            yield Document(part, doc.source, doc.num_bytes)


def read_file(path: str, stats: ReadStats, *, fmt: str = "auto", max_line_bytes: int = 1_000_000,
              errors: str = "strict", text_field: str = "text",
              max_document_chars: int = 64_000_000) -> Iterator[Document]:
    """Stream one file as documents. Empty files are warned about and skipped (listed in ``stats``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown input format {fmt!r}; choose one of {FORMATS}")
    if errors not in ("strict", "replace", "skip"):
        raise ValueError(f"errors must be 'strict', 'replace' or 'skip', got {errors!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path} does not exist")
    size = os.path.getsize(path)
    stats.files += 1
    stats.bytes += size
    if size == 0:
        warnings.warn(f"skipping empty input file {path}", stacklevel=2)
        stats.empty_files.append(path)
        return
    with open(path, "rb") as f:
        lines = _iter_lines(f, path, stats, max_line_bytes=max_line_bytes, errors=errors)
        # Peek (bounded) to detect the format without losing lines.
        head: list[tuple[str, int]] = []
        for item in lines:
            head.append(item)
            if item[0].strip() or len(head) >= _GUTENBERG_SCAN_LINES:
                break
        first = next((s for s, _ in head if s.strip()), "")
        kind = detect_format(path, first) if fmt == "auto" else fmt
        if kind == "text":
            for item in lines:
                head.append(item)
                s = item[0].lstrip()
                if s.startswith("*** START OF") or s.startswith("***START OF"):
                    kind = "gutenberg" if fmt == "auto" else kind
                    break
                if len(head) >= _GUTENBERG_SCAN_LINES:
                    break
        if not head:  # every line was skipped (and counted) as bad input
            return
        all_lines = _chain(head, lines)
        if kind == "wikiextractor":
            docs = _read_wikiextractor(all_lines, path, stats)
        elif kind == "gutenberg":
            docs = _read_gutenberg(all_lines, path)
        elif kind == "jsonl":
            docs = _read_jsonl(all_lines, path, stats, text_field)
        else:
            docs = _read_text(all_lines, path)
        for doc in _split_oversized(docs, stats, max_document_chars):
            if doc.num_bytes == 0:
                doc.num_bytes = size
            yield doc


def _chain(head: list[tuple[str, int]], rest: Iterator[tuple[str, int]]) -> Iterator[tuple[str, int]]:
    yield from head
    yield from rest


def iter_documents(inputs: list[str], stats: ReadStats | None = None, **kwargs) -> Iterator[Document]:
    """All documents of all inputs (files or directories), in sorted, deterministic order."""
    stats = stats if stats is not None else ReadStats()
    for path in expand_inputs(inputs):
        yield from read_file(path, stats, **kwargs)
