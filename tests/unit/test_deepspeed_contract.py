"""What distributed/engine.py relies on in DeepSpeed, pinned: when a DeepSpeed upgrade changes one of these, this
fails first (and pyproject.toml's deepspeed range must move with a reviewed Engine).

- The installed DeepSpeed lies in pyproject.toml's range.
- bf16 checks the gradients for inf/NaN by default (``bf16.check_grad_overflow``, on since DeepSpeed's 2026
  default): where DeepSpeed keeps its checks (bf16 at ZeRO-0 and ZeRO-3) the Engine leaves the skip of a
  non-finite step to it, so a default turned off would apply NaN updates; where the Engine checks on the device
  (bf16 at ZeRO 1-2) it turns the switch off. fp16 always checks (dynamic loss scaling).
- ``was_step_applied()`` says whether the last boundary step updated the weights (the Engine's ``skipped`` where
  DeepSpeed checks).
- ZeRO 1-2's optimizer takes ``check_grad_overflow`` and ``compute_grad_norm`` (how the engine hands its settings
  down; ``zero_optimization.compute_grad_norm`` is the config key), keeps them as attributes of those names with
  ``clip_grad`` (Engine.load sets them around a load), and ``scaled_global_norm()`` returns the norm of all ranks'
  gradients as a tensor, -1 where it is not finite (Engine.step's norm under ZeRO 1-2).
- DeepSpeed calls the client optimizer's ``step()`` once per parameter group under ZeRO 1-2, with ``param_groups``
  narrowed to that group (the ScheduledAdamW reads its schedule position from the group it is handed).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import deepspeed
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_installed_deepspeed_is_in_the_pinned_range():
    spec = re.search(r'"deepspeed>=([\d.]+),<([\d.]+)"', PYPROJECT.read_text()).groups()
    low, high = map(Version, spec)
    assert low <= Version(deepspeed.__version__) < high, (deepspeed.__version__, spec)


def test_bf16_checks_gradient_overflow_by_default():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config

    assert DeepSpeedBF16Config(enabled=True).check_grad_overflow is True


def test_the_engine_reports_whether_a_step_was_applied_and_zero_takes_the_overflow_switch():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert callable(getattr(DeepSpeedEngine, "was_step_applied", None))
    params = inspect.signature(DeepSpeedZeroOptimizer.__init__).parameters
    assert "check_grad_overflow" in params and "compute_grad_norm" in params


def test_zero_keeps_the_switches_the_engine_sets_and_reports_a_bad_norm_as_minus_one():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert DeepSpeedZeroConfig(stage=2, compute_grad_norm=False).compute_grad_norm is False
    init = inspect.getsource(DeepSpeedZeroOptimizer.__init__)
    assert "self.compute_grad_norm = compute_grad_norm" in init and "self.clip_grad = clip_grad" in init
    assert "checkpoint_clip_grad" in inspect.getsource(DeepSpeedZeroOptimizer._load_global_state)
    assert callable(DeepSpeedZeroOptimizer.scaled_global_norm)
    step = inspect.getsource(DeepSpeedZeroOptimizer._optimizer_step)
    assert "self.optimizer.param_groups = [original_param_groups[group_no]]" in step
