"""Config system: YAML + include + dotted overrides, strict keys and types with dotted paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pretrain.config import RunConfig, from_dict, load_run_config, to_dict, to_yaml

REPO = Path(__file__).resolve().parents[2]


def test_model_sizes_resolve_from_yaml_includes():
    sizes = {}
    for name in ("tiny", "mini", "small", "base", "large"):
        cfg = load_run_config(REPO / "configs" / "models" / f"{name}.yaml")
        m = cfg.model
        sizes[name] = (m.num_layers, m.hidden_size, m.num_heads, m.ffn_size)
    assert sizes["base"] == (12, 768, 12, 3072)  # BERT-base
    assert sizes["large"] == (24, 1024, 16, 4096)
    assert [sizes[n][1] for n in ("tiny", "mini", "small", "base", "large")] == sorted(
        sizes[n][1] for n in sizes)


def test_overrides_parse_values_and_win_over_files(tmp_path):
    cfg = load_run_config(REPO / "configs" / "quickstart.yaml",
                          ["optim.lr=3e-4", "model.norm=pre", "train.max_steps=7", "optim.betas=[0.9, 0.999]",
                           "data.sources=[{name: a, path: /x, weight: 2}]"])
    assert cfg.optim.lr == 3e-4 and cfg.model.norm == "pre" and cfg.train.max_steps == 7
    assert cfg.optim.betas == (0.9, 0.999)
    assert cfg.data.sources[0].name == "a" and cfg.data.sources[0].weight == 2.0
    assert cfg.model.hidden_size == 128  # from the included models/tiny.yaml


def test_include_order_and_local_keys_win(tmp_path):
    (tmp_path / "a.yaml").write_text("seed: 1\ntrain: {max_steps: 5, log_every: 2}\n")
    (tmp_path / "b.yaml").write_text("include: [a.yaml]\ntrain: {max_steps: 9}\n")
    cfg = load_run_config(tmp_path / "b.yaml")
    assert (cfg.seed, cfg.train.max_steps, cfg.train.log_every) == (1, 9, 2)


@pytest.mark.parametrize("override, fragment", [
    ("optim.lrr=1", "optim.lrr"),
    ("model.hiden_size=3", "model.hiden_size"),
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("optim.lr=-1", "optim.lr"),
    ("model.norm=middle", "model.norm"),
    ("distributed.zero_stage=4", "distributed.zero_stage"),
    ("data.masking.prob=1.5", "data.masking.prob"),
    ("model.hidden_size=100", "model.num_heads"),
    ("train.precision=fp8", "train.precision"),
    ("objective.nt_xent.temperature=0", "objective.nt_xent.temperature"),
    ("data.sources=[{name: a}]", "path"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("train.micro_batch_size=true", "train.micro_batch_size"),
])
def test_bad_values_name_the_dotted_path(override, fragment):
    with pytest.raises(ValueError) as e:
        load_run_config(None, [override])
    assert fragment in str(e.value)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="key.sub=value"):
        load_run_config(None, ["optim.lr"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_run_config(tmp_path / "list.yaml")


def test_resolved_config_round_trips_through_yaml():
    cfg = load_run_config(REPO / "configs" / "quickstart.yaml", ["objective.nt_xent=null"])
    again = from_dict(RunConfig, yaml.safe_load(to_yaml(cfg)))
    assert again == cfg
    assert to_dict(again)["objective"]["nt_xent"] is None


def test_every_shipped_config_loads():
    files = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        load_run_config(f)
