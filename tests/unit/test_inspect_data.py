"""pretrain-inspect shows exactly the samples training draws, as text."""

from __future__ import annotations

import torch

from pretrain.config import load_run_config
from pretrain.data.loader import build_loader
from pretrain.inspect_data import inspect_samples, main


def test_inspect_shows_the_samples_the_loader_builds(tiny_corpus, tiny_overrides, tmp_path, capsys):
    overrides = tiny_overrides(tmp_path / "run", data__augment__methods="del-span+reorder")
    cfg = load_run_config(None, overrides)
    tokenizer, samples = inspect_samples(cfg, 6, start=12)
    from pretrain.training.build import build_train_set

    dataset = build_train_set(cfg, tokenizer)
    loader = build_loader(dataset, seed=cfg.seed, rank=0, world_size=1, micro_batch_size=6, start_sample=12,
                          num_workers=0, pad_id=tokenizer.pad_id)
    batch = next(iter(loader))
    for b, (_, sample) in enumerate(samples):
        for name, field in (("input_ids", "input_ids"), ("mlm_labels", "mlm_labels"), ("view_a", "view_a_ids"),
                            ("view_b", "view_b_ids")):
            n = len(sample[name])
            assert torch.equal(batch[field][b, :n], torch.from_numpy(sample[name])), name

    assert main([*overrides, "-n", "2", "--start", "12"]) == 0
    out = capsys.readouterr().out
    assert out.count("sample (epoch 0, index") == 2
    assert "[MASK]" in out and "view_a" in out and "view_b" in out and "predicts" in out
    assert main([*overrides, "data.augment.methods=del-spam"]) == 2
    assert "del-spam" in capsys.readouterr().err
    from pretrain.config.loader import to_yaml

    resolved = tmp_path / "config.yaml"  # what a run writes to <run_dir>/config.yaml (the README's example)
    resolved.write_text(to_yaml(cfg))
    assert main([str(resolved), "-n", "1", "data.augment.methods=subs"]) == 0
    assert "view_a" in capsys.readouterr().out


def test_inspect_follows_the_runs_sample_order_rule(tiny_overrides, tmp_path):
    """A run whose checkpoint predates recorded order rules continues in permutation-v1: inspect shows that
    order for it, and the current rule for a run without checkpoints."""
    import json

    import numpy as np

    from pretrain.data.loader import ORDER_RULE
    from pretrain.inspect_data import order_rule

    cfg = load_run_config(None, tiny_overrides(tmp_path / "run"))
    assert order_rule(cfg) == ORDER_RULE
    tag = tmp_path / "run" / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / "trainer_state.json").write_text(json.dumps({"step": 4, "format_version": 2}))
    assert order_rule(cfg) == "permutation-v1"
    _, samples = inspect_samples(cfg, 3, start=0)
    from pretrain.prep.tokenizer import load_tokenizer
    from pretrain.training.build import build_train_set

    dataset = build_train_set(cfg, load_tokenizer(cfg.data.tokenizer))
    want = np.random.default_rng([cfg.seed, 0]).permutation(len(dataset))[:3].tolist()
    assert [key for key, _ in samples] == [(0, i) for i in want]


def test_a_run_whose_newest_checkpoint_state_is_unreadable_is_an_error_not_a_traceback(tiny_corpus, tiny_overrides,
                                                                                        tmp_path, capsys):
    """The sample order comes from the run's newest checkpoint: when its trainer_state.json does not parse, the tool
    exits 2 saying which file and what to do (it raised a CheckpointError traceback)."""
    run = tmp_path / "run"
    tag = run / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "trainer_state.json").write_text("{not json")
    assert main([*tiny_overrides(run), "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "pretrain-inspect: error:" in err and "trainer_state.json is unreadable" in err and "damaged" in err
