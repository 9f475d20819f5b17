"""Two trainer runs, one after the other, in one Python process (a sweep script, a notebook): DeepSpeed caches
sub-groups of the first run's process group, and the second run must not be handed them."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def test_a_second_run_in_the_same_process_trains(tmp_path, tiny_overrides, capsys):
    """Nothing between the runs but what a user's script would do. Before distributed.env.init_process_group
    dropped DeepSpeed's cached groups, a run after one whose group the caller tore down stopped in
    deepspeed.initialize: "Group ... is not registered" (exit 2); and a run after one the CLI ran read the RANK and
    WORLD_SIZE the Engine had set as a launcher's, and asked for MASTER_ADDR."""
    from pretrain.config import load_run_config
    from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
    from pretrain.train import main
    from pretrain.training.trainer import Trainer

    env = single_process_env()  # the first run in a group of the caller's, torn down by the caller
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = Trainer(load_run_config(None, tiny_overrides(tmp_path / "a", train__max_steps=2, checkpoint__every=0)),
                      env)
    assert trainer.train() == 0
    trainer.close()
    destroy_process_group()
    assert "RANK" not in os.environ  # what the Engine set for DeepSpeed is gone with the group
    for name in ("b", "c"):  # then two runs through the CLI's main, back to back
        code = main(tiny_overrides(tmp_path / name, train__max_steps=2, checkpoint__every=0))
        out = capsys.readouterr()
        assert code == 0, out.out[-2000:] + out.err[-2000:]
        assert (tmp_path / name / "metrics.jsonl").read_text().count('"split": "train"') == 2
