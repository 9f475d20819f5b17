"""Resumable, data-parallel sharded loading of micro-batches.

Shape legend: N = samples per epoch, M = micro-batch size per rank, W = world size.

The global sample stream is the concatenation of epoch permutations; global position p is sample
``perm_{p // N}(p % N)`` of epoch ``p // N``. A permutation is computed where it is read (``SampleOrder``: a
keyed Feistel network, O(1) memory), not materialised: at 1e9 sentences an epoch has ~2e8 samples, whose
array would be 1.6 GB on every rank and seconds of start-up at every epoch. Each micro-step consumes M * W
consecutive positions and rank r takes the r-th contiguous block of M. A global batch is a run of consecutive
micro-steps, so the set of samples in each global batch depends only on the position, never on how it is split
over ranks and accumulation steps: resuming at ``consumed = steps * global_batch`` works for any world size with
the same global batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np
import torch

from pretrain.data.collate import collate
from pretrain.data.counter_rng import _GOLDEN, mix64, sample_keys
from pretrain.data.workers import (_LIVE_LOADERS, _LIVE_WORKERS, defer_worker_checks, kill_workers,
                                   unwatch_workers, watch_workers, worker_failure)
from pretrain.distributed.signals import ignore_in_worker

ORDER_RULE = "feistel-v1"
"""The rule new runs order their samples by; checkpoints record it (``sample_order``) and a resume keeps the
checkpoint's rule. "permutation-v1": ``default_rng([seed, epoch]).permutation(N)`` (runs before feistel-v1)."""
ORDER_RULES = ("feistel-v1", "permutation-v1")
FEISTEL_ROUNDS = 6


class SampleOrder:
    """The global (epoch, index) order of a dataset of ``num_samples``, independent of world size.

    feistel-v1: epoch e's order maps position p to ``E(p)``, with E a balanced Feistel network of
    FEISTEL_ROUNDS rounds over the smallest even-bit domain 2**(2h) >= N (< 4N), each round a SplitMix64 hash
    of (seed, epoch, round, half) keeping h bits, and cycle-walking (E applied again while the result is >= N,
    which ends because E is a permutation of the domain and p < N lies on a cycle through [0, N)). A bijection
    of [0, N) for every key; pseudo-random by Luby-Rackoff; no memory; any position of any epoch at once."""

    def __init__(self, num_samples: int, *, seed: int, rule: str = ORDER_RULE):
        if num_samples <= 0:
            raise ValueError(f"cannot iterate a dataset with {num_samples} samples; check data.sources")
        if rule not in ORDER_RULES:
            raise ValueError(f"unknown sample order rule {rule!r}: this pretrain version knows "
                             f"{', '.join(ORDER_RULES)}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.rule = rule
        self._epoch = -1
        self._perm_N = np.zeros(0, dtype=np.int64)
        self._half = max(1, (max(self.num_samples - 1, 1).bit_length() + 1) // 2)

    def indices(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """int64: the samples at positions ``pos`` (each in [0, N)) of epoch ``epoch``'s order."""
        pos = np.asarray(pos, dtype=np.int64)
        if self.rule == "permutation-v1":
            if epoch != self._epoch:
                self._perm_N = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                self._epoch = epoch
            return self._perm_N[pos]
        keys_R = self._round_keys(epoch)
        x = pos.astype(np.uint64)
        walk = np.ones(len(x), dtype=bool)
        while walk.any():
            x[walk] = self._feistel(x[walk], keys_R)
            walk = x >= np.uint64(self.num_samples)
        return x.astype(np.int64)

    def _round_keys(self, epoch: int) -> np.ndarray:
        return sample_keys(self.seed, np.full(FEISTEL_ROUNDS, epoch), np.arange(FEISTEL_ROUNDS) + (1 << 40))

    def _feistel(self, x: np.ndarray, keys_R: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        mask = np.uint64((1 << self._half) - 1)
        left, right = x >> h, x & mask
        with np.errstate(over="ignore"):
            for key in keys_R:
                left, right = right, left ^ (mix64(key + (right + np.uint64(1)) * _GOLDEN) & mask)
        return (left << h) | right

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s whole order, int64[N] (tests and small datasets; training reads positions)."""
        return self.indices(epoch, np.arange(self.num_samples))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, index) int64 arrays of global stream positions (any order, any epochs), one vectorised
        permutation call per epoch present."""
        positions = np.asarray(positions, dtype=np.int64)
        epoch, offset = np.divmod(positions, self.num_samples)
        index = np.empty_like(offset)
        for e in np.unique(epoch).tolist():
            rows = epoch == e
            index[rows] = self.indices(e, offset[rows])
        return epoch, index

    def keys(self, start: int, count: int) -> list[tuple[int, int]]:
        """(epoch, index) of global positions start .. start + count - 1 (may span epochs)."""
        epoch, index = self.locate(np.arange(start, start + count, dtype=np.int64))
        return list(zip(epoch.tolist(), index.tolist()))


LOOKAHEAD_SAMPLES = 4096
"""Keys a sampler computes per call to the order (at least one chunk): the permutation's numpy calls are paid
once per few thousand samples, not per micro-batch."""


class RankBatchSampler:
    """Infinite batch sampler: lists of (epoch, index) keys for one rank, from ``start``: the keys of
    ``chunk`` consecutive micro-batches per list (a worker builds them in one task; the loader splits them)."""

    def __init__(self, order: SampleOrder, *, rank: int, world_size: int, micro_batch_size: int, start: int,
                 chunk: int = 1):
        self.order = order
        self.rank, self.world_size, self.micro_batch_size = rank, world_size, micro_batch_size
        self.start = start
        self.chunk = chunk

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        M, step = self.micro_batch_size, self.micro_batch_size * self.world_size
        chunks = max(1, LOOKAHEAD_SAMPLES // (M * self.chunk))  # chunks located per call to the order
        offsets = np.arange(M, dtype=np.int64) + self.rank * M
        pos = self.start
        while True:
            n_steps = chunks * self.chunk
            positions = pos + np.arange(n_steps, dtype=np.int64)[:, None] * step + offsets
            epoch, index = self.order.locate(positions.ravel())
            keys = list(zip(epoch.tolist(), index.tolist()))
            for c in range(chunks):
                yield keys[c * self.chunk * M:(c + 1) * self.chunk * M]
            pos += n_steps * step


CHUNK_SAMPLES = 128
"""Samples a DataLoader task builds at least (rounded up to whole micro-batches), by default."""


_TENSOR, _DATACLASS, _SEQUENCE, _MAPPING = "\0tensor", "\0dataclass", "\0sequence", "\0mapping"
"""Tags of ``split_tensors``' encoding of non-tensor values: plain tuples (fast to pickle: no object state)."""


def split_tensors(batch: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A batch as (its tensors, the rest): the tensors are its tensor values and every tensor inside its other
    values (dataclasses, tuples, lists, dicts: the packed streams of a prepared batch), each under a name of
    its own; the rest holds those other values encoded as tagged tuples, a tensor as its name (small, pickled
    through the queue). ``join_tensors`` puts them back."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(v, name: str):
        if torch.is_tensor(v):
            tensors[name] = v
            return (_TENSOR, name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return (_DATACLASS, type(v), tuple((f.name, strip(getattr(v, f.name), f"{name}.{f.name}"))
                                               for f in dataclasses.fields(v) if f.init))
        if isinstance(v, (tuple, list)):
            return (_SEQUENCE, type(v), tuple(strip(x, f"{name}.{i}") for i, x in enumerate(v)))
        if isinstance(v, dict):
            return (_MAPPING, tuple((k, strip(x, f"{name}.{k}")) for k, x in v.items()))
        return v

    rest = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            tensors[key] = value
        else:
            rest[key] = strip(value, f"{key}:")
    return tensors, rest


def join_tensors(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    """The batch ``split_tensors`` split (its keys in their order: tensors first, then the rest)."""
    if not rest:
        return tensors

    def put(v):
        if type(v) is not tuple:  # every tuple of the encoding is a tagged one
            return v
        if v[0] == _TENSOR:
            return tensors.pop(v[1])
        if v[0] == _DATACLASS:
            return v[1](**{name: put(x) for name, x in v[2]})
        if v[0] == _SEQUENCE:
            return v[1](put(x) for x in v[2])
        return {k: put(x) for k, x in v[1]}

    out = {k: put(v) for k, v in rest.items()}
    return {**tensors, **out}


class PackedBatch:
    """A batch (dict of CPU tensors) as one byte buffer and its layout, for the worker -> trainer hand-off when
    no SlotRing slot is free (and for batches of a collate that returns no dict).

    Through the DataLoader's queue, torch moves every tensor into its own shared-memory file and passes its
    descriptor (~0.5 ms per tensor, more than building the batch); one pickled buffer costs one copy through
    the pipe. int64 tensors whose values fit travel as int32 (half the bytes) and are widened on arrival."""

    def __init__(self, batch: dict):
        tensors, self.rest = split_tensors(batch)
        self.layout, parts, offset = [], [], 0
        for name, t in tensors.items():
            a = t.numpy()
            wide = a.dtype == np.int64 and (a.size == 0 or (int(a.min()) >= -(2**31) and int(a.max()) < 2**31))
            if wide:
                a = a.astype(np.int32)
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            pad = -len(raw) % 8  # every field starts 8-byte aligned, so it can be viewed in place
            self.layout.append((name, t.dtype, a.shape, offset, len(raw), wide))
            parts += [raw, np.zeros(pad, np.uint8)]
            offset += len(raw) + pad
        self.buffer = np.concatenate(parts) if parts else np.zeros(0, np.uint8)

    def unpack(self) -> dict[str, torch.Tensor]:
        buf = torch.from_numpy(self.buffer)
        out = {}
        for name, dtype, shape, offset, nbytes, wide in self.layout:
            view = buf[offset : offset + nbytes]
            out[name] = view.view(torch.int32).view(shape).long() if wide else view.view(dtype).view(shape)
        return join_tensors(out, self.rest)


_PAD = torch.zeros(64, dtype=torch.uint8)


class SlotRing:
    """Shared-memory slots for the worker -> main hand-off: a task's micro-batches are written straight into one
    of its worker's slots and only (worker, slot, layout) goes through the DataLoader's queue.

    Each worker owns ``slots`` buffers (shared memory it allocates on first use and regrows when a task needs
    more); a buffer's handle travels with the first message that uses it in a generation, later messages name
    it. ``state[w, s]`` (shared, created before the workers) is 0 for a free slot, or the generation that holds
    it: the worker takes a slot whose state is not the current generation, the main process copies the batches
    out as the message arrives and frees the slot. Every ``ResumableLoader.__iter__`` starts a new generation
    before the DataLoader restarts, so slots held by messages it discards are free again (a task being built
    across the change may keep its slot until the next one: slower, never wrong). With no free slot (more tasks in
    flight than slots) a task travels as pickled PackedBatch buffers: slower, never blocked, the same batches."""

    def __init__(self, num_workers: int, slots: int):
        self.state = torch.zeros((num_workers, slots), dtype=torch.int64).share_memory_()
        self.generation = torch.ones(1, dtype=torch.int64).share_memory_()
        self._own: dict[int, tuple[torch.Tensor, int]] = {}  # worker side: slot -> (buffer, generation sent in)
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}  # main side: (worker, slot) -> buffer
        self._no_shm = False

    def __getstate__(self) -> dict:  # spawn start method: the shared tensors travel, the caches do not
        return {"state": self.state, "generation": self.generation, "_own": {}, "_mapped": {}, "_no_shm": False}

    def new_generation(self) -> None:
        self.generation += 1

    def pack(self, batches: list[dict[str, torch.Tensor]], worker: int):
        """In a worker: a ``SlotChunk`` of ``batches`` (dicts of CPU tensors), or None when no slot is free."""
        gen = int(self.generation[0])
        state_S = self.state[worker].numpy()
        free = np.flatnonzero(state_S != gen)
        if not len(free):
            return None
        slot = int(free[0])
        layouts, parts, total = [], [], 0
        for batch in batches:
            tensors, rest = split_tensors(batch)
            fields = []
            for name, t in tensors.items():
                # an empty tensor from numpy may have stride 0, which no dtype view takes
                raw = t.contiguous().view(-1).view(torch.uint8) if t.numel() else _PAD[:0]
                nbytes = raw.numel()
                fields.append((name, t.dtype, tuple(t.shape), total, nbytes))
                pad = -nbytes % 64  # 64-byte aligned fields: each is viewed in place as its dtype
                parts += [raw, _PAD[:pad]] if pad else [raw]
                total += nbytes + pad
            layouts.append((fields, rest))
        buffer, sent = self._own.get(slot, (None, 0))
        if buffer is None or buffer.numel() < total:
            if self._no_shm:
                return None
            try:
                buffer, sent = torch.empty(max(total + total // 4, 1 << 16), dtype=torch.uint8).share_memory_(), 0
            except RuntimeError as e:  # /dev/shm full (a container's 64 MB default): the pipe still works
                self._no_shm = True
                print(f"[data] worker {worker}: no shared memory for the batch hand-off ({e}); its batches go "
                      "through the pipe instead (slower; give the job a larger /dev/shm)", flush=True)
                return None
        state_S[slot] = gen
        if parts:
            torch.cat(parts, out=buffer[:total])  # one call writes every field and its padding
        self._own[slot] = (buffer, gen)
        return SlotChunk(worker, slot, gen, buffer if sent != gen else None, layouts)

    def unpack(self, chunk: "SlotChunk") -> list[dict[str, torch.Tensor]]:
        """In the main process: the chunk's batches, copied out of the slot, which is then free again."""
        key = (chunk.worker, chunk.slot)
        if chunk.buffer is not None:
            self._mapped[key] = chunk.buffer
        buffer = self._mapped.get(key)
        if buffer is None:
            raise RuntimeError(f"data loader hand-off: worker {chunk.worker} named slot {chunk.slot} before sending "
                               "it; this is a bug in pretrain.data.loader")
        end = max((offset + nbytes for fields, _ in chunk.layouts for _, _, _, offset, nbytes in fields), default=0)
        block = buffer[:end].clone()  # one copy of the task; its batches are views of it
        out = [join_tensors({name: block[offset:offset + nbytes].view(dtype).view(shape)
                             for name, dtype, shape, offset, nbytes in fields}, rest)
               for fields, rest in chunk.layouts]
        if int(self.state[chunk.worker, chunk.slot]) == chunk.generation:
            self.state[chunk.worker, chunk.slot] = 0
        return out


@dataclasses.dataclass(slots=True)
class SlotChunk:
    """One task's micro-batches in a SlotRing slot: what goes through the queue (the buffer only on first use)."""

    worker: int
    slot: int
    generation: int
    buffer: torch.Tensor | None
    layouts: list


def _collate_chunk(samples, *, collate_fn, pad_id: int, micro_batch_size: int, ring: SlotRing | None = None,
                   prepare=None):
    """The micro-batches of one sampler chunk (``samples``: a list, or a SampleBatch, of chunk x M samples),
    each collated on its own (padded to its own longest row: the same tensors as without chunks) and passed
    through ``prepare``; in a worker process they are handed over through the ring's shared memory (or packed,
    when no slot is free)."""
    info = torch.utils.data.get_worker_info()
    out = [collate_fn(samples[a : a + micro_batch_size], pad_id) for a in range(0, len(samples), micro_batch_size)]
    if prepare is not None:
        out = [prepare(b) for b in out]
    if info is None or not all(isinstance(b, dict) for b in out):
        return out
    if ring is not None:
        chunk = ring.pack(out, info.id)
        if chunk is not None:
            return chunk
    return [PackedBatch(b) for b in out]


def _worker_init(worker_id: int) -> None:
    torch.set_num_threads(1)
    ignore_in_worker()  # SIGTERM/SIGINT/SIGUSR1 to the process group (or cgroup): the main process decides


class ResumableLoader:
    """Iterable over this rank's collated micro-batches; ``consumed_samples`` counts global
    samples handed to the caller (all ranks), which is the position to checkpoint."""

    def __init__(self, loader: torch.utils.data.DataLoader, sampler: RankBatchSampler, start_sample: int,
                 ring: SlotRing | None = None):
        self.loader = loader
        self.sampler = sampler
        self.consumed_samples = start_sample
        self.ring = ring

    def __iter__(self) -> Iterator[dict]:
        # A new iterator restarts at the current position (persistent workers are reused).
        self.sampler.start = self.consumed_samples
        step = self.sampler.micro_batch_size * self.sampler.world_size
        if self.ring is not None:
            self.ring.new_generation()
        chunks = self._checked(iter, self.loader)  # a restart (a rollback) waits for the workers too
        _LIVE_WORKERS.update(getattr(chunks, "_workers", ()))
        defer_worker_checks(chunks)
        while True:
            try:
                chunk = self._checked(next, chunks)
            except StopIteration:
                return
            if isinstance(chunk, SlotChunk):
                chunk = self.ring.unpack(chunk)
            for batch in chunk:
                self.consumed_samples += step
                yield batch.unpack() if isinstance(batch, PackedBatch) else batch

    def _checked(self, fetch, arg):
        """``fetch(arg)``, with a dead worker (or one out of memory, or none delivering within the loader's
        timeout) raised as a one-line ``DataWorkerError``.

        The workers are in torch's SIGCHLD check only while the fetch waits for them: a worker killed while writing
        its message leaves half of it in the pipe, and the read of it would wait forever but for that signal."""
        it = getattr(self.loader, "_iterator", None)
        watched = False
        try:
            watched = watch_workers(it)
            failure = worker_failure(None, it, self.consumed_samples)  # one that died between fetches
            if failure is None:
                return fetch(arg)
        except (RuntimeError, MemoryError) as e:
            failure = worker_failure(e, it, self.consumed_samples)
            if failure is None:
                raise
        finally:
            if watched:
                unwatch_workers(it)
        raise failure from None

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def close(self) -> None:
        """Stop the worker processes: asked to exit, then SIGKILLed if they have not within a few seconds (they
        ignore SIGTERM, which is what the DataLoader's own shutdown and multiprocessing's exit handler send).
        Idempotent; the trainer calls it when a run ends, an error included."""
        it = getattr(self.loader, "_iterator", None)
        if it is None or not hasattr(it, "_shutdown_workers"):
            return
        workers = list(getattr(it, "_workers", []))
        it._shutdown_workers()
        kill_workers(workers)
        self.loader._iterator = None


def _check_position(rank: int, world_size: int, micro_batch_size: int, start_sample: int) -> None:
    """ValueError unless rank is in the world and ``start_sample`` is a whole number of global micro-steps."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    step = micro_batch_size * world_size
    if start_sample < 0 or start_sample % step:
        raise ValueError(
            f"start_sample {start_sample} must be a non-negative multiple of micro_batch_size * world_size = {step}; "
            "resume with a global batch size that divides the checkpoint's consumed samples"
        )


def build_loader(
    dataset,
    *,
    seed: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    start_sample: int,
    num_workers: int,
    pad_id: int,
    prefetch_factor: int = 4,
    collate_fn=collate,
    chunk: int | None = None,
    order_rule: str = ORDER_RULE,
    prepare=None,
    timeout_s: float = 0.0,
) -> ResumableLoader:
    """Infinite loader of this rank's micro-batches from global position ``start_sample``.

    ``start_sample`` (consumed global samples) must be a multiple of micro_batch_size * world_size.
    ``collate_fn(samples, pad_id)`` builds the batch (pretraining samples by default). A worker builds
    ``chunk`` micro-batches per task (default: enough for 128 samples): the per-task costs of the DataLoader
    and the numpy calls of a batched ``__getitems__`` are paid once per chunk; the batches are the same.
    ``order_rule``: the SampleOrder rule (a resumed run passes its checkpoint's). ``prepare(batch) -> batch``
    (picklable; the trainer's ``training.step.HostFacts``): the step's host work on each batch, done where the
    batch is built (the workers), its values tensors or holding them (``split_tensors``). ``timeout_s`` (> 0, with
    workers): a wait for a batch longer than that raises ``DataWorkerError`` naming the stuck workers."""
    _check_position(rank, world_size, micro_batch_size, start_sample)
    if chunk is None:
        chunk = max(1, -(-CHUNK_SAMPLES // micro_batch_size))
    order = SampleOrder(len(dataset), seed=seed, rule=order_rule)
    sampler = RankBatchSampler(order, rank=rank, world_size=world_size, micro_batch_size=micro_batch_size,
                               start=start_sample, chunk=chunk)
    extra, ring = {}, None
    if num_workers > 0:
        extra = dict(persistent_workers=True, prefetch_factor=prefetch_factor, worker_init_fn=_worker_init,
                     timeout=max(0.0, float(timeout_s)))
        # A worker has at most prefetch_factor tasks queued; one more is being built while one is copied out.
        ring = SlotRing(num_workers, prefetch_factor + 2)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=functools.partial(_collate_chunk, collate_fn=collate_fn, pad_id=pad_id,
                                     micro_batch_size=micro_batch_size, ring=ring, prepare=prepare),
        # A private generator: creating iterators must not consume the trainer's global torch RNG.
        generator=torch.Generator().manual_seed(int(seed)),
        **extra,
    )
    resumable = ResumableLoader(loader, sampler, start_sample, ring)
    if num_workers > 0:
        _LIVE_LOADERS.add(resumable)
    return resumable
