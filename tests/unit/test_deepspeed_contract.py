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
  ``clip_grad`` (Engine.load sets them around a load), and at the boundary holds this rank's gradient partition in
  ``averaged_gradients[group]`` (a list of tensors; alignment padding marked ``_zero_padding``) for the groups of
  ``bit16_groups``, what Engine._grad_norm reads under ZeRO 1-2 (tests/distributed/test_zero_step.py compares it
  with DeepSpeed's own ``scaled_global_norm``).
- DeepSpeed calls the client optimizer's ``step()`` once per parameter group under ZeRO 1-2, with ``param_groups``
  narrowed to that group (the ScheduledAdamW reads its schedule position from the group it is handed).
- DeepSpeed imports its Muon module in every run (ZeRO 1-2's gradient reduction, the bf16 optimizer, ZeRO-3), and
  that module wraps its functions in ``torch.compile`` through ``deepspeed.runtime.compiler.compile()`` as it is
  imported; the Engine imports it first with those wrappers made on first call (no torch._dynamo / _inductor).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
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
    assert "self.averaged_gradients = {}" in init and "self.bit16_groups = []" in init
    norm = inspect.getsource(DeepSpeedZeroOptimizer.get_grad_norm_direct)
    assert 'getattr(g, "_zero_padding", False)' in norm  # the padding the Engine leaves out as DeepSpeed does
    step = inspect.getsource(DeepSpeedZeroOptimizer._optimizer_step)
    assert "self.optimizer.param_groups = [original_param_groups[group_no]]" in step


def test_deepspeed_imports_muon_in_every_run_and_wraps_it_at_import():
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    from pretrain.distributed.engine import MUON_MODULE

    muon_import = f"from {MUON_MODULE} import MuonWithAuxAdam"
    assert muon_import in inspect.getsource(stage_1_and_2.DeepSpeedZeroOptimizer.average_tensor)
    assert muon_import in inspect.getsource(bf16_optimizer.BF16_Optimizer.__init__)
    assert muon_import in inspect.getsource(stage3)
    original_muon = Path(stage_1_and_2.__file__).parent / "muon" / "original_muon.py"
    assert "from deepspeed.runtime import compiler" in original_muon.read_text()
    assert original_muon.read_text().count("@compiler.compile()") >= 2


MUON_FIRST_CALL = """
import functools, sys
import torch
from pretrain.distributed.engine import MUON_MODULE, _import_deepspeed
_import_deepspeed()
from deepspeed.runtime import compiler
import deepspeed.runtime.zero.muon.original_muon as om
print("imported", MUON_MODULE in sys.modules, sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
print("restored", compiler.compile() is torch.compile)
print("lazy", sorted(n for n, f in vars(om).items() if getattr(f, "compiles_on_first_call", False)))
# The first call compiles: torch.compile itself, with its eager backend here (the graph dynamo captures, no C++ build).
torch.compile = functools.partial(torch.compile, backend="eager")
import torch._dynamo
G = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
out = om.zeropower_via_newtonschulz5(G, 5)
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
again = om.zeropower_via_newtonschulz5(G, 5)
print("graphs", graphs, torch._dynamo.utils.counters["stats"]["unique_graphs"])
print("equal", torch.equal(out, om.zeropower_via_newtonschulz5.__wrapped__(G, 5)), torch.equal(out, again))
"""


def test_the_engine_imports_muon_without_compiling_and_its_first_call_compiles():
    """DeepSpeed's import of its Muon module compiled three functions at import: torch._dynamo and torch._inductor,
    ~2-4 s of CPU in every rank of every run (1.8 s of a 7.5 s tiny single-process run, measured)."""
    proc = subprocess.run([sys.executable, "-c", MUON_FIRST_CALL], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["imported"] == "True []"
    assert lines["restored"] == "True"
    assert "zeropower_via_newtonschulz5" in lines["lazy"] and "muon_update" in lines["lazy"]
    first, second = map(int, lines["graphs"].split())
    assert first >= 1 and second == first  # compiled on the first call, once
    assert lines["equal"] == "True True"


ENGINE_AT_ZERO_2 = """
import torch
from pretrain.config.train import DistributedConfig, OptimConfig, TrainConfig
from pretrain.distributed import engine
from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
env = single_process_env()
init_process_group(env, backend="gloo", timeout_s=60)
m = torch.nn.Linear(2, 2)
engine.Engine(m, [{"params": list(m.parameters())}], optim=OptimConfig(), dist=DistributedConfig(zero_stage=2),
              train=TrainConfig(micro_batch_size=1, precision="fp32"), env=env, lr_lambda=lambda step: 1.0)
destroy_process_group()
"""


def test_the_untested_optimizer_warning_stays_off_the_console_unless_verbose():
    """Every ZeRO run's first console line was DeepSpeed's "You are using ZeRO with an untested optimizer" (its
    logger writes to a stream captured at import, past quiet_third_party): the optimizer is the Engine's on purpose
    and this file pins what the Engine relies on. It is still there with --verbose, and other warnings pass."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PRETRAIN_VERBOSE"}
    quiet = subprocess.run([sys.executable, "-c", ENGINE_AT_ZERO_2], capture_output=True, text=True, env=env)
    loud = subprocess.run([sys.executable, "-c", ENGINE_AT_ZERO_2], capture_output=True, text=True,
                          env=env | {"PRETRAIN_VERBOSE": "1"})
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    assert "untested optimizer" not in quiet.stdout + quiet.stderr
    assert "untested optimizer" in loud.stdout + loud.stderr
