"""RoBERTa and pre-LN out to Hugging Face and back (model.arch=bert with model.position_offset / model.norm=pre).

``from-hf`` of a RobertaModel / RobertaForMaskedLM that transformers initialised itself is exact both ways (CLI
included); ours computes its outputs (to 1e-5, fp32) on real wiki1m sentences in a padded batch, and packed (the
unpadded path) the same; the export loads as RobertaModel, RobertaForMaskedLM (mlm/) and a SentenceTransformer with
no load report. A pre-LN model (positions from 0 or RoBERTa's) exports to transformers' RobertaPreLayerNorm, exact
both ways. A tiny byte-level BPE tokenizer with RoBERTa's special tokens is trained here (no downloads).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from conftest import save_roberta_dir, train_roberta_tokenizer
from test_hf_convert import _quietly

from pretrain.config.model import ModelConfig
from pretrain.export import hf as hfmod
from pretrain.export import resolve
from pretrain.export.convert import main as convert_main
from pretrain.model import build_model
from pretrain.model.packing import pack

transformers = pytest.importorskip("transformers")
LOAD_COMPLAINTS = re.compile(r"unexpected|missing|newly initiali[sz]ed|not used|not initiali[sz]ed", re.IGNORECASE)


@pytest.fixture(scope="module")
def sentences(data_dir) -> list[str]:
    """8 wiki1m sentences and one text of several joined (a padded batch of very different lengths)."""
    lines = [x for x in (data_dir / "corpus" / "wiki1m" / "wiki1m_for_simcse.txt").read_text(
        encoding="utf-8").splitlines()[:400] if x.strip()]
    return lines[:8] + [" ".join(lines[8:11])]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    """RoBERTa-like BPE trained on the embedded corpus (no shared data needed)."""
    from pretrain.prep.embedded import write_embedded_corpus

    root = tmp_path_factory.mktemp("bpe")
    train, _ = write_embedded_corpus(root / "text")
    return train_roberta_tokenizer(train.read_text(encoding="utf-8").splitlines(), root / "tokenizer.json")


def _roberta_config(family: str = "roberta", **kw):
    cls = transformers.RobertaConfig if family == "roberta" else transformers.RobertaPreLayerNormConfig
    return cls(**{"vocab_size": 600, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "max_position_embeddings": 66, "type_vocab_size": 1,
                  "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, **kw})


def _randomise_norms(model) -> None:
    """Norms and biases away from 1/0, so that a swapped key shows."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _batch(tok_dir: Path, sentences: list[str]):
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    enc = tok(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
    ids_BT, mask_BT = enc["input_ids"], enc["attention_mask"]
    assert ids_BT[0, 0] == 0 and (ids_BT == 1).any() and mask_BT.sum(1).min() < ids_BT.shape[1]  # <s>, padded
    return ids_BT, mask_BT


def _assert_same(model, hf_base, ids_BT, mask_BT, hf_mlm=None) -> None:
    """Our hidden states (padded and packed) and MLM logits equal transformers' on the real tokens (1e-5)."""
    keep_BT = mask_BT.bool()
    with torch.no_grad():
        ref_h_BTD = hf_base(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
        h_BTD = model.eval().encode(ids_BT, mask_BT)
        h_ND = model.encode(None, None, packed=pack([(ids_BT.numpy(), mask_BT.numpy())]))
        assert (h_BTD - ref_h_BTD)[keep_BT].abs().max() < 1e-5
        if model.cfg.position_offset:  # padding too: it takes row pad_id, as in RoBERTa (BERT's numbering: not)
            assert (h_BTD - ref_h_BTD).abs().max() < 1e-5
        assert (h_ND - ref_h_BTD[keep_BT]).abs().max() < 1e-5
        if hf_mlm is not None:
            logits_MV, _ = model.mlm_logits(h_BTD, torch.where(keep_BT, ids_BT, -100))
            ref_logits = hf_mlm(input_ids=ids_BT, attention_mask=mask_BT).logits
            assert (logits_MV - ref_logits[keep_BT]).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["roberta", "roberta-prelayernorm"])
@pytest.mark.parametrize("head", [True, False], ids=["ForMaskedLM", "Model"])
def test_from_hf_of_a_transformers_roberta_is_exact_both_ways(family, head, tok_path, sentences, tmp_path, capfd):
    """transformers initialises a Roberta(PreLayerNorm)ForMaskedLM or a bare *Model; from-hf takes its weights bit
    for bit, ours computes its outputs padded and packed, and to-hf of that init directory gives back the same
    tensors, which transformers loads quietly."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    prefix = "roberta." if family == "roberta" else "roberta_prelayernorm."
    name = "Roberta" if family == "roberta" else "RobertaPreLayerNorm"
    hf = getattr(transformers, name + ("ForMaskedLM" if head else "Model"))(_roberta_config(family)).eval()
    _randomise_norms(hf)
    hf_dir, init_dir, back_dir = tmp_path / "hf", tmp_path / "init", tmp_path / "back"
    save_roberta_dir(hf, tok_path, hf_dir)
    assert convert_main(["from-hf", str(hf_dir), str(init_dir)]) == 0
    ours = load_file(str(init_dir / "model.safetensors"))
    assert any(k.startswith("mlm_head.") for k in ours) == head
    assert ours["encoder.embeddings.position.weight"].shape[0] == 66

    model = resolve.open_hf_dir(hf_dir).build_model(warn_fresh_head=False)
    assert (model.cfg.position_offset, model.cfg.max_position, model.cfg.type_vocab_size, model.cfg.norm) == (
        2, 66, 1, "pre" if family != "roberta" else "post")
    ids_BT, mask_BT = _batch(hf_dir, sentences)
    _assert_same(model, getattr(hf, prefix[:-1]) if head else hf, ids_BT, mask_BT, hf if head else None)

    assert convert_main(["to-hf", str(init_dir), str(back_dir)]) == 0
    config = json.loads((back_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["pad_token_id"]) == (family, [name + "Model"], 1)
    base = load_file(str(back_dir / "model.safetensors"))
    hf_base = {k.removeprefix(prefix): v for k, v in hf.state_dict().items() if not k.startswith("lm_head.")}
    if head:  # *ForMaskedLM has no pooler; ours then has none either and writes zeros for *Model's
        assert all(not base[k].any() for k in base if k.startswith("pooler."))
        base = {k: v for k, v in base.items() if not k.startswith("pooler.")}
    assert base.keys() == hf_base.keys() and all(torch.equal(base[k], hf_base[k]) for k in base)
    loaded, said = _quietly(lambda: transformers.AutoModel.from_pretrained(str(back_dir)), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    src, back = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (hf_dir, back_dir))
    for args in ((sentences,), (sentences[:4], sentences[4:8])):  # single sentences and pairs: the same ids
        assert src(*args)["input_ids"] == back(*args)["input_ids"]
    assert (back_dir / "mlm").is_dir() == head  # a head the source lacks is not invented
    if head:
        mlm = load_file(str(back_dir / "mlm" / "model.safetensors"))
        want = {k: v for k, v in hf.state_dict().items() if k not in ("lm_head.decoder.weight", "lm_head.decoder.bias")}
        assert mlm.keys() == want.keys() and all(torch.equal(mlm[k], want[k]) for k in mlm)
        loaded, said = _quietly(lambda: transformers.AutoModelForMaskedLM.from_pretrained(
            str(back_dir), subfolder="mlm"), capfd)
        assert not LOAD_COMPLAINTS.search(said), said
        assert type(loaded) is getattr(transformers, name + "ForMaskedLM")


def _our_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 600, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_size": 48,
                          "max_position": 66, "position_offset": 2, "type_vocab_size": 1, "layer_norm_eps": 1e-5,
                          "pooling": "mean", "projection_dim": 16, **kw})


@pytest.mark.parametrize("kw", [{}, {"norm": "pre"}, {"norm": "pre", "position_offset": 0, "max_position": 64}],
                         ids=["roberta", "pre-LN offset 2", "pre-LN BERT"])
def test_our_export_loads_quietly_in_transformers_and_sentence_transformers(kw, tok_path, sentences, tmp_path, capfd):
    """Ours (RoBERTa positions, post- or pre-LN; or a pre-LN BERT, positions from 0) -> to-hf: AutoModel,
    AutoModelForMaskedLM and SentenceTransformer load it quietly and compute what ours computes; importing it
    gives back the same model."""
    st_mod = pytest.importorskip("sentence_transformers")
    model = build_model(_our_cfg(**kw), seed=3).eval()
    _randomise_norms(model)
    out = tmp_path / "hf"
    assert hfmod.export_hf(model, str(tok_path), str(out)) == ["Transformer", "Pooling"]
    base, said = _quietly(lambda: transformers.AutoModel.from_pretrained(str(out)), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    mlm, said = _quietly(lambda: transformers.AutoModelForMaskedLM.from_pretrained(str(out), subfolder="mlm"), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    want = "RobertaPreLayerNorm" if kw else "Roberta"
    assert (type(base).__name__, type(mlm).__name__) == (want + "Model", want + "ForMaskedLM")
    ids_BT, mask_BT = _batch(out, sentences)
    _assert_same(model, base.eval(), ids_BT, mask_BT, mlm.eval())

    st, said = _quietly(lambda: st_mod.SentenceTransformer(str(out), device="cpu"), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    assert st.max_seq_length == 64
    e_st = st.encode(sentences, convert_to_tensor=True, batch_size=4)
    enc = st.tokenize(sentences)
    with torch.no_grad():
        e_BD = model.pool(model.encode(enc["input_ids"], enc["attention_mask"]), enc["attention_mask"])
    assert (e_st - e_BD).abs().max() < 1e-5

    again = resolve.load_hf_model(str(out))
    assert again.cfg == model.cfg
    a, b = model.state_dict(), again.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_position_offset_counts_real_tokens_only():
    """Left padding: each row's first real token takes row offset, padding row offset - 1 (RoBERTa's rule)."""
    model = build_model(_our_cfg(dropout=0.0, attention_dropout=0.0), seed=1).eval()
    ids_BT = torch.tensor([[0, 7, 8, 2], [1, 0, 9, 2]])
    mask_BT = (ids_BT != 1).long()
    hf = transformers.RobertaModel(_roberta_config(num_hidden_layers=2, max_position_embeddings=66)).eval()
    hf.load_state_dict({k.removeprefix("roberta."): v for k, v in hfmod.to_hf_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith(("mlm_head.decoder", "projection"))}, 2,
        "roberta").items() if not k.startswith("lm_head.")}, strict=False)
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        ref = hf(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
    assert (h_BTD - ref).abs().max() < 1e-5


def test_bad_roberta_settings_are_refused(tok_path, tmp_path, capsys):
    """A RoBERTa decoder, a pad id the positions cannot follow, or an offset the tokenizer's pad does not give:
    errors saying what is wrong and what to do."""
    d = _roberta_config().to_dict()
    with pytest.raises(ValueError, match="is_decoder=true: a RoBERTa decoder does not convert"):
        hfmod.model_config_from_hf_config({**d, "is_decoder": True})
    with pytest.raises(ValueError, match="pad_token_id=None; RoBERTa's positions start at pad_token_id"):
        hfmod.model_config_from_hf_config({**d, "pad_token_id": None})
    with pytest.raises(ValueError, match="hidden_act='relu': our MLM head applies model.activation"):
        hfmod.model_config_from_hf_config({**d, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="no position is left"):
        hfmod.model_config_from_hf_config({**d, "max_position_embeddings": 2})
    with pytest.raises(ValueError, match="position_embedding_type='relative_key' is not supported"):
        hfmod.model_config_from_hf_config({**d, "position_embedding_type": "relative_key"})
    hf_dir = save_roberta_dir(transformers.RobertaModel(_roberta_config(is_decoder=True)), tok_path, tmp_path / "dec")
    assert convert_main(["from-hf", str(hf_dir), str(tmp_path / "init")]) == 2
    assert "error: config.json has is_decoder=true: a RoBERTa decoder does not convert" in capsys.readouterr().err
    assert not (tmp_path / "init").exists()
    model = build_model(_our_cfg(position_offset=3), seed=0)
    with pytest.raises(ValueError, match="model.position_offset=3 but the tokenizer's pad id is 1.*"
                                         "model.position_offset=2"):
        hfmod.export_hf(model, str(tok_path), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="only model.activation=gelu exports to RoBERTa"):
        hfmod.export_hf(build_model(_our_cfg(activation="relu"), seed=0), str(tok_path), str(tmp_path / "b"))
    with pytest.raises(ValueError, match="position_offset applies to model.arch=bert only"):
        ModelConfig(arch="modernbert", pooler=False, position_offset=2)
    with pytest.raises(ValueError, match="sequence length 65 exceeds the 64 positions"):
        build_model(_our_cfg(), seed=0).encode(torch.zeros(1, 65, dtype=torch.long), torch.ones(1, 65, dtype=torch.long))


def test_a_roberta_vocabulary_pairs_sentences_as_roberta(tok_path):
    """Our Tokenizer reads RoBERTa's special tokens; sentence pairs (GLUE) are <s> a </s></s> b </s>, one token
    type (RoBERTa's type_vocab_size is 1), as transformers' RoBERTa tokenizer makes them."""
    from pretrain.eval.encoder import add_specials
    from pretrain.prep.tokenizer import Tokenizer

    tok = Tokenizer(str(tok_path))
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.roberta_specials) == (1, 0, 2, 4, True)
    a, b = tok.encode("A man plays."), tok.encode(" Someone plays music.")
    ids, types = add_specials(a, b, tok, 64)
    assert ids == [0, *a, 2, 2, *b, 2] and set(types) == {0}
    ids, _ = add_specials(a * 20, b * 20, tok, 64)
    assert len(ids) == 64 and ids[-1] == 2


@pytest.mark.parametrize("backend", ["pretrain", "transformers"])
def test_glue_on_a_roberta_export_pairs_sentences_as_roberta(backend, tok_path, tmp_path):
    """pretrain-finetune-glue on a to-hf RoBERTa export, with either backend: a sentence pair goes in as RoBERTa's
    <s> a </s></s> b </s>, one token type (type_vocab_size 1), as transformers' tokenizer of the export makes it."""
    from pretrain.eval import glue_cli
    from pretrain.eval.encoder import add_specials, load_backbone, tokenize_all

    out = tmp_path / "hf"
    hfmod.export_hf(build_model(_our_cfg(), seed=3), str(tok_path), str(out))
    a, b = "A man plays the guitar.", "Someone plays music."
    _, tok = load_backbone(out, backend=backend)
    ids, types = add_specials(*tokenize_all(tok, [a]), *tokenize_all(tok, [b]), tok, 64)
    ref = transformers.AutoTokenizer.from_pretrained(str(out))(a, b, return_token_type_ids=True)
    assert (ids, types) == (ref["input_ids"], ref["token_type_ids"])
    rows = ["index\tsentence1\tsentence2\tlabel"] + [f"{i}\t{a}\t{b}\t{('not_entailment', 'entailment')[i % 2]}"
                                                      for i in range(8)]
    for split in ("train", "dev"):
        (tmp_path / "glue" / "RTE").mkdir(parents=True, exist_ok=True)
        (tmp_path / "glue" / "RTE" / f"{split}.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    glue_cli.main(["--model", str(out), "--backend", backend, "--tasks", "rte", "--lrs", "1e-3", "--epochs", "1",
                   "--batch-size", "4", "--max-len", "64", "--glue-dir", str(tmp_path / "glue"),
                   "--out", str(tmp_path / "glue_out")])
    res = json.loads(glue_cli.run_path(tmp_path / "glue_out", "rte", 1e-3, 1).read_text())
    assert res["steps"] == 2 and res["best"] is not None
