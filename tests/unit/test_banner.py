"""The start-up banner and --dry-run: parameter counts, the ZeRO memory formula, and a dry run that writes nothing."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pretrain.config import load_run_config
from pretrain.train import main
from pretrain.training.banner import GIB, contrastive_batch_line, memory_estimate, parameter_counts


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=True)
        self.head.weight = self.embed.weight  # tied: counted once, in the first part that holds it
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_parameter_counts_count_tied_weights_once_and_skip_frozen():
    parts = parameter_counts(_Tied())
    assert parts == {"embed": 40, "head": 10}


@pytest.mark.parametrize("precision,stage,want", [
    ("fp32", 0, 16.0), ("fp32", 1, 4 + 4 + 8 / 8), ("fp32", 2, 4 + 12 / 8), ("fp32", 3, 16 / 8),
    ("bf16", 0, 16.0), ("bf16", 1, 2 + 2 + 12 / 8), ("bf16", 2, 2 + 14 / 8), ("fp16", 3, 16 / 8),
])
def test_model_state_memory_follows_the_zero_paper(precision, stage, want):
    """Bytes per parameter of weights + gradients + Adam state: 16 unsharded, 16/N under ZeRO-3, and the
    ZeRO-1/2 splits (Rajbhandari et al. 2020, Fig. 1: 2+2+12 in mixed precision)."""
    cfg = load_run_config(None, [f"train.precision={precision}", f"distributed.zero_stage={stage}"])
    cfg = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, mlm=None))
    P = 10_000_000
    est = memory_estimate(cfg, P, 8, vocab_size=1000)
    states = est["weights"] + est["gradients"] + est["optimizer"]
    assert states * GIB / P == pytest.approx(want)
    assert est["activations"] > 0 and est["total"] == pytest.approx(states + est["activations"])
    # Activations grow with the micro-batch, linearly (no logits term without MLM).
    twice = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=2 * cfg.train.micro_batch_size))
    assert memory_estimate(twice, P, 8, 1000)["activations"] == pytest.approx(2 * est["activations"])


def test_the_compiled_zero3_step_counts_the_whole_models_weights():
    """train.compile at ZeRO-3 gathers every parameter for the step (Engine: DeepSpeed's leaf module): weights
    count whole, gradients and Adam state stay sharded; under objective.gradient_cache nothing is compiled."""
    P = 10_000_000
    base = ["train.precision=fp32", "distributed.zero_stage=3", "objective.mlm=null"]
    for overrides, want in ((["train.compile=true"], 4 + 12 / 8), ([], 16 / 8),
                            (["train.compile=true", "objective.gradient_cache=true"], 16 / 8)):
        est = memory_estimate(load_run_config(None, base + overrides), P, 8, vocab_size=1000)
        assert (est["weights"] + est["gradients"] + est["optimizer"]) * GIB / P == pytest.approx(want), overrides


def test_the_sentence_stage_is_sized_at_the_length_its_sentences_are_cut_to():
    """The sentence stage cuts every sentence to data.view_max_len (data/sentences.py); its passes were sized at
    data.max_len, several times the activations of configs/sentence_stage_quick.yaml (view length 32, max_len 128),
    which --dry-run's memory-fit check then used. ArcCSE's triplet views are objective.triplet.max_len long."""
    P = 1_000_000
    base = ["data.stage=sentences", "data.sentences=x.txt", "objective.mlm=null", "objective.nt_xent=null",
            "objective.info_nce={}", "data.max_len=128", "train.precision=fp32"]
    at = {v: memory_estimate(load_run_config(None, base + [f"data.view_max_len={v}"]), P, 1, 1000)["activations"]
          for v in (32, 64)}
    cfg = load_run_config(None, base + ["data.view_max_len=32"])
    m, b = cfg.model, cfg.train.micro_batch_size
    per_pass = m.num_layers * 32 * b * m.hidden_size * (34 + 5 * m.num_heads * 32 / m.hidden_size) * 2 / GIB
    assert at[32] == pytest.approx(2 * per_pass)  # anchor and positive, 32 tokens each
    assert at[64] > 2 * at[32]
    with_triplet = load_run_config(None, base + ["data.view_max_len=32", "objective.triplet={}"])
    t = with_triplet.objective.triplet.max_len
    extra = m.num_layers * t * b * m.hidden_size * (34 + 5 * m.num_heads * t / m.hidden_size) * 2 / GIB
    assert memory_estimate(with_triplet, P, 1, 1000)["activations"] == pytest.approx(2 * per_pass + 3 * extra)


def test_the_banner_says_how_many_sentences_the_contrastive_terms_compare():
    """grad_accum without objective.gradient_cache keeps the negatives at one micro-batch's (times the gathered
    ranks): the banner says the number and what the cache would make of it, instead of leaving it silent."""
    def line(overrides, ranks):
        return contrastive_batch_line(load_run_config(None, ["train.micro_batch_size=32", *overrides]), ranks)

    assert line(["train.grad_accum=4"], 8).startswith("contrastive batch: 256 sentences compared with each other "
                                                      "by nt_xent (micro 32 x 8 ranks gathered; each of the step's "
                                                      "4 micro-batches on its own: objective.gradient_cache=true "
                                                      "would compare all 1,024)")
    assert "1,024 sentences" in line(["train.grad_accum=4", "objective.gradient_cache=true"], 8)
    assert "32 sentences" in line(["train.grad_accum=4", "objective.nt_xent.gather=false"], 8)
    assert "32 sentences" in line([], 1) and "on its own" not in line([], 1)
    assert line(["objective.nt_xent=null"], 8) is None


def test_dry_run_prints_the_banner_and_writes_nothing(tmp_path, tiny_overrides, capsys):
    run_dir = tmp_path / "run"
    assert main([*tiny_overrides(run_dir), "--dry-run", "--ranks", "4", "train.max_steps=50"]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 32 hidden x 2 heads" in out and "parameters (encoder.embeddings" in out
    assert "x 4 rank(s) =" in out and "ZeRO-" in out and "epochs" in out and "memory per rank" in out
    assert "contrastive batch: " in out
    assert "dry run:" in out and not run_dir.exists()
    assert main([*tiny_overrides(run_dir), "--dry-run", "data.valid=[]", "train.eval_every=3"]) == 0
    assert "warning: train.eval_every=3 does nothing" in capsys.readouterr().out
    # A bad input fails with one line and exit 2, before anything starts.
    assert main([*tiny_overrides(run_dir), "--dry-run", "data.sources=[{name: x, path: /nonexistent}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/nonexistent" in err[0] and not run_dir.exists()


def test_memory_check_names_the_estimate_the_free_memory_and_what_to_change():
    from pretrain.training.banner import check_memory_fits

    mem = {"weights": 0.5, "gradients": 0.5, "optimizer": 2.0, "activations": 30.0, "total": 33.0}
    check_memory_fits(mem, "cpu", free_bytes=34 * GIB)  # fits: no error
    with pytest.raises(ValueError) as e:
        check_memory_fits(mem, "cpu", free_bytes=24 * GIB)
    msg = str(e.value)
    assert "33.00 GiB" in msg and "24.00 GiB free RAM" in msg
    assert msg.index("activations 30.00") < msg.index("optimizer 2.00")  # largest part first
    assert "train.micro_batch_size" in msg and "model=tiny" in msg
    # The ranks of a node share its RAM.
    with pytest.raises(ValueError, match=r"2 ranks x 20.00 GiB = 40.00 GiB"):
        check_memory_fits(dict(mem, activations=17.0, total=20.0), "cpu", ranks_per_device=2, free_bytes=34 * GIB)


def test_free_memory_on_this_host_is_positive_and_below_the_total():
    from pretrain.training.banner import free_memory_bytes

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free_memory_bytes("cpu") <= total


def test_dry_run_of_a_base_recipe_refuses_a_plan_larger_than_this_machine(tmp_path, tiny_overrides, capsys):
    """A base-size model with 512-token batches of 4,096 needs terabytes: more than this host has free is
    refused with exit 2 instead of "dry run: ... fine" (the tiny dry runs above pass the same check)."""
    big = [*tiny_overrides(tmp_path / "run"), "model=base", "data.max_len=512", "data.view_max_len=512",
           "train.micro_batch_size=4096", "model.max_position=512"]
    assert main([*big, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "the plan does not fit" in err and "GiB free RAM" in err and "train.micro_batch_size" in err
    assert "dry run: config" not in capsys.readouterr().out


def test_bf16_on_a_cpu_warns_with_its_cost(tmp_path, tiny_overrides, capsys, monkeypatch):
    """On a CPU without AMX-BF16 an explicit bf16 warns and auto is fp32; with it (the flags line of a Sapphire
    Rapids), neither warning nor fp32: auto is bf16."""
    if torch.cuda.is_available():
        pytest.skip("the warning is for CPUs")
    from pretrain.config import train
    from tests.integration.test_precision_resume import AMX, NO_AMX

    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(train, "CPUINFO", str(cpuinfo))
    cpuinfo.write_text(NO_AMX)
    assert main([*tiny_overrides(tmp_path / "run"), "train.precision=bf16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: train.precision=bf16 on a CPU without AMX-BF16") == 1 and "14x slower" in out
    assert main([*tiny_overrides(tmp_path / "run"), "train.precision=auto", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "precision fp32" in out and "bf16 on a CPU" not in out
    cpuinfo.write_text(AMX)
    for precision in ("bf16", "auto"):
        assert main([*tiny_overrides(tmp_path / "run"), f"train.precision={precision}", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "precision bf16" in out and "bf16 on a CPU" not in out, precision


def test_a_cpu_run_without_the_c_kernels_says_so(tmp_path, tiny_overrides, capsys, monkeypatch):
    """Where the C kernels were not built (no compiler at install) a CPU run's banner warns that dropout, RoPE,
    GeGLU and the MLM loss take torch's slower paths and how to build them; with them built, no such line."""
    if torch.cuda.is_available():
        pytest.skip("the warning is for CPUs")
    from pretrain.training import banner

    assert main([*tiny_overrides(tmp_path / "run"), "--dry-run"]) == 0
    assert "CPU kernels" not in capsys.readouterr().out or banner.cpu_kernels() is None
    monkeypatch.setattr(banner, "cpu_kernels", lambda: None)
    assert main([*tiny_overrides(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: the CPU kernels (pretrain.model._kernels") == 1 and "C compiler" in out


def test_varlen_where_it_takes_the_nested_tensors_warns_with_its_cost(tmp_path, tiny_overrides, capsys):
    """train.unpadded_attention=varlen on a CPU runs SDPA over nested tensors (model/attention.py), a sequence at a
    time: the banner says so, why, and what to set; the default (groups) and a padded step (where varlen does
    nothing, said by its own line) get no such warning."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU varlen may call flash attention directly")
    warning = "warning: train.unpadded_attention=varlen runs SDPA over nested jagged tensors here (no GPU)"
    for overrides, want in ((["train.unpadded_attention=varlen"], 1), ([], 0),
                            (["train.unpadded_attention=varlen", "train.unpadded=false"], 0)):
        assert main([*tiny_overrides(tmp_path / "run"), *overrides, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert out.count(warning) == want, (overrides, out)
        assert ("set train.unpadded_attention=auto (groups)" in out) == bool(want)
    assert "train.unpadded_attention=varlen does nothing: the step runs padded (train.unpadded=false)" in out


def test_varlen_nested_reasons_on_a_gpu(monkeypatch):
    """On CUDA the direct flash call runs in bf16/fp16 with a head size flash takes on sm80+; each other case
    names its reason (the GPU faked by the banner's own probes: the check reads the config and the device's
    capability only)."""
    from pretrain.training import banner

    monkeypatch.setattr(banner, "_on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    def why(*overrides):
        return banner.varlen_nested_why(load_run_config(None, ["train.unpadded_attention=varlen", *overrides]))

    assert why("train.precision=bf16") is None and why("train.precision=fp16") is None
    assert "train.precision=fp32" in why("train.precision=fp32")
    assert "head size of 12" in why("train.precision=bf16", "model.hidden_size=48", "model.num_heads=4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    assert "compute capability 8.0" in why("train.precision=bf16")
    assert banner.varlen_nested_why(load_run_config(None, ["train.precision=bf16"])) is None  # auto: groups


def test_parameter_counts_of_a_zero3_module_are_the_whole_models(clean_env):
    """The trainer prints the banner after DeepSpeed wrapped the module; ZeRO-3 then holds each parameter as an
    empty tensor outside a gather (its ``numel()`` 0, the whole count in ``ds_numel``): the counts (and the
    memory estimate made from them) are still the whole model's, as at ZeRO 0-2. Until 2026-12-06 the banner of
    every ZeRO-3 run said "0 parameters"."""
    from pretrain.config import DistributedConfig, ModelConfig, ObjectiveConfig, OpsConfig, OptimConfig, TrainConfig
    from pretrain.distributed.engine import Engine
    from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
    from pretrain.model import build_model
    from pretrain.objective import Context, Objective, TrainModule
    from pretrain.training.optim import build_param_groups, lr_lambda

    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    try:
        mcfg = ModelConfig(vocab_size=200, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_position=32)
        module = TrainModule(build_model(mcfg, seed=0), Objective(ObjectiveConfig(), Context(env, OpsConfig(), "mean")))
        whole = parameter_counts(module)
        optim = OptimConfig()
        engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                        train=TrainConfig(micro_batch_size=4, precision="fp32"), env=env,
                        dist=DistributedConfig(zero_stage=3), lr_lambda=lr_lambda(optim, 10))
        assert any(p.numel() == 0 for p in engine.module.parameters())  # partitioned, as the banner sees them
        assert parameter_counts(engine.module) == whole and sum(whole.values()) > 0
    finally:
        destroy_process_group()


def test_plan_check_looks_at_the_gpu_this_rank_uses(monkeypatch):
    """srun --gpus-per-task=1 narrows CUDA_VISIBLE_DEVICES to the task's one GPU: local rank 3 runs on cuda:0,
    and the dry run's memory check must ask cuda:0 (cuda:3 does not exist in that process)."""
    from pretrain.distributed.env import DistEnv
    from pretrain.training import banner

    env = DistEnv(rank=3, world_size=4, local_rank=3, local_world_size=4, node_rank=0, master_addr="gpu01",
                  master_port=20001, launcher="slurm")
    asked = []
    monkeypatch.setattr(banner, "_on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(banner, "check_memory_fits", lambda mem, device, **kw: asked.append(device))
    banner.check_plan_fits(load_run_config(None, ["model=tiny"]), _Tied(), 4, env)
    assert asked == ["cuda:0"]


def test_reduce_overhead_without_a_gpu_says_it_runs_as_default(tmp_path, tiny_overrides, capsys):
    """compile_mode=reduce-overhead on a CPU: inductor skips CUDA graphs and compiles as the default mode, which
    nothing said; the banner does (and not for the default mode)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU records the CUDA graphs")
    warning = "warning: train.compile_mode=reduce-overhead records CUDA graphs, and this run has no GPU"
    for mode, want in (("reduce-overhead", 1), ("default", 0)):
        overrides = ["train.compile=true", f"train.compile_mode={mode}", "train.compile_shapes=bucketed"]
        assert main([*tiny_overrides(tmp_path / "run"), *overrides, "--dry-run"]) == 0
        assert capsys.readouterr().out.count(warning) == want, mode
