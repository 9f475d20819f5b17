"""Preprocessing review: planned byte ranges read as the whole file even around giant lines, a parquet row group's
text size found past nested columns, a text file without blank lines tokenized in chunks, an input given twice
refused, every input checked before the first is read, and a parquet/Arrow file whose text column is all null (type
null) read as null rows."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from pretrain.prep import columnar  # noqa: E402
from pretrain.prep.preprocess import ChunkProcessor, Spilled, _run_task, _unspill, preprocess  # noqa: E402
from pretrain.prep.preprocess import main as preprocess_main  # noqa: E402
from pretrain.prep.readers import (  # noqa: E402
    Part,
    ReadStats,
    expand_inputs,
    plan_ranges,
    read_file,
    read_range,
    sniff_format,
)
from pretrain.prep.tokenizer import main as tokenizer_main  # noqa: E402
from pretrain.prep.tokenizer import train_tokenizer  # noqa: E402

WORDS = "alpha beta gamma delta river mountain forest city music science history language people".split()


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 9)).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "plain.txt").write_text("\n\n".join(_sentences(200)) + "\n", encoding="utf-8")
    return train_tokenizer([str(d / "plain.txt")], str(d / "tok.json"), vocab_size=120, min_frequency=1)


# ---------------------------------------------------------------------------------------------- 1. range cuts


@pytest.mark.parametrize("target", [1, 16, 50, 200])
def test_a_giant_line_that_starts_like_a_cut_is_no_cut(tmp_path, target):
    """The reader skips a line longer than --max-line-bytes whole, so the planner must not cut at it: a run of
    spaces longer than the limit is no blank line (text), a '<doc ' line longer than it no document start
    (wikiextractor), nor is a '<doc ' line with a NUL byte (skipped too). Cut there, the ranges gave other
    documents than the whole file and counted the giant line twice."""
    limit = 100
    paras = _sentences(12)
    text = ""
    for k in range(3):
        text += f"{paras[4 * k]}\n{paras[4 * k + 1]}\n" + " " * 300 + f"\n{paras[4 * k + 2]}\n\n{paras[4 * k + 3]}\n\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    wiki = ""
    for k in range(3):
        wiki += f'<doc id="{k}">\nTitle {k}\n{paras[4 * k]}\n<doc ' + "x" * 300 + f"\n{paras[4 * k + 1]}\n"
        wiki += f'<doc id="nul\x00">\n{paras[4 * k + 2]}\n</doc>\n'
    (tmp_path / "wiki_00").write_text(wiki, encoding="utf-8")
    for path in (tmp_path / "a.txt", tmp_path / "wiki_00"):
        whole_stats = ReadStats()
        whole = [d.paragraphs for d in read_file(str(path), whole_stats, max_line_bytes=limit)]
        kind = sniff_format(str(path), max_line_bytes=limit)
        ranges = plan_ranges(str(path), kind, target, max_line_bytes=limit)
        stats = ReadStats()
        parts = [d.paragraphs for a, b, before in ranges
                 for d in read_range(str(path), a, b, kind, stats, ends_before_doc=before, max_line_bytes=limit)]
        assert whole and whole_stats.skipped["giant_line"] == 3, path.name
        assert parts == whole, (path.name, target, ranges)
        assert stats.skipped == whole_stats.skipped, (path.name, target)


# ---------------------------------------------------------------------------------------------- 2. parquet plan


def test_a_nested_column_before_the_text_column_does_not_hide_a_big_row_group(tmp_path):
    """A row group's text size is its text column's leaf: a struct column before it (``meta: {a, b}``) shifts the
    leaves, and the planner took ``meta.b``'s few bytes for the text's, so a big row group was never cut (one
    worker read it all) and small groups were joined into parts far above the chunk size."""
    n = 200
    texts = [" ".join(_sentences(40, seed=i)) for i in range(n)]
    meta = pa.array([{"a": i, "b": "x"} for i in range(n)])
    pq.write_table(pa.table({"text": texts, "meta": meta}), tmp_path / "first.parquet", row_group_size=n)
    pq.write_table(pa.table({"meta": meta, "text": texts}), tmp_path / "after.parquet", row_group_size=n)
    plans = {name: [(a, b) for a, b, _ in columnar.plan_parquet(str(tmp_path / f"{name}.parquet"), "text",
                                                                 50_000, 8)]
             for name in ("first", "after")}
    assert len(plans["first"]) > 1, plans
    assert plans["after"] == plans["first"]


# ---------------------------------------------------------------------------------------------- 3. no blank lines


def test_a_text_file_without_blank_lines_is_tokenized_in_chunks(tmp_path, tok):
    """One sentence per line and no blank line (wiki1m, BookCorpus' books_large): the planner finds nowhere to cut,
    so the whole file is one byte range. It was tokenized in one call holding every line and token of the file
    (a 2 GB file: tens of GB); it goes in chunks of documents (each at most --max-document-chars) like a
    compressed stream, with the same result."""
    lines = _sentences(3000)
    path = tmp_path / "one_per_line.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    part = Part(str(path), 0, path.stat().st_size, "text")
    read_kwargs = {"max_line_bytes": 1000, "errors": "strict", "text_field": "text", "max_document_chars": 20_000}
    processor = ChunkProcessor(tok, 8)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    result, skipped = _run_task(part, processor, read_kwargs, {"dir": str(spill_dir), "chunk_chars": 16_000})
    assert isinstance(result, Spilled) and len(result.pieces) > 3, result
    chunks = list(_unspill(result))
    assert not os.listdir(spill_dir)
    at_once, _ = _run_task(part, processor, read_kwargs, None)
    assert np.array_equal(np.concatenate([r.flat_ids for r in chunks]), at_once.flat_ids)
    assert np.array_equal(np.concatenate([r.sizes for r in chunks]), at_once.sizes)
    assert np.array_equal(np.concatenate([r.doc_sentences for r in chunks]), at_once.doc_sentences)
    assert len(at_once.sizes) == len(lines) and skipped == {"document_split": len(at_once.doc_sentences) - 1}


# ---------------------------------------------------------------------------------------------- 4. repeats


def test_an_input_given_twice_is_refused(tmp_path, tok, capsys):
    """A file reached twice (a directory and a file in it, a repeated argument, a link to another input) was read
    twice: its text twice in the dataset, with nothing said."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(_sentences(20)) + "\n", encoding="utf-8")
    (corpus / "b.txt").write_text("\n\n".join(_sentences(20, seed=1)) + "\n", encoding="utf-8")
    assert expand_inputs([str(corpus)]) == [str(corpus / "a.txt"), str(corpus / "b.txt")]
    with pytest.raises(ValueError, match=r"input file .*a\.txt is given twice.*pass each file once"):
        preprocess([str(corpus), str(corpus / "a.txt")], str(tmp_path / "ds"), tok.path, progress=False)
    with pytest.raises(ValueError, match=r"b\.txt is given twice"):
        expand_inputs([str(corpus / "b.txt"), str(corpus / "b.txt")])
    os.symlink(corpus / "a.txt", tmp_path / "link.txt")
    with pytest.raises(ValueError, match=r"link\.txt is given twice \(also as .*corpus/a\.txt\)"):
        expand_inputs([str(corpus), str(tmp_path / "link.txt")])
    twice = [str(corpus), str(corpus / "a.txt")]
    assert preprocess_main([*twice, "--tokenizer", tok.path, "--out", str(tmp_path / "ds"), "--no-progress"]) == 2
    assert tokenizer_main([*twice, "--out", str(tmp_path / "tok2.json"), "--no-progress"]) == 2
    assert "a.txt is given twice" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists() and not (tmp_path / "tok2.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.partial")]


# ---------------------------------------------------------------------------------------------- 5. checked first


@pytest.mark.parametrize("num_workers", [1, 2])
def test_every_input_is_checked_before_the_first_is_read(tmp_path, tok, num_workers):
    """What stops a run at a file's start (here a parquet file without the text column; also binary files, a
    jsonl file without records) is found before any file is read: it used to show only when that file's turn
    came, hours into a big corpus. The proof: the first input, a gzip file cut short, is only found bad by
    reading it to its end, and the run names the parquet file, the last input, instead."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    data = gzip.compress(("\n\n".join(_sentences(5000)) + "\n").encode())  # cut far past its head
    (corpus / "a.txt.gz").write_bytes(data[:len(data) // 2])
    (corpus / "b.txt").write_text("\n\n".join(_sentences(50, seed=2)) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"content": _sentences(5)}), corpus / "c.parquet")
    with pytest.raises(ValueError, match=r"c\.parquet has no column 'text'; its columns are content"):
        preprocess([str(corpus)], str(tmp_path / "ds"), tok.path, num_workers=num_workers, chunk_chars=200,
                   progress=False)  # (b.txt: more parts than the pool's window of 4 per worker)
    (corpus / "c.parquet").unlink()
    with pytest.raises(ValueError, match=r"a\.txt\.gz: the gzip stream is truncated"):
        preprocess([str(corpus)], str(tmp_path / "ds"), tok.path, num_workers=num_workers, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


# ---------------------------------------------------------------------------------------------- 6. all-null column


@pytest.mark.parametrize("container", ["parquet", "arrow"])
def test_a_shard_whose_text_is_all_null_counts_its_nulls(tmp_path, tok, container):
    """pandas writes an object column holding only None as Arrow type ``null``: one shard of a corpus whose texts
    are all missing. Its rows are null texts, counted as in a string column (``null_text``), not a refusal of
    the whole run as a column that is "not text"."""
    docs = _sentences(30)
    files = {"a": pa.table({"text": pa.array(docs, pa.string())}),
             "b": pa.table({"text": pa.array([None] * 4, pa.null())})}
    for name, table in files.items():
        path = tmp_path / "in" / f"{name}.{container}"
        path.parent.mkdir(exist_ok=True)
        if container == "parquet":
            pq.write_table(table, path)
        else:
            with pa.ipc.new_file(str(path), table.schema) as w:
                w.write_table(table)
    if container == "parquet":  # (as written: parquet keeps the type)
        assert pq.read_schema(tmp_path / "in" / "b.parquet").field("text").type == pa.null()
    stats = ReadStats()
    assert list(read_file(str(tmp_path / "in" / f"b.{container}"), stats)) == [] and stats.skipped == {
        "null_text": 4}
    m = preprocess([str(tmp_path / "in")], str(tmp_path / "ds"), tok.path, progress=False)
    assert m["report"]["skipped"] == {"null_text": 4} and m["report"]["documents"] == len(docs)


# ------------------------------------------------------------------------------- documentation in a corpus dir


def test_a_directorys_readme_and_license_are_not_tokenized_unless_named(tmp_path, tok):
    """A downloaded dataset directory holds its README and license beside the text (wikitext-2's README in the
    shared data): a directory input read them into the corpus, and the tokenizer's training, with nothing said.
    They are skipped with a warning naming them; a file given by name is read as any."""
    import json

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("\n\n".join(_sentences(20)) + "\n", encoding="utf-8")
    docs = {corpus / "README.md": "# Dataset card\n\nLicensed under CC BY-SA.\n",
            corpus / "LICENSE": "Permission is hereby granted, free of charge, to any person obtaining a copy.\n",
            corpus / "sub" / "CITATION.cff": "cff-version: 1.2.0\ntitle: a corpus\n"}
    for path, text in docs.items():
        path.write_text(text, encoding="utf-8")
    (corpus / "readme_notes.txt").write_text("\n\n".join(_sentences(3, seed=2)) + "\n")  # not documentation
    with pytest.warns(UserWarning, match=r"skipping 3 documentation file\(s\) in input directory .*LICENSE"):
        files = expand_inputs([str(corpus)])
    assert files == [str(corpus / "a.txt"), str(corpus / "readme_notes.txt")]
    with pytest.warns(UserWarning, match="documentation"):
        manifest = preprocess([str(corpus)], str(tmp_path / "ds"), tok.path, progress=False)
    alone = preprocess([str(corpus / "a.txt"), str(corpus / "readme_notes.txt")], str(tmp_path / "ref"), tok.path,
                       progress=False)
    assert manifest["num_tokens"] == alone["num_tokens"] and json.dumps(manifest["report"]).count("README") == 0
    assert expand_inputs([str(corpus / "README.md")]) == [str(corpus / "README.md")]  # named: read
    only_docs = tmp_path / "only_docs"
    only_docs.mkdir()
    (only_docs / "README").write_text("about\n")
    with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match="no files besides documentation"):
        expand_inputs([str(only_docs)])
