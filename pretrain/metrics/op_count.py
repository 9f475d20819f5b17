"""What a step asks of the host: the ops it dispatches (``OpCounter``) and which of them force a host-device sync.

Counted below autograd (a ``TorchDispatchMode``), so composite ops appear as what they decompose into (``linear`` ->
``t`` + ``addmm``) and the backward's ops are counted too: about one op per kernel launch on CUDA. On the CPU no op
syncs, but the same calls would on CUDA; ``SYNC_OPS`` names them so that a CPU run can count them.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({
    "aten._local_scalar_dense",  # .item(), bool(t), int(t), float(t), `if t:` of a one-element tensor
    "aten.is_nonzero",  # bool(t) where it is not decomposed into _local_scalar_dense
    "aten.nonzero",  # output size depends on the data: torch.nonzero, torch.where(cond), t[bool_mask]
    "aten.masked_select",  # ditto
    "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
    "aten.unique_dim_consecutive",  # ditto
    "aten.equal",  # returns a Python bool
    "aten.allclose",  # ditto (when it is not decomposed into isclose + all + item)
})
"""Ops that make the host wait for the device on CUDA (their result is a Python value or a data-dependent shape).
Also sync-forcing, decided on the arguments (``is_sync``): ``aten.repeat_interleave`` without ``output_size`` and
indexing with a boolean mask (``index.Tensor``, ``index_put(_)`` with a bool index: a hidden ``nonzero``).
Not visible on the CPU: device-to-host copies (``.cpu()``, ``.tolist()``, ``.numpy()`` of a CUDA tensor)."""

_BOOL_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})


def op_name(func) -> str:
    """'namespace.op' of an OpOverload (``aten.add``), without the overload."""
    return f"{func.namespace}.{func._opname}"


def is_sync(func, args, kwargs) -> bool:
    """Whether this call forces a host-device sync on CUDA (``SYNC_OPS`` and the argument-dependent cases)."""
    name = op_name(func)
    if name in SYNC_OPS:
        return True
    if name == "aten.repeat_interleave":  # a tensor of repeats: the output length is their sum
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in _BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename]
    return " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[-2:][::-1])


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched inside ``with OpCounter() as c:`` (all namespaces: aten, c10d, ...).

    ``c.ops``: name -> calls; ``c.syncs``: name -> sync-forcing calls; ``c.num_aten`` / ``c.num_sync`` the totals;
    ``c.where``: (sync op, the two innermost calling frames outside torch) -> calls, i.e. where to look."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.where: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        self.ops[name] += 1
        if is_sync(func, args, kwargs):
            self.syncs[name] += 1
            self.where[(name, _caller())] += 1
        return func(*args, **kwargs)

    @property
    def num_aten(self) -> int:
        return sum(n for name, n in self.ops.items() if name.startswith("aten."))

    @property
    def num_sync(self) -> int:
        return sum(self.syncs.values())
