"""A state dict copied into reused host memory now, serialized later (off the training path).

``torch.save`` of a state dict into memory costs about 1 s per GB on a CPU (the zip records' CRC32 and fresh pages
for the bytes). What the training loop must wait for is only a copy of the state it goes on mutating, so a
background save copies each storage once into buffers kept from the previous save (no page faults after the first)
and runs ``torch.save`` in the writer thread. The copy keeps everything ``torch.save`` writes: the same storages
shared by the same views (offset, size, stride), the same containers shared the same way (pickle's memo), the
tensors' class and ``requires_grad``; the bytes written are the ones ``torch.save`` of the original would have
written (``tests/unit/test_snapshot.py`` on a synthetic state, ``tests/distributed/test_snapshot_engine.py`` on
DeepSpeed's own state dicts at ZeRO 0-3).

Containers (dict, OrderedDict with its ``_metadata``, list, tuple), immutable scalars, CPU tensors and Parameters,
and instances of plain classes (rebuilt as pickle rebuilds them, their ``__dict__`` copied) are copied. Tensors keep
``requires_grad`` (a non-leaf is saved as a leaf, as pickle saves it) and their Python attributes. What the copy
cannot reproduce exactly — tensors on a device (their location tag), tensor subclasses, sparse, quantized or
conjugated tensors, objects with their own reduce or ``__setstate__`` or slots — makes ``copy_state`` raise
``NotCopyable``, and the caller serializes that file at once, as before.

Shapes: none (state dicts and bytes).
"""

from __future__ import annotations

import copyreg
import pickle
import threading
from collections import OrderedDict
from enum import Enum

import torch

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device,
          torch.memory_format, torch.layout)


class NotCopyable(TypeError):
    """The state holds something ``copy_state`` cannot copy with ``torch.save``'s bytes unchanged."""


class StoragePool:
    """Host buffers of the last snapshot, reused by the next one (a checkpoint's storages have the same sizes at
    every save). Holds at most one snapshot's worth: what is given back replaces what was left."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.UntypedStorage]] = {}

    def take(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.UntypedStorage(nbytes)

    def give_back(self, storages, *, keep_free: bool = False) -> None:
        """``storages`` become the pool (with ``keep_free``: join what it holds)."""
        free: dict[int, list[torch.UntypedStorage]] = {}
        for storage in storages:
            free.setdefault(storage.nbytes(), []).append(storage)
        with self._lock:
            if keep_free:
                for nbytes, group in self._free.items():
                    free.setdefault(nbytes, []).extend(group)
            self._free = free

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for group in self._free.values() for s in group)


class CopiedState:
    """A state dict copied by ``copy_state``: ``save(f)`` writes what ``torch.save(original, f)`` would have, then
    ``release`` hands its buffers back to the pool."""

    def __init__(self, state, storages: list[torch.UntypedStorage], pool: StoragePool | None,
                 zipfile: bool = True):
        self.state, self.storages, self.pool, self.zipfile = state, storages, pool, zipfile

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def save(self, f) -> None:
        torch.save(self.state, f, _use_new_zipfile_serialization=self.zipfile)

    def release(self) -> None:
        storages, self.state, self.storages = self.storages, None, []
        if self.pool is not None and storages:
            self.pool.give_back(storages)


def copy_state(state, pool: StoragePool | None = None, *, zipfile: bool = True) -> CopiedState:
    """``state`` with every CPU storage copied into ``pool``'s buffers and every container rebuilt (shared where
    the original shares it). Raises NotCopyable (having taken nothing from the pool for good) when it holds
    something whose ``torch.save`` bytes a copy would not reproduce."""
    copier = _Copier(pool)
    try:
        copied = copier.copy(state)
    except NotCopyable:
        if pool is not None:
            pool.give_back(copier.storages.values(), keep_free=True)
        raise
    return CopiedState(copied, list(copier.storages.values()), pool, zipfile)


class _Copier:
    def __init__(self, pool: StoragePool | None):
        self.pool = pool
        self.memo: dict[int, object] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}  # the original storage's _cdata -> its copy

    def copy(self, obj):
        kind = type(obj)
        if kind in _ATOMS or isinstance(obj, Enum):
            return obj
        done = self.memo.get(id(obj))
        if done is not None:
            return done
        if kind is dict or kind is OrderedDict:
            out = self.memo[id(obj)] = kind()
            for key, value in obj.items():
                out[self.copy(key)] = self.copy(value)
            if kind is OrderedDict and obj.__dict__:  # a module's state dict: its _metadata is pickled with it
                out.__dict__.update(self.copy(obj.__dict__))
            return out
        if kind is list:
            out = self.memo[id(obj)] = []
            out.extend(self.copy(v) for v in obj)
            return out
        if kind is tuple:
            out = self.memo[id(obj)] = tuple(self.copy(v) for v in obj)
            return out
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            out = self.memo[id(obj)] = self._tensor(obj)
            return out
        return self._instance(obj)

    def _instance(self, obj):
        """An instance of a plain class (DeepSpeed's LossScaler): rebuilt as pickle would, its state copied."""
        name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        try:
            reduced = obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        except TypeError as e:
            raise NotCopyable(f"{name}: {e}") from None
        if (not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__
                or any(extra is not None for extra in reduced[3:])):
            raise NotCopyable(f"{name}: not a plain object")
        cls, *args = reduced[1]
        out = self.memo[id(obj)] = cls.__new__(cls, *(self.copy(a) for a in args))
        state = reduced[2] if len(reduced) > 2 else None
        if state is not None:
            if hasattr(out, "__setstate__") and type(out).__setstate__ is not object.__setstate__:
                raise NotCopyable(f"{name}: has its own __setstate__")
            if not isinstance(state, dict):
                raise NotCopyable(f"{name}: __slots__")
            out.__dict__.update(self.copy(state))
        return out

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
            raise NotCopyable(f"tensor on {t.device} ({t.layout})")
        src = t.untyped_storage()
        dst = self.storages.get(src._cdata)
        if dst is None:
            dst = self.pool.take(src.nbytes()) if self.pool is not None else torch.UntypedStorage(src.nbytes())
            dst.copy_(src)
            self.storages[src._cdata] = dst
        out = torch.empty((0,), dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())
        # pickle keeps requires_grad (a non-leaf, ZeRO-1/2's unpadded fp32 partitions, is saved as a leaf that
        # requires grad) and the Python attributes (ZeRO-3's ds_id), not the graph
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad) if type(t) is torch.nn.Parameter \
            else out.requires_grad_(t.requires_grad)
        if t.__dict__:
            out.__dict__.update(self.copy(t.__dict__))
        return out
