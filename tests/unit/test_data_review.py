"""Data path under faults and at the edges: a DataLoader worker killed mid-run, resume exactness, edge samples,
memory over a long run."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.config.data import DataConfig
from pretrain.data.datasets import PretrainDataset
from pretrain.data.loader import build_loader
from pretrain.data.workers import DataWorkerError
from test_loader import FakeShards  # noqa: E402  (tests/unit is on the path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from pretrain.prep.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    (d / "c.txt").write_text("The quick brown fox jumps over the lazy dog near the river bank.\n" * 20)
    return train_tokenizer([str(d / "c.txt")], str(d / "tok.json"), vocab_size=120, min_frequency=1)


@pytest.fixture(scope="module")
def dataset(tok):
    return PretrainDataset(FakeShards(53, tok.vocab_size), tok, DataConfig(max_len=32, view_max_len=24), seed=7)


def as_lists(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


def test_a_killed_worker_stops_the_loader_in_one_line_and_the_stream_resumes_exactly(dataset):
    """A worker SIGKILLed (the OOM killer) mid-run: the main process is not interrupted wherever it is (torch's
    SIGCHLD handler raised its RuntimeError from inside the model's forward, a 40-line traceback); the next batch
    it waits for raises one ValueError line naming the worker, the signal and what to do; the batches handed out
    before are the reference stream's, and a loader from the consumed position continues it exactly."""
    kw = dict(seed=3, rank=0, world_size=1, micro_batch_size=4, pad_id=0, chunk=1)
    ref = as_lists(itertools.islice(iter(build_loader(dataset, start_sample=0, num_workers=0, **kw)), 30))
    loader = build_loader(dataset, start_sample=0, num_workers=2, prefetch_factor=1, **kw)
    it = iter(loader)
    got = as_lists(itertools.islice(it, 3))
    victim = loader.loader._iterator._workers[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    time.sleep(0.5)  # the main process goes on with its own work (a forward, a checkpoint write) undisturbed
    t0 = time.monotonic()
    with pytest.raises(DataWorkerError, match=r"worker 1 \(pid \d+\) was killed by SIGKILL .*OOM killer") as failure:
        for _ in range(20):
            got += as_lists([next(it)])
    assert time.monotonic() - t0 < 30
    assert "\n" not in str(failure.value) and failure.value.__cause__ is None
    assert got == ref[:len(got)] and len(got) < 20
    assert loader.consumed_samples == 4 * len(got)
    loader.close()
    assert not victim.is_alive()
    resumed = build_loader(dataset, start_sample=loader.consumed_samples, num_workers=2, **kw)
    assert as_lists(itertools.islice(iter(resumed), 30 - len(got))) == ref[len(got):]
    resumed.close()


class _RunsOutOfMemory(torch.utils.data.Dataset):
    """Sample 5 cannot be allocated (numpy's MemoryError under a job's address-space limit)."""

    def __len__(self):
        return 64

    def __getitem__(self, key):
        if key[1] == 5:
            raise MemoryError("Unable to allocate 12.0 GiB for an array with shape (40000, 40000)")
        return {"input_ids": torch.tensor([key[1]])}


def _cat_ids(samples, pad_id):
    return {"input_ids": torch.cat([s["input_ids"] for s in samples])}


def test_a_worker_out_of_memory_is_one_line_not_the_workers_traceback():
    loader = build_loader(_RunsOutOfMemory(), seed=0, rank=0, world_size=1, micro_batch_size=2, start_sample=0,
                          num_workers=2, pad_id=0, collate_fn=_cat_ids, chunk=1)
    it = iter(loader)
    with pytest.raises(DataWorkerError, match=r"worker ran out of memory .* data\.num_workers") as failure:
        for _ in range(40):
            next(it)
    assert "\n" not in str(failure.value) and "Traceback" not in str(failure.value)
    loader.close()


class _Hangs(torch.utils.data.Dataset):
    """Sample 9 never comes back: its read blocks, as a read from a hung NFS/Lustre mount does (here an open of a
    FIFO nobody writes)."""

    def __init__(self, fifo: str):
        self.fifo = fifo

    def __len__(self):
        return 64

    def __getitem__(self, key):
        if key[1] == 9:
            open(self.fifo, "rb").read()
        return {"input_ids": torch.tensor([key[1]])}


def test_a_worker_stuck_on_a_read_stops_the_loader_after_data_timeout_s_in_one_line(tmp_path):
    """A worker stuck on a read that never returns (a hung mount) hung a one-rank run for good: the loader waited
    for its batch forever. With ``timeout_s`` the wait ends with one line naming the workers and their state, the
    setting and the data position, and closing the loader does not wait for the stuck worker."""
    fifo = tmp_path / "hung"
    os.mkfifo(fifo)
    loader = build_loader(_Hangs(str(fifo)), seed=0, rank=0, world_size=1, micro_batch_size=2, start_sample=0,
                          num_workers=1, prefetch_factor=1, pad_id=0, collate_fn=_cat_ids, chunk=1, timeout_s=2)
    it = iter(loader)
    t0 = time.monotonic()
    with pytest.raises(DataWorkerError, match=r"no batch from the data loader's workers for 2 s \(data\.timeout_s\) "
                                              r"while building batches at data position \d+ .*: worker 0 \(pid \d+\) "
                                              r"sleeping\. A worker is stuck") as failure:
        for _ in range(40):
            next(it)
    assert 2 <= time.monotonic() - t0 < 30
    assert "\n" not in str(failure.value) and failure.value.__cause__ is None
    assert not isinstance(failure.value, ValueError)  # not the input error's exit 2: pretrain-train exits 5
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 15


def test_a_worker_that_died_between_fetches_is_named_when_the_loader_restarts(dataset):
    """A rollback restarts the iterator at the rolled-back position (``iter`` again, which first waits for every
    worker to acknowledge): a worker that died meanwhile is named there in one line, not a torch RuntimeError."""
    loader = build_loader(dataset, seed=3, rank=0, world_size=1, micro_batch_size=4, pad_id=0, chunk=1,
                          start_sample=0, num_workers=2, prefetch_factor=1)
    next(iter(loader))
    victim = loader.loader._iterator._workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    time.sleep(0.5)
    loader.consumed_samples = 0  # as Trainer.roll_back
    with pytest.raises(DataWorkerError, match=r"worker 0 \(pid \d+\) was killed by SIGKILL while building batches "
                                         r"at data position 0 "):
        next(iter(loader))
    loader.close()


@pytest.mark.skipif(not os.path.isfile("/usr/share/wordnet/data.noun"), reason="wordnet-base not installed")
def test_synonyms_keep_their_word_boundary_with_a_bpe_tokenizer_without_prefix_space(tmp_path):
    """RoBERTa's byte-level BPE (no prefix space) writes "glad" mid-sentence as "Ġg l ad" but encodes the bare
    word as "g l ad": a synonym put in as the latter was glued to the word before ("the gladhotdog") and made
    one word with it for the augmentations after it. Every view keeps the sentence's words, each a synonym."""
    from tiny_roberta import train_roberta_tokenizer

    from pretrain.config.data import AugmentConfig
    from pretrain.data.augment import build_augmenter
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.ragged import Ragged
    from pretrain.data.wordnet import load_synonyms
    from pretrain.prep.tokenizer import load_tokenizer

    text = ("The quick brown fox jumps over the lazy dog. A big car drove fast down the happy road. "
            "She was glad to see the large house and the small garden near the river. ") * 30
    tok = load_tokenizer(str(train_roberta_tokenizer([text], tmp_path / "bpe.json", vocab_size=300)))
    sentence = "The big car drove fast down the happy road near the small house"
    ids = np.array(tok.encode(sentence))
    aug = build_augmenter(AugmentConfig(methods="subs", subs_rate=0.5), tok)
    syn = load_synonyms("/usr/share/wordnet")
    changed = 0
    for row in aug(Ragged.from_rows([ids] * 12), sample_keys(0, 0, np.arange(12))).rows():
        out = tok.decode(row.tolist()).split()
        assert len(out) == len(sentence.split()), tok.decode(row.tolist())
        for a, b in zip(sentence.split(), out):
            if a != b:
                assert b.lower() in syn[a.lower()], (a, b)
                changed += 1
    assert changed >= 12
    # Without [DEL] in the vocabulary (RoBERTa's) a deletion marker past the vocabulary can head a looked-up word
    # (the sentence's first word, not a word start, moved right after a deleted one): no lookup fails on it.
    first = np.array(tok.encode("Supercalifragilistic " + sentence))
    aug = build_augmenter(AugmentConfig(methods="del-word+reorder+subs", reorder_frac=0.2, reorder_pairs=2,
                                        del_word_rate=0.3), tok)
    assert len(aug(Ragged.from_rows([first] * 200), sample_keys(0, 0, np.arange(200))).rows()) == 200


def test_a_worker_killed_halfway_through_writing_a_batch_does_not_hang_the_next_fetch(tmp_path):
    """A worker SIGKILLed while its 8 MB message is half written into the pipe (the main process busy, not
    reading), and reaped meanwhile (as multiprocessing reaps dead children whenever it starts a process: the next
    validation's workers), which torch's SIGCHLD check then misses: the next fetch must name the dead worker, not
    read the half message and wait for the rest forever (it did). In a subprocess: a hang is a timeout here."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent('''
        import os, signal, time
        import numpy as np
        import torch
        from pretrain.data.loader import build_loader

        class Big(torch.utils.data.Dataset):
            def __len__(self):
                return 100
            def __getitem__(self, key):
                return np.full(1 << 20, key[1], dtype=np.int64)  # 8 MB, pickled into the pipe

        def collate(samples, pad_id):
            return ("not a dict: sent pickled", samples[0])

        loader = build_loader(Big(), seed=0, rank=0, world_size=1, micro_batch_size=1, start_sample=0,
                              num_workers=1, pad_id=0, collate_fn=collate, chunk=1, prefetch_factor=1)
        it = iter(loader)
        next(it)
        time.sleep(1.0)  # the worker's next message fills the pipe and waits for a reader
        victim = loader.loader._iterator._workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        time.sleep(0.5)
        try:
            next(it)
            print("no error")
        except RuntimeError as e:
            print(e)
        loader.close()
    '''))
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    try:
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the fetch after the worker's death hung")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "worker 0" in p.stdout and "was killed by SIGKILL" in p.stdout, (p.stdout, p.stderr[-3000:])
