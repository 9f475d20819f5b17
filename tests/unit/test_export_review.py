"""What a user hands the Hugging Face conversion, checked against transformers and sentence-transformers themselves:
an MLM decoder not tied to the word embeddings (warned: ours always ties), weights kept only as a pickle
(pytorch_model.bin: refused, never unpickled), a sentence-transformers model that lowercases its input
(sentence_bert_config.json do_lower_case: tokenized as SentenceTransformer does), a ModernBERT export with a RoBERTa
vocabulary (its special ids stated), an MLM copy named outside the directory (refused), a ModernBERT classifier's
head.* (not an MLM head) and a BERT decoder (refused: causal attention is not our encoder's)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from conftest import train_roberta_tokenizer  # noqa: E402
from test_hf_convert import SENTENCES, _local_tokenizer  # noqa: E402

from pretrain.config.model import ModelConfig  # noqa: E402
from pretrain.eval.encoder import SentenceEncoder, load_sentence_encoder  # noqa: E402
from pretrain.export import hf as hfmod  # noqa: E402
from pretrain.export import resolve  # noqa: E402
from pretrain.export.convert import main as convert_main  # noqa: E402
from pretrain.model import build_model  # noqa: E402
from pretrain.prep.embedded import write_embedded_corpus  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 96
"""Above the test tokenizer's 80 tokens (test_hf_convert._local_tokenizer)."""
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48}


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    _local_tokenizer(path)
    return path


def _mlm_model(family: str, tied: bool):
    """A transformers *ForMaskedLM of ``family`` initialised by transformers, its decoder tied or its own."""
    torch.manual_seed(0)
    if family == "modernbert":
        config = transformers.ModernBertConfig(vocab_size=VOCAB, local_attention=8, global_attn_every_n_layers=2,
                                               pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
                                               eos_token_id=3, tie_word_embeddings=tied, **TINY)
        return transformers.ModernBertForMaskedLM(config).eval()
    cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig}[family]
    config = cls(vocab_size=VOCAB, max_position_embeddings=34, pad_token_id=1 if family == "roberta" else 0,
                 tie_word_embeddings=tied, **TINY)
    model = {"bert": transformers.BertForMaskedLM, "roberta": transformers.RobertaForMaskedLM}[family](config)
    return model.eval()


@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_an_untied_mlm_decoder_is_warned_about(family, wordpiece, tmp_path):
    """Our MLM head reads the word embeddings; a source whose decoder is its own matrix (tie_word_embeddings=false)
    loses it, and its MLM logits change: said once when the weights are opened (init_from, from-hf, eval), not
    silently. The encoder is taken over exactly either way; a tied source opens without a warning."""
    ids_BT = torch.tensor([[2, 7, 9, 11, 3, 0], [2, 8, 3, 0, 0, 0]])
    if family == "roberta":
        ids_BT = torch.where(ids_BT == 0, 1, ids_BT)
    mask_BT = (ids_BT != (1 if family == "roberta" else 0)).long()
    keep_BT = mask_BT.bool()
    for tied in (True, False):
        hf = _mlm_model(family, tied)
        with torch.no_grad():
            decoder = hf.get_output_embeddings()
            if not tied:  # transformers draws both from one init; make the decoder its own
                decoder.weight.add_(0.5 * torch.randn_like(decoder.weight))
        d = tmp_path / f"{family}-{tied}"
        hf.save_pretrained(str(d))
        shutil.copy(wordpiece, d / "tokenizer.json")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = resolve.open_weights(d).build_model().eval()
        said = [str(w.message) for w in caught if "not tied" in str(w.message)]
        assert len(said) == (0 if tied else 1), said
        with torch.no_grad():
            ref = hf(input_ids=ids_BT, attention_mask=mask_BT, output_hidden_states=True)
            h_BTD = model.encode(ids_BT, mask_BT)
            logits_MV, _ = model.mlm_logits(h_BTD, torch.where(keep_BT, ids_BT, -100))
        assert (h_BTD - ref.hidden_states[-1])[keep_BT].abs().max() < 1e-5
        assert ((logits_MV - ref.logits[keep_BT]).abs().max() < 1e-4) == tied  # what the warning is about


class _Planted:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("content", ["tensors", "planted"])
def test_weights_kept_only_as_a_pickle_are_refused_never_unpickled(content, wordpiece, tmp_path, capsys):
    """A directory with pytorch_model.bin and no model.safetensors (a plain tensor dict, or a pickle that would run
    code): from-hf, open_weights and a sentence-transformers Dense module refuse it with a ValueError saying how
    to re-save it, without unpickling (no torch.load, not even weights_only=True); the CLI says so in one line."""
    hf = _mlm_model("bert", True)
    d = tmp_path / "hf"
    hf.save_pretrained(str(d))
    shutil.copy(wordpiece, d / "tokenizer.json")
    (d / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    if content == "tensors":
        torch.save(hf.state_dict(), d / "pytorch_model.bin")
    else:
        planted = {"bert.embeddings.word_embeddings.weight": _Planted(marker)}
        (d / "pytorch_model.bin").write_bytes(pickle.dumps(planted))
    with pytest.raises(ValueError, match="never unpickles"):
        resolve.open_weights(d)
    assert convert_main(["from-hf", str(d), str(tmp_path / "init")]) == 2
    assert "never unpickles" in capsys.readouterr().err
    assert not (tmp_path / "init").exists() and not marker.exists()

    # a sentence-transformers model whose Dense module has only a pickle
    model = build_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_size=48,
                                    max_position=34, pooling="mean", dense_dim=8), seed=1)
    st_dir = tmp_path / "st"
    hfmod.export_hf(model, str(wordpiece), str(st_dir), mlm_head=False)
    dense = st_dir / "2_Dense"
    assert (dense / "model.safetensors").is_file()
    (dense / "model.safetensors").unlink()
    if content == "tensors":
        torch.save({k.removeprefix("sentence_dense."): v for k, v in model.state_dict().items()
                    if k.startswith("sentence_dense.")}, dense / "pytorch_model.bin")
    else:
        (dense / "pytorch_model.bin").write_bytes(pickle.dumps({"linear.weight": _Planted(marker)}))
    with pytest.raises(ValueError, match="never unpickles"):
        resolve.open_weights(st_dir)
    assert not marker.exists()


def test_a_sentence_transformers_model_that_lowercases_its_input(wordpiece, tmp_path, monkeypatch):
    """sentence_bert_config.json's do_lower_case=true: SentenceTransformer lowercases the text before a cased
    tokenizer sees it. Our tokenizer for the directory (eval, from-hf's tokenizer.json, the cached copy) does the
    same, so that our embeddings of cased text are SentenceTransformer's; a later change of the flag is seen."""
    st_mod = pytest.importorskip("sentence_transformers")
    from tokenizers import Tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cased = json.loads(wordpiece.read_text())
    cased["normalizer"] = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                           "strip_accents": None, "lowercase": False}
    (tmp_path / "cased.json").write_text(json.dumps(cased))
    model = build_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_size=48,
                                    max_position=34, pooling="mean", normalize=True), seed=3).eval()
    out = tmp_path / "st"
    hfmod.export_hf(model, str(tmp_path / "cased.json"), str(out))
    texts = [s.upper() for s in SENTENCES[:3]] + ["Hello World"]

    def ours():
        w = resolve.open_weights(out)
        return torch.from_numpy(SentenceEncoder(w.build_model().eval(), w.load_tokenizer(), pooling="mean",
                                                max_len=32)(texts))

    def theirs():
        return st_mod.SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_tensor=True)

    assert (ours() - theirs()).abs().max() < 1e-5  # cased as exported (and cached so)
    unk = Tokenizer.from_file(str(tmp_path / "cased.json")).token_to_id("[UNK]")
    assert unk in Tokenizer.from_file(str(tmp_path / "cased.json")).encode(texts[0]).ids  # upper case is unknown
    config = json.loads((out / "sentence_bert_config.json").read_text())
    (out / "sentence_bert_config.json").write_text(json.dumps({**config, "do_lower_case": True}))
    want = theirs()
    assert (ours() - want).abs().max() < 1e-5
    hf_backend = load_sentence_encoder(out, "mean", backend="transformers", max_len=32)  # the reference path too
    assert (torch.from_numpy(hf_backend(texts)) - want).abs().max() < 1e-5
    assert convert_main(["from-hf", str(out), str(tmp_path / "init")]) == 0
    tok = Tokenizer.from_file(str(tmp_path / "init" / "tokenizer.json"))
    assert unk not in tok.encode(texts[0]).ids


def test_a_modernbert_export_states_its_tokenizers_special_ids(tmp_path):
    """A ModernBERT trained with a RoBERTa vocabulary (<s> <pad> </s> ...): config.json's pad/cls/sep/bos/eos ids
    are that tokenizer's, as the BERT and RoBERTa exports state them (not None for want of [PAD])."""
    train, _ = write_embedded_corpus(tmp_path / "text")
    tok_path = train_roberta_tokenizer(train.read_text(encoding="utf-8").splitlines(), tmp_path / "tokenizer.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    model = build_model(ModelConfig(arch="modernbert", pooler=False, vocab_size=hf_tok.backend_tokenizer
                                    .get_vocab_size(with_added_tokens=True), hidden_size=32, num_layers=2, num_heads=4,
                                    ffn_size=48, max_position=64, local_window=8), seed=0)
    out = tmp_path / "hf"
    hfmod.export_hf(model, str(tok_path), str(out))
    ids = {name: hf_tok.convert_tokens_to_ids(t) for name, t in
           (("pad", "<pad>"), ("cls", "<s>"), ("sep", "</s>"))}
    assert None not in ids.values()
    for where in (out, out / "mlm"):
        config = transformers.AutoConfig.from_pretrained(str(where))
        assert (config.pad_token_id, config.cls_token_id, config.sep_token_id, config.bos_token_id,
                config.eos_token_id) == (ids["pad"], ids["cls"], ids["sep"], ids["cls"], ids["sep"])


@pytest.mark.parametrize("where", ["..", "symlink"])
def test_an_mlm_copy_outside_the_directory_is_refused(where, wordpiece, tmp_path):
    """config.json's "pretrain": {"mlm_head": NAME} names the MLM copy inside the export; a name that leads out of
    it ("..", or a folder that is a symlink out) is refused, not read as the model's MLM head."""
    model = build_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_size=48,
                                    max_position=34), seed=2)
    out = tmp_path / "parent" / "hf"
    hfmod.export_hf(model, str(wordpiece), str(out))
    assert resolve.open_weights(out).state.keys() >= {"mlm_head.dense.weight"}
    if where == "..":
        shutil.copy(out / "mlm" / "model.safetensors", out.parent / "model.safetensors")
        config = json.loads((out / "config.json").read_text())
        config["pretrain"]["mlm_head"] = ".."
        (out / "config.json").write_text(json.dumps(config))
    else:
        shutil.move(str(out / "mlm"), str(tmp_path / "elsewhere"))
        (out / "mlm").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="outside"):
        resolve.open_weights(out)


def test_a_modernbert_classifiers_head_is_not_taken_for_an_mlm_head(wordpiece, tmp_path):
    """ModernBertForSequenceClassification keeps its classifier's dense + norm under head.*, the names of
    ModernBertForMaskedLM's MLM head (whose decoder.* it lacks): its encoder is taken over exactly, its head is
    not (no MLM head in from-hf's init directory nor in to-hf's export of it)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.ModernBertConfig(vocab_size=VOCAB, local_attention=8, global_attn_every_n_layers=2,
                                           pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
                                           eos_token_id=3, num_labels=3, **TINY)
    hf = transformers.ModernBertForSequenceClassification(config).eval()
    d = tmp_path / "hf"
    hf.save_pretrained(str(d))
    shutil.copy(wordpiece, d / "tokenizer.json")
    w = resolve.open_weights(d)
    assert not any(k.startswith("mlm_head.") for k in w.state)
    ids_BT = torch.tensor([[2, 7, 9, 11, 3], [2, 8, 3, 0, 0]])
    mask_BT = (ids_BT != 0).long()
    with torch.no_grad():
        h_BTD = w.build_model(warn_fresh_head=False).eval().encode(ids_BT, mask_BT)
        ref_BTD = hf.model(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
    assert (h_BTD - ref_BTD)[mask_BT.bool()].abs().max() < 1e-5
    assert convert_main(["from-hf", str(d), str(tmp_path / "init")]) == 0
    assert not any(k.startswith("mlm_head.") for k in load_file(str(tmp_path / "init" / "model.safetensors")))
    assert convert_main(["to-hf", str(tmp_path / "init"), str(tmp_path / "back")]) == 0
    assert not (tmp_path / "back" / "mlm").exists()


@pytest.mark.parametrize("cross", [False, True], ids=["causal", "cross-attention"])
def test_a_bert_decoder_is_refused(cross, wordpiece, tmp_path, capsys):
    """A BERT with is_decoder (BertLMHeadModel: causal self-attention; with or without cross-attention) computes
    something our bidirectional encoder does not: refused by name, as a RoBERTa decoder is, not converted into
    other outputs."""
    config = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=34, pad_token_id=0, is_decoder=True,
                                     add_cross_attention=cross, **TINY)
    d = tmp_path / "hf"
    transformers.BertLMHeadModel(config).save_pretrained(str(d))
    shutil.copy(wordpiece, d / "tokenizer.json")
    with pytest.raises(ValueError, match="is_decoder=true: a BERT decoder does not convert"):
        resolve.open_weights(d)
    assert convert_main(["from-hf", str(d), str(tmp_path / "init")]) == 2
    assert "a BERT decoder does not convert" in capsys.readouterr().err


def test_a_handed_tokenizer_runs_no_code_even_when_the_user_says_yes(tmp_path):
    """A directory with only vocab.txt goes through AutoTokenizer; one whose tokenizer_config.json names its own
    code (auto_map) made transformers ask "run the custom code? [y/N]", and a "y" ran it. Now it is refused."""
    import subprocess
    import sys

    d = tmp_path / "tokrc"
    d.mkdir()
    marker = tmp_path / "ran"
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                               "from transformers import BertTokenizerFast as EvilTok\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTok", None]},
                                                         "tokenizer_class": "EvilTok"}))
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    code = ("import sys; from pretrain.export.hf_tokenizer import write_clean_tokenizer; "
            f"write_clean_tokenizer({str(d)!r}, {str(tmp_path / 'out.json')!r})")
    proc = subprocess.run([sys.executable, "-c", code], input="y\ny\n", capture_output=True, text=True,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf")}, timeout=120)
    assert proc.returncode != 0 and not marker.exists() and not (tmp_path / "out.json").exists(), proc.stderr[-2000:]


def test_the_model_card_copies_no_file_from_outside_the_run_directory(tmp_path):
    """The card quotes the run's eval reports; a report that is a symlink out of a handed run directory put the
    linked file (anything the user can read) into the README.md they publish."""
    from pretrain.export.model_card import _evaluations

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-KEY-abc123")
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "eval.md").symlink_to(secret)
    (run / "eval2").mkdir()
    (run / "eval2" / "eval.md").write_text("| STS-B | 80.1 |")
    (run / "eval2" / "eval.json").symlink_to(tmp_path / "secret.json")  # nor what an eval.json beside it links to
    (tmp_path / "secret.json").write_text('{"args": {"pooling": "SECRET-POOLING"}}')
    text = "\n".join(_evaluations(run, tmp_path / "hf", "mean"))
    assert "SECRET" not in text and "80.1" in text
