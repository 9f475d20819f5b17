"""Loader: each sample once per epoch across ranks, resume = tail of the stream, world-size and
worker-count invariance, collate padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pretrain.config.data import DataConfig
from pretrain.data.collate import collate
from pretrain.data.datasets import PretrainDataset
from pretrain.data.loader import RankBatchSampler, SampleOrder, build_loader


class FakeShards:
    """Stand-in for ShardedDataset: one sentence per document."""

    def __init__(self, num: int, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self._sents = [rng.integers(6, vocab, size=int(rng.integers(3, 30))).astype(np.uint16) for _ in range(num)]
        self.sizes = np.array([len(s) for s in self._sents], dtype=np.int32)
        self.doc_idx = np.arange(num + 1, dtype=np.int64)

    def __len__(self):
        return len(self._sents)

    def __getitem__(self, i):
        return self._sents[i]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from pretrain.prep.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    (d / "c.txt").write_text("The quick brown fox jumps over the lazy dog near the river bank.\n" * 20)
    tok = train_tokenizer([str(d / "c.txt")], str(d / "tok.json"), vocab_size=120, min_frequency=1)
    return PretrainDataset(FakeShards(37, tok.vocab_size), tok, DataConfig(max_len=32, view_max_len=24), seed=7)


def rank_stream(order, *, rank, world, mb, start, steps):
    sampler = RankBatchSampler(order, rank=rank, world_size=world, micro_batch_size=mb, start=start)
    return list(itertools.islice(iter(sampler), steps))


@pytest.mark.parametrize("world,mb", [(1, 4), (2, 3), (3, 5)])
def test_every_sample_once_per_epoch_across_ranks(world, mb):
    n = 37
    order = SampleOrder(n, seed=1)
    steps = 3 * n // (mb * world) + 1
    per_rank = [rank_stream(order, rank=r, world=world, mb=mb, start=0, steps=steps) for r in range(world)]
    # Global stream: micro-step by micro-step, rank 0's block then rank 1's ...
    stream = [k for step in zip(*per_rank) for batch in step for k in batch]
    for epoch in range(3):
        keys = stream[epoch * n : (epoch + 1) * n]
        assert all(e == epoch for e, _ in keys)
        assert sorted(i for _, i in keys) == list(range(n))
    expected0 = SampleOrder(n, seed=1).permutation(0).tolist()
    assert [i for _, i in stream[:n]] == expected0
    old = SampleOrder(n, seed=1, rule="permutation-v1")  # the rule of checkpoints before feistel-v1
    assert old.keys(0, n) == [(0, i) for i in np.random.default_rng([1, 0]).permutation(n).tolist()]


def _feistel_slow(n: int, seed: int, epoch: int, p: int) -> int:
    """feistel-v1 with Python integers, one position at a time (the reference for the vectorised rule)."""
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.loader import FEISTEL_ROUNDS

    half = max(1, ((n - 1).bit_length() + 1) // 2) if n > 1 else 1
    mask = (1 << half) - 1
    keys = [int(k) for k in sample_keys(seed, np.full(FEISTEL_ROUNDS, epoch), np.arange(FEISTEL_ROUNDS) + (1 << 40))]

    def mix(x):
        x &= (1 << 64) - 1
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
        return x ^ (x >> 31)

    x = p
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (mix(k + (right + 1) * 0x9E3779B97F4A7C15) & mask)
        x = (left << half) | right
        if x < n:
            return x


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 63, 64, 65, 1000, 4097])
def test_feistel_order_is_a_bijection_equal_to_its_slow_reference(n):
    order = SampleOrder(n, seed=11)
    for epoch in (0, 3):
        perm = order.permutation(epoch)
        assert sorted(perm.tolist()) == list(range(n))
        some = np.unique(np.linspace(0, n - 1, 40).astype(int))
        assert order.indices(epoch, some).tolist() == [_feistel_slow(n, 11, epoch, int(p)) for p in some]


def test_feistel_order_looks_shuffled_and_differs_by_epoch_and_seed():
    n = 100_000
    order = SampleOrder(n, seed=5)
    perm, pos = order.permutation(0).astype(np.float64), np.arange(n, dtype=np.float64)
    assert abs(np.corrcoef(pos, perm)[0, 1]) < 0.02  # no trend
    assert abs(np.corrcoef(perm[:-1], perm[1:])[0, 1]) < 0.02  # neighbours unrelated
    assert np.mean(np.abs(np.diff(perm)) < 10) < 0.001  # consecutive positions are not clustered
    assert np.count_nonzero(perm == pos) < 10  # about one fixed point expected
    # Each tenth of the positions draws from every tenth of the samples about equally.
    counts = np.histogram2d(pos, perm, bins=10)[0]
    assert counts.min() > 0.9 * n / 100 and counts.max() < 1.1 * n / 100
    for other in (order.permutation(1), SampleOrder(n, seed=6).permutation(0)):
        assert np.count_nonzero(other == perm) < 10


def test_order_needs_no_memory_at_corpus_scale():
    order = SampleOrder(2 * 10**9, seed=1)  # ~1e10 sentences: no array of this length is made
    got = order.keys(3 * 2 * 10**9 - 2, 4)  # spans the end of epoch 2 and the start of epoch 3
    assert [e for e, _ in got] == [2, 2, 3, 3] and all(0 <= i < 2 * 10**9 for _, i in got)
    with pytest.raises(ValueError, match="unknown sample order rule"):
        SampleOrder(5, seed=1, rule="shuffled-v9")


@pytest.mark.parametrize("world", [1, 2])
def test_start_position_gives_tail_of_stream(world):
    order, mb = SampleOrder(23, seed=4), 3
    full = [rank_stream(order, rank=r, world=world, mb=mb, start=0, steps=30) for r in range(world)]
    for p_steps in (1, 7, 16):
        start = p_steps * mb * world
        tail = [rank_stream(order, rank=r, world=world, mb=mb, start=start, steps=30 - p_steps) for r in range(world)]
        for r in range(world):
            assert tail[r] == full[r][p_steps:]


@pytest.mark.parametrize("rule", ["feistel-v1", "permutation-v1"])
def test_sampler_keys_are_each_ranks_blocks_of_the_stream_in_chunks(rule, monkeypatch):
    """The sampler locates thousands of positions per call (LOOKAHEAD_SAMPLES, here shrunk so that calls
    span epochs); its lists are this rank's micro-batch blocks of the global stream, ``chunk`` at a time."""
    from pretrain.data import loader as loader_mod

    monkeypatch.setattr(loader_mod, "LOOKAHEAD_SAMPLES", 40)
    order, mb, world = SampleOrder(29, seed=6, rule=rule), 3, 2
    stream = order.keys(7 * mb * world, 200 * mb * world)
    for rank in range(world):
        for chunk in (1, 3):
            sampler = RankBatchSampler(order, rank=rank, world_size=world, micro_batch_size=mb,
                                       start=7 * mb * world, chunk=chunk)
            got = list(itertools.islice(iter(sampler), 60 // chunk))
            want = [stream[s * mb * world + rank * mb:s * mb * world + (rank + 1) * mb] for s in range(60)]
            assert got == [sum(want[c * chunk:(c + 1) * chunk], []) for c in range(60 // chunk)]


def test_global_batches_do_not_depend_on_world_size():
    order = SampleOrder(50, seed=2)
    one = rank_stream(order, rank=0, world=1, mb=8, start=0, steps=10)  # global batch 8, 1 rank
    two = [rank_stream(order, rank=r, world=2, mb=2, start=0, steps=20) for r in range(2)]  # 2 ranks x 2 accum
    for g in range(5):
        union = [k for step in (2 * g, 2 * g + 1) for r in range(2) for k in two[r][step]]
        assert union == one[g]


def as_lists(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


def test_loader_resume_and_worker_invariance(dataset):
    kw = dict(seed=3, micro_batch_size=4, pad_id=0)
    ref = [as_lists(itertools.islice(iter(build_loader(dataset, rank=r, world_size=2, start_sample=0,
                                                        num_workers=0, **kw)), 13)) for r in range(2)]
    # Same stream with worker processes, resumed at position 40 (= 5 micro-steps of 2 ranks x 4).
    for r in range(2):
        loader = build_loader(dataset, rank=r, world_size=2, start_sample=40, num_workers=2, **kw)
        got = as_lists(itertools.islice(iter(loader), 7))
        assert got == ref[r][5:12]
        assert loader.state_dict() == {"consumed_samples": 40 + 7 * 8}
        # Re-iterating continues from the consumed position (persistent workers reused).
        assert as_lists(itertools.islice(iter(loader), 1)) == ref[r][12:13]
    with pytest.raises(ValueError, match="multiple"):
        build_loader(dataset, rank=0, world_size=2, start_sample=6, num_workers=0, **kw)


def test_loader_keeps_global_torch_rng_untouched(dataset):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(build_loader(dataset, seed=1, rank=0, world_size=1, micro_batch_size=2, start_sample=0,
                           num_workers=0, pad_id=0)))
    assert torch.equal(before, torch.get_rng_state())


def test_collate_pads_to_batch_max():
    samples = [
        {"input_ids": np.array([2, 7, 3]), "mlm_labels": np.array([-100, 7, -100]),
         "view_a": np.array([2, 3]), "view_b": np.array([2, 9, 9, 3]), "source": 1},
        {"input_ids": np.array([2, 8, 8, 8, 3]), "mlm_labels": np.array([-100, -100, 8, -100, -100]),
         "view_a": np.array([2, 5, 3]), "view_b": np.array([2, 3]), "source": 0},
    ]
    b = collate(samples, pad_id=0)
    assert b["input_ids"].tolist() == [[2, 7, 3, 0, 0], [2, 8, 8, 8, 3]]
    assert b["attention_mask"].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert b["mlm_labels"].tolist() == [[-100, 7, -100, -100, -100], [-100, -100, 8, -100, -100]]
    assert b["view_a_ids"].shape == (2, 3) and b["view_b_ids"].shape == (2, 4)
    assert b["view_b_mask"].tolist() == [[True] * 4, [True, True, False, False]]
    assert b["source"].tolist() == [1, 0]
    assert b["input_ids"].dtype == torch.int64 and b["attention_mask"].dtype == torch.bool


def test_chunks_and_packed_hand_off_give_the_same_batches(dataset):
    """Workers build several micro-batches per task and hand them over packed in one buffer: the batches
    (values, dtypes, shapes) and the consumed position are those of one micro-batch per task in-process."""
    from pretrain.data.loader import PackedBatch

    kw = dict(seed=5, rank=1, world_size=2, micro_batch_size=3, pad_id=0)
    ref_loader = build_loader(dataset, start_sample=12, num_workers=0, chunk=1, **kw)
    ref = list(itertools.islice(iter(ref_loader), 9))
    for workers, chunk in ((0, 4), (2, 4), (1, 1)):
        loader = build_loader(dataset, start_sample=12, num_workers=workers, chunk=chunk, **kw)
        got = list(itertools.islice(iter(loader), 9))
        assert loader.state_dict() == ref_loader.state_dict() == {"consumed_samples": 12 + 9 * 6}
        for a, b in zip(got, ref):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (workers, chunk, k)
    big = {"x": torch.tensor([[2**40, -1]]), "m": torch.tensor([[True, False]]), "f": torch.tensor([0.5])}
    out = PackedBatch(big).unpack()  # values beyond int32 travel as int64
    assert all(out[k].dtype == big[k].dtype and torch.equal(out[k], big[k]) for k in big)



def _run_script(script, timeout: float):
    """``python script`` with this checkout's pretrain first on the path (whatever pip's editable install names)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env)

def test_a_script_that_ends_with_workers_running_exits(tmp_path):
    """Workers ignore SIGTERM (a signal to the whole job must not kill them mid-checkpoint), so the interpreter's
    exit must not wait on them: the loader stops them itself at exit."""
    import textwrap

    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent('''
        import itertools, torch
        from pretrain.data.loader import build_loader

        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 1000
            def __getitem__(self, key):
                return {"input_ids": torch.tensor([key[1] ** 2])}

        def collate(samples, pad_id):
            return {"input_ids": torch.cat([s["input_ids"] for s in samples])}

        loader = build_loader(Squares(), seed=0, rank=0, world_size=1, micro_batch_size=2, start_sample=0,
                              num_workers=2, pad_id=0, collate_fn=collate)
        it = iter(loader)
        print(next(it)["input_ids"].tolist(), flush=True)
    '''))
    p = _run_script(script, timeout=30)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(eval(p.stdout.strip())) == 2



def test_a_dropped_loader_whose_worker_is_busy_does_not_hold_the_exit(tmp_path):
    """A loader dropped without close() (an error unwinding the trainer): torch's finaliser asks the workers to
    exit and SIGTERMs the one still busy, which ignores it; the process must still exit at once, not when that
    worker's task ends (120 s here; multiprocessing's exit handler would wait for it). Stop 31's CI hung there."""
    import textwrap
    import time

    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent('''
        import gc, os, time, torch
        from pretrain.data.loader import build_loader

        class SlowAfterTheFirst(torch.utils.data.Dataset):
            calls = 0
            def __len__(self):
                return 1000
            def __getitem__(self, key):
                type(self).calls += 1
                if type(self).calls > 2:
                    time.sleep(120)
                return {"input_ids": torch.tensor([key[1]])}

        def collate(samples, pad_id):
            return {"input_ids": torch.cat([s["input_ids"] for s in samples])}

        loader = build_loader(SlowAfterTheFirst(), seed=0, rank=0, world_size=1, micro_batch_size=2,
                              start_sample=0, num_workers=1, pad_id=0, collate_fn=collate, chunk=1)
        it = iter(loader)
        print(len(next(it)["input_ids"]), flush=True)
        time.sleep(0.5)  # the worker is in its 120 s task now
        del it, loader
        gc.collect()
    '''))
    t0 = time.monotonic()
    p = _run_script(script, timeout=90)
    assert p.returncode == 0 and p.stdout.strip() == "2", p.stderr[-2000:]
    assert time.monotonic() - t0 < 60, "the exit waited for the busy worker"

def test_slot_ring_round_trip_reuse_growth_and_fallback():
    """The shared-memory hand-off gives back the batches it was given (dtypes, shapes, values, empty fields) as
    copies; a slot is reused once the main process has copied it out, its buffer travels only on first use in a
    generation (again after it grows or a new generation starts), and with every slot held pack() declines."""
    import pickle

    from pretrain.data.loader import SlotChunk, SlotRing

    def batch(rows: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(-2**40, 2**40, (rows, 7), generator=g),
                "mask": torch.rand(rows, 7, generator=g) < 0.5,
                "w": torch.rand(rows, generator=g, dtype=torch.float64), "none": torch.zeros(0, 5, dtype=torch.int64)}

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    ring = SlotRing(num_workers=2, slots=2)
    first = [batch(3, 0), batch(2, 1)]
    chunk = ring.pack(first, worker=1)
    assert isinstance(chunk, SlotChunk) and chunk.buffer is not None and int(ring.state[1, chunk.slot]) == 1
    chunk = pickle.loads(pickle.dumps(chunk))  # what crosses the queue (here without torch's storage sharing)
    ring._mapped[(1, chunk.slot)] = ring._own[chunk.slot][0]  # the main process would map the shared buffer
    chunk.buffer = None
    got = ring.unpack(chunk)
    assert all(same(g, w) for g, w in zip(got, first)) and int(ring.state[1, chunk.slot]) == 0
    again = ring.pack([batch(3, 2)], worker=1)  # the freed slot again: no buffer resent
    assert again.slot == chunk.slot and again.buffer is None
    assert same(ring.unpack(again)[0], batch(3, 2)) and all(same(g, w) for g, w in zip(got, first))  # copies
    grown = ring.pack([batch(5000, 3)], worker=1)
    assert grown.buffer is not None and same(ring.unpack(grown)[0], batch(5000, 3))
    held = [ring.pack([batch(1, 4)], worker=1), ring.pack([batch(1, 5)], worker=1)]
    assert all(isinstance(h, SlotChunk) for h in held) and ring.pack([batch(1, 6)], worker=1) is None
    assert isinstance(ring.pack([batch(1, 6)], worker=0), SlotChunk)  # another worker's slots are its own
    ring.new_generation()  # a restarted DataLoader discards what was in flight: its slots are free again
    fresh = ring.pack([batch(2, 7)], worker=1)
    assert fresh is not None and fresh.buffer is not None and same(ring.unpack(fresh)[0], batch(2, 7))
    stale = SlotChunk(0, 1, 9, None, [])
    with pytest.raises(RuntimeError, match="before sending"):
        ring.unpack(stale)


def test_loader_workers_fall_back_to_packed_buffers_when_slots_run_out(dataset):
    """With every slot of the ring held, the workers' batches travel pickled and are still the same batches."""
    kw = dict(seed=5, rank=0, world_size=1, micro_batch_size=3, pad_id=0, start_sample=0, chunk=2)
    ref = as_lists(itertools.islice(iter(build_loader(dataset, num_workers=0, **kw)), 8))
    loader = build_loader(dataset, num_workers=1, **kw)
    loader.ring.state.fill_(2)  # the generation the first iteration will use: every slot looks held
    assert as_lists(itertools.islice(iter(loader), 8)) == ref
    assert int(loader.ring.generation[0]) == 2 and not loader.ring._mapped  # nothing went through the ring


def _same_value(a, b) -> bool:
    """Equal values, tensors by dtype, shape and values, through dataclasses (packed streams), tuples and dicts."""
    import dataclasses

    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same_value(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("unpadded,joint", [("groups", True), ("groups", False), (False, False), ("fixed", True)])
def test_batches_prepared_by_the_workers_are_what_the_step_would_make(dataset, unpadded, joint):
    """``build_loader(prepare=HostFacts(...))``: the packed streams made where the batch is built travel through
    the shared-memory slots, the pickled fallback and in-process alike, and the step takes them as they are: the
    same dict (keys, tensors, dtypes, every field of every packed stream) as packing the plain batch in the step."""
    from pretrain.model.packing import Packed
    from pretrain.training.step import PREPARED, HostFacts, step_facts

    facts = HostFacts(unpadded, joint)
    kw = dict(seed=5, rank=0, world_size=1, micro_batch_size=3, pad_id=0, start_sample=0, chunk=2)
    ref = [step_facts(b, facts) for b in itertools.islice(iter(build_loader(dataset, num_workers=0, **kw)), 6)]
    assert (unpadded is False) == ("packed_mlm" not in ref[0]) and all(PREPARED not in b for b in ref)
    assert any(isinstance(v, Packed) for v in ref[0].values()) == bool(unpadded)
    for workers, slots_held in ((0, False), (2, False), (1, True)):
        loader = build_loader(dataset, num_workers=workers, prepare=facts, **kw)
        if slots_held:  # every slot looks held: the pickled buffers carry the packed streams
            loader.ring.state.fill_(2)
        got = list(itertools.islice(iter(loader), 6))
        assert all(b[PREPARED] == facts for b in got)
        taken = [step_facts(b, facts) for b in got]
        assert all(_same_value(a, b) for a, b in zip(taken, ref)), (workers, slots_held)
        loader.close()
    other = HostFacts(unpadded, not joint)
    with pytest.raises(ValueError, match="prepared with"):
        step_facts(got[0], other)


def test_split_tensors_round_trip_keeps_every_value():
    """What travels beside the tensors: nested tensors named apart and put back, other values as they were."""
    from pretrain.data.loader import join_tensors, split_tensors
    from pretrain.model.packing import pack

    ids = np.array([[2, 5, 6, 3], [2, 7, 3, 0]])
    mask = ids != 0
    batch = {"input_ids": torch.from_numpy(ids), "packed": pack([(ids, mask)]), "counts": {"mlm": 3},
             "full": frozenset({"view_a_mask"}), "pair": (torch.ones(2), None, 4)}
    tensors, rest = split_tensors(batch)
    assert set(tensors) >= {"input_ids", "pair:.0", "packed:.ids_N"} and "input_ids" not in rest
    assert all(torch.is_tensor(t) for t in tensors.values())
    back = join_tensors(dict(tensors), rest)
    assert back.keys() == batch.keys() and all(_same_value(back[k], batch[k]) for k in batch)


def test_a_micro_batch_in_one_buffer_moves_as_one_copy(dataset):
    """``step.views_moved``: the tensors a worker handed over in one slot (the batch's and its packed streams')
    are copied as one byte range per storage, each rebuilt there with its dtype, shape, strides and values; a
    tensor alone in its storage or empty is left to move on its own."""
    from pretrain.training.step import HostFacts, step_facts, to_device, views_moved

    facts = HostFacts("groups", True)
    kw = dict(seed=5, rank=0, world_size=1, micro_batch_size=3, pad_id=0, start_sample=0, chunk=2)
    loader = build_loader(dataset, num_workers=1, prepare=facts, **kw)
    batch = step_facts(next(iter(loader)), facts)
    loader.close()
    tensors = [t for v in batch.values() for t in ([v] if torch.is_tensor(v) else
                                                    v.tensors() if hasattr(v, "tensors") else [])]
    copies = []

    def copy(block: torch.Tensor, at: int = 0) -> torch.Tensor:
        copies.append(block.numel())
        return torch.cat([torch.zeros(at, dtype=torch.uint8), block])[at:]  # elsewhere, ``at`` bytes in

    moved = views_moved(tensors, copy)
    alone = [t for t in tensors if not t.numel()]
    assert len(copies) == 1 and len(moved) == len(tensors) - len(alone) > 20
    for t in tensors:
        if t.numel():
            m = moved[id(t)]
            assert m.dtype == t.dtype and m.shape == t.shape and m.stride() == t.stride() and torch.equal(m, t)
            assert m.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert copies[0] <= sum(t.untyped_storage().nbytes() for t in tensors[:1])
    odd = views_moved(tensors, lambda block: copy(block, at=3))  # only the 1-byte dtypes fit at an odd offset
    assert odd and all(t.element_size() == 1 and torch.equal(odd[id(t)], t) for t in tensors if id(t) in odd)
    lone = [torch.arange(4), torch.arange(6).view(2, 3)[:, 1:], torch.zeros(0)]
    assert views_moved(lone, copy) == {} and len(copies) == 2
    base = torch.arange(12, dtype=torch.int64)
    pair = [base[2:5], base.view(torch.int32)[7:9], base[::4]]  # byte 28: no int64 offset, an int32 one
    got = views_moved(pair, copy)
    assert all(torch.equal(got[id(t)], t) for t in pair) and len(copies) == 3
    from pretrain.metrics.op_count import OpCounter

    with OpCounter() as ops:
        on_meta = to_device(batch, "meta")  # off the CPU: the whole batch, packed streams too, through views_moved
    assert ops.ops["aten._to_copy"] == 1  # one transfer (empty tensors are made there)
    assert on_meta.keys() == batch.keys()
    for k, v in batch.items():
        if torch.is_tensor(v):
            m = on_meta[k]
            assert m.device.type == "meta" and (m.dtype, m.shape, m.stride()) == (v.dtype, v.shape, v.stride())
        elif hasattr(v, "tensors"):
            assert [(m.device.type, m.shape) for m in on_meta[k].tensors()] == [("meta", t.shape) for t in v.tensors()]
    # views of one transferred block (a meta storage has no address: its size tells), as on a GPU
    block = on_meta["input_ids"].untyped_storage().nbytes()
    assert block > sum(batch[k].numel() * batch[k].element_size()
                       for k in ("input_ids", "attention_mask", "mlm_labels"))
    assert all(on_meta[k].untyped_storage().nbytes() == block for k in ("attention_mask", "mlm_labels"))
