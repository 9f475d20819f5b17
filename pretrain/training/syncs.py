"""Counting what a step asks of the host: every aten op, and those that force a host-device sync on CUDA (the host
waits for the device to finish everything queued before it). ``tests/integration/test_step_syncs.py`` and
``tools/bench_step.py --host-cost`` count with it; on a CPU the same ops run, so the count is the CUDA one."""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",  # tensor.item(), float(t), int(t), bool(t)
    "aten::is_nonzero",  # bool(t) of a one-element tensor
    "aten::nonzero", "aten::nonzero_static", "aten::argwhere",  # output size depends on the values
    "aten::masked_select",
    "aten::unique_consecutive", "aten::_unique2", "aten::unique_dim",
    "aten::equal",  # returns a Python bool
    "aten::allclose",
})
"""Ops whose result the host needs before it can go on: the value itself, or an output shape that depends on
the values. Indexing with a boolean mask (``aten::index`` with a bool index) and ``repeat_interleave`` without
``output_size`` are counted too (``OpCounter._forces_sync``)."""


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` -> ``c.ops`` (aten op name -> calls), ``c.syncs`` (the sync-forcing ones)
    and ``c.where`` (sync op -> the innermost frames outside torch that issued it: where to look)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.where: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops[name] += 1
        if _forces_sync(name, args, kwargs):
            self.syncs[name] += 1
            self.where[(name, _caller())] += 1
        return func(*args, **kwargs)

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename]
    return " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[-2:][::-1])


def _forces_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_OPS:
        return True
    if name in ("aten::index", "aten::index_put_", "aten::index_put") and len(args) > 1:
        return any(torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    return False
