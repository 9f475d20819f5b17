"""How each text format becomes documents: the line reader (BOM, CRLF, oversized and non-UTF-8 lines counted),
format detection, and the text / Gutenberg / WikiExtractor / jsonl parsers (``readers.py`` plans the files and
streams them through these; the formats themselves are described there)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

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
    first_bad_utf8: str = ""
    """Where the first line skipped or replaced for invalid UTF-8 is ("PATH: invalid UTF-8 at byte offset N", as
    strict mode names it); "" if none. Not part of ``as_dict``."""

    def count(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def as_dict(self) -> dict:
        return {"files": self.files, "bytes": self.bytes, "empty_files": list(self.empty_files),
                "skipped": dict(sorted(self.skipped.items()))}


def _iter_lines(f: BinaryIO, path: str, stats: ReadStats, *, max_line_bytes: int,
                errors: str, base: int = 0, where: str = "") -> Iterator[tuple[str, int]]:
    """Decoded lines (without EOL) and the byte position after each; bad lines are skipped and counted. ``base``:
    where ``f`` starts in the file (a range read by a worker); only a file's first line may start with a BOM.
    ``where`` qualifies byte offsets in messages (" of the decompressed stream")."""
    pos = base
    first = base == 0
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
        line = decode_utf8(raw, errors, stats,
                           lambda e, start=start: f"{path}: invalid UTF-8 at byte offset {start + e.start}{where}")
        if line is not None:
            yield line.rstrip("\r\n"), pos


def decode_utf8(raw: bytes, errors: str, stats, where) -> str | None:
    """``raw`` as UTF-8 under the ``--errors`` policy: strict raises ValueError with ``where(e)`` (the place, named
    by the reader) and the remedy; skip counts it and returns None; replace counts it and decodes with U+FFFD."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise ValueError(f"{where(e)}; fix the file or re-run with --errors replace or --errors skip") from None
        stats.count("invalid_utf8" if errors == "skip" else "replaced_utf8")
        stats.first_bad_utf8 = stats.first_bad_utf8 or where(e)
        return None if errors == "skip" else raw.decode("utf-8", errors="replace")


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


def _read_wikiextractor(lines: Iterator[tuple[str, int]], path: str, stats: ReadStats, *,
                        ends_before_doc: bool = False) -> Iterator[Document]:
    """``ends_before_doc``: the lines stop right before a ``<doc`` line (a range cut there), whose arrival would
    close the current document as the whole file's reading does."""
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
    if ends_before_doc:  # what the next <doc line does to the current state (the first branch above)
        if in_doc:
            stats.count("unclosed_doc")
            if paragraphs:
                yield Document(paragraphs, path, 0)
    elif paragraphs:
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
    """One document per JSON object's string ``text_field``; other lines are skipped and counted (``bad_json``;
    ``check_jsonl_head`` has refused a file whose first lines are all such)."""
    for line, pos in lines:
        if not line.strip():
            continue
        obj = _parse_json(line)
        text = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            stats.count("bad_json")
            continue
        # Split at "\n" only, as a .txt file's lines and a parquet row's are (str.splitlines would also cut at
        # \r, form feeds, NEL, U+2028, ...): the same text gives the same paragraphs in every format.
        paragraphs = [p.strip() for p in text.split("\n") if p.strip()]
        if paragraphs:
            yield Document(paragraphs, path, pos)


_JSONL_HEAD_LINES = 100
_JSONL_HEAD_BYTES = 1 << 20


def check_jsonl_head(lines: Iterator[tuple[str, int]], path: str, text_field: str) -> None:
    """ValueError, naming the first bad line and why, when none of a jsonl file's first non-empty lines (up to
    100, or 1 MB) is a JSON object with a string ``text_field``: a wrong ``--text-field`` or a ``.json`` file
    holding one array would otherwise vanish as a ``bad_json`` count. Checked once per file, before it is read."""
    bad, first_bad = 0, None
    for line, pos in lines:
        if not line.strip():
            continue
        obj = _parse_json(line)
        if isinstance(obj, dict) and isinstance(obj.get(text_field), str):
            return
        bad += 1
        first_bad = first_bad or (pos, _why_not_a_record(obj, text_field))
        if bad >= _JSONL_HEAD_LINES or pos >= _JSONL_HEAD_BYTES:
            break
    if first_bad is not None:
        pos, why = first_bad
        raise ValueError(f"{path}: none of its first {bad} lines is a JSON object with a string {text_field!r} field "
                         f"(the first, ending at byte offset {pos}, {why}); pass the text field with "
                         f"--text-field NAME, or convert the file to JSON Lines (one object per line)")


def _parse_json(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return _NOT_JSON


_NOT_JSON = object()


def _why_not_a_record(obj, text_field: str) -> str:
    if obj is _NOT_JSON:
        return "is not JSON"
    if isinstance(obj, list):
        return "is a JSON array (a .json file holding one array: jq -c '.[]' FILE > FILE.jsonl)"
    if not isinstance(obj, dict):
        return f"is a JSON {type(obj).__name__}, not an object"
    if text_field not in obj:
        keys = ", ".join(list(obj)[:10]) or "none"
        return f"has no field {text_field!r} (its fields: {keys})"
    return f"has {text_field!r} of JSON type {type(obj[text_field]).__name__}, not a string"


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
