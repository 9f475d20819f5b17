"""Three small preprocessing fixes: dictionary-encoded parquet text columns are text, ``pretrain-tokenizer`` says
how many lines it changed (invalid UTF-8 replaced), and a corrupt bzip2 block is named by every reader of
compressed files (data.sentences, data.pairs, the preprocessing readers)."""

from __future__ import annotations

import bz2
import gzip
import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from pretrain.data.pairs import read_pairs  # noqa: E402
from pretrain.data.sentences import _read_lines  # noqa: E402
from pretrain.prep.preprocess import preprocess  # noqa: E402
from pretrain.prep.readers import ReadStats, plan_parts, read_file, read_part  # noqa: E402
from pretrain.prep.tokenizer import main as tokenizer_main  # noqa: E402
from pretrain.prep.tokenizer import train_tokenizer  # noqa: E402

WORDS = "alpha beta gamma delta river mountain forest city music science history language people".split()


def _docs(n: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["\n".join(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 9)).capitalize() + "."
                      for _ in range(rng.integers(1, 4))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- 1. dictionary


@pytest.mark.parametrize("container", ["parquet", "arrow"])
def test_dictionary_and_large_string_text_columns_give_the_string_columns_dataset(tmp_path, container):
    """pandas categoricals (dictionary<values=string>) and large_string columns hold the same text as a string
    column: the same shards byte for byte, nulls counted alike."""
    docs = _docs()
    texts = docs[:3] + [None] + docs[3:] + docs[:5]  # a null, and repeated values (what dictionaries share)
    (tmp_path / "plain.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    tok = train_tokenizer([str(tmp_path / "plain.txt")], str(tmp_path / "tok.json"), vocab_size=120,
                          min_frequency=1)
    columns = {
        "string": pa.array(texts, pa.string()),
        "large_string": pa.array(texts, pa.large_string()),
        "dictionary": pa.array(texts, pa.string()).dictionary_encode(),
        "dictionary_large": pa.array(texts, pa.large_string()).dictionary_encode(),
    }
    manifests = {}
    for name, column in columns.items():
        table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": column})
        path = tmp_path / f"{name}.{container}"
        if container == "parquet":
            pq.write_table(table, path, row_group_size=6)
            read_as = pq.ParquetFile(path).schema_arrow.field("text").type  # (dictionaries of large_string: string)
            assert pa.types.is_dictionary(read_as) == pa.types.is_dictionary(column.type)
        else:
            with pa.ipc.new_file(str(path), table.schema) as w:
                for batch in table.to_batches(max_chunksize=6):
                    w.write_batch(batch)
        # the planner's pass over a cut row group's text (row sizes) reads the column too
        parts = plan_parts(str(path), 200)
        assert any(p.end - p.start < 6 for p in parts), name  # groups of 6 rows were cut into row slices
        assert [d.paragraphs for p in parts for d in read_part(p, ReadStats())] == [
            [line for line in doc.split("\n")] for doc in texts if doc], name
        out = tmp_path / f"ds_{name}"
        manifests[name] = preprocess([str(path)], str(out), tok.path, shard_size_tokens=300, chunk_chars=200,
                                     num_workers=1, progress=False)
    ref = manifests["string"]
    assert len(ref["shards"]) > 1 and ref["report"]["skipped"] == {"null_text": 1}
    for name, m in manifests.items():
        assert [s["bin_sha256"] for s in m["shards"]] == [s["bin_sha256"] for s in ref["shards"]], name
        assert [s["idx_sha256"] for s in m["shards"]] == [s["idx_sha256"] for s in ref["shards"]], name
        assert m["report"]["skipped"] == ref["report"]["skipped"], name


def test_dictionary_of_integers_is_still_not_text(tmp_path):
    path = tmp_path / "codes.arrow"  # (parquet reads an integer dictionary back as plain integers)
    table = pa.table({"text": pa.array([1, 2, 1]).dictionary_encode()})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    with pytest.raises(ValueError, match=r"column 'text' has type dictionary<values=int64.*not text"):
        list(read_file(str(path), ReadStats()))


# ---------------------------------------------------------------------------------------------- 2. tokenizer


def test_pretrain_tokenizer_reports_the_lines_it_replaced(tmp_path, capsys):
    """pretrain-tokenizer reads with --errors replace: it says how many lines it changed, and where the first one
    is (its byte offset, in the decompressed bytes for a stream), as pretrain-preprocess reports its skipped lines."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_bytes("".join(d.replace("\n", " ") + "\n" for d in _docs(30)).encode())
    bad = (b"A fine first sentence here.\n\nA second document.\nIts second line.\n\n"
           b"Then \xff\xfe broken bytes appear.\nAnd \xc3 again.\nThe end.\n")
    (inputs / "b.txt").write_bytes(bad)

    def run(*inputs) -> str:
        assert tokenizer_main([*map(str, inputs), "--out", str(tmp_path / "tok.json"), "--vocab-size", "120",
                               "--min-frequency", "1", "--no-progress"]) == 0
        return "".join(capsys.readouterr())

    text = run(inputs)
    offset = bad.index(b"\xff")
    assert "skipped lines: replaced_utf8=2" in text, text
    assert f"the first: {inputs / 'b.txt'}: invalid UTF-8 at byte offset {offset}\n" in text, text
    (inputs / "b.txt").unlink()
    (inputs / "c.txt.gz").write_bytes(gzip.compress(bad))  # a stream: the file is named
    text = run(inputs)
    assert "skipped lines: replaced_utf8=2" in text, text  # a stream: its offset in the decompressed bytes
    assert f"the first: {inputs / 'c.txt.gz'}: invalid UTF-8 at byte offset {offset} of the decompressed stream\n" \
        in text, text
    text = run(inputs / "a.txt")
    assert "skipped lines" not in text and "UTF-8" not in text and "wrote" in text, text


# ---------------------------------------------------------------------------------------------- 3. bzip2


def _corrupt_bz2(text: bytes) -> bytes:
    """bzip2 of ``text`` in 100 kB blocks with the stored CRC of its second block wrong: the first 8 KiB (what
    ``identify`` reads) and the text itself decompress, and bz2 raises its bare OSError("Invalid data stream") at
    the end of that block (a flipped bit among the coded data would give garbage lines first)."""
    assert len(text) > 300_000
    bits = np.unpackbits(np.frombuffer(bz2.compress(text, compresslevel=1), np.uint8))
    magic = format(0x314159265359, "048b")  # a block's start (bit-aligned), followed by its 32-bit CRC
    second = "".join(map(str, bits)).index(magic, 32 + 48)
    bits[second + 48 + 7] ^= 1
    return np.packbits(bits).tobytes()


def _lines(n: int = 9000) -> list[str]:
    rng = np.random.default_rng(1)
    return [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 8)) for _ in range(n)]


def test_corrupt_bz2_block_is_named_by_the_sentence_and_pair_readers(tmp_path):
    lines = _lines()
    (tmp_path / "s.txt.bz2").write_bytes(_corrupt_bz2("".join(s + "\n" for s in lines).encode()))
    with pytest.raises(ValueError, match=r"s\.txt\.bz2: the bzip2 stream is truncated or corrupt"):
        _read_lines(str(tmp_path / "s.txt.bz2"))
    (tmp_path / "p.tsv.bz2").write_bytes(_corrupt_bz2("".join(f"{s}\t{s[::-1]}\n" for s in lines).encode()))
    with pytest.raises(ValueError, match=r"p\.tsv\.bz2: the bzip2 stream is truncated or corrupt"):
        read_pairs(str(tmp_path / "p.tsv.bz2"))
    (tmp_path / "p.jsonl.bz2").write_bytes(_corrupt_bz2(
        "".join(json.dumps({"anchor": s, "positive": s[::-1]}) + "\n" for s in lines).encode()))
    with pytest.raises(ValueError, match=r"p\.jsonl\.bz2: the bzip2 stream is truncated or corrupt"):
        read_pairs(str(tmp_path / "p.jsonl.bz2"))
    # the preprocessing readers, which named it before (their own workaround, now STREAM_ERRORS)
    with pytest.raises(ValueError, match=r"s\.txt\.bz2: the bzip2 stream is truncated or corrupt"):
        list(read_file(str(tmp_path / "s.txt.bz2"), ReadStats()))


def test_an_io_error_reading_a_plain_file_is_not_called_a_corrupt_stream():
    """STREAM_ERRORS holds OSError (bz2's bad-data error is a bare one); a plain file's OSError keeps its words."""
    from pretrain.data.containers import STREAM_ERRORS, read_or_raise, stream_error

    assert OSError in STREAM_ERRORS

    def fail(*_):
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        read_or_raise("f.txt", "", fail)
    msg = str(stream_error("f.txt", "", OSError(5, "Input/output error")))
    assert "f.txt" in msg and "stream" not in msg and "Input/output error" in msg
