"""distributed/snapshot.py: a state copied now and serialized later writes the bytes torch.save of the original
would have written, whatever training does to the original in between; buffers are reused from save to save;
what cannot be copied exactly is refused (and then serialized at once by the Engine). DeepSpeed's own state dicts
at ZeRO 0-3: tests/distributed/test_snapshot_engine.py."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch

from pretrain.distributed.snapshot import NotCopyable, StoragePool, copy_state


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _state() -> dict:
    """What a DeepSpeed state dict holds: views sharing one flat storage (partitions, flat parameters), a
    Parameter, an OrderedDict, a container and a tensor referenced twice, sizes, dtypes and strings."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=g)
    moments = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g, dtype=torch.float64)]
    shared = {"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}
    module = OrderedDict((f"layer.{i}.weight", flat[i * 100:(i + 1) * 100].view(10, 10)) for i in range(4))
    module._metadata = OrderedDict({"": {"version": 1}, "layer": {"version": 1}})  # as Module.state_dict()'s
    state = OrderedDict(
        module=module,
        transposed=flat[400:500].view(10, 10).t(),
        param=torch.nn.Parameter(torch.randn(4, 4, generator=g)),
        frozen=torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        bf16=torch.randn(6, generator=g).to(torch.bfloat16),
        moments=moments, again=moments[0], groups=[shared, shared],
        shapes=OrderedDict(w=torch.Size([10, 10])), dtype=torch.float32, version="0.19.8", step=12, none=None,
        empty=torch.empty(0), scalar=torch.tensor(3.5), scaler=_Scaler(torch.tensor(2.0 ** 16)),
        unpadded=torch.randn(10, generator=g, requires_grad=True)[:8],  # ZeRO-1/2's fp32 partition: not a leaf
        tagged=flat[500:600],
    )
    state["tagged"].ds_id = 3  # ZeRO-3's flat groups carry attributes; pickle keeps them
    return state


def test_the_copy_saves_the_originals_bytes_after_the_original_changed():
    state = _state()
    want = _saved(state)
    copied = copy_state(state, StoragePool())
    with torch.no_grad():  # training goes on: every original storage changes in place
        for t in (state["module"]["layer.0.weight"], state["param"], state["moments"][0], state["bf16"],
                  state["scalar"], state["transposed"]):
            t.add_(1)
    state["groups"][0]["lr"] = 5.0
    state["scaler"].history.append(4.0)
    state["scaler"].cur_scale.mul_(2)
    got = io.BytesIO()
    copied.save(got)
    assert got.getvalue() == want
    assert _saved(state) != want  # the change is real: the copy did not share the originals' memory


def test_a_copy_keeps_views_sharing_one_storage_and_objects_shared():
    state = _state()
    copied = copy_state(state).state
    views = list(copied["module"].values())
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert copied["transposed"].untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
    assert copied["transposed"].stride() == (1, 10) and copied["transposed"].storage_offset() == 400
    assert copied["again"] is copied["moments"][0] and copied["groups"][0] is copied["groups"][1]
    assert type(copied["param"]) is torch.nn.Parameter and copied["param"].requires_grad
    assert not copied["frozen"].requires_grad and type(copied["module"]) is OrderedDict
    assert type(copied["scaler"]) is _Scaler and copied["scaler"] is not state["scaler"]
    assert copied["unpadded"].requires_grad and copied["unpadded"].is_leaf and copied["tagged"].ds_id == 3


def test_the_second_save_reuses_the_first_saves_buffers():
    pool = StoragePool()
    first = copy_state(_state(), pool)
    ptrs = sorted(s.data_ptr() for s in first.storages)
    nbytes = first.nbytes
    first.release()
    assert pool.nbytes == nbytes
    second = copy_state(_state(), pool)
    assert sorted(s.data_ptr() for s in second.storages) == ptrs
    assert pool.nbytes == 0
    second.release()
    assert pool.nbytes == nbytes  # what is given back replaces, never accumulates


class _Opaque:
    def __reduce__(self):
        return (_Opaque, ())


class _Scaler:
    """Like DeepSpeed's LossScaler: a plain object in the optimizer's state dict."""

    def __init__(self, scale):
        self.cur_scale, self.history, self.dynamic = scale, [1.0, 2.0], False


@pytest.mark.parametrize("bad", ["object", "attribute", "conj"])
def test_what_a_copy_would_not_reproduce_is_refused_and_the_pool_keeps_its_buffers(bad):
    pool = StoragePool()
    copy_state(_state(), pool).release()
    held = pool.nbytes
    state = _state()
    if bad == "object":
        state["extra"] = _Opaque()
    elif bad == "attribute":
        t = torch.ones(3)
        t.owner = _Opaque()  # pickled with the tensor
        state["extra"] = t
    else:
        state["extra"] = torch.ones(3, dtype=torch.complex64).conj()
    with pytest.raises(NotCopyable):
        copy_state(state, pool)
    assert pool.nbytes >= held  # its buffers (and any taken before the refusal) stay for the next save
