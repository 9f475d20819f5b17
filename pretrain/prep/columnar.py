"""Columnar inputs: parquet files and Arrow files (what ``datasets``' ``save_to_disk`` writes), streamed.

Every row's text column is one document; its lines are paragraphs, exactly as a ``.txt`` document's lines are
(split at ``\\n`` only, stripped, empty lines dropped), so the same text gives the same documents and sentences
whichever format it arrives in. A parquet file is read row group by row group, an Arrow file record batch by
record batch (memory-mapped): never a whole file in memory. A worker's part is a range of the file's rows of
about the chunk size: a run of small row groups (parquet) or record batches (arrow), or a slice of a big one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from pretrain.fsutil import inside
from pretrain.prep.formats import decode_utf8

STATE_FILE = "state.json"
"""Written by ``Dataset.save_to_disk`` beside its ``data-0000x-of-0000n.arrow`` files (their order)."""
DICT_FILE = "dataset_dict.json"
"""Written by ``DatasetDict.save_to_disk``: one sub-directory per split."""
_BATCH_ROWS = 64
"""Rows per record batch read from a parquet row group: small batches decode into small, reused buffers (the
planner's first pass over the 16 MB row group of the wiki articles took 0.06 s in batches of 64 rows, 0.12 s in
batches of 1024, in a fresh process: the time the workers wait before their first part)."""


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
    for n in names:  # the directory's own Arrow files (paths read from its state.json)
        inside(directory, n, listed_in=STATE_FILE, links=False)
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


def _is_text(tp) -> bool:
    """A string or binary type (any width; string views too), or a dictionary of one: what pandas categoricals and
    writers that dictionary-encode repeated values give; or type null: the column of a file whose texts are all
    missing, as pandas writes an object column holding only None (its rows are null texts, counted)."""
    import pyarrow as pa

    if pa.types.is_dictionary(tp):
        tp = tp.value_type
    return (pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_binary(tp)
            or pa.types.is_large_binary(tp) or pa.types.is_string_view(tp) or pa.types.is_null(tp))


def _text_column(path: str, schema, text_field: str) -> None:
    """ValueError unless ``schema`` has a string (or binary, or dictionary-encoded) column ``text_field``."""
    names = list(schema.names)
    if text_field not in names:
        raise ValueError(f"{path} has no column {text_field!r}; its columns are {', '.join(names) or '(none)'}; "
                         f"choose the text column with --text-field NAME")
    tp = schema.field(text_field).type
    if not _is_text(tp):
        raise ValueError(f"{path}: column {text_field!r} has type {tp}, not text; choose the text column with "
                         f"--text-field NAME (columns: {', '.join(names)})")


def check_text_column(path: str, kind: str, text_field: str) -> None:
    """ValueError unless the parquet or Arrow file ``path`` is readable and has the text column ``text_field``:
    its footer (parquet) or schema (Arrow) only, read before any file is processed."""
    import pyarrow.parquet as pq

    what = "parquet" if kind == "parquet" else "Arrow"
    with _named(path, what):
        schema = pq.read_schema(path) if kind == "parquet" else _open_arrow(path)[0]
    _text_column(path, schema, text_field)


# ---------------------------------------------------------------------------------------------------- planning


def plan_parquet(path: str, text_field: str, target_bytes: int,
                 max_slices: int = 64) -> Iterator[tuple[int, int, int]]:
    """(first row, end row, input bytes attributed) covering the file, each about ``target_bytes`` of uncompressed
    text column (``plan_rows``), planned lazily; the attributed bytes sum to the file size (for progress)."""
    import pyarrow.parquet as pq

    with _named(path, "parquet"):
        pf = pq.ParquetFile(path)
    _text_column(path, pf.schema_arrow, text_field)
    # The text column's index among the file's leaf columns (a struct or list column before it has several):
    # not its index among the Arrow fields.
    md = pf.metadata
    leaves = [j for j in range(md.num_columns) if md.schema.column(j).path == text_field]
    units = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        units.append((rg.num_rows, rg.column(leaves[0]).total_uncompressed_size if len(leaves) == 1
                      else rg.total_byte_size))

    def row_sizes(i: int):  # a group to be cut: one streamed pass over its text column for the rows' sizes
        with _named(path, "parquet"):
            return _lengths(pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=[i], columns=[text_field],
                                            use_threads=False), 0)

    return plan_rows(units, target_bytes, Path(path).stat().st_size, max_slices, row_sizes)


def _lengths(batches, column) -> "np.ndarray":
    """Text bytes of every row of these record batches' ``column`` (nulls: 0)."""
    import numpy as np

    parts = [_row_bytes(b.column(column)) for b in batches]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _row_bytes(array) -> "np.ndarray":
    """int64 bytes of each value of a string or binary ``array`` (nulls: 0), read off its offsets buffer: the
    planner's pass over a cut row group costs the decoding only (``pyarrow.compute``'s first call alone took
    0.3 s of the main process, while the workers waited for the plan). View types, which have no offsets, are
    cast to the large type first; dictionaries are decoded first."""
    import numpy as np
    import pyarrow as pa

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    tp, n, first = array.type, len(array), array.offset
    if pa.types.is_null(tp):
        return np.zeros(n, np.int64)
    if pa.types.is_string(tp) or pa.types.is_binary(tp):
        width = np.int32
    elif pa.types.is_large_string(tp) or pa.types.is_large_binary(tp):
        width = np.int64
    elif pa.types.is_binary_view(tp) or pa.types.is_string_view(tp):  # no offsets: as a large type
        return _row_bytes(array.cast(pa.large_binary() if pa.types.is_binary_view(tp) else pa.large_string()))
    else:
        raise TypeError(f"not a text column: {tp}")
    validity, offsets = array.buffers()[:2]
    if n == 0 or offsets is None:
        return np.zeros(n, np.int64)
    sizes = np.diff(np.frombuffer(offsets, dtype=width, count=first + n + 1)[first:]).astype(np.int64)
    if array.null_count and validity is not None:  # a null's slot may have a length: it holds no text
        valid = np.unpackbits(np.frombuffer(validity, np.uint8), count=first + n, bitorder="little")[first:]
        sizes[valid == 0] = 0
    return sizes


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


def plan_arrow(path: str, text_field: str, target_bytes: int,
               max_slices: int = 64) -> Iterator[tuple[int, int, int]]:
    """(first row, end row, input bytes attributed), as ``plan_parquet``, over the file's record batches."""
    with _named(path, "Arrow"):
        schema, batches = _open_arrow(path)
        _text_column(path, schema, text_field)
        batches = list(batches)  # memory-mapped: no copy, no decoding
        units = [(b.num_rows, b.column(text_field).nbytes) for b in batches]
    return plan_rows(units, target_bytes, Path(path).stat().st_size, max_slices,
                     lambda i: _lengths([batches[i]], text_field))


def plan_rows(units: list[tuple[int, int]], target_bytes: int, file_bytes: int,
              max_slices: int = 64, row_sizes=None) -> Iterator[tuple[int, int, int]]:
    """Parts of about ``target_bytes`` of text, as (first row, end row, file bytes attributed), from the file's
    units (row groups, record batches) given as (rows, text bytes): consecutive small units are joined, a unit
    larger than ``target_bytes`` is cut into row slices of about that size, at most ``max_slices`` (a parquet
    part's reader decodes its row group's pages from the group's start to the part's end, so k slices decode a
    group about (k+1)/2 times: ``pretrain-preprocess`` asks for 2 per worker, enough to keep every worker busy on
    a file of one big row group; 1 for one worker: no cut). ``row_sizes(i)``, where given, is unit i's text bytes
    row by row: its slices then hold equal text, not equal rows (rows are documents of any length: equal rows
    left one worker with 40% more text than the other on the wiki articles). File bytes are shared by text
    size.

    A generator: a unit is cut (``row_sizes``, a pass over its text) only when its parts are asked for, so the
    workers start on the first part while the rest of a file of many big row groups is still unplanned (planned
    all at once, a file of 20 groups of 100 MB had the main process decode 2 GB before any worker started)."""
    last_row = sum(rows for rows, _ in units)
    if last_row == 0:
        yield 0, 0, file_bytes
        return
    total = max(sum(size for _, size in units), 1)
    done = 0  # file bytes attributed so far; the last part takes the rest (the shares are floors)

    def share(text: int, last: bool) -> int:
        nonlocal done
        n = file_bytes - done if last else min(file_bytes * text // total, file_bytes - done)
        done += n
        return n

    row = start = acc = 0
    for i, (rows, size) in enumerate(units):
        if size > target_bytes and rows > 1 and max_slices > 1:
            if row > start:
                yield start, row, share(acc, False)
            k = min(rows, max_slices, -(-size // max(target_bytes, 1)))
            for a, b, text in _slices(row, rows, size, k, row_sizes(i) if row_sizes is not None else None):
                yield a, b, share(text, b == last_row)
            row += rows
            start, acc = row, 0
            continue
        row += rows
        acc += size
        if acc >= target_bytes:
            yield start, row, share(acc, row == last_row)
            start, acc = row, 0
    if row > start:
        yield start, row, share(acc, True)


def _slices(row: int, rows: int, size: int, k: int, sizes=None) -> list[tuple[int, int, int]]:
    """Unit rows ``row .. row + rows`` (``size`` text bytes) cut into ``k`` slices (first row, end row, text bytes):
    of equal text where the rows' ``sizes`` are known, else of equal rows; every slice holds a row at least."""
    import numpy as np

    if sizes is None or len(sizes) != rows or int(sizes.sum()) <= 0:
        cuts = [rows * j // k for j in range(k + 1)]
        return [(row + a, row + b, size * (b - a) // rows) for a, b in zip(cuts, cuts[1:])]
    cum = np.cumsum(sizes)
    cuts = [0]
    for j in range(1, k):  # the row at which the text before it first reaches j/k of the unit's
        cut = int(np.searchsorted(cum, cum[-1] * j / k, side="left")) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), rows - (k - j)))
    cuts.append(rows)
    text = [int(cum[b - 1] - (cum[a - 1] if a else 0)) for a, b in zip(cuts, cuts[1:])]
    return [(row + a, row + b, size * t // int(cum[-1])) for (a, b), t in zip(zip(cuts, cuts[1:]), text)]


# ---------------------------------------------------------------------------------------------------- reading


def _texts(path: str, column, stats, errors: str, row0: int, text_field: str) -> Iterator[str]:
    """The values of one text column chunk (rows ``row0 ..`` of the file) as str; nulls counted; invalid UTF-8
    (in a binary column, or in a string column written without validation) handled by ``errors`` as in text. A
    dictionary column is decoded first: its nulls are then the rows' nulls, counted alike."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
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
    """Paragraphs of each non-empty row of rows ``start .. end``, streamed in batches of rows from the row groups
    that hold them (pyarrow's own threads off: the worker processes are the parallelism)."""
    import pyarrow.parquet as pq

    with _named(path, "parquet"):
        pf = pq.ParquetFile(path)
    _text_column(path, pf.schema_arrow, text_field)
    if end <= start:
        return
    groups, first, row = [], 0, 0
    for i in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        if row < end and row + n > start:
            first = row if not groups else first
            groups.append(i)
        row += n
    batches = pf.iter_batches(batch_size=min(_BATCH_ROWS, end - start), row_groups=groups, columns=[text_field],
                              use_threads=False)
    row = first
    while row < end:
        with _named(path, "parquet"):  # a damaged page shows only when its row group is read
            batch = next(batches, None)
        if batch is None:
            return
        yield from _rows_of(path, batch.column(0), row, start, end, stats, errors, text_field, max_line_bytes)
        row += batch.num_rows


def read_arrow(path: str, start: int, end: int, stats, *, text_field: str, errors: str,
               max_line_bytes: int) -> Iterator[list[str]]:
    """Paragraphs of each non-empty row of rows ``start .. end`` of a memory-mapped Arrow file."""
    with _named(path, "Arrow"):
        schema, batches = _open_arrow(path)
    _text_column(path, schema, text_field)
    row = 0
    for batch in batches:
        if row >= end:
            break
        yield from _rows_of(path, batch.column(text_field), row, start, end, stats, errors, text_field,
                            max_line_bytes)
        row += batch.num_rows


def _rows_of(path: str, column, row0: int, start: int, end: int, stats, errors: str, text_field: str,
             max_line_bytes: int) -> Iterator[list[str]]:
    """The paragraphs of the rows of ``column`` (file rows ``row0 ..``) that fall in ``start .. end``."""
    a, b = max(start - row0, 0), min(end - row0, len(column))
    if a >= b:
        return
    for text in _texts(path, column.slice(a, b - a), stats, errors, row0 + a, text_field):
        paragraphs = paragraphs_of(text, stats, max_line_bytes)
        if paragraphs:
            yield paragraphs


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
