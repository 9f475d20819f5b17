"""metrics.op_count: every dispatched op is counted, and exactly the ones that would make the host wait on CUDA
are counted as syncs."""

from __future__ import annotations

import torch

from pretrain.metrics.op_count import OpCounter


def test_item_is_one_sync():
    x = torch.randn(4, 4)
    with OpCounter() as c:
        x.sum().item()
    assert c.ops == {"aten.sum": 1, "aten._local_scalar_dense": 1}
    assert c.syncs == {"aten._local_scalar_dense": 1}
    assert (c.num_aten, c.num_sync) == (2, 1)


def test_matmul_and_elementwise_are_not_syncs():
    x = torch.randn(4, 4, requires_grad=True)
    with OpCounter() as c:
        y = torch.relu(x @ x + 1).sum()
        y.backward()  # the backward's ops are counted too
    assert c.num_sync == 0
    assert c.ops["aten.mm"] == 3  # forward + two in the backward
    assert c.num_aten == sum(c.ops.values()) > 5


def test_data_dependent_shapes_and_python_values_are_syncs():
    x = torch.randn(6, 3)
    mask = x[:, 0] > 0
    with OpCounter() as c:
        torch.nonzero(x)
        x[mask]  # a boolean index: a hidden nonzero
        x.masked_select(x > 0)
        torch.unique(torch.tensor([1, 1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.equal(x, x)
        bool(x.sum() > 0)
        y = x.clone()
        y[mask] = 0.0  # index_put_ with a boolean index
    assert c.syncs["aten.nonzero"] == 1
    assert c.syncs["aten.index"] == 1
    assert c.syncs["aten.masked_select"] == 1
    assert sum(n for name, n in c.syncs.items() if "unique" in name) == 1
    assert c.syncs["aten.repeat_interleave"] == 1
    assert c.syncs["aten.equal"] == 1
    assert c.syncs["aten._local_scalar_dense"] == 1
    assert c.syncs["aten.index_put_"] == 1
    assert c.num_sync == 8


def test_shapes_known_in_advance_are_not_syncs():
    x = torch.randn(6, 3)
    with OpCounter() as c:
        x[torch.tensor([0, 2])]  # an integer index
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        torch.where(x > 0, x, 0.0)  # the three-argument where keeps the shape
        x.masked_fill(x > 0, 0.0)
    assert c.num_sync == 0, dict(c.syncs)
