"""Shared fixtures: the real-data directory, a tiny generated corpus, device skips; and the session's process
reaper: a process of this session still alive when it ends (a descendant of pytest, or an orphan whose environment
carries ``PRETRAIN_TEST_SESSION``: a DataLoader worker, a trainer or a job step a failing test left) is named with
the test after which it was first seen, then killed. Stop 31's CI ran out of time after pytest's summary: persistent
DataLoader workers of in-process runs, which ignore SIGTERM, held multiprocessing's exit handler."""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from tiny_roberta import save_roberta_dir, train_roberta_tokenizer  # noqa: E402  (tools/, and re-exported to tests)
_SESSION_VAR = "PRETRAIN_TEST_SESSION"
# A fresh mark per session, also in a pytest that a test runs (tools/gpu_check.sh's tests stage): with the outer
# session's mark inherited, the inner one's reaper killed the outer test's processes as its own.
os.environ[_SESSION_VAR] = uuid.uuid4().hex
_SESSION_MARK = f"{_SESSION_VAR}={os.environ[_SESSION_VAR]}".encode()
_first_seen: dict[int, str] = {}  # pid of a marked process -> the test after which it was first seen alive


def _session_processes() -> dict[int, str]:
    """{pid: command line} of this session's live processes other than pytest itself: its descendants (forked
    ones, DataLoader workers of in-process runs, included) and any process whose environment carries the session
    mark (an orphan re-parented to init). Read from /proc; {} where there is none."""
    parents, found = {}, {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z":  # a zombie holds nothing open
                continue
            parents[int(entry.name)] = int(fields[1])
            if _SESSION_MARK in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = ""
        except (OSError, ValueError):  # gone, or not ours to read
            continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        found[pid] = ""
        todo += children.get(pid, [])
    found.pop(os.getpid(), None)
    for pid in list(found):
        try:
            found[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:
            del found[pid]
    return found


@pytest.fixture(autouse=True)
def _note_leftover_processes(request):
    yield
    for pid in _session_processes():
        _first_seen.setdefault(pid, request.node.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """Name, then kill, the session's processes still alive, and name its non-daemon threads still running."""
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    say = report.write_line if report is not None else (lambda line: print(line, file=sys.stderr))
    left = _session_processes()
    threads = [t for t in threading.enumerate()
               if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if (left or threads) and report is not None:
        report.write_sep("=", "left behind by the tests")
    for pid, cmd in sorted(left.items()):
        say(f"LEFTOVER PROCESS {pid} (first seen after {_first_seen.get(pid, 'the last test')}): {cmd[:300]}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for t in threads:
        say(f"LEFTOVER THREAD {t.name!r} (non-daemon: the interpreter waits for it at exit)")


def _data_dir() -> Path | None:
    env = os.environ.get("PRETRAIN_DATA_DIR")
    if env:
        return Path(env)
    default = REPO.parent / "shared" / "data"
    return default if default.is_dir() else None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """../shared/data (or $PRETRAIN_DATA_DIR); tests using it skip when it is absent."""
    d = _data_dir()
    if d is None or not d.is_dir():
        pytest.skip("real data not found: set PRETRAIN_DATA_DIR to the shared data directory")
    return d


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    # PRETRAIN_GPU_TEST_DEVICE=cpu: tests/gpu/test_model_cuda.py runs on the CPU, to check the tests themselves
    dry_run = os.environ.get("PRETRAIN_GPU_TEST_DEVICE") == "cpu"
    for item in items:
        if "gpu" in item.keywords and not has_cuda and not dry_run:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict:
    """Embedded corpus -> WordPiece tokenizer (vocab 2000) -> train/valid datasets, built once per session.

    Returns {"tokenizer": path, "train": dataset dir, "valid": dataset dir, "dir": root}.
    """
    from pretrain.prep.embedded import write_embedded_corpus
    from pretrain.prep.preprocess import preprocess
    from pretrain.prep.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_corpus")
    train_txt, valid_txt = write_embedded_corpus(root / "text", valid_every=10)
    tok = root / "tokenizer.json"
    train_tokenizer([str(train_txt)], str(tok), kind="wordpiece", vocab_size=2000)
    out = {"tokenizer": str(tok), "dir": str(root)}
    for split, txt in (("train", train_txt), ("valid", valid_txt)):
        preprocess([str(txt)], str(root / split), str(tok), num_workers=1)
        out[split] = str(root / split)
    return out


@pytest.fixture(scope="session")
def tiny_roberta(tiny_corpus, tmp_path_factory) -> Path:
    """A randomly initialised transformers RobertaForMaskedLM (no pooler, as roberta-base's weights) at model=tiny's
    sizes (514 position rows as RoBERTa's: 512 tokens from row pad + 1 = 2, one token type) with a byte-level BPE
    tokenizer trained on the tiny corpus' text: a stand-in for roberta-base (tools/tiny_roberta.py)."""
    from tiny_roberta import tiny_roberta

    root = tmp_path_factory.mktemp("tiny_roberta")
    lines = (Path(tiny_corpus["dir"]) / "text" / "train.txt").read_text(encoding="utf-8").splitlines()
    return tiny_roberta(lines, root / "hf", vocab_size=1000)


@pytest.fixture(scope="session")
def tiny_overrides(tiny_corpus):
    """fn(run_dir, **extra) -> dotted overrides for a seconds-long tiny MLM + CLEAR run on tiny_corpus.

    Extra keys use '__' for '.', e.g. train__max_steps=12.
    """

    def make(run_dir, **extra) -> list[str]:
        return _tiny_run_overrides(tiny_corpus, run_dir, **{k.replace("__", "."): v for k, v in extra.items()})

    return make


def _tiny_run_overrides(corpus: dict, run_dir, **extra) -> list[str]:
    base = {
        "run_dir": str(run_dir),
        "data.tokenizer": corpus["tokenizer"],
        "data.sources": f"[{{name: docs, path: {corpus['train']}}}]",
        "data.valid": f"[{{name: docs, path: {corpus['valid']}}}]",
        "data.max_len": 64,
        "data.view_max_len": 32,
        "data.num_workers": 0,
        "model.hidden_size": 32,
        "model.num_layers": 2,
        "model.num_heads": 2,
        "model.ffn_size": 64,
        "model.max_position": 64,
        "train.micro_batch_size": 4,
        "train.max_steps": 8,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.eval_batches": 2,
        "optim.lr": 1e-3,
        "optim.warmup_steps": 2,
        "checkpoint.every": 4,
        "checkpoint.keep_last": 3,
        "distributed.timeout_s": 120,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add contention on the shared CI cores."""
    import torch

    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


@pytest.fixture
def clean_env():
    """For in-process trainer runs: start as a single process (no launcher variables) and afterwards restore the
    whole environment. (DeepSpeed's cached sub-groups of an old process group are dropped by the next
    ``distributed.env.init_process_group``.)"""
    saved = dict(os.environ)
    for k in _LAUNCHER_VARS:
        os.environ.pop(k, None)
    if not torch.cuda.is_available():  # as the Engine decides; on a GPU machine DeepSpeed must drive the GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    yield
    os.environ.clear()
    os.environ.update(saved)


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _restore_launcher_env():
    """In-process trainer runs let DeepSpeed put RANK/WORLD_SIZE/... into os.environ; a later test's
    subprocess (Slurm, torchrun) must not inherit them, so restore them after every test."""
    saved = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tiny_encoder(tiny_corpus):
    """(a 2-layer, 32-wide encoder in eval mode, seed 3, no dropout; the tiny corpus's tokenizer path)."""
    from pretrain.config.model import ModelConfig
    from pretrain.model import build_model
    from pretrain.prep.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_corpus["tokenizer"])
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                      max_position=64, pooling="mean", dropout=0.0, attention_dropout=0.0)
    return build_model(cfg, seed=3).eval(), tiny_corpus["tokenizer"]
