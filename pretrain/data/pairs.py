"""Reading supervised pairs for the sentence stage (``data.pairs``): (anchor, positive[, hard negative]) rows.

Supervised SimCSE (Gao et al. 2021, Sec. 4) trains on NLI triples: a premise, an entailed hypothesis (its
positive) and a contradicting one (its hard negative). A sample is the anchor (with MLM / triplet views when those
terms are on, as ``SentenceDataset``'s sentence), its positive and, when the file has a third column, its hard
negative; the pair the terms compare is (anchor, positive) instead of one sentence twice.

Formats (by the file name, after a compression suffix: gzip, zstd, bzip2 and xz are read):
  .tsv    tab-separated, 2 or 3 fields a line; an optional header row of column names (HEADER_NAMES)
  .csv    RFC 4180 (quoted fields may hold commas, quotes, newlines), same columns (SimCSE's nli_for_simcse.csv
          with its sent0,sent1,hard_neg header reads as is)
  .jsonl  one JSON object a line, {"anchor": .., "positive": .., "negative": ..} ("negative" optional), or a
          list of 2 or 3 strings
``read_pairs`` reads them; ``pretrain.data.sentences.PairDataset`` makes the samples. Blank lines are skipped. Every row has the same number of columns as the first; a row that does not (or has an
empty field, or is not valid JSON) is a ValueError naming the file and line. Rows are held in memory (NLI: 275k
triples); sentences are tokenized per sample in the loader's workers.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from pretrain.data.containers import STREAM_ERRORS, identify, open_stream, stream_error

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}
"""File suffix -> reader."""

HEADER_NAMES = frozenset({"anchor", "positive", "negative", "hard_negative", "sent0", "sent1", "hard_neg"})
"""A first tsv/csv row made only of these (any case) is a header, not a pair."""

JSON_KEYS = ("anchor", "positive", "negative")
COLUMNS = ("anchor", "positive", "hard negative")


@dataclass
class PairRows:
    anchor: list[str]
    positive: list[str]
    negative: list[str] | None
    """None when the file has two columns."""

    def __len__(self) -> int:
        return len(self.anchor)


def read_pairs(path: str) -> PairRows:
    """The rows of a pairs file (see the module docstring); FileNotFoundError / ValueError naming file and line."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"data.pairs={path} does not exist; give a .tsv, .csv or .jsonl file of "
                                "(anchor, positive[, hard negative]) rows")
    try:
        container = identify(path)
    except ValueError as e:
        raise ValueError(f"data.pairs: {e}") from None
    fmt = FORMATS.get(Path(container.inner_name).suffix.lower())
    if container.columnar or fmt is None:
        raise ValueError(f"data.pairs={path}: cannot tell the format from the name; name it *.tsv, *.csv or *.jsonl "
                         "(optionally compressed: .gz, .zst, .bz2, .xz)")
    rows: list[list[str]] = []
    # utf-8-sig: a file's BOM (Excel's CSV export) is dropped, not read into the first field (it would make the
    # header row a pair), as the preprocessing readers drop it.
    with io.TextIOWrapper(open_stream(path, container.compression), encoding="utf-8-sig", errors="replace",
                          newline="" if fmt == "csv" else None) as f:
        try:
            for line_no, fields in READERS[fmt](f, path):
                _check_row(fields, rows, path, line_no)
                rows.append(fields)
        except STREAM_ERRORS as e:
            raise stream_error(path, container.compression, e) from None
    if not rows:
        raise ValueError(f"data.pairs={path} holds no rows; each line should be anchor, positive[, hard negative]")
    columns = list(zip(*rows))
    return PairRows(anchor=list(columns[0]), positive=list(columns[1]),
                    negative=list(columns[2]) if len(columns) == 3 else None)


def _check_row(fields: list[str], rows: list, path: str, line_no: int) -> None:
    where = f"data.pairs: {path}:{line_no}"
    if len(fields) not in (2, 3):
        raise ValueError(f"{where}: expected 2 or 3 columns (anchor, positive[, hard negative]), got {len(fields)}")
    for name, text in zip(COLUMNS, fields):
        if not text:
            raise ValueError(f"{where}: the {name} is empty")
    if rows and len(fields) != len(rows[0]):
        raise ValueError(f"{where}: {len(fields)} columns, but the first row has {len(rows[0])}; every row needs "
                         "the same columns (a file with hard negatives needs one on every row)")


def _is_header(fields: list[str]) -> bool:
    return all(x.lower() in HEADER_NAMES for x in fields)


def _tsv_rows(f, path: str):
    first = True
    for line_no, line in enumerate(f, start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        fields = [x.strip() for x in line.split("\t")]
        if first and _is_header(fields):
            first = False
            continue
        first = False
        yield line_no, fields


def _csv_rows(f, path: str):
    reader = csv.reader(f, strict=True)
    first = True
    start = 1
    try:
        for record in reader:
            line_no, start = start, reader.line_num + 1  # the record's first line
            if not any(x.strip() for x in record):
                continue
            fields = [x.strip() for x in record]
            if first and _is_header(fields):
                first = False
                continue
            first = False
            yield line_no, fields
    except csv.Error as e:
        raise ValueError(f"data.pairs: {path}:{reader.line_num}: not valid CSV ({e})") from None


def _jsonl_rows(f, path: str):
    for line_no, line in enumerate(f, start=1):
        if not line.strip():
            continue
        where = f"data.pairs: {path}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if isinstance(row, dict):
            missing = [k for k in JSON_KEYS[:2] if k not in row]
            if missing:
                raise ValueError(f"{where}: the object has no {' or '.join(repr(k) for k in missing)} key; each "
                                 f"line is {{\"anchor\": .., \"positive\": .., \"negative\": ..}} (negative optional)")
            row = [row[k] for k in JSON_KEYS if k in row]
        if not isinstance(row, list) or not all(isinstance(x, str) for x in row):
            raise ValueError(f"{where}: expected an object with string anchor/positive[/negative] or a list of 2-3 "
                             f"strings, got {line.strip()[:80]!r}")
        yield line_no, [x.strip() for x in row]


READERS = {"tsv": _tsv_rows, "csv": _csv_rows, "jsonl": _jsonl_rows}
