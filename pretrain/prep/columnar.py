"""Columnar inputs: parquet files and Arrow files (what ``datasets``' ``save_to_disk`` writes), streamed.

Every row's text column is one document; its lines are paragraphs, exactly as a ``.txt`` document's lines are
(split at ``\\n`` only, stripped, empty lines dropped), so the same text gives the same documents and sentences
whichever format it arrives in. A parquet file is read row group by row group, an Arrow file record batch by
record batch (memory-mapped): never a whole file in memory. A worker's part is a run of whole row groups
(parquet) or record batches (arrow) of about the chunk size; a row group larger than that is one part by itself.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from pretrain.prep.formats import decode_utf8

STATE_FILE = "state.json"
"""Written by ``Dataset.save_to_disk`` beside its ``data-0000x-of-0000n.arrow`` files (their order)."""
DICT_FILE = "dataset_dict.json"
"""Written by ``DatasetDict.save_to_disk``: one sub-directory per split."""
_BATCH_ROWS = 1024


def saved_dataset_files(directory: Path) -> list[str] | None:
    """The Arrow files of a ``save_to_disk`` directory in their order, or None when ``directory`` is not one;
    ValueError for a ``DatasetDict`` (its splits are separate datasets: pass one)."""
    if (directory / DICT_FILE).is_file():
        try:
            splits = json.loads((directory / DICT_FILE).read_text(encoding="utf-8")).get("splits", [])
        except (OSError, ValueError):
            splits = []
        example = directory / (splits[0] if splits else "train")
        raise ValueError(f"{directory} is a datasets DatasetDict with splits {splits}; pass one split's directory "
                         f"(e.g. {example}) so that held-out splits do not end up in the training data")
    state = directory / STATE_FILE
    if not state.is_file():
        return None
    try:
        files = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
        names = [f["filename"] for f in files]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} is a datasets save_to_disk directory but {missing[0]} listed in its "
                                f"{STATE_FILE} is missing; copy the whole directory again")
    return [str(directory / n) for n in names]


@contextlib.contextmanager
def _named(path: str, what: str):
    """pyarrow's errors on a damaged file (truncated download, not really parquet/Arrow) as a ValueError naming
    the file and what to do."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable {what} file ({e}); re-download or re-write it") from None


def _text_column(path: str, schema, text_field: str) -> None:
    """ValueError unless ``schema`` has a string (or binary) column ``text_field``."""
    import pyarrow as pa

    names = list(schema.names)
    if text_field not in names:
        raise ValueError(f"{path} has no column {text_field!r}; its columns are {', '.join(names) or '(none)'}; "
                         f"choose the text column with --text-field NAME")
    tp = schema.field(text_field).type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_binary(tp)
            or pa.types.is_large_binary(tp) or pa.types.is_string_view(tp)):
        raise ValueError(f"{path}: column {text_field!r} has type {tp}, not text; choose the text column with "
                         f"--text-field NAME (columns: {', '.join(names)})")


# ---------------------------------------------------------------------------------------------------- planning


def plan_parquet(path: str, text_field: str, target_bytes: int) -> list[tuple[int, int, int]]:
    """(first row group, end row group, input bytes attributed) covering the file, each about ``target_bytes`` of
    uncompressed text column; the attributed bytes sum to the file size (for progress)."""
    import pyarrow.parquet as pq

    with _named(path, "parquet"):
        pf = pq.ParquetFile(path)
    _text_column(path, pf.schema_arrow, text_field)
    col = pf.schema_arrow.get_field_index(text_field)
    sizes = []
    for i in range(pf.metadata.num_row_groups):
        rg = pf.metadata.row_group(i)
        sizes.append(rg.column(col).total_uncompressed_size if col < rg.num_columns else rg.total_byte_size)
    return _group(sizes, target_bytes, Path(path).stat().st_size)


def _open_arrow(path: str):
    """A record batch reader over a memory-mapped Arrow file (IPC file or stream format)."""
    import pyarrow as pa

    source = pa.memory_map(path, "r")
    if source.read(6) == b"ARROW1":
        source.seek(0)
        f = pa.ipc.open_file(source)
        return f.schema, (f.get_batch(i) for i in range(f.num_record_batches))
    source.seek(0)
    r = pa.ipc.open_stream(source)
    return r.schema, iter(r)


def plan_arrow(path: str, text_field: str, target_bytes: int) -> list[tuple[int, int, int]]:
    """(first record batch, end record batch, input bytes attributed), as ``plan_parquet``."""
    with _named(path, "Arrow"):
        schema, batches = _open_arrow(path)
        _text_column(path, schema, text_field)
        sizes = [b.column(text_field).nbytes for b in batches]  # memory-mapped: no copy, no decoding
    return _group(sizes, target_bytes, Path(path).stat().st_size)


def _group(sizes: list[int], target_bytes: int, file_bytes: int) -> list[tuple[int, int, int]]:
    """Consecutive runs of units (row groups, batches) of about ``target_bytes``; file bytes shared by size."""
    runs: list[tuple[int, int, int]] = []
    start, acc = 0, 0
    for i, s in enumerate(sizes):
        acc += s
        if acc >= target_bytes or i == len(sizes) - 1:
            runs.append((start, i + 1, acc))
            start, acc = i + 1, 0
    if not runs:
        return [(0, 0, file_bytes)]
    total = sum(r[2] for r in runs) or 1
    shares = [file_bytes * r[2] // total for r in runs]
    shares[-1] += file_bytes - sum(shares)
    return [(a, b, s) for (a, b, _), s in zip(runs, shares)]


# ---------------------------------------------------------------------------------------------------- reading


def _texts(path: str, column, stats, errors: str, row0: int, text_field: str) -> Iterator[str]:
    """The values of one text column chunk (rows ``row0 ..`` of the file) as str; nulls counted; invalid UTF-8
    (in a binary column, or in a string column written without validation) handled by ``errors`` as in text."""
    import pyarrow as pa

    values = None
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        try:
            values = column.to_pylist()
        except UnicodeDecodeError:  # a string column with invalid bytes: decode value by value below
            column = column.view(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    if values is not None:
        for value in values:
            if value is None:
                stats.count("null_text")
            else:
                yield value
        return
    for row, value in enumerate(column.to_pylist(), start=row0):
        if value is None:
            stats.count("null_text")
            continue
        value = decode_utf8(value, errors, stats, lambda e, row=row: (
            f"{path}: invalid UTF-8 in row {row} of column {text_field!r} at byte {e.start}"))
        if value is not None:
            yield value


def paragraphs_of(text: str, stats, max_line_bytes: int) -> list[str]:
    """The paragraphs a ``.txt`` reader makes of these lines: split at ``\\n``, stripped, empty ones dropped;
    lines with NUL bytes and lines longer than ``max_line_bytes`` are skipped and counted as the text reader
    counts them."""
    out = []
    for line in text.split("\n"):
        if len(line) * 4 > max_line_bytes and len(line.encode("utf-8")) > max_line_bytes:
            stats.count("giant_line")
            continue
        if "\x00" in line:
            stats.count("nul_bytes")
            continue
        s = line.strip()
        if s:
            out.append(s)
    return out


def read_parquet(path: str, start: int, end: int, stats, *, text_field: str, errors: str,
                 max_line_bytes: int) -> Iterator[list[str]]:
    """Paragraphs of each non-empty row of row groups ``start .. end``, streamed in batches of rows."""
    import pyarrow.parquet as pq

    with _named(path, "parquet"):
        pf = pq.ParquetFile(path)
    _text_column(path, pf.schema_arrow, text_field)
    if end <= start:
        return
    row = sum(pf.metadata.row_group(i).num_rows for i in range(start))
    batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=list(range(start, end)), columns=[text_field])
    while True:
        with _named(path, "parquet"):  # a damaged page shows only when its row group is read
            batch = next(batches, None)
        if batch is None:
            return
        for text in _texts(path, batch.column(0), stats, errors, row, text_field):
            paragraphs = paragraphs_of(text, stats, max_line_bytes)
            if paragraphs:
                yield paragraphs
        row += batch.num_rows


def read_arrow(path: str, start: int, end: int, stats, *, text_field: str, errors: str,
               max_line_bytes: int) -> Iterator[list[str]]:
    """Paragraphs of each non-empty row of record batches ``start .. end`` of a memory-mapped Arrow file."""
    with _named(path, "Arrow"):
        schema, batches = _open_arrow(path)
    _text_column(path, schema, text_field)
    row = 0
    for i, batch in enumerate(batches):
        if i >= end:
            break
        if i >= start:
            for text in _texts(path, batch.column(text_field), stats, errors, row, text_field):
                paragraphs = paragraphs_of(text, stats, max_line_bytes)
                if paragraphs:
                    yield paragraphs
        row += batch.num_rows


# ---------------------------------------------------------------------------------------------------- writing


def write_parquet(documents, path: str, *, text_field: str = "text", row_group_rows: int = 1000) -> int:
    """Write documents (each a list of paragraphs) as a parquet file, one row per document whose ``text_field``
    holds the paragraphs joined by newlines, ``row_group_rows`` rows per row group, streamed (for conversions and
    benchmarks; reading the file back gives the same documents). Returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(text_field, pa.string())])
    rows = 0
    batch: list[str] = []
    tmp = f"{path}.tmp"
    with pq.ParquetWriter(tmp, schema) as writer:
        for doc in documents:
            batch.append("\n".join(doc))
            if len(batch) == row_group_rows:
                writer.write_table(pa.table({text_field: batch}, schema=schema), row_group_size=row_group_rows)
                rows += len(batch)
                batch = []
        if batch:
            writer.write_table(pa.table({text_field: batch}, schema=schema), row_group_size=row_group_rows)
            rows += len(batch)
    Path(tmp).replace(path)
    return rows
