"""The training-dynamics table of a study: when a contrastive term escaped its chance value, read from a run's
metrics.jsonl and config (study.tables.escape_step / run_dynamics)."""

import json
import math

from pretrain.config import load_run_config
from pretrain.config.loader import to_yaml
from pretrain.study.tables import escape_step, run_dynamics


def _rec(step, loss, split="train", **kw):
    return {"step": step, "split": split, "nt_xent": loss, **kw}


def test_escape_step_is_where_the_loss_leaves_chance_for_good():
    chance = math.log(63)
    at, below = chance * 0.995, chance * 0.9
    records = [_rec(0, at, split="valid"), _rec(10, at), _rec(20, below), _rec(30, at), _rec(40, below),
               _rec(50, below)]
    assert escape_step(records, "nt_xent", chance, 0.02) == 40  # the dip at 20 came back to chance
    assert escape_step(records[:4], "nt_xent", chance, 0.02) is None  # at chance at the end: never
    assert escape_step([_rec(10, below), _rec(20, below)], "nt_xent", chance, 0.02) == 10  # from the start
    # Exactly 2% below is still "at chance"; validation records do not count.
    assert escape_step([_rec(10, chance * 0.98), _rec(0, below, split="valid")], "nt_xent", chance, 0.02) is None
    assert escape_step([], "nt_xent", chance, 0.02) is None


def test_run_dynamics_reads_chance_from_the_config_and_world_size(tmp_path):
    cfg = load_run_config(None, ["train.micro_batch_size=16"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert run_dynamics(tmp_path) is None  # no metrics yet
    state = tmp_path / "checkpoints" / "step_00000050"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"format_version": 3, "step": 50, "world_size": 2}))
    chance = math.log(2 * 16 * 2 - 1) if cfg.objective.nt_xent.gather else math.log(2 * 16 - 1)
    lines = [_rec(0, 3.0, split="valid", mlm=9.5), _rec(10, chance, cl_emb_cos=0.999),
             _rec(20, chance * 0.5, cl_emb_cos=0.4), _rec(50, 1.25, split="valid", mlm=7.25)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n{\"step\": 6")  # torn last line
    d = run_dynamics(tmp_path)
    assert d["last_step"] == 50 and d["heldout_mlm"] == 7.25
    assert d["terms"]["nt_xent"] == {"chance": chance, "escape_step": 20, "final": chance * 0.5, "emb_cos": 0.4}


def test_run_dynamics_reads_non_finite_values_as_floats(tmp_path):
    """metrics.jsonl keeps a NaN/inf as the string "nan"/"inf" (JSON has none); the study's tables compared those
    strings with floats and crashed pretrain-study on one NaN window of a contrastive term."""
    cfg = load_run_config(None, ["train.micro_batch_size=16"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    chance = math.log(2 * 16 - 1)
    lines = [_rec(10, chance), _rec(20, "nan"), _rec(30, chance * 0.5, cl_emb_cos="inf")]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    d = run_dynamics(tmp_path)
    assert d["terms"]["nt_xent"]["final"] == chance * 0.5 and d["terms"]["nt_xent"]["emb_cos"] == math.inf
    assert d["terms"]["nt_xent"]["escape_step"] == 30
