"""The tied word table's gradient as rows (model.py: ``PretrainModel.word_rows``; embeddings.py: ``TiedWord``,
``_RowsLookup``): the lookup's gradient comes sparse and is added into the decoder's, with the gradient autograd
sums from two dense tables.

The rows are added into the decoder's gradient token by token, where autograd adds their sum: the two differ by
rounding, so the comparison is against float64 autograd (and, without a decoder, against aten's dense backward to
the bit: the same additions in the same order).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_joint_pass import _module as _joint_module
from test_joint_pass import _run
from test_trim_last_layer import _batch, _module, assert_same_step

from pretrain.model import embeddings
from pretrain.model.embeddings import TiedWord, _RowsLookup
from pretrain.model.model import PretrainModel

V, D = 400, 16


def _table_grad(weight: torch.Tensor, rows: bool, lookups: int, decoder: bool) -> torch.Tensor:
    """d/dW of a small loss over ``lookups`` lookups of the table and, with ``decoder``, logits against it."""
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 60 if i == 0 else V, (12, 30), generator=gen) for i in range(lookups)]  # many repeats
    w = weight.detach().clone().requires_grad_()
    w_lookup, w_decoder = TiedWord.apply(w) if rows else (w, w)
    xs = [_RowsLookup.apply(w_lookup, i) if rows else F.embedding(i, w_lookup) for i in ids]
    loss = sum((x.float() ** 2).sum() * (k + 1) for k, x in enumerate(xs))
    if decoder:
        h = torch.tanh(xs[0].reshape(-1, D)[:100])
        loss = loss + torch.logsumexp((h @ w_decoder.t()).float(), -1).sum()
    loss.backward()
    return w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_a_decoder_the_rows_are_atens_dense_gradient_to_the_bit(dtype):
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=dtype)
    got, want = _table_grad(weight, True, 1, False), _table_grad(weight, False, 1, False)
    assert got.layout == torch.strided and got.dtype == dtype
    assert torch.equal(got, want)
    assert int((want.abs().sum(1) > 0).sum()) == 60  # the looked-up rows only


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("lookups", [1, 2])
@pytest.mark.parametrize("decoder", [True, False])
def test_the_rows_agree_with_float64(dtype, tol, lookups, decoder):
    """The decoder's gradient plus the rows token by token, against autograd's dense sum in float64; in bf16 no
    looser than autograd's own sum at that precision."""
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = _table_grad(weight, True, lookups, decoder)
    want = _table_grad(weight.double(), False, lookups, decoder)
    assert got.dtype == dtype and got.layout == torch.strided
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * float(want.abs().max()))
    assert int((want.abs().sum(1) > 0).sum()) >= (V - 10 if decoder else 60 if lookups == 1 else 200)
    if dtype == torch.bfloat16:
        theirs = _table_grad(weight, False, lookups, decoder).double()
        assert (got.double() - want).abs().max() <= (theirs - want).abs().max()


def _count_backwards(monkeypatch) -> list[tuple[bool, bool]]:
    """Run-time record of ``TiedWord``'s backwards: (lookup gradient sparse, decoder gradient given) per call."""
    ran: list[tuple[bool, bool]] = []
    backward = TiedWord.backward

    def counted(ctx, grad_lookup, grad_decoder):
        ran.append((grad_lookup is not None and grad_lookup.is_sparse, grad_decoder is not None))
        return backward(ctx, grad_lookup, grad_decoder)

    monkeypatch.setattr(TiedWord, "backward", staticmethod(counted))
    return ran


@pytest.mark.parametrize("unpadded", [True, False])
@pytest.mark.parametrize("joint", [True, False])
def test_a_training_step_gives_the_same_gradients_with_the_rows(unpadded, joint, monkeypatch):
    """TrainModule's eager step (float64): loss and metrics equal with the rows and without, every other gradient
    to the bit and the word table's at 1e-10; the rows path ran (one TiedWord backward, given the lookups' rows and
    the decoder's gradient), with one encoder pass (joint) or two."""
    batch = _batch()
    ran = _count_backwards(monkeypatch)
    *got, passes, _ = _run(_joint_module(trim=True), batch, joint, unpadded)
    assert ran == [(True, True)] and passes == (1 if joint else 2)
    monkeypatch.setattr(PretrainModel, "word_rows", lambda self: contextlib.nullcontext())
    *want, _, _ = _run(_joint_module(trim=True), batch, joint, unpadded)
    assert ran == [(True, True)]  # the reference ran without
    assert_same_step(got, want, ("mlm", "nt_xent"))  # the word table's gradient at 1e-10 of its largest entry
    for name, g in want[2].items():  # the other gradients do not depend on how the table's are summed
        if name != "model.encoder.embeddings.word.weight":
            assert torch.equal(got[2][name], g), name


def test_the_sentence_stage_without_a_decoder_gives_the_dense_gradient(monkeypatch):
    batch = _batch()
    sentences = dict(sentence_ids=batch["view_a_ids"], sentence_mask=batch["view_a_mask"])
    ran = _count_backwards(monkeypatch)
    got = _run(_module(False, stage="sentences"), sentences, False)
    assert ran == [(True, False)]
    monkeypatch.setattr(PretrainModel, "word_rows", lambda self: contextlib.nullcontext())
    want = _run(_module(False, stage="sentences"), sentences, False)
    for name, g in want[2].items():
        assert torch.equal(got[2][name], g), name


def test_the_rows_are_not_used_where_they_do_not_apply():
    module = _module(False)
    model, word = module.model, module.model.encoder.embeddings.word
    with model.word_rows():
        assert word.step_weight is not None and model.mlm_head.step_weight is not None
    assert word.step_weight is None and model.mlm_head.step_weight is None  # dropped on exit
    with torch.no_grad(), model.word_rows():
        assert word.step_weight is None
    word.weight.ds_id = 7  # a ZeRO-3 parameter: partitioned, gathered by DeepSpeed's module hooks
    with model.word_rows():
        assert word.step_weight is None
    del word.weight.ds_id
    model.mlm_head.decoder.weight = torch.nn.Parameter(word.weight.detach().clone())  # untied
    with model.word_rows():
        assert word.step_weight is None
    assert embeddings.Embedding.step_weight is None


def test_the_rows_sum_in_the_same_order_on_any_thread_count():
    """A resumed run must redo the same sums: the in-place add of repeated rows may not depend on the threads."""
    gen = torch.Generator().manual_seed(3)
    grad_VD = torch.randn(3000, 256, generator=gen)
    ids = torch.randint(0, 50, (40000,), generator=gen)  # each id ~800 times
    rows = torch.sparse_coo_tensor(ids[None], torch.randn(40000, 256, generator=gen), grad_VD.shape,
                                   check_invariants=False)
    threads = torch.get_num_threads()
    sums = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            sums.append(TiedWord.backward(None, rows, grad_VD.clone()))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sums[0], sums[1]) and torch.equal(sums[0], sums[2])
    want = grad_VD.double().index_add(0, ids, rows._values().double())
    torch.testing.assert_close(sums[0].double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
