"""What distributed/engine.py relies on in DeepSpeed, pinned: when a DeepSpeed upgrade changes one of these, this
fails first (and pyproject.toml's deepspeed range must move with a reviewed Engine).

- The installed DeepSpeed lies in pyproject.toml's range.
- bf16 checks the gradients for inf/NaN by default (``bf16.check_grad_overflow``, on since DeepSpeed's 2026
  default): under bf16 the Engine leaves the skip of a non-finite step to DeepSpeed (ZeRO 1-3 and its bf16
  optimizer), so a default turned off would apply NaN updates. fp16 always checks (dynamic loss scaling).
- ``was_step_applied()`` says whether the last boundary step updated the weights (the Engine's ``skipped``).
- ZeRO's optimizer takes ``check_grad_overflow`` (how the engine hands the bf16 setting down).
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
    assert "check_grad_overflow" in inspect.signature(DeepSpeedZeroOptimizer.__init__).parameters
