"""The GPU pass's own logic, dry-run on the CPU: `tools/gpu_smoke.py` (train, resume a copy from the
half-way checkpoint, compare the losses) and `tools/bench_step.py`'s FLOP count and table; and
`bench_step.py --host-cost`, the CPU measure of a step's host cost (issue 24); `bench_step.py --arch modernbert`,
ours against transformers' ModernBertForMaskedLM (issue 27).

The GPU pass runs only where a GPU is lent (tools/gpu_check.sh); these keep its scripts working in
between, so that the next lent GPU is not spent on a broken script.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_gpu_smoke_dry_run_on_cpu(tmp_path, clean_env):  # clean_env: no launcher variables leak in
    out = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_smoke.py"), str(out), "--only", "matrix", "--zero-stages", "2",
         "--precisions", "fp32", "--similarity", "torch", "--steps", "20", "--parallel", "1",
         "--model", "quickstart", "--compiled-zero-stages"],  # (ZeRO-3 compiled: tests/distributed/test_zero_step.py)
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "smoke.json").read_text())
    (run,) = summary["matrix"]
    assert run["rc"] == 0 and run["resume"]["resumed_msg"]
    # The resumed copy continues from step 10 exactly as the uninterrupted run (CPU: bitwise).
    assert run["resume"]["steps_compared"] == [20]
    assert run["resume"]["max_rel_diff"] == 0.0
    assert run["valid_mlm"][0][0] == 0 and run["valid_mlm"][-1][0] == 20 and run["loss_falls"]


def test_gpu_smokes_plain_compiled_variant_is_the_trainers_default():
    """The smoke's first compiled run (``_compiled``) is what train.compile does unless told otherwise."""
    from pretrain.config import TrainConfig

    assert _tool("gpu_smoke").PLAIN_COMPILE == f"{TrainConfig().compile_mode}:{TrainConfig().compile_shapes}"


def test_gpu_check_keeps_to_its_budget_and_packs_one_file(tmp_path):
    """A lease has 15 minutes of device time: with GPU_CHECK_BUDGET_S a stage's limit is cut to what is left (less
    20 s), a stage with under 30 s left is skipped and recorded, and GPU_CHECK_TAR packs the logs and JSON into one
    file (the device tool brings back at most 8). The tests stage runs for real here (tests/gpu skips on a CPU)."""
    import tarfile

    def check(out: Path, stages: str, budget: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
        env |= {"PYTHON": sys.executable, "GPU_CHECK_STAGES": stages, "GPU_CHECK_BUDGET_S": str(budget),
                "GPU_CHECK_TAR": str(out) + ".tar.gz"}
        proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=300)
        return proc, [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]

    proc, stages = check(tmp_path / "spent", "tests,bench_step,smoke", 40)
    assert proc.returncode == 1, proc.stdout
    assert stages == [{"stage": s, "rc": "skipped", "seconds": 0} for s in ("tests", "bench_step", "smoke")]
    assert "tests skipped: " in proc.stdout and "of the 40s budget left" in proc.stdout

    proc, stages = check(tmp_path / "run", "tests", 200)
    assert [(s["stage"], s["rc"]) for s in stages] == [("tests", 0)], proc.stdout + proc.stderr
    limit = int(proc.stdout.split("tests (limit ")[1].split("s)")[0])
    assert 150 <= limit <= 180  # 900 cut to the budget left less 20 s
    summary = json.loads((tmp_path / "run" / "gpu_check.json").read_text())
    assert summary["tests"]["skipped"] == summary["tests"]["tests"] != "0"
    with tarfile.open(tmp_path / "run.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"run/stages.jsonl", "run/tests.log", "run/gpu_check.json", "run/tests_gpu.xml"} <= names, names


def test_bench_step_padding_shares_count_the_masks():
    """--data's printed padding shares: padded slots over all slots of the MLM rows, and of both views together."""
    bench_step = _bench_step()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    full = torch.ones(2, 3, dtype=torch.bool)
    half = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    batches = [dict(attention_mask=mask, view_a_mask=full, view_b_mask=half),
               dict(attention_mask=torch.ones(2, 4, dtype=torch.bool), view_a_mask=full, view_b_mask=full)]
    got = bench_step.padding_shares(batches)
    assert got["mlm"] == pytest.approx(4 / 16) and got["views"] == pytest.approx(3 / 24)


def test_bench_step_warms_every_arm_up_on_every_batch_it_times():
    """The CPU timing starts on a settled heap: every arm (the third too, when there is one) has run once on every
    batch, its own copy (ours the host batch, HF the device one), alternating as the timed steps do."""
    bench_step = _bench_step()
    calls = []

    def arm(name):
        return lambda batch: calls.append((name, batch["i"]))

    host = [{"i": f"host{i}"} for i in range(3)]
    moved = [{"i": f"dev{i}"} for i in range(3)]
    bench_step.warm_up(arm("ours"), arm("hf"), arm("full"), host, moved)
    assert calls == [c for i in range(3) for c in (("ours", f"host{i}"), ("hf", f"dev{i}"), ("full", f"host{i}"))]
    calls.clear()
    bench_step.warm_up(arm("ours"), arm("hf"), None, host[:1], moved[:1])
    assert calls == [("ours", "host0"), ("hf", "dev0")]


def test_bench_step_flop_count_matches_hand_count():
    bench_step = _bench_step()
    d, f, layers, vocab = 768, 3072, 12, 30522
    per_token = lambda t: layers * (24 * d * d + 4 * t * d)  # noqa: E731 - f = 4d: 8d^2 + 4df = 24d^2
    fwd = 128 * per_token(128) + 2 * 64 * per_token(64) + 0.15 * 128 * (2 * d * d + 2 * d * vocab)
    assert f == 4 * d
    assert bench_step.train_flops_per_sample("base", 128, 64, vocab, trim=False) == pytest.approx(3 * fwd, rel=1e-12)
    # Ours' default, the last layer trimmed (tests/unit/test_flops_accounting.py): the 108.8 unlabelled rows skip
    # q, the output projection, the FFN (20 d^2) and their attention (4 T d)
    trimmed = 3 * (fwd - (128 - 19.2) * (20 * d * d + 4 * 128 * d))
    assert bench_step.train_flops_per_sample("base", 128, 64, vocab) == pytest.approx(trimmed, rel=1e-12)


def test_bench_step_modernbert_flop_count_matches_hand_count():
    bench_step = _bench_step()
    d, f, vocab, window = 128, 256, 8192, 128  # configs/models/modernbert-tiny.yaml: 3 layers, global every 3
    layer = lambda t, keys: t * (8 * d * d + 6 * d * f) + 4 * keys * d  # GeGLU: d -> 2f, f -> d
    # keys all queries read: a local layer's +-64 band, clipped at the row's ends
    band = lambda t: sum(min(t - 1, q + window // 2) - max(0, q - window // 2) + 1 for q in range(t))  # noqa: E731
    encoder = lambda t: layer(t, t * t) + 2 * layer(t, band(t))  # layer 0 global, 1-2 local
    fwd = encoder(512) + 2 * encoder(64) + 0.15 * 512 * (2 * d * d + 2 * d * vocab)
    assert band(64) == 64 * 64 and band(512) == 512 * 129 - 2 * sum(range(65))
    assert bench_step.train_flops_per_sample("tiny", 512, 64, vocab, arch="modernbert",
                                             trim=False) == pytest.approx(3 * fwd)
    assert bench_step.model_shape("mini", "modernbert")["ffn_size"] == 384  # read from the size's YAML
    with pytest.raises(ValueError, match="no size 'small'"):
        bench_step.model_shape("small", "modernbert")


def test_bench_step_modernbert_runs_both_arms_with_equal_parameters(tmp_path, clean_env):
    out = tmp_path / "modern.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_step.py"), "--arch", "modernbert", "--sizes", "tiny", "--steps",
         "2", "--batch", "2", "--seq", "32", "--view-len", "16", "--vocab", "512", "--zero-stage", "0",
         "--json-out", str(out)],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "HF: ModernBertForMaskedLM, sdpa (padded" in proc.stdout
    assert "| modernbert | tiny | 2 |" in proc.stdout
    report = json.loads(out.read_text())
    assert (report["arch"], report["hf_attention"]) == ("modernbert", "sdpa")
    assert "load average " in proc.stdout and report["load_avg_end"] >= 0  # benchmarks state the machine's load
    (row,) = report["rows"]
    assert row["ours"]["samples_per_s"] > 0 and row["hf"]["samples_per_s"] > 0
    # The same shapes on both sides: embeddings 512 x 128, 3 layers, head, decoder bias, projection MLP.
    assert row["ours"]["num_params"] == row["hf"]["num_params"] > 512 * 128


def test_bench_step_refuses_a_size_the_arch_lacks(capsys):
    """Its argument check, in this process (the script's own entry point runs in the tests above)."""
    with pytest.raises(SystemExit) as stop:
        _bench_step().main(["--arch", "modernbert", "--sizes", "small"])
    assert stop.value.code == 2 and "--arch modernbert has sizes tiny, mini, base, large" in capsys.readouterr().err


def _tool(name: str):
    """The module tools/<name>.py."""
    import importlib

    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _bench_step():
    return _tool("bench_step")


def test_bench_step_host_cost_runs_both_arms(tmp_path, clean_env):
    out = tmp_path / "host_cost.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_step.py"), "--host-cost", "--steps", "2", "--zero-stages", "2",
         "--precisions", "bf16", "--json-out", str(out)],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| ZeRO | precision | ours host ms | per-tensor ms | HF host ms | ours / HF |" in proc.stdout
    assert "| 2 | bf16 |" in proc.stdout and "Goal: ours <= 0.5x HF" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["zero_stage"], row["precision"], row["threads"]) == (2, "bf16", 1)
    for arm in ("ours", "ours_per_tensor", "hf"):
        a = row[arm]
        assert a["s"] > 0 and len(a["all_s"]) == 2
        assert a["aten_ops"] > 1000 and a["aten_ops"] == sum(n for k, n in a["ops"].items() if k.startswith("aten."))
        assert a["sync_ops"] == sum(a["syncs"].values())
        # The mode saw the whole step: the backward, and the optimizer's update (ours: inside DeepSpeed's step).
        assert a["ops"]["aten.native_layer_norm_backward"] >= 12
        assert any(a["ops"].get(op, 0) for op in ("aten.addcdiv_", "aten._foreach_addcdiv_", "aten._fused_adamw_"))
    assert row["hf"]["syncs"].get("aten._local_scalar_dense", 0) >= 1  # its loss.item()
    # Flat layers: DeepSpeed's per-parameter hooks and the optimizer see 2 tensors a layer instead of 16.
    assert row["ours"]["aten_ops"] < row["ours_per_tensor"]["aten_ops"] - 2000
    for arm in ("ours", "hf"):  # the matrix products' share: part of the step, measured beside it
        assert 0 < row[arm]["matmul_s"] < max(row[arm]["all_s"]) * 2
    assert "Matrix products in those steps" in proc.stdout and "- ZeRO 2 bf16: ours " in proc.stdout


def test_host_cost_table_ratios_and_goal():
    bench_step = _bench_step()

    def arm(ms, ops, syncs):
        return {"s": ms / 1e3, "aten_ops": ops, "sync_ops": syncs, "syncs": {"aten.nonzero": syncs} if syncs else {},
                "adamw_fused": False}

    rows = [{"zero_stage": 0, "precision": "fp32", "ours": arm(66, 12000, 3), "ours_per_tensor": arm(77, 13000, 3),
             "hf": arm(55, 8000, 1)},
            {"zero_stage": 2, "precision": "bf16", "ours": arm(25, 7000, 0), "ours_per_tensor": arm(40, 9000, 0),
             "hf": arm(50, 7000, 1)}]
    text = "\n".join(bench_step.host_cost_table(rows))
    assert "| 0 | fp32 | 66.0 | 77.0 | 55.0 | 1.20x | 1.40x | 12,000 | 13,000 | 8,000 | 1.50x | 3 | 1 |" in text
    assert "| 2 | bf16 | 25.0 | 40.0 | 50.0 | 0.50x | 0.80x | 7,000 | 9,000 | 7,000 | 1.00x | 0 | 1 |" in text
    assert "host 0.50x (met), aten ops 1.00x (met)" in text
    assert "- ZeRO 2 bf16 ours: none" in text and "- ZeRO 0 fp32 ours: nonzero 3" in text
    rows[1]["ours"] = arm(26, 7001, 0)
    assert "host 0.52x (not met), aten ops 1.00x (not met)" in "\n".join(bench_step.host_cost_table(rows))
    assert "HF eager" not in text
    rows[1]["hf_eager"] = arm(65, 7000, 1)  # --compile: HF eager timed beside the compiled arms
    assert "| 2 | bf16 | 26.0 | 65.0 | 0.40x |" in "\n".join(bench_step.host_cost_table(rows))
    assert "two passes" not in text
    rows[1]["ours_two_passes"] = arm(32.5, 8000, 0)  # --ab joint: ours with train.joint_pass=false beside
    assert "| 2 | bf16 | 32.5 | 0.65x | 8,000 | 0.80x |" in "\n".join(bench_step.host_cost_table(rows))
    rows[1]["ours_layer"] = arm(29, 7400, 0)  # --ab layer: ours with train.flat_scope=layer beside
    text_layer = "\n".join(bench_step.host_cost_table(rows))
    assert "Ours with train.flat_scope=layer" in text_layer
    assert "| 2 | bf16 | 29.0 | 0.58x | 7,400 | 0.90x |" in text_layer
    assert "Matrix products" not in text
    rows[1]["ours"]["matmul_s"], rows[1]["hf"]["matmul_s"] = 0.006, 0.010  # measured beside: the step without them
    assert ("- ZeRO 2 bf16: ours 6.0 ms, HF 10.0 ms; the step without them ours 20.0 ms, HF 40.0 ms (0.50x)"
            in "\n".join(bench_step.host_cost_table(rows)))


def test_back_to_back_lines_compare_the_runs_and_the_third_arm():
    """CUDA rows carry a back-to-back run per arm (steps without a synchronize between them): the lines give each
    arm's rate, ours / HF and ours / the --ab arm; a CPU row (no runs) gives none."""
    bench_step = _bench_step()
    rows = [{"size": "base", "batch": 256, "ours": {"run_samples_per_s": 2000.0}, "hf": {"run_samples_per_s": 1600.0},
             "ours_full": {"run_samples_per_s": 1900.0}},
            {"size": "base", "batch": 512, "ours": {"oom": True}, "hf": {"run_samples_per_s": 1500.0}},
            {"size": "mini", "batch": 32, "ours": {"samples_per_s": 20.0}, "hf": {"samples_per_s": 9.0}}]
    lines = bench_step.back_to_back_lines(rows, 10, "pin")
    assert lines == ["base batch 256, 10 steps back to back (one synchronize at the end): ours 2000.0 samples/s, "
                     "HF 1600.0, 1.25x; ours with train.pin_memory=false 1900.0 (ours / that arm 1.05x)"]
    assert "that arm" not in bench_step.back_to_back_lines(rows, 10, "")[0]


def test_matmul_seconds_count_matmuls_only_and_the_bound_line():
    """--matmul-bound: the profiled seconds are the matmuls' (none in an elementwise step, most of a GEMM-heavy
    one), and the line's bound is HF's step over ours' matmul seconds."""
    bench_step = _bench_step()
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    assert bench_step.matmul_seconds(lambda x: (x * 2 + 1).exp(), a) == 0.0
    t = bench_step.matmul_seconds(lambda x: [(x @ b).relu_() @ b for _ in range(4)], a)
    assert t > 0
    rows = [{"size": "small", "batch": 32, "ours": {"step_s": 4.0, "matmul_s": 3.5},
             "hf": {"step_s": 7.0, "matmul_s": 6.0}},
            {"size": "mini", "batch": 32, "ours": {"step_s": 1.0}, "hf": {"step_s": 2.0}}]
    (line,) = bench_step.matmul_bound_lines(rows)
    assert line == ("small batch 32: matmuls take ours 3.50 s of its 4.00 s step (88%), HF 6.00 s of 7.00 s (86%); "
                    "ours doing nothing but its matmuls would be 2.00x HF (now 1.75x)")


def test_device_busy_is_the_union_of_the_device_intervals_over_the_window():
    """GPU busy (issue 24 item 7): overlapping kernels count once, time outside the window is cut off, and the
    profile's CUDA events are the ones counted, against the span of all its events."""
    bench_step = _bench_step()
    assert bench_step.device_busy([], 0, 10) == 0.0
    assert bench_step.device_busy([(0, 10)], 0, 10) == 1.0
    assert bench_step.device_busy([(1, 4), (2, 3), (3, 6), (8, 9)], 0, 10) == pytest.approx(0.6)  # 1-6 and 8-9
    assert bench_step.device_busy([(-5, 2), (9, 20)], 0, 10) == pytest.approx(0.3)
    assert bench_step.device_busy([(1, 2)], 5, 5) == 0.0
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(a, b, dev):
        return NS(time_range=NS(start=a, end=b), device_type=dev)

    prof = NS(events=lambda: [ev(0, 40, DeviceType.CPU), ev(10, 30, DeviceType.CUDA), ev(20, 50, DeviceType.CUDA),
                              ev(45, 100, DeviceType.CPU)])
    assert bench_step._profile_busy(prof) == pytest.approx(0.4)  # 10-50 of 0-100
    assert math.isnan(bench_step._profile_busy(NS(events=lambda: [ev(0, 5, DeviceType.CPU)])))  # no device
    rows = [{"size": "base", "batch": 256, "ours": {"busy": 0.951}, "hf": {"busy": 0.9}},
            {"size": "mini", "batch": 32, "ours": {"samples_per_s": 20.0}, "hf": {"samples_per_s": 9.0}}]
    assert bench_step.busy_lines(rows) == ["base batch 256: GPU busy over 3 profiled steps back to back (a lower "
                                           "bound: the profiler adds host work): ours 95.1%, HF 90.0%"]
    rows[0]["ours"]["syncs_per_step"], rows[0]["hf"]["syncs_per_step"] = 0, 3
    assert bench_step.busy_lines(rows)[0].endswith("HF 90.0%; host waits for the device in one step (where: "
                                                   "--profile-out): ours 0, HF 3")


def _reads_a_value(x):
    return float((x * 2).sum())  # .item(): what a CUDA device would be waited for


def test_sync_sites_name_the_ops_and_python_frames_around_each_wait():
    """Where the host waits (issue 24 item 7's profile): on the CPU no CUDA runtime call is recorded, so the
    same walk is checked on aten's scalar read, which is one on CUDA: each wait by its enclosing ops and Python
    frames (torch's and the test runner's left out), innermost first, counted."""
    from torch.profiler import ProfilerActivity, profile

    bench_step = _bench_step()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            _reads_a_value(torch.ones(4))
        torch.ones(2).sum().item()
    sites = bench_step.sync_sites(prof, names=("aten::_local_scalar_dense",))
    assert [count for count, _ in sites] == [3, 1]
    chain = sites[0][1].split(" <- ")
    assert chain[:2] == ["aten::_local_scalar_dense", "aten::item"]
    assert "test_gpu_tools_cpu.py(" in chain[2] and chain[2].endswith("): _reads_a_value")
    assert chain[3].endswith("): test_sync_sites_name_the_ops_and_python_frames_around_each_wait")
    assert len(chain) == 4  # the test runner's frames are left out
    assert bench_step.sync_sites(prof, names=("aten::_local_scalar_dense",), frames=1)[0][1] == " <- ".join(chain[:3])
    assert bench_step.sync_sites(prof) == []  # no CUDA runtime call on the CPU


def test_gpu_data_stages_the_books_and_the_tokenizer_the_books_bench_reads(tmp_path, data_dir, monkeypatch):
    """tools/gpu_data.sh copies the shared books and BERT's tokenizer.json into one directory (what the GPU machine
    lacks), replacing an earlier copy whole; bench_step's --data then reads them there through $PRETRAIN_DATA_DIR
    and $PRETRAIN_BERT_TOKENIZER (padding_share.bert_tokenizer), and refuses a tokenizer path that is not a file."""
    out = tmp_path / "gpu_data"
    for _ in range(2):  # the second run replaces the first copy (the shared books may be read-only)
        proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_data.sh"), str(out)], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "PRETRAIN_DATA_DIR": str(data_dir)}, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    books = sorted(p.name for p in (out / "corpus" / "books").iterdir())
    assert books == sorted(p.name for p in (data_dir / "corpus" / "books").iterdir()) and books
    padding_share = _tool("padding_share")
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(
        Path(padding_share.bert_tokenizer()).read_text())
    assert not list(tmp_path.glob("*.partial.*"))
    monkeypatch.setenv("PRETRAIN_BERT_TOKENIZER", str(out / "tokenizer.json"))
    assert padding_share.bert_tokenizer() == str(out / "tokenizer.json")
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(out))
    (batch,) = _bench_step().real_batches("books", 4, 128, 64, 1, work=str(tmp_path / "work"))
    assert batch["input_ids"].shape[0] == 4 and int(batch["input_ids"].max()) < 30522
    monkeypatch.setenv("PRETRAIN_BERT_TOKENIZER", str(out / "missing.json"))
    with pytest.raises(SystemExit, match="no such file"):
        padding_share.bert_tokenizer()


def test_device_ops_count_sdpa_and_dropout_as_one_op_each_way_without_the_c_kernels():
    """``tools/bench_device_ops.py``'s CUDA op shape: inside, every module that calls the C kernels sees none,
    an SDPA with gradients is one counted op each way with SDPA's own values and gradients, dropout is aten's
    native_dropout; outside, all as before."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_device_ops as bdo
    from pretrain.metrics.op_count import OpCounter
    from pretrain.model import gather, kernels

    sdpa, dropout = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.dropout
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    mask = torch.rand(2, 1, 1, 5, generator=gen) > 0.3
    mask[..., 0] = True
    want_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = sdpa(*want_in, attn_mask=mask)
    want.sum().backward()
    with bdo.cuda_op_shape():
        assert all(__import__(m, fromlist=["x"]).cpu_kernels() is None for m in bdo.KERNEL_USERS)
        got_in = [t.clone().requires_grad_() for t in (q, k, v)]
        with OpCounter() as counter:
            got = torch.nn.functional.scaled_dot_product_attention(*got_in, attn_mask=mask)
            got.sum().backward()
            torch.nn.functional.dropout(torch.ones(8, 8, requires_grad=True), 0.5, True).sum().backward()
    assert counter.ops[bdo.ATTENTION_OP] == 1 and counter.ops[bdo.ATTENTION_OP + "_backward"] == 1
    assert counter.ops["aten.native_dropout"] == 1 and counter.ops["aten.native_dropout_backward"] == 1
    assert not {"aten.bmm", "aten._safe_softmax", "aten.bernoulli_"} & set(counter.ops), counter.ops
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa and torch.nn.functional.dropout is dropout
    assert gather.cpu_kernels is kernels.cpu_kernels


def test_device_ops_count_what_sdpa_does_to_a_mask_before_the_efficient_kernel():
    """Under the CUDA op shape, SDPA's front end's handling of a mask is run and counted as on CUDA before the
    memory-efficient kernel: a boolean mask converted (``where``), padded to 8 columns and sliced back; a bias from
    ``dropout.sdpa_bias`` (aligned, additive) only broadcast. The same attention either way."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_device_ops as bdo
    from pretrain.metrics.op_count import OpCounter
    from pretrain.model.dropout import sdpa_bias

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 1, 5, generator=gen) > 0.3
    mask[..., 0] = True
    outs, counts = [], []
    with bdo.cuda_op_shape():
        for m in (mask, sdpa_bias(mask, torch.float64)):
            with OpCounter() as counter:
                outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m))
            counts.append(counter.ops)
    converted, biased = counts
    assert converted["aten.where"] == 1 and converted["aten.constant_pad_nd"] == 1, converted
    assert not {"aten.where", "aten.constant_pad_nd", "aten.scalar_tensor"} & set(biased), biased
    assert biased["aten.expand"] == 1 and biased[bdo.ATTENTION_OP] == 1
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_device_ops_count_the_direct_flash_varlen_call_as_one_op_each_way():
    """Under the CUDA op shape, bf16 ``varlen_attention`` takes ``flash_varlen`` as on CUDA, stood in for by one
    counted op each way with the nested path's values and gradients (the arm ``--ab varlen`` counts); outside, the
    CPU takes the nested path as before."""
    import numpy as np

    sys.path.insert(0, str(REPO / "tools"))
    import bench_device_ops as bdo
    from pretrain.metrics.op_count import OpCounter
    from pretrain.model import attention
    from pretrain.model.packing import pack

    lengths = [5, 3, 7]
    mask = np.arange(7)[None, :] < np.array(lengths)[:, None]
    packed = pack([(np.ones((3, 7), dtype=np.int64), mask)], attention="varlen")
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(sum(lengths), 16, generator=gen).to(torch.bfloat16) for _ in range(3)]
    want_in = [t.clone().requires_grad_() for t in qkv]
    want = attention.nested_attention(*want_in, packed, 2, 0.0)
    want.float().sum().backward()
    with bdo.cuda_op_shape():
        got_in = [t.clone().requires_grad_() for t in qkv]
        with OpCounter() as counter:
            got = attention.varlen_attention(*got_in, packed, 2, 0.0)
            got.float().sum().backward()
    assert counter.ops[bdo.VARLEN_OP] == 1 and counter.ops[bdo.VARLEN_OP + "_backward"] == 1, counter.ops
    assert counter.num_sync == 0 and not {"aten.bmm", "aten._safe_softmax"} & set(counter.ops), counter.ops
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert not attention.flash_varlen_applies(qkv[0], 8)  # restored: the CPU's nested path
