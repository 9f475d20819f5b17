"""Tokenizer training/loading: special ids, no specials in encode, pickling, word starts, spm equivalence."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest

from pretrain.data.tokenizer import SPECIAL_TOKENS, Tokenizer, load_tokenizer, main, train_tokenizer

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
