"""One optimizer step as the trainer runs it (``optimizer_step``: forward -> loss -> backward -> step -> metrics
over grad_accum micro-batches), and what it needs beside the model: the dropout seed, the token count, the move to
the device and the all-ranks finite check. ``tools/bench_step.py`` times this same function."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from pretrain.config.data import IGNORE_INDEX
from pretrain.distributed.comm import all_reduce_host
from pretrain.model.autoencoder import sentences_with_content
from pretrain.model.packing import Packed, join, move_tensor, pack


@dataclass
class StepResult:
    info: object
    """The Engine's StepInfo (lr, grad norm, loss scale, skipped)."""
    bad: bool | torch.Tensor
    """A non-finite loss or gradient skipped the update (fp16 loss-scale overflows are routine, not bad): a 0-dim
    device tensor where the Engine decided on the device, read by the trainer's ``BadSteps`` when it logs."""
    samples: int
    tokens: int
    """This rank's samples and real (non-padding) tokens."""
    loss: torch.Tensor
    """This rank's mean loss over the micro-batches, a device scalar (not read here: NaN when one was not finite)."""


@dataclass(frozen=True)
class Buckets:
    """train.compile_shapes=bucketed: the compiled step sees a few shapes, each a static graph (one CUDA graph each
    under compile_mode=reduce-overhead) instead of a new shape almost every batch. ``bucket_batch`` pads every
    (ids, mask) pair's width up to a multiple of ``width`` (at most ``max_width``, the model's positions, and
    never below the batch's own width), and ``host_facts`` pads the MLM positions up to a multiple of
    ``positions`` with unlabelled tokens, whose cross-entropy is ignored; the term's count stays the real one
    (``host_counts``)."""

    width: int = 64
    positions: int = 64
    max_width: int | None = None

    @staticmethod
    def round(n: int, multiple: int, cap: int | None = None) -> int:
        """n rounded up to a multiple, at most ``cap`` (but never below n)."""
        up = -(-n // multiple) * multiple
        return up if cap is None else max(n, min(up, cap))


_WITH_INPUT = {"mlm_labels": IGNORE_INDEX, "token_type_ids": 0}
"""Per-token tensors that share input_ids' width, and their padding values."""


def bucket_batch(batch: dict, buckets: Buckets) -> dict:
    """The batch (host tensors) with each (``*_ids``, ``*_mask``) pair padded on the right to its bucket's width
    (``Buckets``): padding ids repeat the batch's own padding id (the value under a False mask; 0 where there is
    none), masks False, ``mlm_labels`` IGNORE_INDEX."""
    out = dict(batch)
    for ids_key in [k for k in batch if k.endswith("_ids") and k not in _WITH_INPUT]:
        mask_key = "attention_mask" if ids_key == "input_ids" else ids_key[: -len("ids")] + "mask"
        if mask_key not in batch or batch[ids_key].dim() != 2:
            continue
        ids, mask = batch[ids_key], batch[mask_key]
        width = ids.shape[1]
        pad = buckets.round(width, buckets.width, buckets.max_width) - width
        if pad == 0:
            continue
        pad_id = int(ids[~mask][0]) if (~mask).any() else 0
        out[ids_key] = torch.nn.functional.pad(ids, (0, pad), value=pad_id)
        out[mask_key] = torch.nn.functional.pad(mask, (0, pad), value=False)
        if ids_key == "input_ids":
            for key, value in _WITH_INPUT.items():
                if key in batch:
                    out[key] = torch.nn.functional.pad(batch[key], (0, pad), value=value)
    return out


def optimizer_step(engine, next_batch, sums, *, env, grad_accum: int, seed: int, step: int,
                   precision: str, unpadded: bool | str = False, joint: bool = False, buckets: Buckets | None = None,
                   pin_memory: bool = False) -> StepResult:
    """grad_accum micro-batches from ``next_batch()`` through forward -> loss -> backward, then the update (or its
    skip when any rank saw a non-finite loss or gradient); finite micro-batches' metrics are added to ``sums``.
    ``unpadded`` (train.unpadded): the host packs each micro-batch's sequences, with the attention layout it names
    (True: groups; ``TrainConfig.unpadded_layout``); ``joint`` (train.joint_pass where
    the objective keeps it, ``Context.joint_pass``): also the MLM rows and views as one stream; ``buckets``: the
    compiled step's bucketed shapes (all ``host_facts``); ``pin_memory``: train.pin_memory (``to_device``)."""
    n_samples, n_tokens, all_finite_t, loss_sum = 0, 0, None, 0.0
    # Dropout noise is a function of (seed, step, rank): exact resume needs no RNG replay.
    with dropout_rng(seed, step, env.rank, engine.device):
        for _ in range(grad_accum):
            batch = next_batch()  # counted on the host, then moved: no device sync
            n_samples += batch["input_ids"].shape[0]
            n_tokens += count_tokens(batch)
            facts = step_facts(batch, HostFacts(unpadded, joint, buckets))
            loss, metrics = engine.forward(to_device(facts, engine.device, pin=pin_memory))
            # Decided on the device, no host sync: a non-finite micro-batch's figures are dropped, and its
            # gradients become NaN (micro_step), so the update is skipped on every rank (the NaN reaches every
            # rank's gradients through their reduction, and every optimizer DeepSpeed runs refuses them).
            finite = torch.isfinite(loss.detach())
            # With the loss (x world size: the rank mean is the global loss), in one batched update (MetricSums).
            sums.update({**metrics, "loss": (loss.detach(), 1)}, keep=finite)
            all_finite_t = finite if all_finite_t is None else all_finite_t & finite
            loss_sum = loss_sum + loss.detach()
            engine.micro_step(loss, finite=finite)
    info = engine.step()  # skipped when the gradients are non-finite (on the device, or DeepSpeed's check)
    # A non-finite loss always skips the step, so outside fp16 "skipped" says it; fp16's loss-scale overflows are
    # routine skips, so there the loss itself decides (one host sync, fp16 only).
    bad = info.skipped if precision != "fp16" else not all_finite(all_finite_t, env)
    return StepResult(info=info, bad=bad, samples=n_samples, tokens=n_tokens, loss=loss_sum / grad_accum)


@contextlib.contextmanager
def seeded_rng(seed: int, device):
    """The process-global RNG (CPU, and the device's on CUDA) seeded with ``seed`` inside, its state restored on
    exit. On the CPU only the CPU generator: ``torch.manual_seed`` would also queue a lazy seed of every CUDA
    device, recording the Python stack (``traceback.format_stack``) each time: ~0.1 ms a call, every step."""
    on_cuda = torch.device(device).type == "cuda"
    devices = [torch.device(device).index or 0] if on_cuda else []
    with torch.random.fork_rng(devices=devices):
        if on_cuda:
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def dropout_rng(seed: int, step: int, rank: int, device):
    """Dropout (and any other RNG use inside) keyed by (seed, step, rank), scoped (``seeded_rng``)."""
    return seeded_rng((seed * 1_000_003 + step * 1009 + rank) % (2**63), device)


def count_tokens(batch: dict) -> int:
    """Real (non-padding) tokens of a batch (host tensors): the sequence and both views, or data.pairs' three."""
    keys = ("attention_mask", "view_a_mask", "view_b_mask", "positive_mask", "negative_mask")
    return int(sum(batch[k].numpy().sum() for k in keys if k in batch))


def host_facts(batch: dict, *, unpadded: bool | str = False, joint: bool = False,
               buckets: Buckets | None = None) -> dict:
    """The batch (host tensors, from the loader) with what the device would otherwise be asked for, read here
    with numpy before it moves: ``mlm_positions`` (flat indices of the MLM-labelled tokens: the MLM head's
    rows, a shape the device cannot know without a sync) and ``full_masks`` (the attention masks without
    padding: the encoder then passes no mask).

    ``unpadded``: also the sequences packed into streams (model/packing.py: ``pack``; lengths, positions and
    attention groups are shapes too; ``unpadded`` may name the layout, model/packing.py's ``LAYOUTS``, True
    being groups): ``packed_mlm`` (the MLM rows; ``mlm_labels_packed`` and ``mlm_positions``
    then index the stream), ``packed_views`` (view A's rows, then view B's: the pair's one pass) and
    ``packed_sentences`` (the sentence stage's rows twice, or data.pairs' anchors then positives). Triplets, data.pairs'
    hard negatives and RankCSE's teachers stay padded. ``joint`` (train.joint_pass where the objective keeps it,
    with ``unpadded``): also ``packed_joint``, the MLM rows then both views as one stream, for the objective's one
    pass over both (objective/forward.py: ``Forward._joint_pass``); its first tokens are ``packed_mlm``'s stream,
    the rest ``packed_views``', and those two then carry no attention layout (``pack(attention=False)``): the
    encoder runs over the joint stream only.

    ``buckets`` (train.compile_shapes=bucketed, the compiled step, never with ``unpadded``): widths and the MLM
    positions padded to their buckets, and ``host_counts`` = {"mlm": the real number of labelled tokens}. In the
    sentence stage ``host_counts["reconstruction"]``: the sentences with a content token (SARCSE's count; the
    term then reads none on the device)."""
    if buckets is not None and unpadded:
        raise ValueError("bucketed shapes are for the compiled step, which then runs padded")
    out = dict(batch) if buckets is None else bucket_batch(batch, buckets)
    batch = out
    joint = joint and unpadded and "attention_mask" in batch and "view_a_ids" in batch
    if unpadded and "attention_mask" in batch:
        out["packed_mlm"] = pack([(batch["input_ids"].numpy(), batch["attention_mask"].numpy())],
                                 attention=not joint and unpadded)
    if "mlm_labels" in batch:
        labels = batch["mlm_labels"].numpy().reshape(-1)
        if "packed_mlm" in out:
            labels = labels[out["packed_mlm"].index_N.numpy()]
            out["mlm_labels_packed"] = torch.from_numpy(labels)
        positions = np.flatnonzero(labels != IGNORE_INDEX)
        if buckets is not None:  # unlabelled tokens up to the bucket: their loss is ignored, the count kept
            out["host_counts"] = {"mlm": int(positions.size)}
            extra = buckets.round(positions.size, buckets.positions, labels.size) - positions.size
            unlabelled = np.flatnonzero(labels == IGNORE_INDEX)[:extra]
            positions = np.concatenate([positions, unlabelled])
        out["mlm_positions"] = torch.from_numpy(positions)
    if unpadded and "view_a_ids" in batch:
        views = [(batch[f"view_{v}_ids"].numpy(), batch[f"view_{v}_mask"].numpy()) for v in "ab"]
        out["packed_views"] = pack(views, attention=not joint and unpadded)
        if joint:
            out["packed_joint"] = join([out["packed_mlm"], out["packed_views"]], unpadded)
    if unpadded and "sentence_ids" in batch:
        second = "positive" if "positive_ids" in batch else "sentence"  # data.pairs' positive, or the sentence again
        out["packed_sentences"] = pack([(batch["sentence_ids"].numpy(), batch["sentence_mask"].numpy()),
                                        (batch[f"{second}_ids"].numpy(), batch[f"{second}_mask"].numpy())], unpadded)
    if "sentence_mask" in batch:  # SARCSE's count: sentences with a content token (beyond [CLS] and [SEP])
        out["host_counts"] = {**out.get("host_counts", {}),
                              "reconstruction": sentences_with_content(batch["sentence_mask"].numpy().sum(1))}
    out["full_masks"] = frozenset(k for k, v in batch.items() if k.endswith("_mask") and v.numpy().all())
    return out


@dataclass(frozen=True)
class HostFacts:
    """``host_facts`` with the step's arguments, picklable: the trainer gives it to the train loader
    (``build_loader(prepare=...)``), whose worker processes then pack every batch where they build it, and the step
    takes the batch as it comes (``step_facts``). Per micro-batch of 128 books rows (the CLEAR recipe's 128/64
    lengths) that moves ~2.5 ms of numpy out of the training process, where on a GPU the host is what the device
    waits for; receiving the packed batch (~3 MB where a plain one is ~0.5) costs it ~1.7 ms more, so it spends
    ~0.7 ms (26%) less (``tools/bench_data.py --parts prepare``). The batch records the arguments it was prepared
    with (``PREPARED``)."""

    unpadded: bool | str = False
    joint: bool = False
    buckets: Buckets | None = None

    def __call__(self, batch: dict) -> dict:
        out = host_facts(batch, unpadded=self.unpadded, joint=self.joint, buckets=self.buckets)
        out[PREPARED] = self
        return out


PREPARED = "prepared_facts"
"""The key of a batch ``HostFacts`` prepared: the HostFacts it was prepared with."""


def step_facts(batch: dict, facts: HostFacts) -> dict:
    """``facts(batch)`` without ``PREPARED``; a batch the loader prepared already is taken as it is (the same
    dict as ``facts`` would make). A batch prepared for another step (other arguments) is an error: a bug in
    how the trainer built its loader, which would otherwise train on wrongly packed batches."""
    made = batch.get(PREPARED)
    if made is None:
        made, batch = facts, facts(batch)
    if made != facts:
        raise ValueError(f"a batch the loader prepared with {made} reached a step that runs with {facts}; the "
                         "train loader's prepare must be the step's HostFacts (training/trainer.py)")
    return {k: v for k, v in batch.items() if k != PREPARED}


def to_device(batch: dict, device, pin: bool = False) -> dict:
    """The batch's tensors (and packed streams) copied to ``device`` without waiting for it; ``pin``:
    train.pin_memory (``packing.move_tensor``). Off the CPU, tensors that lie in one host buffer (the loader's
    hand-off: every tensor of a micro-batch, its packed streams' too, is a view of one block) go over as that
    buffer's bytes in one copy, each a view of the copy there (``views_moved``): one pinned copy and one transfer
    a micro-batch instead of one each for ~50 tensors."""
    if torch.device(device).type == "cpu":
        return {k: move_tensor(v, device, True, pin) if torch.is_tensor(v)
                else v.to(device, non_blocking=True, pin=pin) if isinstance(v, Packed) else v
                for k, v in batch.items()}
    tensors = [t for v in batch.values() for t in ([v] if torch.is_tensor(v) else
                                                    v.tensors() if isinstance(v, Packed) else [])]
    moved = views_moved(tensors, lambda block: move_tensor(block, device, True, pin))

    def move(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():  # nothing to send
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return moved[id(t)] if id(t) in moved else move_tensor(t, device, True, pin)

    return {k: move(v) if torch.is_tensor(v) else v.map(move) if isinstance(v, Packed) else v
            for k, v in batch.items()}


def views_moved(tensors: list[torch.Tensor], copy) -> dict[int, torch.Tensor]:
    """{id(t): t moved} for the tensors that share their storage with another of ``tensors``: per storage, the
    byte range they span is copied once (``copy(bytes_as_uint8)`` -> the copy elsewhere) and each is rebuilt
    there as a view with its own dtype, shape, strides and offset. An empty tensor, one alone in its storage, or
    one whose offset into the range is not a multiple of its element size is left out (moved on its own)."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    out = {}
    for ts in by_storage.values():
        if len(ts) < 2:
            continue
        spans = [(t.storage_offset() * t.element_size(),
                  (t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size())
                 for t in ts]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        block = copy(torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage(), lo, (hi - lo,), (1,)))
        for t, (start, _) in zip(ts, spans):
            byte = block.storage_offset() + start - lo  # into the copy's storage
            if byte % t.element_size() == 0:
                out[id(t)] = torch.empty(0, dtype=t.dtype, device=block.device).set_(
                    block.untyped_storage(), byte // t.element_size(), t.shape, t.stride())
    return out


def all_finite(finite: torch.Tensor, env) -> bool:
    """Whether ``finite`` (a device bool) holds on every rank: one host sync and, distributed, a MIN all-reduce."""
    ok = torch.tensor([1 if bool(finite) else 0])
    if env.is_distributed:
        ok = all_reduce_host(ok, torch.distributed.ReduceOp.MIN)
    return bool(ok.item())
