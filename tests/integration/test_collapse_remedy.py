"""objective.nt_xent.mean_pool_warmup_steps through the trainer: the views' share of mean pooling follows
1 - step/K at every training step and is 0 from step K on (the blend itself: test_objective_terms.py)."""

from __future__ import annotations

import pytest

from pretrain.objective.forward import Forward
from tests.integration.test_faults import _main


@pytest.mark.slow
def test_mean_pool_warmup_follows_the_schedule_in_training(tmp_path, tiny_overrides, clean_env, capsys,
                                                           monkeypatch):
    seen: list[float] = []
    real = Forward.embed

    def spy(self, h, mask, mean_mix=None, **kwargs):
        seen.append(mean_mix)
        return real(self, h, mask, mean_mix, **kwargs)

    monkeypatch.setattr(Forward, "embed", spy)
    for k, want in ((4, [1.0, 0.75, 0.5, 0.25, None, None]), (0, [None] * 6)):  # None: no blend (Context)
        seen.clear()
        code, out = _main(tiny_overrides(tmp_path / f"k{k}", data__valid="[]", train__max_steps=6,
                                         checkpoint__every=0, model__pooling="cls",
                                         objective__nt_xent__mean_pool_warmup_steps=k), capsys)
        assert code == 0, out[-2000:]
        assert seen == want, (k, seen)  # one views pass per step (micro-batch 4, no accumulation)
