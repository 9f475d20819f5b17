"""Today's corpora: parquet, ``datasets`` save_to_disk directories and compressed text give exactly the documents,
sentences and shards of the same text as a plain ``.txt``; and bad ones (no text column, a truncated stream,
binary files) are refused by what they are, leaving no dataset behind.

Every file is written here at test time (pyarrow, ``datasets``, gzip/zstd/bz2/xz); one test converts a shared-data
text file (skipped without ``PRETRAIN_DATA_DIR``).
"""

from __future__ import annotations

import bz2
import filecmp
import gzip
import json
import lzma
import os
import shutil
import subprocess
import zipfile

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstd = pytest.importorskip("zstandard")

from pretrain.prep.preprocess import main, preprocess  # noqa: E402
from pretrain.prep.readers import ReadStats, plan_parts, read_file, read_part  # noqa: E402
from pretrain.prep.tokenizer import train_tokenizer  # noqa: E402

WORDS = ("alpha beta gamma delta river mountain forest city music science history language people "
         "government war king church island ocean planet").split()


def _plan_rows(*args, **kwargs):
    """The planner's parts as a list (it yields them one at a time)."""
    from pretrain.prep.columnar import plan_rows

    return list(plan_rows(*args, **kwargs))


def _sentence(rng) -> str:
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=rng.integers(4, 12))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?"])


def _documents(seed: int = 0, n: int = 60) -> list[str]:
    """Texts of ``n`` documents: lines (paragraphs) of 1-4 sentences, some with untidy whitespace."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(_sentence(rng) for _ in range(rng.integers(1, 5))) for _ in range(rng.integers(1, 6))]
        if rng.random() < 0.3:
            lines[0] = "  " + lines[0] + " \t"
        docs.append("\n".join(lines))
    return docs


def _txt(docs: list[str]) -> str:
    return "\n\n".join(docs) + "\n"


def _shards_equal(a, b) -> None:
    """Same shard files, byte for byte, and the same counts in the manifests."""
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert [s["name"] for s in ma["shards"]] == [s["name"] for s in mb["shards"]]
    for s in ma["shards"]:
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(a / (s["name"] + ext), b / (s["name"] + ext), shallow=False), s["name"] + ext
    for key in ("documents", "sentences", "tokens", "short_sentences", "empty_sentences"):
        assert ma["report"][key] == mb["report"][key], key
    assert ma["num_documents"] == mb["num_documents"] and ma["num_sequences"] == mb["num_sequences"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The same 60 documents as .txt (the reference dataset), and a tokenizer trained on it."""
    root = tmp_path_factory.mktemp("corpora")
    docs = _documents()
    (root / "plain.txt").write_text(_txt(docs), encoding="utf-8")
    tok = train_tokenizer([str(root / "plain.txt")], str(root / "tok.json"), vocab_size=200, min_frequency=1)
    preprocess([str(root / "plain.txt")], str(root / "ref"), tok.path, shard_size_tokens=700, progress=False)
    return {"root": root, "docs": docs, "tok": tok.path, "ref": root / "ref"}


def _write_parquet(path, docs, *, column="text", row_group_size=7, nulls=False) -> None:
    texts = list(docs)
    ids = list(range(len(texts)))
    if nulls:  # a null and an empty row make no documents
        texts = texts[:3] + [None, ""] + texts[3:]
        ids = list(range(len(texts)))
    table = pa.table({"id": pa.array(ids, pa.int64()), column: pa.array(texts, pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size)


# ---------------------------------------------------------------------------------------------- parquet


@pytest.mark.parametrize("workers,chunk", [(1, 1 << 20), (1, 300), (2, 300)])
def test_parquet_gives_the_txt_datasets_shards(corpus, tmp_path, workers, chunk):
    path = tmp_path / "docs.parquet"
    _write_parquet(path, corpus["docs"], nulls=True)
    assert pq.ParquetFile(path).metadata.num_row_groups == 9
    m = preprocess([str(path)], str(tmp_path / "ds"), corpus["tok"], shard_size_tokens=700, chunk_chars=chunk,
                   num_workers=workers, progress=False)
    _shards_equal(corpus["ref"], tmp_path / "ds")
    assert m["report"]["skipped"] == {"null_text": 1}
    if chunk == 300:  # the plan split the file by row groups
        assert len(plan_parts(str(path), chunk)) > 3


def test_parquet_parts_read_one_after_another_give_read_files_documents(corpus, tmp_path):
    path = tmp_path / "docs.parquet"
    _write_parquet(path, corpus["docs"], row_group_size=5)
    whole = [d.paragraphs for d in read_file(str(path), ReadStats())]
    assert len(whole) == len(corpus["docs"])
    parts = plan_parts(str(path), 200)  # row groups of 5 rows, each more than 200 bytes: cut into row slices
    assert parts[0].start == 0 and all(a.end == b.start for a, b in zip(parts, parts[1:]))
    assert parts[-1].end == len(corpus["docs"]) and len(parts) > 12
    assert sum(p.input_bytes for p in parts) == os.path.getsize(path)
    assert [d.paragraphs for p in parts for d in read_part(p, ReadStats())] == whole
    txt = [d.paragraphs for d in read_file(str(corpus["root"] / "plain.txt"), ReadStats())]
    assert whole == txt



def test_jsonl_splits_a_documents_lines_where_txt_and_parquet_do(tmp_path):
    """Only ``\\n`` ends a paragraph, in every format: a lone ``\\r``, a form feed, NEL or U+2028 inside a line (which
    ``str.splitlines`` would also cut at) leaves the same paragraph, hence the same sentences, in .jsonl as in .txt
    and parquet."""
    docs = ["First line here.\nA lone\rcarriage return and a\x0cform feed stay in this line.",
            "Next\u2028line separator, and a\x85NEL too.\nA windows line.\r\nLast line."]
    (tmp_path / "d.txt").write_bytes(_txt(docs).encode("utf-8"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    _write_parquet(tmp_path / "d.parquet", docs)
    txt, jsonl, parquet = ([d.paragraphs for d in read_file(str(tmp_path / name), ReadStats())]
                           for name in ("d.txt", "d.jsonl", "d.parquet"))
    assert txt == parquet and len(txt) == 2 and len(txt[0]) == 2 and len(txt[1]) == 3
    assert jsonl == txt


def test_one_big_row_group_is_cut_into_row_slices_that_read_back_the_whole_file(corpus, tmp_path):
    """A file of one row group (what many writers produce) gives every worker a part: row slices of about the
    chunk size, at most ``max_slices`` of them (none for one worker); read one after another they are the
    file's documents, and the dataset is the same with 1 and 2 workers."""
    path = tmp_path / "one.parquet"
    _write_parquet(path, corpus["docs"], row_group_size=10_000)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    parts = plan_parts(str(path), 300)
    assert len(parts) > 4 and parts[0].start == 0 and parts[-1].end == len(corpus["docs"])
    assert all(a.end == b.start and a.end > a.start for a, b in zip(parts, parts[1:]))
    assert sum(p.input_bytes for p in parts) == os.path.getsize(path)
    whole = [d.paragraphs for d in read_file(str(path), ReadStats())]
    assert [d.paragraphs for p in parts for d in read_part(p, ReadStats())] == whole
    # the plan on its own: small units joined, a big one cut (capped), file bytes shared by text size
    plan = _plan_rows([(10, 40), (10, 40), (1000, 1000), (5, 100)], 100, 1000)
    assert plan[0][:2] == (0, 20) and [b - a for a, b, _ in plan[1:11]] == [100] * 10 and plan[-1][:2] == (1020, 1025)
    assert sum(n for *_, n in plan) == 1000
    capped = _plan_rows([(10**6, 10**9)], 1, 7, max_slices=4)
    assert [a for a, *_ in capped] == [0, 250_000, 500_000, 750_000] and capped[-1][1] == 10**6
    assert _plan_rows([(10**6, 10**9)], 1, 7, max_slices=1) == [(0, 10**6, 7)]
    assert len(plan_parts(str(path), 300, max_slices=1)) == 1
    for workers in (1, 2):
        preprocess([str(path)], str(tmp_path / f"ds{workers}"), corpus["tok"], shard_size_tokens=700,
                   chunk_chars=300, num_workers=workers, progress=False)
        _shards_equal(corpus["ref"], tmp_path / f"ds{workers}")
    assert _plan_rows([], 100, 5) == [(0, 0, 5)] and _plan_rows([(0, 0)], 100, 5) == [(0, 0, 5)]


def test_row_bytes_read_off_the_offsets_equal_pyarrow_compute():
    """The planner reads each row's text size off the array's offsets buffer; the values' own byte lengths are
    the reference: string / binary / large / view types, nulls whose slot has a length, sliced arrays."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from pretrain.prep.columnar import _row_bytes

    values = ["", "a", None, "héllo wörld", "x" * 300, None, "naïve\ntext", "z"] * 5
    types = [pa.string(), pa.large_string(), pa.binary(), pa.large_binary(), pa.string_view(), pa.binary_view()]
    for tp in types:
        whole = pa.array([v.encode() if v is not None and "binary" in str(tp) else v for v in values], type=tp)
        for arr in (whole, whole.slice(3), whole.slice(5, 17), whole.slice(40), pa.array([], type=tp)):
            ref = [0 if v is None else len(v if isinstance(v, bytes) else v.encode()) for v in arr.to_pylist()]
            got = _row_bytes(arr)
            assert got.dtype == np.int64 and got.tolist() == ref, (tp, arr.offset, len(arr))
    # a null whose slot is not empty (allowed by the Arrow format): built from raw buffers
    offsets = pa.py_buffer(np.array([0, 3, 7, 9], dtype=np.int32).tobytes())
    validity = pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes())
    arr = pa.Array.from_buffers(pa.string(), 3, [validity, offsets, pa.py_buffer(b"abcdefghi")], null_count=1)
    assert _row_bytes(arr).tolist() == [3, 0, 2] == pc.binary_length(arr).fill_null(0).to_pylist()
    with pytest.raises(TypeError, match="not a text column"):
        _row_bytes(pa.array([1, 2]))
    assert _row_bytes(arr.slice(1)).tolist() == [0, 2]


def test_a_cut_row_group_is_cut_into_slices_of_equal_text_not_equal_rows(corpus, tmp_path):
    """Documents differ in length: slices of equal rows left one worker with far more text than the other. With
    the rows' sizes (one streamed pass over the group's text column) the slices hold about equal text."""
    import numpy as np

    from pretrain.prep.columnar import _slices

    sizes = np.array([90] * 10 + [10] * 90)  # the first tenth of the rows holds half the text
    even_rows = _slices(0, 100, 1800, 2)
    even_text = _slices(0, 100, 1800, 2, sizes)
    assert [b - a for a, b, _ in even_rows] == [50, 50] and [n for *_, n in even_rows] == [900, 900]
    assert [(a, b) for a, b, _ in even_text] == [(0, 10), (10, 100)] and [n for *_, n in even_text] == [900, 900]
    assert [(a, b) for a, b, _ in _slices(7, 4, 100, 4, np.array([1, 1, 1, 97]))] == [(7, 8), (8, 9), (9, 10),
                                                                                       (10, 11)]  # a row each
    plan = _plan_rows([(100, 1800)], 450, 1800, 4, lambda i: sizes)
    text = [int(sizes[a:b].sum()) for a, b, _ in plan]
    assert max(text) - min(text) <= 90 and sum(n for *_, n in plan) == 1800
    # planned lazily: a group's rows are sized only when its parts are asked for (the workers start meanwhile)
    from pretrain.prep.columnar import plan_rows

    sized = []
    units = [(100, 1800), (3, 10), (100, 1800)]
    parts = plan_rows(units, 450, 3610, 4, lambda i: sized.append(i) or sizes)
    assert next(parts)[:2] == (0, 5) and sized == [0]
    rest = list(parts)
    assert sized == [0, 2]
    assert [p[:2] for p in rest] == [(5, 10), (10, 55), (55, 100), (100, 103), (103, 108), (108, 113), (113, 158),
                                     (158, 203)]
    assert sum(n for *_, n in _plan_rows(units, 450, 3610, 4, lambda i: sizes)) == 3610
    # on a real file: a big row group of documents of mixed lengths, cut for 2 workers
    docs = [d * 8 if i % 7 == 0 else d for i, d in enumerate(corpus["docs"])]
    path = tmp_path / "mixed.parquet"
    _write_parquet(path, docs, row_group_size=10_000)
    parts = plan_parts(str(path), 1, max_slices=4)
    got = [sum(len(d.encode("utf-8")) for d in docs[p.start:p.end]) for p in parts]
    longest = max(len(d.encode("utf-8")) for d in docs)
    assert len(parts) == 4 and max(got) - min(got) <= longest, got
    whole = [d.paragraphs for d in read_file(str(path), ReadStats())]
    assert [d.paragraphs for p in parts for d in read_part(p, ReadStats())] == whole

def test_parquet_text_field_picks_the_column(corpus, tmp_path, capsys):
    path = tmp_path / "content.parquet"
    _write_parquet(path, corpus["docs"], column="content")
    assert main([str(path), "--tokenizer", corpus["tok"], "--out", str(tmp_path / "ds"), "--text-field", "content",
                 "--workers", "1", "--no-progress", "--shard-size-tokens", "700"]) == 0
    _shards_equal(corpus["ref"], tmp_path / "ds")


def test_parquet_is_streamed_by_row_group(corpus, tmp_path, monkeypatch):
    """The reader asks pyarrow for batches of the planned row groups only, never for the whole file."""
    path = tmp_path / "docs.parquet"
    _write_parquet(path, corpus["docs"], row_group_size=5)
    seen = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        seen.append(list(kwargs.get("row_groups")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("whole file read"))
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("whole file read"))
    parts = plan_parts(str(path), 300)
    # the plan reads the row sizes of a group it cuts (one group at a time), the others not at all
    assert all(len(groups) == 1 for groups in seen)
    seen.clear()
    for p in parts:
        list(read_part(p, ReadStats()))
    groups = [(5 * g, 5 * g + 5) for g in range(12)]  # row group g holds rows 5g .. 5g+5
    assert seen == [[g for g, (a, b) in enumerate(groups) if a < p.end and b > p.start] for p in parts]
    assert all(len(s) <= 2 for s in seen)


# ---------------------------------------------------------------------------------------------- datasets


def test_datasets_save_to_disk_directory_gives_the_txt_datasets_shards(corpus, tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": corpus["docs"], "id": list(range(len(corpus["docs"])))})
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=3)
    arrow = sorted(p.name for p in (tmp_path / "hf").glob("*.arrow"))
    assert len(arrow) == 3 and (tmp_path / "hf" / "state.json").is_file()
    for workers, chunk in ((1, 1 << 20), (2, 200)):
        out = tmp_path / f"ds{workers}"
        preprocess([str(tmp_path / "hf")], str(out), corpus["tok"], shard_size_tokens=700, chunk_chars=chunk,
                   num_workers=workers, progress=False)
        _shards_equal(corpus["ref"], out)
        inputs = [os.path.basename(i["path"]) for i in json.loads((out / "manifest.json").read_text())["inputs"]]
        assert inputs == arrow  # the JSON files beside them are not read as text


def test_datasets_dict_directory_asks_for_one_split(corpus, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": corpus["docs"][:5]}),
                               "test": datasets.Dataset.from_dict({"text": corpus["docs"][5:8]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert main([str(tmp_path / "dd"), "--tokenizer", corpus["tok"], "--out", str(tmp_path / "ds"),
                 "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "DatasetDict" in err and "pass one split's directory" in err and str(tmp_path / "dd" / "train") in err
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("where", ["../outside", "absolute"])
def test_datasets_directory_naming_files_outside_it_is_refused(corpus, tmp_path, capsys, where):
    """state.json names the directory's own Arrow files: one that leads out of it is refused, not read as text."""
    import shutil

    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": corpus["docs"][:5]}).save_to_disk(str(tmp_path / "hf"))
    state = json.loads((tmp_path / "hf" / "state.json").read_text())
    (tmp_path / "outside").mkdir()
    arrow = state["_data_files"][0]["filename"]
    shutil.move(str(tmp_path / "hf" / arrow), str(tmp_path / "outside" / arrow))
    state["_data_files"][0]["filename"] = (str(tmp_path / "outside") if where == "absolute" else "../outside") + \
        "/" + arrow
    (tmp_path / "hf" / "state.json").write_text(json.dumps(state))
    assert main([str(tmp_path / "hf"), "--tokenizer", corpus["tok"], "--out", str(tmp_path / "ds"),
                 "--workers", "1", "--no-progress"]) == 2
    assert "outside" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()


# ---------------------------------------------------------------------------------------------- compressed


def _compress(kind: str, data: bytes) -> bytes:
    if kind == "gz":
        return gzip.compress(data)
    if kind == "bz2":
        return bz2.compress(data)
    if kind == "xz":
        return lzma.compress(data)
    half = len(data) // 2  # zstd: two frames, as parallel compressors write them
    return zstd.ZstdCompressor().compress(data[:half]) + zstd.ZstdCompressor().compress(data[half:])


@pytest.mark.parametrize("kind", ["gz", "zst", "bz2", "xz"])
def test_compressed_text_and_jsonl_give_the_plain_datasets_shards(corpus, tmp_path, kind):
    txt = _txt(corpus["docs"]).encode()
    (tmp_path / f"plain.txt.{kind}").write_bytes(_compress(kind, txt))
    preprocess([str(tmp_path / f"plain.txt.{kind}")], str(tmp_path / "ds"), corpus["tok"], shard_size_tokens=700,
               chunk_chars=300, num_workers=2, progress=False)
    _shards_equal(corpus["ref"], tmp_path / "ds")
    assert len(plan_parts(str(tmp_path / f"plain.txt.{kind}"), 300)) == 1  # one worker per stream
    jsonl = "".join(json.dumps({"text": d}) + "\n" for d in corpus["docs"]).encode()
    (tmp_path / f"docs.jsonl.{kind}").write_bytes(_compress(kind, jsonl))
    (tmp_path / "docs.jsonl").write_bytes(jsonl)
    for name in ("docs.jsonl", f"docs.jsonl.{kind}"):
        preprocess([str(tmp_path / name)], str(tmp_path / name.replace(".", "_")), corpus["tok"],
                   shard_size_tokens=700, progress=False)
    _shards_equal(tmp_path / "docs_jsonl", tmp_path / f"docs_jsonl_{kind}")


def _skippable(payload: bytes, nibble: int = 0) -> bytes:
    """A zstd skippable frame (RFC 8878, 3.1.2): magic 0x184D2A5n, the payload's size, the payload."""
    return bytes([0x50 + nibble]) + b"\x2a\x4d\x18" + len(payload).to_bytes(4, "little") + payload


def test_zstd_with_skippable_frames_as_pzstd_writes_them_gives_the_plain_datasets_shards(corpus, tmp_path):
    """pzstd (zstd's parallel compressor) puts a skippable frame before each frame, holding that frame's size: the
    file's first bytes were no known magic, and it was refused as binary."""
    txt = _txt(corpus["docs"]).encode()
    half = len(txt) // 2
    frames = [zstd.ZstdCompressor().compress(part) for part in (txt[:half], txt[half:])]
    data = b"".join(_skippable(len(f).to_bytes(4, "little")) + f for f in frames) + _skippable(b"", nibble=0xF)
    (tmp_path / "plain.txt.zst").write_bytes(data)
    preprocess([str(tmp_path / "plain.txt.zst")], str(tmp_path / "ds"), corpus["tok"], shard_size_tokens=700,
               chunk_chars=300, num_workers=2, progress=False)
    _shards_equal(corpus["ref"], tmp_path / "ds")
    if shutil.which("pzstd"):  # the tool itself, where it is installed
        (tmp_path / "p.txt").write_bytes(txt)
        subprocess.run(["pzstd", "-q", "-p", "2", str(tmp_path / "p.txt"), "-o", str(tmp_path / "p.txt.zst")],
                       check=True)
        preprocess([str(tmp_path / "p.txt.zst")], str(tmp_path / "pz"), corpus["tok"], shard_size_tokens=700,
                   progress=False)
        _shards_equal(corpus["ref"], tmp_path / "pz")


def test_compressed_wikiextractor_and_gutenberg_are_sniffed_inside_the_stream(tmp_path):
    wiki = '<doc id="1" url="u" title="A">\nA\n\nThe first line of this article has more than six words.\n</doc>\n'
    book = "Header\n*** START OF THE BOOK ***\nSome text\nwrapped here.\n*** END OF THE BOOK ***\n"
    (tmp_path / "wiki_00.gz").write_bytes(gzip.compress(wiki.encode()))
    (tmp_path / "book.txt.zst").write_bytes(_compress("zst", book.encode()))
    assert [d.paragraphs for d in read_file(str(tmp_path / "wiki_00.gz"), ReadStats())] == [["The first line of this article has more than six words."]]
    assert [d.paragraphs for d in read_file(str(tmp_path / "book.txt.zst"), ReadStats())] == [
        ["Some text wrapped here."]]


# ---------------------------------------------------------------------------------------------- shared data


def test_shared_text_file_as_parquet_gives_byte_identical_shards(data_dir, tmp_path):
    """WikiText-2 valid.txt, converted to parquet here (one row per blank-line-separated block), preprocessed both
    ways: the same shards byte for byte."""
    src = data_dir / "corpus" / "wikitext-2" / "valid.txt"
    if not src.is_file():
        pytest.skip(f"{src} not found")
    rows, block = [], []
    for line in src.read_text(encoding="utf-8").split("\n"):  # independent of the readers: blocks of lines
        if line.strip():
            block.append(line)
        elif block:
            rows.append("\n".join(block))
            block = []
    if block:
        rows.append("\n".join(block))
    pq.write_table(pa.table({"text": rows}), tmp_path / "valid.parquet", row_group_size=500)
    tok = train_tokenizer([str(src)], str(tmp_path / "tok.json"), vocab_size=2000)
    for name, inp in (("txt", src), ("parquet", tmp_path / "valid.parquet")):
        preprocess([str(inp)], str(tmp_path / name), tok.path, shard_size_tokens=100_000, num_workers=2,
                   chunk_chars=100_000, progress=False)
    _shards_equal(tmp_path / "txt", tmp_path / "parquet")
    m = json.loads((tmp_path / "parquet" / "manifest.json").read_text())
    assert len(m["shards"]) > 1 and m["report"]["documents"] > 500


# ---------------------------------------------------------------------------------------------- bad input


def _run(args, tmp_path, capsys) -> tuple[int, str]:
    code = main([*map(str, args), "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress"])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_parquet_without_the_text_column_lists_its_columns(corpus, tmp_path, capsys):
    _write_parquet(tmp_path / "c.parquet", corpus["docs"], column="content")
    code, text = _run([tmp_path / "c.parquet", "--tokenizer", corpus["tok"]], tmp_path, capsys)
    assert code == 2 and "c.parquet has no column 'text'" in text and "its columns are id, content" in text
    assert "--text-field" in text and not (tmp_path / "out").exists()
    code, text = _run([tmp_path / "c.parquet", "--tokenizer", corpus["tok"], "--text-field", "id"], tmp_path, capsys)
    assert code == 2 and "column 'id' has type int64, not text" in text


@pytest.mark.parametrize("kind", ["gz", "zst", "bz2", "xz"])
def test_truncated_stream_is_named_and_leaves_no_dataset(corpus, tmp_path, capsys, kind):
    """A stream cut in its middle: the message names the file, and neither a dataset nor a partial directory
    remains (the reader fails after the first documents have gone to the shard writer)."""
    data = _txt(corpus["docs"] * 40).encode()
    blob = _compress(kind, data)
    path = tmp_path / f"cut.txt.{kind}"
    path.write_bytes(blob[:len(blob) * 3 // 4])
    code, text = _run([path, "--tokenizer", corpus["tok"], "--shard-size-tokens", "200"], tmp_path, capsys)
    assert code == 2, text
    assert f"cut.txt.{kind}: the" in text and "stream is truncated or corrupt" in text
    assert os.listdir(tmp_path) == [path.name]


def test_invalid_utf8_inside_a_stream_is_counted_as_in_plain_text(corpus, tmp_path, capsys):
    raw = b"A fine first sentence here.\nThen \xff\xfe broken bytes appear.\nAnd a last line.\n"
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(raw))
    code, text = _run([tmp_path / "bad.txt.gz", "--tokenizer", corpus["tok"]], tmp_path, capsys)
    assert code == 2 and "bad.txt.gz: invalid UTF-8 at byte offset 33 of the decompressed stream" in text
    (tmp_path / "bad.txt").write_bytes(raw)
    for errors in ("replace", "skip"):
        a, b = ReadStats(), ReadStats()
        docs_gz = [d.paragraphs for d in read_file(str(tmp_path / "bad.txt.gz"), a, errors=errors)]
        docs_txt = [d.paragraphs for d in read_file(str(tmp_path / "bad.txt"), b, errors=errors)]
        assert docs_gz == docs_txt and a.skipped == b.skipped and a.skipped


def _elf() -> bytes:
    return b"\x7fELF\x02\x01\x01" + bytes(9) + bytes(range(256)) * 4


@pytest.mark.parametrize("name,content,words", [
    ("prog", _elf(), "is an ELF executable"),
    ("blob.txt", bytes(range(256)) * 8, "is a binary file (8 NUL bytes and 208 other control bytes"),
    ("docs.zip", None, "is a zip archive"),
    ("notes.txt", "Some text here.\n".encode("utf-16"), "UTF-16"),
    ("corpus.tar", b"a.txt".ljust(257, b"\0") + b"ustar\x0000" + bytes(250), "is a tar archive"),
    ("corpus.txt.lz4", b"\x04\x22\x4d\x18" + bytes(20), "LZ4-compressed file (not supported)"),
    ("corpus.txt.gz", gzip.compress(_elf()), "(after gzip decompression) is an ELF executable"),
])
def test_binary_files_are_named_by_preprocess_and_tokenizer(tmp_path, capsys, corpus, name, content, words):
    from pretrain.prep.tokenizer import main as tokenizer_main

    path = tmp_path / name
    if content is None:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("a.txt", "Some text in a zip archive.\n")
    else:
        path.write_bytes(content)
    code, text = _run([path, "--tokenizer", corpus["tok"], "--errors", "replace"], tmp_path, capsys)
    assert code == 2 and f"{name}{'' if 'after' in words else ' '}" in text and words in text, text
    assert not (tmp_path / "out").exists()
    assert tokenizer_main([str(path), "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert words in err and not (tmp_path / "t.json").exists()


def test_a_stray_nul_byte_keeps_a_text_file_text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"Fine line one.\nHas a NUL \x00 byte.\nLast line.\n")
    stats = ReadStats()
    assert [d.paragraphs for d in read_file(str(path), stats)] == [["Fine line one.", "Last line."]]
    assert stats.skipped == {"nul_bytes": 1}


def test_write_parquet_round_trips_documents(corpus, tmp_path):
    from pretrain.prep.columnar import write_parquet

    docs = [d.paragraphs for d in read_file(str(corpus["root"] / "plain.txt"), ReadStats())]
    assert write_parquet(iter(docs), str(tmp_path / "w.parquet"), row_group_rows=8) == len(docs)
    assert pq.ParquetFile(tmp_path / "w.parquet").metadata.num_row_groups == -(-len(docs) // 8)
    assert [d.paragraphs for d in read_file(str(tmp_path / "w.parquet"), ReadStats())] == docs


@pytest.mark.parametrize("binary", [False, True])
def test_invalid_utf8_in_parquet_is_named_or_counted_as_in_text(tmp_path, binary):
    raw = [b"A fine first row of text.", b"Then \xff\xfe broken bytes appear.", None, b"And a last row."]
    column = pa.array(raw, pa.binary())
    pq.write_table(pa.table({"text": column if binary else column.view(pa.string())}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: invalid UTF-8 in row 1 of column 'text' at byte 5"):
        list(read_file(str(tmp_path / "bad.parquet"), ReadStats()))
    (tmp_path / "bad.txt").write_bytes(b"\n\n".join(r for r in raw if r is not None) + b"\n")
    for errors in ("replace", "skip"):
        a, b = ReadStats(), ReadStats()
        docs_pq = [d.paragraphs for d in read_file(str(tmp_path / "bad.parquet"), a, errors=errors)]
        docs_txt = [d.paragraphs for d in read_file(str(tmp_path / "bad.txt"), b, errors=errors)]
        assert docs_pq == docs_txt and a.skipped == {**b.skipped, "null_text": 1}


def test_tokenizer_trains_on_parquet_and_compressed_text_as_on_the_txt(corpus, tmp_path):
    """The tokenizer trainer reads the same text from each form (its training itself breaks ties run by run)."""
    from pretrain.prep.tokenizer import _text_batches, load_tokenizer

    _write_parquet(tmp_path / "docs.parquet", corpus["docs"])
    (tmp_path / "docs.txt.zst").write_bytes(_compress("zst", _txt(corpus["docs"]).encode()))
    want = list(_text_batches([str(corpus["root"] / "plain.txt")], None, sentences=False))
    assert sum(map(len, want)) > 100
    for name in ("docs.parquet", "docs.txt.zst"):
        assert list(_text_batches([str(tmp_path / name)], None, sentences=False)) == want, name
        tok = train_tokenizer([str(tmp_path / name)], str(tmp_path / f"{name}.json"), vocab_size=200, min_frequency=1)
        assert tok.vocab_size == load_tokenizer(corpus["tok"]).vocab_size > 100


def test_sentence_stage_file_may_be_compressed_and_binary_ones_are_named(corpus, tmp_path):
    """data.sentences (one sentence per line) read plain or compressed alike; a binary, parquet or truncated file
    is refused by what it is, not read as junk."""
    from pretrain.config.data import DataConfig
    from pretrain.config.objective import ObjectiveConfig
    from pretrain.data.sentences import SentenceDataset
    from pretrain.prep.tokenizer import load_tokenizer

    tok = load_tokenizer(corpus["tok"])
    cfg = DataConfig(tokenizer=corpus["tok"], max_len=32, view_max_len=32, stage="sentences", sentences="x")
    lines = "".join(f"Sentence number {i} is about the river and the city.\n\n" for i in range(50)).encode()
    (tmp_path / "s.txt").write_bytes(lines)
    (tmp_path / "s.txt.gz").write_bytes(gzip.compress(lines))
    plain = SentenceDataset(str(tmp_path / "s.txt"), tok, cfg, ObjectiveConfig(), seed=1)
    packed = SentenceDataset(str(tmp_path / "s.txt.gz"), tok, cfg, ObjectiveConfig(), seed=1)
    assert plain.lines == packed.lines and len(plain) == 50
    (tmp_path / "prog").write_bytes(_elf())
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(lines * 50)[:500])
    _write_parquet(tmp_path / "s.parquet", ["One sentence here."])
    for name, words in (("prog", "data.sentences: " + str(tmp_path / "prog") + " is an ELF executable"),
                        ("cut.txt.gz", "gzip stream is truncated"), ("s.parquet", "is a parquet file; preprocess")):
        with pytest.raises(ValueError, match=words.replace(".", r"\.").replace("(", r"\(")):
            SentenceDataset(str(tmp_path / name), tok, cfg, ObjectiveConfig(), seed=1)


def test_a_compressed_stream_is_tokenized_in_chunks_spilled_and_read_back_once(corpus, tmp_path):
    """One worker reads a whole stream, but holds only a chunk of its tokens at a time: the chunks go to files in
    the output's temporary directory, which the main process reads back in order and deletes."""
    from pretrain.prep.preprocess import ChunkProcessor, Spilled, _run_task, _unspill
    from pretrain.prep.tokenizer import load_tokenizer

    (tmp_path / "big.txt.gz").write_bytes(gzip.compress(_txt(corpus["docs"] * 5).encode()))
    (part,) = plan_parts(str(tmp_path / "big.txt.gz"), 1000)
    processor = ChunkProcessor(load_tokenizer(corpus["tok"]), 8)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    result, skipped = _run_task(part, processor, {}, {"dir": str(spill_dir), "chunk_chars": 2000})
    assert isinstance(result, Spilled) and len(result.pieces) > 10 and skipped == {}
    whole, _ = _run_task(part, processor, {})
    chunks = list(_unspill(result))
    assert np.array_equal(np.concatenate([c.flat_ids for c in chunks]), whole.flat_ids)
    assert np.array_equal(np.concatenate([c.doc_sentences for c in chunks]), whole.doc_sentences)
    assert sum(c.num_chars for c in chunks) == whole.num_chars and not os.listdir(spill_dir)
    assert max(len(c.flat_ids) for c in chunks) < len(whole.flat_ids) / 5
    # A parquet part larger than a chunk (one big row group planned whole) spills too; one that fits does not.
    _write_parquet(tmp_path / "one_group.parquet", corpus["docs"] * 5, row_group_size=10_000)
    (big,) = plan_parts(str(tmp_path / "one_group.parquet"), 10**9)
    result, _ = _run_task(big, processor, {}, {"dir": str(spill_dir), "chunk_chars": 2000})
    assert isinstance(result, Spilled) and len(result.pieces) > 10
    assert np.array_equal(np.concatenate([c.flat_ids for c in _unspill(result)]), whole.flat_ids)
    result, _ = _run_task(big, processor, {}, {"dir": str(spill_dir), "chunk_chars": 10**9})
    assert not isinstance(result, Spilled) and np.array_equal(result.flat_ids, whole.flat_ids)
    assert not os.listdir(spill_dir)


def test_truncated_parquet_and_arrow_files_are_named(corpus, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    _write_parquet(tmp_path / "ok.parquet", corpus["docs"])
    blob = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(blob[:len(blob) // 2])
    code, text = _run([tmp_path / "cut.parquet", "--tokenizer", corpus["tok"]], tmp_path, capsys)
    assert code == 2 and "cut.parquet is not a readable parquet file" in text and "re-download" in text
    datasets.Dataset.from_dict({"text": corpus["docs"]}).save_to_disk(str(tmp_path / "hf"))
    (arrow,) = (tmp_path / "hf").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:3000])
    code, text = _run([tmp_path / "hf", "--tokenizer", corpus["tok"]], tmp_path, capsys)
    assert code == 2 and f"{arrow.name} is not a readable Arrow file" in text, text
    assert not (tmp_path / "out").exists()
