"""Pad a list of samples into a batch of tensors (to the batch's own max length).

Shape legend: B = batch size, T / Ta / Tb = longest MLM sequence / view A / view B in the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from pretrain.data.masking import IGNORE_INDEX


def pad_stack(seqs: list[np.ndarray], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BT int64 right-padded with ``value``, mask_BT bool True on real tokens)."""
    lengths = [len(s) for s in seqs]
    ids_BT = np.full((len(seqs), max(lengths, default=0)), value, dtype=np.int64)
    mask_BT = np.zeros(ids_BT.shape, dtype=bool)
    for b, s in enumerate(seqs):
        ids_BT[b, : len(s)] = s
        mask_BT[b, : len(s)] = True
    return torch.from_numpy(ids_BT), torch.from_numpy(mask_BT)


def collate(samples, pad_id: int) -> dict[str, torch.Tensor]:
    """A SampleBatch (PretrainDataset/BlendedDataset.__getitems__), or a list of their samples -> batch dict.

    Keys: input_ids [B,T], attention_mask [B,T] bool, mlm_labels [B,T] (-100 on padding),
    view_{a,b}_ids [B,Ta|Tb], view_{a,b}_mask (bool), and source [B] when samples carry it.
    """
    if hasattr(samples, "fields"):
        return collate_batch(samples, pad_id)
    if not samples:
        raise ValueError("collate got an empty list of samples")
    batch: dict[str, torch.Tensor] = {}
    batch["input_ids"], batch["attention_mask"] = pad_stack([s["input_ids"] for s in samples], pad_id)
    batch["mlm_labels"], _ = pad_stack([s["mlm_labels"] for s in samples], IGNORE_INDEX)
    for view in ("view_a", "view_b"):
        if view in samples[0]:
            batch[f"{view}_ids"], batch[f"{view}_mask"] = pad_stack([s[view] for s in samples], pad_id)
    if "source" in samples[0]:
        batch["source"] = torch.tensor([s["source"] for s in samples], dtype=torch.int64)
    return batch


def collate_batch(batch, pad_id: int) -> dict[str, torch.Tensor]:
    """``collate`` of a SampleBatch: its padded fields with the padding values set, as tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, r in batch.fields.items():
        mask_BT = r.valid()
        ids_BT = np.where(mask_BT, r.ids, IGNORE_INDEX if name == "mlm_labels" else pad_id)
        key = "input_ids" if name == "input_ids" else name if name == "mlm_labels" else f"{name}_ids"
        out[key] = torch.from_numpy(ids_BT)
        if name != "mlm_labels":
            out["attention_mask" if name == "input_ids" else f"{name}_mask"] = torch.from_numpy(mask_BT)
    if batch.source is not None:
        out["source"] = torch.from_numpy(np.asarray(batch.source, dtype=np.int64))
    return out
