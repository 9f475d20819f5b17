"""A reader asked for a run's latest checkpoint (pretrain-eval/-finetune-glue --model RUN_DIR, pretrain-convert to-hf
RUN_DIR: export.resolve.select_checkpoint) takes the newest one that verifies, as a resume does
(store.find_resumable), and says which damaged ones it skipped; a damaged checkpoint named explicitly is refused."""

from __future__ import annotations

import json

import pytest
import yaml

from pretrain.checkpoint import store
from pretrain.checkpoint.files import save_safetensors
from pretrain.config.model import ModelConfig
from pretrain.model import build_model

_CFG = dict(vocab_size=7, hidden_size=16, num_layers=1, num_heads=2, ffn_size=24, max_position=32)


def _tiny_run(root, steps=(2, 4), latest=4):
    """A run directory with a complete, verifiable checkpoint per step (weights, config.yaml, tokenizer.json,
    files.json, trainer_state.json) of a tiny BERT, and ``latest`` naming step ``latest``."""
    from tokenizers import Tokenizer, models

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"])}
    ckpt = store.checkpoints_dir(root)
    for step in steps:
        tag = ckpt / store.tag_for_step(step)
        tag.mkdir(parents=True)
        Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")).save(str(tag / "tokenizer.json"))
        model = build_model(ModelConfig(**_CFG), seed=step)
        save_safetensors({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                         tag / store.WEIGHTS_FILE, metadata={"format": "pt"})
        (tag / "config.yaml").write_text(yaml.safe_dump({"model": _CFG, "data": {"tokenizer": "tokenizer.json",
                                                                                 "max_len": 32}}))
        store.record_files(tag, {})
        (tag / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": step}))
    (ckpt / store.LATEST_FILE).write_text(store.tag_for_step(latest) + "\n")
    return root


def _damage(run, step: int) -> None:
    weights = store.checkpoints_dir(run) / store.tag_for_step(step) / store.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])  # truncated


@pytest.mark.parametrize("latest", [4, 2])  # 2: a crash left `latest` behind the newer tag, which is damaged
def test_latest_is_the_newest_checkpoint_that_verifies(tmp_path, latest):
    from pretrain.export.resolve import select_checkpoint

    run = _tiny_run(tmp_path / "run", latest=latest)
    _damage(run, 4)
    said = []
    path, line = select_checkpoint(run, say=said.append)
    assert path == store.checkpoints_dir(run) / "step_00000002" and "(step 2, " in line
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("warning:") and "step_00000004" in said[0] and "truncated" in said[0]
    assert store.load_model_state(path)[0]  # what the tool then reads opens
    # named explicitly, the damaged checkpoint is still refused when read
    path, _ = select_checkpoint(run, "step_4", say=said.append)
    with pytest.raises(store.CheckpointError, match="step_00000004 is damaged"):
        store.load_model_state(path)
    assert len(said) == 1  # nothing skipped for an explicit step


def test_every_checkpoint_damaged_is_refused_naming_them(tmp_path):
    from pretrain.export.resolve import select_checkpoint

    run = _tiny_run(tmp_path / "run")
    _damage(run, 4), _damage(run, 2)
    with pytest.raises(store.CheckpointError, match="step_00000004.*step_00000002"):
        select_checkpoint(run, say=lambda _: None)


def test_an_intact_latest_is_read_without_a_warning(tmp_path):
    from pretrain.export.resolve import select_checkpoint

    run = _tiny_run(tmp_path / "run")
    said = []
    path, line = select_checkpoint(run, say=said.append)
    assert path.name == "step_00000004" and "(step 4, the latest)" in line and said == []


def test_convert_to_hf_of_a_run_skips_its_damaged_newest_checkpoint(tmp_path, capsys):
    """pretrain-convert to-hf RUN_DIR exports the newest intact checkpoint with a one-line warning (it refused:
    "checkpoint ... is damaged ... Use an older checkpoint"); --checkpoint step_4 still refuses."""
    from pretrain.export.convert import main

    run = _tiny_run(tmp_path / "run")
    _damage(run, 4)
    assert main(["to-hf", str(run), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    warning = [x for x in out.splitlines() if x.startswith("warning:")]
    assert len(warning) == 1 and "step_00000004" in warning[0], out
    assert "reading checkpoint step_00000002 (step 2" in out and (tmp_path / "hf" / "config.json").is_file()
    assert main(["to-hf", str(run), str(tmp_path / "hf4"), "--checkpoint", "step_4"]) == 2
    assert "step_00000004 is damaged" in capsys.readouterr().err and not (tmp_path / "hf4").exists()
