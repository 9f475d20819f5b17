"""``metrics.jsonl`` read back as columns: per split, the steps and each numeric key as one numpy array.

A run with ``train.log_every 1`` reaches 1e6 records (~500 MB of JSON). Read as Python dicts they made
``pretrain-report`` take 1.8 GB and 42 s; as columns they are an array per key, 8 MB per key per 1e6 records
(docs/operations.md, "The report of a long run"). The file is read a block of
lines at a time: pyarrow's JSON reader parses a block into columns (the writer's "nan"/"inf" strings as the
floats they stand for, as ``read_number`` reads them); a block it cannot take as the line reader would (a torn
last line, a line that is not a record, a key whose type changes, a duplicated key) is read a line at a time with
``json`` instead, with the same result.

Legend: N records of one split; a record is one JSON object with an int ``step`` and a ``split`` (default train).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.metrics.writer import NUMBER_WORDS, read_number

ROLLBACK = "rollback"
"""The split of the records ``training/spikes.py`` rollbacks write: two rollbacks to one checkpoint share its step."""

BLOCK_BYTES = 2 << 20
"""Bytes of ``metrics.jsonl`` parsed at a time (~4k records): the reader's memory beside the columns (8 MB: +30 MB
at 1e6 records, no faster)."""

_NON_FINITE = ((b': "nan"', b": NaN"), (b': "inf"', b": Infinity"), (b': "-inf"', b": -Infinity"))
"""How the writer stores a non-finite value (``json.dumps`` of ``str(float)``) and the JSON literals pyarrow reads."""

_INT64 = (-(1 << 63), 1 << 63)


@dataclass
class Records:
    """One split's records in file order: ``steps`` (N,) int64; per numeric key its values (N,) (int64 where every
    value was an int, else float64) and, for a key some records lack, where it is present (N,) bool; other values
    (text, lists, booleans) by row. ``records[i]`` is record i as a dict; ``series`` and ``last`` read the columns."""

    split: str
    steps: np.ndarray
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    present: dict[str, np.ndarray] = field(default_factory=dict)
    other: dict[int, dict] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> dict:
        i = range(len(self))[i]  # negative indices; IndexError past the end
        rec = {"step": int(self.steps[i]), "split": self.split}
        for key, values in self.columns.items():
            if key not in self.present or self.present[key][i]:
                rec[key] = values[i].item()
        rec.update(self.other.get(i, {}))
        return rec

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps (M,) int64, values (M,) float64) of the M records where ``key`` is a number."""
        values = self.columns.get(key)
        if values is None:
            return np.zeros(0, np.int64), np.zeros(0)
        values = values.astype(np.float64, copy=False)
        mask = self.present.get(key)
        return (self.steps, values) if mask is None else (self.steps[mask], values[mask])

    def last(self, key: str | None = None) -> dict | None:
        """The last record (with ``key`` a number, when given)."""
        if key is None:
            return self[-1]
        if key not in self.columns:
            return None
        mask = self.present.get(key)
        return self[-1] if mask is None else self[int(np.flatnonzero(mask)[-1])]


def read_metrics(path: str | Path, keys: dict[str, set[str]] | None = None) -> tuple[dict[str, Records], list[str]]:
    """Records of ``metrics.jsonl`` by split, and notes on what was skipped; ``keys`` {split: keys}: only those keys
    of those splits' records are kept (besides the step), to save memory.

    A torn last line (a run killed while writing) and lines that are not JSON objects with a step are skipped.
    When a split's step goes back (a relaunch that restarted from an earlier step without truncating the file),
    the later records supersede the earlier ones from that step on, as in the relaunched run's own curve.
    """
    path = Path(path)
    splits: dict[str, _Split] = {}
    notes: list[str] = []
    bad: list[int] = []
    lines_before = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size  # what is there now: the run may still be appending
        # the most records a split can have: its columns are made that long at once
        capacity = 1 + sum(block.count(b"\n") for block in _blocks(f, size))
        f.seek(0)
        for block in _blocks(f, size):
            by_split = _parse_arrow(block, keys)
            if by_split is None:
                by_split = _parse_lines(block, lines_before, path, keys, notes, bad)
            for split, part in by_split.items():
                splits.setdefault(split, _Split(split, capacity)).add(part)
            lines_before += block.count(b"\n")
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        notes.append(f"{path}: line(s) {shown} are not metrics records; skipped")
    import pyarrow as pa

    pa.default_memory_pool().release_unused()  # its allocator keeps what the blocks used; the plots can have it
    superseded = sum(split.superseded for split in splits.values())
    if superseded:
        notes.append(f"{path}: {superseded} record(s) superseded by a relaunch that restarted from an earlier step")
    return {name: split.records() for name, split in splits.items()}, notes


# ------------------------------------------------------------------------------------------------ one block

def _blocks(f, size: int):
    """The first ``size`` bytes of ``f`` from where it is, in blocks of about BLOCK_BYTES that end with a line (the
    last one where ``size`` ends)."""
    while (left := size - f.tell()) > 0 and (block := f.read(min(BLOCK_BYTES, left))):
        yield block if block.endswith(b"\n") else block + f.readline(size - f.tell())


@dataclass
class _Part:
    """One split's records of one block: as ``Records``, the columns without a mask where present everywhere."""

    steps: np.ndarray
    columns: dict[str, tuple[np.ndarray, np.ndarray | None]]
    other: dict[int, dict]


def _parse_arrow(block: bytes, keys: dict[str, set[str]] | None) -> dict[str, _Part] | None:
    """The block's records by split through pyarrow's JSON reader; None where the line reader must decide. Only
    ``pyarrow.json``: ``pyarrow.compute`` would cost ~35 MB once loaded, and numpy does the little needed here."""
    import pyarrow as pa
    import pyarrow.json as pj

    if not block.isascii():  # the writer's JSON is ASCII (\u escapes); pyarrow would take invalid UTF-8 as text
        return None
    for written, literal in _NON_FINITE:
        if written in block:
            block = block.replace(written, literal)
    try:
        table = pj.read_json(io.BytesIO(block), read_options=pj.ReadOptions(block_size=1 << 20))
    except pa.ArrowException:
        return None
    columns = {name: table[name] for name in table.column_names}
    step, split = columns.pop("step", None), columns.pop("split", None)
    if step is None or step.type != pa.int64() or step.null_count:
        return None  # a record without an int step: the line reader names the line
    if split is not None and (split.type != pa.string() or split.null_count):
        return None  # a split that is not text, or null ("None" to the line reader)
    for column in columns.values():
        if column.type in (pa.int64(), pa.float64()):
            continue
        if not _as_json(column.type):
            return None  # a timestamp (pyarrow's reading of a date), a float in a list (1 read as 1.0)
        if column.type == pa.string() and any(v is not None and v.lower() in NUMBER_WORDS for v in column.to_pylist()):
            return None  # "NaN", "Infinity": read_number makes them floats
    names = ["train"] if split is None else split.to_pylist()
    labels = np.array(names) if len(set(names)) > 1 else None
    rows = {s: None if labels is None else np.flatnonzero(labels == s) for s in dict.fromkeys(names)}  # None: all
    steps = _numbers(step)[0]
    parts = {s: _Part(steps if r is None else steps[r], {}, {}) for s, r in rows.items()}
    for name, column in columns.items():
        wanted = [s for s in rows if keys is None or s not in keys or name in keys[s]]
        if not wanted or column.null_count == len(column):
            continue
        if column.type not in (pa.int64(), pa.float64()):  # text, booleans, lists, objects: kept by row
            for i, v in enumerate(column.to_pylist()):
                s = names[0] if labels is None else names[i]
                if v is not None and s in wanted:
                    parts[s].other.setdefault(i if labels is None else int(np.searchsorted(rows[s], i)), {})[name] = v
            continue
        values, valid = _numbers(column)
        for s in wanted:
            v, m = (values, valid) if rows[s] is None else (values[rows[s]], None if valid is None else valid[rows[s]])
            if m is None or m.all():
                parts[s].columns[name] = (v, None)
            elif m.any():
                parts[s].columns[name] = (v, m)
    return parts


def _numbers(column) -> tuple[np.ndarray, np.ndarray | None]:
    """A pyarrow int64 or float64 column's values (N,) and, when it has nulls (records without the key), where it
    is valid (N,) bool, read from its buffers; a null's value is undefined."""
    import pyarrow as pa

    dtype = np.int64 if column.type == pa.int64() else np.float64
    values, valid = [np.zeros(0, dtype)], [np.zeros(0, bool)]
    for chunk in column.chunks:
        if not len(chunk):
            continue
        bitmap, data = chunk.buffers()
        start, stop = chunk.offset, chunk.offset + len(chunk)
        values.append(np.frombuffer(data, dtype, count=stop)[start:])
        if column.null_count:
            valid.append(np.ones(len(chunk), bool) if bitmap is None else np.unpackbits(
                np.frombuffer(bitmap, np.uint8, count=(stop + 7) // 8), bitorder="little")[start:stop].astype(bool))
    return np.concatenate(values), np.concatenate(valid) if column.null_count else None


def _as_json(t) -> bool:
    """Whether values of the pyarrow type ``t`` come back from ``to_pylist`` as ``json.loads`` reads them."""
    import pyarrow as pa

    if pa.types.is_list(t):
        return _as_json(t.value_type)
    if pa.types.is_struct(t):
        return all(_as_json(t.field(i).type) for i in range(t.num_fields))
    return t in (pa.int64(), pa.string(), pa.bool_(), pa.null())


def _parse_lines(block: bytes, lines_before: int, path: Path, keys: dict[str, set[str]] | None, notes: list[str],
                 bad: list[int]) -> dict[str, _Part]:
    """The block's records by split, a line at a time (``bad``: numbers of lines that are not records)."""
    rows: dict[str, list[dict]] = {}
    lines = block.split(b"\n")
    for n, raw in enumerate(lines, lines_before + 1):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or not _INT64[0] <= step < _INT64[1]:
            if n == lines_before + len(lines):  # the file's last line, without its newline
                notes.append(f"{path}: the last line is incomplete (the run was stopped while writing it); skipped")
            else:
                bad.append(n)
            continue
        rec = {k: read_number(v) for k, v in rec.items()}
        rows.setdefault(str(rec.get("split", "train")), []).append(rec)
    return {split: _rows_part(split_rows, (keys or {}).get(split)) for split, split_rows in rows.items()}


def _rows_part(rows: list[dict], keep: set[str] | None) -> _Part:
    columns, other = {}, {}
    for name in dict.fromkeys(k for r in rows for k in r):
        if name in ("step", "split") or (keep is not None and name not in keep):
            continue
        values = [r.get(name) for r in rows]
        numbers = [v if _is_number(v) else None for v in values]
        for i, v in enumerate(values):
            if v is not None and numbers[i] is None:
                other.setdefault(i, {})[name] = v
        if all(v is None for v in numbers):
            continue
        ints = all(v is None or type(v) is int and _INT64[0] <= v < _INT64[1] for v in numbers)
        mask = None if None not in numbers else np.array([v is not None for v in numbers])
        columns[name] = (np.array([0 if v is None else v for v in numbers], np.int64 if ints else np.float64), mask)
    return _Part(np.array([r["step"] for r in rows], np.int64), columns, other)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ------------------------------------------------------------------------------------------------ all blocks

class _Split:
    """One split's records as they are read, in columns of ``capacity`` rows made when a key first appears (pages
    never written take no memory), so a long history is neither copied nor joined from pieces."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity, self.num_rows, self.superseded = name, capacity, 0, 0
        self.steps = np.empty(capacity, np.int64)
        self.columns: dict[str, np.ndarray] = {}
        self.present: dict[str, np.ndarray] = {}
        self.other: dict[int, dict] = {}

    def add(self, part: _Part) -> None:
        """Appends ``part``'s records after dropping those they supersede: a record stays unless a later one has a
        step <= its step (< for rollbacks, which may share one)."""
        steps = part.steps
        later_min = np.empty_like(steps)
        later_min[-1] = _INT64[1] - 1
        later_min[:-1] = np.minimum.accumulate(steps[:0:-1])[::-1]  # min of steps[i + 1:]
        keep = steps <= later_min if self.name == ROLLBACK else steps < later_min
        kept = None if keep.all() else keep  # the part's own relaunches
        cut = int(np.searchsorted(self.steps[:self.num_rows], steps.min(),  # the earlier records it supersedes
                                  side="right" if self.name == ROLLBACK else "left"))
        self.superseded += self.num_rows - cut + len(steps) - int(np.count_nonzero(keep))
        if cut < self.num_rows and self.other:
            self.other = {row: values for row, values in self.other.items() if row < cut}
        rows = slice(cut, cut + int(np.count_nonzero(keep)))
        self.steps[rows] = steps if kept is None else steps[kept]
        for name, (values, mask) in part.columns.items():
            column = self.columns.get(name)
            if column is None:
                column = self.columns[name] = np.empty(self.capacity, values.dtype)
                if cut:
                    self._mask(name, cut)[:cut] = False
            elif column.dtype != np.result_type(column.dtype, values.dtype):  # an int key with a float now
                floats = np.empty(self.capacity, np.float64)
                floats[:cut] = column[:cut]
                column = self.columns[name] = floats
            column[rows] = values if kept is None else values[kept]
            if mask is not None or name in self.present:
                self._mask(name, cut)[rows] = True if mask is None else mask if kept is None else mask[kept]
        for name in self.columns.keys() - part.columns.keys():
            self._mask(name, cut)[rows] = False
        row_of = np.cumsum(keep) - 1 + cut
        self.other.update((int(row_of[i]), values) for i, values in part.other.items() if keep[i])
        self.num_rows = rows.stop

    def _mask(self, name: str, num_rows: int) -> np.ndarray:
        """Where ``name`` is present, made (present in the first ``num_rows`` rows) when first asked for."""
        if name not in self.present:
            self.present[name] = np.empty(self.capacity, bool)
            self.present[name][:num_rows] = True
        return self.present[name]

    def records(self) -> Records:
        n = self.num_rows
        return Records(self.name, self.steps[:n], {name: c[:n] for name, c in self.columns.items()},
                       {name: p[:n] for name, p in self.present.items() if not p[:n].all()}, self.other)
