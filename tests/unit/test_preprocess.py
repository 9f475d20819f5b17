"""Readers, sentence splitting, preprocessing into shards, manifest, verification, bad input handling."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import warnings

import numpy as np
import pytest

from pretrain.data.shards import ShardedDataset, verify_dataset
from pretrain.prep.preprocess import main, preprocess, split_sentences
from pretrain.prep.readers import ReadStats, read_file
from pretrain.prep.tokenizer import train_tokenizer

WORDS = ("alpha beta gamma delta river mountain forest city music science history language people "
         "government war king church island ocean planet").split()


def _sentence(rng):
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=rng.integers(7, 12))]
    return " ".join(words).capitalize() + "."


def _write_wiki(path, rng, n_docs):
    lines = []
    for d in range(n_docs):
        lines += [f'<doc id="{d}" url="u?curid={d}" title="T{d}">', f"Title number {d}", ""]
        for _ in range(rng.integers(1, 4)):
            lines.append(" ".join(_sentence(rng) for _ in range(rng.integers(1, 4))))
        lines += ["History.", " ".join(_sentence(rng) for _ in range(2)), "</doc>"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (root / "wiki").mkdir()
    for k in range(3):
        _write_wiki(root / "wiki" / f"wiki_{k:02d}", rng, 25)
    docs = ["\n".join(_sentence(rng) + " " + _sentence(rng) for _ in range(3)) for _ in range(15)]
    (root / "plain.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    with open(root / "data.jsonl", "w", encoding="utf-8") as f:
        for _ in range(10):
            f.write(json.dumps({"text": _sentence(rng) + " " + _sentence(rng), "id": 1}) + "\n")
    return root


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer([str(corpus)], str(out), vocab_size=200, min_frequency=1)


# ---------------------------------------------------------------------------------------------- splitting


@pytest.mark.parametrize("text,expected", [
    ("Mr. Smith paid $3.50 today. He left.", ["Mr. Smith paid $3.50 today.", "He left."]),
    ("It is e.g. red. Then i.e. blue! Why? Because.", ["It is e.g. red.", "Then i.e. blue!", "Why?", "Because."]),
    ("The U.S. Army was founded. J. R. R. Tolkien wrote No. 5 here.",
     ["The U.S. Army was founded.", "J. R. R. Tolkien wrote No. 5 here."]),
    ('"Stop." She ran. Pi is 3.14 roughly.', ['"Stop."', "She ran.", "Pi is 3.14 roughly."]),
    ("lower case. continues here", ["lower case. continues here"]),
    ("Dr. Who (b. 1963) is old... Very old.", ["Dr. Who (b. 1963) is old...", "Very old."]),
    ("  ", []),
])
def test_split_sentences(text, expected):
    assert split_sentences(text) == expected


def _spans_with_the_former_pattern(text):
    """sentence_spans with the boundary regex as first written, ``([.!?]+|…)`` behind a lookahead: the reference
    for the faster pattern (which starts with a plain character class)."""
    import re

    from pretrain.prep import sentence_split as ss

    boundary = re.compile(r"(?=[.!?\u2026])([.!?]+|\u2026)([\"'\u201d\u2019)\]]*)\s+"
                          r"(?=[\"'\u201c\u2018(\[]*[A-Z0-9\u00c0-\u00dd])")
    out, start, a = [], 0, len(text) - len(text.lstrip())
    for m in boundary.finditer(text):
        if m.group(1) == "." and ss._is_abbreviation(text, start, m):
            continue
        out.append((a, m.end(2)))
        start = a = m.end()
    b = len(text.rstrip())
    return out + [(a, b)] if b > a else out


def test_sentence_spans_equal_the_former_pattern_on_punctuation_soup():
    """Random strings dense in . ! ? …, closing quotes, abbreviations and capitals (where a run's first character
    decides which alternative matched), and the real wiki text: the same spans as the former pattern."""
    from pretrain.prep.sentence_split import sentence_spans

    pieces = [".", "!", "?", "\u2026", " ", "  ", "A", "b", "5", '"', "\u201d", ")", "(", "Mr", "U.S", "No", "e.g",
              "Messrs", "approx", "Sept", "Smithson", "pp",
              "x", "Word", "\u00c9"]
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(pieces, size=rng.integers(1, 30))) for _ in range(20000)]
    texts += ["Mr\u2026. Smith went.", "He said \u2026. Then", "Wait!\u2026 No.", "Huh\u2026! Yes.", "A\u2026\u2026 B",
              "x.\u2026 Y", "No\u2026. 5 then", "U.S\u2026. Army"]
    diffs = [t for t in texts if sentence_spans(t) != _spans_with_the_former_pattern(t)]
    assert not diffs, diffs[:5]
    assert sum(len(sentence_spans(t)) > 1 for t in texts) > 1000  # the soup does have boundaries


# ---------------------------------------------------------------------------------------------- readers


def test_wikiextractor_reader_drops_markup_title_headings(corpus):
    stats = ReadStats()
    docs = list(read_file(str(corpus / "wiki" / "wiki_00"), stats))
    assert len(docs) == 25
    text = "\n".join(p for d in docs for p in d.paragraphs)
    assert "<doc" not in text and "</doc>" not in text and "Title number" not in text and "History." not in text
    assert stats.skipped["wiki_heading"] == 25


def test_gutenberg_reader_strips_header_joins_wrapped_lines(tmp_path):
    body = ("The Project Gutenberg EBook of Test\r\nheader licence text\r\n\r\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK TEST ***\r\n\r\nCHAPTER I\r\n\r\n"
            "It was a dark and stormy\r\nnight; the rain fell in\r\ntorrents.\r\n\r\nSecond paragraph here.\r\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK TEST ***\r\nEnd of licence.\r\n")
    path = tmp_path / "book.txt"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    docs = list(read_file(str(path), ReadStats()))
    assert len(docs) == 1
    assert docs[0].paragraphs == ["CHAPTER I", "It was a dark and stormy night; the rain fell in torrents.",
                                  "Second paragraph here."]


def test_text_and_jsonl_readers(tmp_path):
    (tmp_path / "a.txt").write_text("\ufeffOne. Two.\nThree.\n\n\nFour.\r\n", encoding="utf-8")
    assert [d.paragraphs for d in read_file(str(tmp_path / "a.txt"), ReadStats())] == [["One. Two.", "Three."],
                                                                                        ["Four."]]
    (tmp_path / "b.jsonl").write_text('{"text": "A.\\nB."}\n{bad json\n{"other": 1}\n\n{"text": "C."}\n')
    stats = ReadStats()
    assert [d.paragraphs for d in read_file(str(tmp_path / "b.jsonl"), stats)] == [["A.", "B."], ["C."]]
    assert stats.skipped == {"bad_json": 2}


def test_bad_bytes_reported(tmp_path):
    good = b"Fine line one.\n"
    bad = b"Broken \xff\xfe byte here.\n"
    path = tmp_path / "bad.txt"
    path.write_bytes(good + bad + b"Has a NUL \x00 byte.\n" + b"x" * 5000 + b"\n" + b"Last line.\n")
    with pytest.raises(ValueError, match=rf"bad\.txt: invalid UTF-8 at byte offset {len(good) + 7}\b"):
        list(read_file(str(path), ReadStats(), max_line_bytes=1000))
    stats = ReadStats()
    docs = list(read_file(str(path), stats, errors="replace", max_line_bytes=1000))
    assert docs[0].paragraphs == ["Fine line one.", "Broken \ufffd\ufffd byte here.", "Last line."]
    assert stats.skipped == {"giant_line": 1, "nul_bytes": 1, "replaced_utf8": 1}
    stats = ReadStats()
    docs = list(read_file(str(path), stats, errors="skip", max_line_bytes=1000))
    assert docs[0].paragraphs == ["Fine line one.", "Last line."] and stats.skipped["invalid_utf8"] == 1


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    stats = ReadStats()
    with pytest.warns(UserWarning, match="empty"):
        assert list(read_file(str(tmp_path / "empty.txt"), stats)) == []
    assert stats.empty_files == [str(tmp_path / "empty.txt")]
    with pytest.raises(FileNotFoundError):
        list(read_file(str(tmp_path / "missing.txt"), stats))


# ---------------------------------------------------------------------------------------------- preprocess


def _expected(inputs, tokenizer, min_chars):
    """Independent path: reader → split → filter → encode, one list of id-lists per document."""
    from pretrain.prep.readers import iter_documents

    docs = []
    for doc in iter_documents(inputs):
        sents = [s for p in doc.paragraphs for s in split_sentences(p) if len(s) >= min_chars]
        ids = [tokenizer.encode(s) for s in sents]
        ids = [x for x in ids if x]
        if ids:
            docs.append(ids)
    return docs


def test_preprocess_contents_match_independent_tokenization(corpus, tokenizer, tmp_path):
    inputs = [str(corpus)]
    m = preprocess(inputs, str(tmp_path / "ds"), tokenizer.path, shard_size_tokens=400, chunk_chars=2000,
                   min_sentence_chars=8, progress=False)
    ds = ShardedDataset(str(tmp_path / "ds"), tokenizer_sha256=tokenizer.sha256)
    expected = _expected(inputs, tokenizer, 8)
    flat = [seq for doc in expected for seq in doc]
    assert len(m["shards"]) > 2 and len(ds) == len(flat) == m["num_sequences"]
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == seq
    np.testing.assert_array_equal(ds.doc_idx, np.concatenate([[0], np.cumsum([len(d) for d in expected])]))
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in flat])
    assert ds.num_documents == len(expected) == m["report"]["documents"]
    assert ds.num_tokens == sum(map(len, flat)) == m["report"]["tokens"]
    freq = ds.token_frequencies()
    counts = np.bincount(np.concatenate([np.asarray(s) for s in flat]), minlength=tokenizer.vocab_size)
    assert freq.dtype == np.float64 and freq.shape == (tokenizer.vocab_size,)
    np.testing.assert_allclose(freq, counts / counts.sum(), rtol=0, atol=1e-15)
    assert abs(freq.sum() - 1) < 1e-12
    assert m["tokenizer"]["sha256"] == tokenizer.sha256 and m["dtype"] == "uint8"
    assert m["report"]["skipped"]["wiki_heading"] == 75 and verify_dataset(str(tmp_path / "ds")) == []
    again = __import__("pickle").loads(__import__("pickle").dumps(ds))
    assert again[len(ds) - 1].tolist() == flat[-1]


def test_worker_count_gives_identical_shards(corpus, tokenizer, tmp_path):
    for w in (1, 2):
        preprocess([str(corpus)], str(tmp_path / f"w{w}"), tokenizer.path, num_workers=w, shard_size_tokens=500,
                   chunk_chars=1500, progress=False)
    names = sorted(os.listdir(tmp_path / "w1"))
    assert names == sorted(os.listdir(tmp_path / "w2")) and len(names) > 4
    for name in names:
        if name != "manifest.json":
            assert filecmp.cmp(tmp_path / "w1" / name, tmp_path / "w2" / name, shallow=False), name


def test_failed_run_leaves_nothing(corpus, tokenizer, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("Good sentence number one.\n\nAnother good one here.\n")
    (src / "b.txt").write_bytes(b"Bad \xc3\x28 utf8 here.\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"b\.txt: invalid UTF-8 at byte offset 4"):
        preprocess([str(src)], str(out), tokenizer.path, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no dataset, no partial directory
    m = preprocess([str(src)], str(out), tokenizer.path, errors="replace", progress=False)
    assert m["report"]["skipped"] == {"replaced_utf8": 1} and (out / "manifest.json").is_file()
    with pytest.raises(ValueError, match="--overwrite"):
        preprocess([str(src)], str(out), tokenizer.path, progress=False, errors="replace")
    with pytest.raises(FileNotFoundError):
        preprocess([str(src / "nope.txt")], str(tmp_path / "o2"), tokenizer.path, progress=False)
    (src / "c.txt").write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = preprocess([str(src)], str(out), tokenizer.path, errors="skip", overwrite=True, progress=False)
    assert m["report"]["empty_files"] == [str(src / "c.txt")] and m["report"]["skipped"] == {"invalid_utf8": 1}


def test_failure_with_worker_pool_leaves_nothing(corpus, tokenizer, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("Good sentence number one.\n\n" * 200)
    (src / "b.txt").write_bytes(b"Fine line here.\n" * 50 + b"\xff\n")
    with pytest.raises(ValueError, match=rf"b\.txt: invalid UTF-8 at byte offset {16 * 50}"):
        preprocess([str(src)], str(tmp_path / "out"), tokenizer.path, num_workers=2, chunk_chars=100,
                   progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_verify_and_dataset_errors(corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "ds"
    preprocess([str(corpus / "wiki")], str(out), tokenizer.path, shard_size_tokens=1000, progress=False)
    assert main(["--verify", str(out)]) == 0
    with pytest.raises(ValueError, match="re-run pretrain-preprocess with that tokenizer"):
        ShardedDataset(str(out), tokenizer_sha256="0" * 64)
    data = bytearray((out / "shard-00001.bin").read_bytes())
    data[3] ^= 1
    (out / "shard-00001.bin").write_bytes(bytes(data))
    problems = verify_dataset(str(out))
    assert len(problems) == 1 and "shard-00001" in problems[0] and "sha256" in problems[0]
    assert main(["--verify", str(out)]) == 1 and "shard-00001" in capsys.readouterr().err
    with open(out / "shard-00000.idx", "r+b") as f:
        f.truncate(100)
    assert any("shard-00000" in p for p in verify_dataset(str(out)))
    os.remove(out / "manifest.json")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ShardedDataset(str(out))
    assert "incomplete" in verify_dataset(str(out))[0]


@pytest.mark.parametrize("where", ["../outside", "absolute", "symlink"])
def test_manifest_paths_leading_out_of_the_dataset_are_refused(corpus, tokenizer, tmp_path, where):
    """A dataset someone else built names its files relative to itself: a shard or token_freq.npy in manifest.json
    that leads out of the directory ("..", an absolute path) is refused, not read. Shard files that are symlinks
    (shards kept on another filesystem, the manifest's names unchanged) are read and verify clean."""
    out = tmp_path / "ds"
    preprocess([str(corpus / "plain.txt")], str(out), tokenizer.path, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    (tmp_path / "outside").mkdir()
    for name in ("shard-00000.bin", "shard-00000.idx", "token_freq.npy"):
        shutil.move(str(out / name), str(tmp_path / "outside" / name))
    if where == "symlink":
        for name in ("shard-00000.bin", "shard-00000.idx", "token_freq.npy"):
            (out / name).symlink_to(tmp_path / "outside" / name)
    else:
        prefix = str(tmp_path / "outside") + "/" if where == "absolute" else "../outside/"
        manifest["shards"][0]["name"] = prefix + manifest["shards"][0]["name"]
        manifest["token_freq"]["file"] = prefix + manifest["token_freq"]["file"]
        (out / "manifest.json").write_text(json.dumps(manifest))
    if where == "symlink":
        assert len(ShardedDataset(str(out))) > 0 and verify_dataset(str(out)) == []
        return
    with pytest.raises(ValueError, match="outside"):
        ShardedDataset(str(out))
    problems = verify_dataset(str(out))
    assert len(problems) == 2 and all("outside" in p for p in problems), problems


def test_cli_end_to_end(corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main([str(corpus / "plain.txt"), str(corpus / "data.jsonl"), "--tokenizer", tokenizer.path,
               "--out", str(out), "--workers", "1", "--no-progress"])
    assert rc == 0 and "documents=25" in capsys.readouterr().out
    assert main([str(corpus / "plain.txt"), "--tokenizer", tokenizer.path, "--out", str(out)]) == 2


def test_real_books_and_wiki(data_dir, tmp_path):
    books = data_dir / "corpus" / "books" / "11-0.txt"
    wiki = data_dir / "corpus" / "wiki" / "text" / "AA" / "wiki_00"
    tok = train_tokenizer([str(books)], str(tmp_path / "tok.json"), vocab_size=500)
    m = preprocess([str(books), str(wiki)], str(tmp_path / "ds"), tok.path, progress=False)
    ds = ShardedDataset(str(tmp_path / "ds"))
    book = [tok.decode(ds[i]) for i in range(ds.doc_idx[1])]  # the whole book is document 0
    assert book[0].startswith("alice") and "chapter i" in " ".join(book[:5])  # header dropped, BOM gone
    assert not any("gutenberg" in s or "\r" in s for s in book)  # licence footer dropped, CRLF handled
    assert any("rabbit - hole" in s and "went straight on like a tunnel" in s for s in book)  # wrapped lines joined
    assert m["num_documents"] == ds.num_documents == 1 + 38 and m["report"]["skipped"]["wiki_heading"] > 100
    assert not any(tok.decode(ds[i]).startswith("< doc") for i in range(len(ds)))


def _reference_split(text: str) -> list[str]:
    """The splitting rule written plainly (strip every piece), as before sentence_spans existed."""
    from pretrain.prep.sentence_split import (
        _ABBREV_BEFORE_NUMBER,
        _ABBREVIATIONS,
        _ACRONYM,
        _BOUNDARY,
    )

    out, start = [], 0
    for m in _BOUNDARY.finditer(text):
        nxt = text[m.end(1)] if m.end(2) > m.end(1) else text[m.end():m.end() + 1]
        if m.group(1) == ".":
            dot = m.start(1)
            word = text[max(text.rfind(" ", start, dot) + 1, start):dot].lstrip("\"'(\u201c\u2018[")
            low = word.lower()
            if (low in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or _ACRONYM.fullmatch(word)
                    or (low in _ABBREV_BEFORE_NUMBER and nxt.isdigit())):
                continue
        if text[start:m.end(2)].strip():
            out.append(text[start:m.end(2)].strip())
        start = m.end()
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def test_sentence_spans_match_the_plain_rule_on_real_and_random_text(data_dir):
    """The fast span finder cuts exactly where the plainly written rule does: real Wikipedia paragraphs and
    random strings dense in dots, quotes, abbreviations, digits and odd whitespace."""
    from pretrain.prep.sentence_split import sentence_spans

    wiki = sorted((data_dir / "corpus" / "wiki").rglob("wiki_*"))[0]
    texts = [p for doc in read_file(str(wiki), ReadStats()) for p in doc.paragraphs][:4000]
    rng = np.random.default_rng(0)
    atoms = ["Mr", "No", "e.g", "U.S", "J", "word", "x", "5", "42", ".", "...", "!", "?", "\u2026", '"', "'",
             "\u201d", "(", ")", "[", " ", "  ", "\t", "\u00a0", "\u00c9cole", "Yes", "vol", "pp"]
    texts += ["".join(rng.choice(atoms, size=int(rng.integers(1, 40)))) for _ in range(20000)]
    for t in texts:
        spans = sentence_spans(t)
        assert [t[a:b] for a, b in spans] == _reference_split(t), t
        assert all(t[a:b] == t[a:b].strip() for a, b in spans)


def _edge_case_files(d):
    """One file per format, with what the readers must handle: BOM, CRLF, blank-line runs, NUL bytes, a giant
    line, an unclosed <doc>, text outside a doc, a title and headings, bad JSON."""
    d.mkdir(parents=True, exist_ok=True)
    paras = [f"Paragraph {i} says something. It has two sentences." for i in range(40)]
    text = "\ufeff" + "\r\n".join(paras[:5]) + "\r\n\r\n\r\n" + "\n".join(paras[5:12]) + "\n  \n\t\n"
    text += "\n".join(paras[12:20]) + "\nnul\x00line here\n" + "x" * 3000 + "\n" + "\n\n".join(paras[20:]) + "\n"
    (d / "a.txt").write_text(text, encoding="utf-8")
    wiki = []
    for k in range(12):
        wiki += [f'<doc id="{k}" title="T{k}">', f"T{k}", "", "History.", *(paras[k:k + 3] if k != 9 else [])]
        if k not in (5, 9):  # 5: unclosed with paragraphs, 9: unclosed without any
            wiki.append("</doc>")
        if k == 7:
            wiki.append("Stray text outside of any document, long enough not to be a heading.")
    wiki += ['<doc id="99">', "T99"]  # opened, never closed, no paragraphs
    (d / "wiki_00").write_text("\n".join(wiki) + "\n", encoding="utf-8")
    jsonl = [json.dumps({"text": "\n".join(paras[k:k + 2])}) for k in range(30)]
    jsonl.insert(4, "{not json")
    jsonl.insert(9, json.dumps({"other": 1}))
    (d / "c.jsonl").write_text("\n".join(jsonl) + "\n", encoding="utf-8")
    book = ["Header line", "*** START OF THE BOOK ***", *[p + "\nwrapped." for p in paras[:10]], "*** END OF IT ***"]
    (d / "book.txt").write_text("\n\n".join(book) + "\n", encoding="utf-8")
    return sorted(d.iterdir())


@pytest.mark.parametrize("target", [1, 7, 64, 333, 100_000])
def test_reading_a_file_in_planned_ranges_gives_exactly_its_documents_and_counts(tmp_path, target):
    """Workers read byte ranges of a file: cut only where the reader starts afresh, the ranges read one after
    another give read_file's documents and skipped-line counts, for every format and any range size."""
    from pretrain.prep.readers import plan_ranges, read_range, sniff_format

    for path in _edge_case_files(tmp_path / "in"):
        whole_stats = ReadStats()
        whole = [d.paragraphs for d in read_file(str(path), whole_stats, max_line_bytes=1000)]
        kind = sniff_format(str(path), max_line_bytes=1000)
        ranges = plan_ranges(str(path), kind, target, max_line_bytes=1000)
        assert ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if target == 1 and kind != "gutenberg":
            assert len(ranges) > 3, (path.name, ranges)
        stats = ReadStats()
        parts = [d.paragraphs for start, end, before in ranges
                 for d in read_range(str(path), start, end, kind, stats, ends_before_doc=before, max_line_bytes=1000)]
        assert parts == whole, (path.name, target)
        assert stats.skipped == whole_stats.skipped, (path.name, target)
        assert whole, path.name


def test_sniffed_formats_of_the_edge_case_files(tmp_path):
    from pretrain.prep.readers import sniff_format

    kinds = {p.name: sniff_format(str(p)) for p in _edge_case_files(tmp_path)}
    assert kinds == {"a.txt": "text", "book.txt": "gutenberg", "c.jsonl": "jsonl", "wiki_00": "wikiextractor"}


def test_cli_warnings_are_one_line(tmp_path, tiny_corpus):
    """An empty input file: one 'pretrain-preprocess: warning: ...' line before the error, no Python
    'UserWarning' with its source line."""
    import subprocess
    import sys

    (tmp_path / "empty.txt").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "pretrain.prep.preprocess", str(tmp_path / "empty.txt"),
                           "--tokenizer", tiny_corpus["tokenizer"], "--out", str(tmp_path / "ds"), "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"pretrain-preprocess: warning: skipping empty input file {tmp_path / 'empty.txt'}" in proc.stderr
    assert "UserWarning" not in proc.stderr and proc.stderr.count("\n") == 2, proc.stderr


def test_sentence_spans_equal_the_former_pattern_on_real_text(data_dir):
    """Two real wiki files and two books, paragraph by paragraph (~25k paragraphs)."""
    from pretrain.prep.sentence_split import sentence_spans

    corpus = data_dir / "corpus"
    files = sorted((corpus / "wiki").rglob("wiki_*"))[:2] + sorted((corpus / "books").glob("*.txt"))[:2]
    paragraphs = [p for f in files for doc in read_file(str(f), ReadStats()) for p in doc.paragraphs]
    assert len(paragraphs) > 5000
    assert all(sentence_spans(p) == _spans_with_the_former_pattern(p) for p in paragraphs)


def _worker_tokenizer_marker(_):
    from pretrain.prep import preprocess as pp

    return getattr(pp._WORKER["processor"].tokenizer, "marker", None)


def test_forked_workers_inherit_the_tokenizer_and_others_load_it(tokenizer):
    """A forked worker's initializer gets the main process's tokenizer object itself (an attribute set on it here
    is there in the worker, so it was not loaded again); another start method passes it pickled, which loads the
    file (a new object, the same SHA-256) and refuses a file whose SHA-256 is not the expected one."""
    import multiprocessing as mp
    import pickle

    from pretrain.prep import preprocess as pp

    tokenizer.marker = "main process's object"
    try:
        with mp.get_context("fork").Pool(2, initializer=pp._init_worker, initargs=(tokenizer, 8, {})) as pool:
            assert pool.map(_worker_tokenizer_marker, range(2)) == ["main process's object"] * 2
        loaded = pickle.loads(pickle.dumps(tokenizer))  # what a spawned worker receives
        assert loaded is not tokenizer and loaded.sha256 == tokenizer.sha256 and not hasattr(loaded, "marker")
        state = tokenizer.__getstate__() | {"sha256": "0" * 64}
        with pytest.raises(ValueError, match="SHA-256|sha256"):
            type(tokenizer).__new__(type(tokenizer)).__setstate__(state)  # not the expected file: refused
    finally:
        del tokenizer.marker
        pp._WORKER.clear()


def _write_per_document(directory, vocab_size, shard_size_tokens, results):
    """The shard writer as first written, the reference: one add_items + end_document a document, a new shard
    after the document that reaches shard_size_tokens."""
    from pretrain.data.indexed import IndexedDatasetBuilder

    shards, builder = [], None
    for r in results:
        sent_end = np.cumsum(r.doc_sentences)
        tok_end = np.concatenate([[0], np.cumsum(r.sizes, dtype=np.int64)])
        s0 = 0
        for n, s1 in zip(r.doc_sentences, sent_end):
            if n == 0:
                continue
            if builder is None:
                builder = IndexedDatasetBuilder(str(directory / f"shard-{len(shards):05d}"), vocab_size)
            builder.add_items(r.flat_ids[tok_end[s0]:tok_end[s1]], r.sizes[s0:s1])
            builder.end_document()
            s0 = s1
            if builder.num_tokens >= shard_size_tokens:
                shards.append(builder.finalize())
                builder = None
    if builder is not None and builder.num_sequences:
        shards.append(builder.finalize())
    return shards


def test_shard_writer_writes_the_per_document_reference_files(tmp_path):
    """Chunks of documents (some dropped: no sentences) written a shard's run of documents at a time give the
    same shard files, byte for byte, as one document at a time: shard sizes from 1 token to more than the input."""
    import filecmp

    from pretrain.prep.preprocess import ChunkResult, _ShardWriter

    rng = np.random.default_rng(0)
    results = []
    for _ in range(12):
        docs = rng.integers(0, 5, size=rng.integers(0, 9))  # sentences per document, 0 = dropped
        sizes = rng.integers(1, 7, size=int(docs.sum())).astype(np.int32)
        flat = rng.integers(0, 50, size=int(sizes.sum())).astype(np.int32)
        results.append(ChunkResult(flat, sizes, docs.astype(np.int64), 0, 0, 0))
    results.append(ChunkResult(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(3, np.int64), 0, 0, 0))
    total = sum(int(r.sizes.sum()) for r in results)
    for shard_size in (1, 5, 17, 40, total - 1, total, 10 * total):
        ref, got = tmp_path / f"ref{shard_size}", tmp_path / f"got{shard_size}"
        ref.mkdir(), got.mkdir()
        want = _write_per_document(ref, 50, shard_size, results)
        writer = _ShardWriter(got, 50, shard_size)
        for r in results:
            writer.add(r)
        assert [{k: v for k, v in shard.items() if k != "name"} for shard in writer.close()] == want
        names = sorted(p.name for p in ref.iterdir())
        assert names == sorted(p.name for p in got.iterdir()) and len(names) == 2 * len(want)
        assert all(filecmp.cmp(ref / n, got / n, shallow=False) for n in names)
    assert len(_write_per_document(tmp_path / "ref1", 50, 1, [])) == 0
