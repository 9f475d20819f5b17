"""Unpadded sequences: a padded batch's real tokens as one stream, with what attention and pooling need to keep
each sequence to itself. Built on the host from the masks (numpy), so no shape the step uses is data-dependent on
the device.

Shapes: B sequences, T padded width, N real tokens (sum of lengths), D hidden, H heads, K head size,
G attention groups, n rows and t length of a group, P = sum over groups of n * t attention slots.

Embeddings, every Linear, LayerNorm, FFN and the MLM head run on the (N, D) stream: no padding there. Attention
runs per *group*: the sequences sorted by length and cut into at most ``MAX_GROUPS`` runs, each run gathered into
an (n, H, t, K) block and sent through SDPA (masked only where its rows differ in length). Why this and not one
varlen kernel, in torch 2.13:
- SDPA over nested jagged tensors reaches flash/mem-efficient varlen on CUDA, but on the CPU it takes the math
  path, which splits the batch with ``list(lengths)`` (a ``.item()`` per sequence: the host syncs the step must
  not force) and runs one tiny attention per sequence.
- FlexAttention with a document block mask computes dense (N x N) scores in eager mode (16k tokens: 3e9 scores a
  layer) unless compiled, and has no attention dropout, which CLEAR's recipe uses.
- Groups are plain SDPA on CPU and CUDA alike: dropout, the padded path's kernels (flash for a group of equal
  lengths, mem-efficient for a masked one) and a few calls per layer. ``plan_groups`` picks the cut that computes
  the fewest attention scores, using more groups only while padding is above ``MAX_WASTE`` of them.
On CUDA the ``varlen`` layout (train.unpadded_attention) does the same in one call per layer: SDPA over nested
jagged tensors made from the stream and its ``cu_seqlens_B1`` (flash or mem-efficient attention over cumulative
lengths; the host gives the longest and shortest length, so nothing is read back). No groups, no gathers. BERT
only: a ModernBERT local layer's window is a mask, which that path does not take. On the CPU it runs too (the
math path's loop over sequences, with a host read per sequence): tests only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from pretrain.model.gather import gather_unique

MAX_GROUPS = 16
"""At most this many attention calls per layer (each an SDPA; the slots of all groups are gathered at once). Real
MLM rows spread over most lengths (books, max_len 128: 6.5% of rows full, median 113 tokens), so padding falls
slowly with the groups: 27% of the scores with one, 9% with 4, 4.3% with 8, 1.7% with 16 (tools/padding_share.py's
data)."""
MAX_WASTE = 0.01
"""Padding share of the attention scores at which ``plan_groups`` stops adding groups (the goal is <= 2%)."""


@dataclass
class AttentionGroup:
    """n sequences attended to as one (n, H, t, K) block: its n * t slots, row-major, are a run of
    ``Packed.gather_P``."""

    keep_n11t: torch.Tensor | None
    """True on real key slots; None when all n rows have length t."""
    rows: int
    cols: int

    @property
    def num_rows(self) -> int:
        """n: the key mask's rows where there is one, so that a compiled step reads a (symbolic) tensor size, not an
        int it would guard on (a new graph for every batch)."""
        return self.rows if self.keep_n11t is None else self.keep_n11t.shape[0]

    @property
    def length(self) -> int:
        """t (as ``num_rows``: the key mask's width where there is one)."""
        return self.cols if self.keep_n11t is None else self.keep_n11t.shape[-1]


def move_tensor(t: torch.Tensor, device, non_blocking: bool = False, pin: bool = False) -> torch.Tensor:
    """``t.to(device, non_blocking=...)``; ``pin`` (train.pin_memory): a host -> CUDA copy goes through pinned
    memory, so that it is asynchronous (ignored for any other device)."""
    if pin and torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


@dataclass
class Packed:
    """The real tokens of B right-padded sequences, row after row, and where each came from."""

    ids_N: torch.Tensor
    position_ids_N: torch.Tensor
    """Position within its own sequence: restarts at 0 for each (the padded path's column index)."""
    row_N: torch.Tensor | None
    """Which sequence each token belongs to (mean pooling). None in a ``padded_stream``, as the three below."""
    first_B: torch.Tensor | None
    """Stream position of each sequence's first token ([CLS] pooling)."""
    lengths_B: torch.Tensor | None
    index_N: torch.Tensor | None
    """Flat index of each token in the padded (B, T) layout (``unpack``; the host gathers labels with it)."""
    back_N: torch.Tensor | None
    """Each token's slot in the groups' slots laid end to end (attention output back to the stream); None when the
    stream is its slots (``padded_stream``), as ``gather_P``."""
    gather_P: torch.Tensor | None
    """(P,) stream position of each slot of every group, groups end to end, each group's row-major; a padding slot
    repeats its row's last token (masked). ``gather.gather_slots``."""
    groups: tuple[AttentionGroup, ...]
    num_rows: int
    width: int
    cu_seqlens_B1: torch.Tensor | None = None
    """The ``varlen`` layout (``pack(..., attention="varlen")``): (B + 1,) stream offset of each sequence and the
    stream's length, int32 as flash attention takes them (made so on the host, not cast in every layer); then no
    groups, and the stream is its own slots (``back_N``/``gather_P`` None)."""
    min_length: int = 0
    max_length: int = 0
    """Shortest and longest sequence (the varlen layout's kernel sizes, given so the device is not asked)."""

    @property
    def num_tokens(self) -> int:
        return self.ids_N.shape[0]

    def to(self, device, non_blocking: bool = False, pin: bool = False) -> Packed:
        """Every tensor moved to ``device`` (``move_tensor``)."""
        return self.map(lambda t: move_tensor(t, device, non_blocking, pin))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (the attention groups' key masks included)."""
        out = [v for f in fields(self) if f.name != "groups" and torch.is_tensor(v := getattr(self, f.name))]
        return out + [g.keep_n11t for g in self.groups if g.keep_n11t is not None]

    def map(self, fn) -> Packed:
        """A copy with ``fn(t)`` for every tensor ``t`` it holds (``tensors``)."""
        def move(v):
            return fn(v) if torch.is_tensor(v) else v

        groups = tuple(AttentionGroup(move(g.keep_n11t), g.rows, g.cols) for g in self.groups)
        return Packed(**{f.name: move(getattr(self, f.name)) for f in fields(self) if f.name != "groups"},
                      groups=groups)

    @property
    def longest(self) -> int:
        """The longest sequence's length (what attention and positions need): the first group's, groups being
        longest first, so that a compiled step reads a tensor size (``AttentionGroup.length``), not ``width``,
        an int it would guard on; a ``padded_stream``'s or the varlen layout's width otherwise."""
        if self.groups and self.back_N is not None:
            return self.groups[0].length
        return self.max_length if self.cu_seqlens_B1 is not None else self.width

    @property
    def group_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows n, length t) of each group, in order: the slots' layout (gather.py) and the groups' masks."""
        return tuple((g.num_rows, g.length) for g in self.groups)

    @property
    def group_sizes(self) -> list[int]:
        """Slots per group (n * t), in order: how gather_P's rows split into the groups."""
        return [n * t for n, t in self.group_shapes]

    def check_layout(self) -> None:
        """Raises where the encoder is to attend over a stream packed without its attention layout."""
        if not self.groups and self.cu_seqlens_B1 is None and self.num_rows:
            raise ValueError("this stream was packed without its attention layout (pack(..., attention=False): the "
                             "MLM rows' and views' own streams beside the joint one, train.joint_pass); run the "
                             "encoder over the joint stream, or pack with host_facts(..., joint=False)")

    def split_groups(self, x_P: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x_P (slots of every group, end to end) split into the groups' parts; one group's part is x_P itself
        (a one-piece ``split`` would copy the whole gradient in its backward)."""
        self.check_layout()
        return (x_P,) if len(self.groups) == 1 else x_P.split(self.group_sizes)

    def slots(self, rows_S: torch.Tensor | None = None) -> torch.Tensor | None:
        """Attention slots of every token (back_N), or of the stream positions ``rows_S``; for a stream that is its
        slots (``padded_stream``) ``rows_S`` itself (None: all). ``take_rows`` of the slots' outputs by them."""
        if self.back_N is None:
            return rows_S
        return self.back_N if rows_S is None else self.back_N.index_select(0, rows_S)

    def first(self, h_ND: torch.Tensor) -> torch.Tensor:
        """h_BD: each sequence's first token."""
        return gather_unique(h_ND, self.first_B)

    def mean(self, h_ND: torch.Tensor) -> torch.Tensor:
        """h_BD: the mean over each sequence's tokens."""
        sum_BD = h_ND.new_zeros((self.lengths_B.shape[0], h_ND.shape[1])).index_add(0, self.row_N, h_ND)
        return sum_BD / self.lengths_B.to(h_ND.dtype)[:, None]

    def unpack(self, h_ND: torch.Tensor) -> torch.Tensor:
        """h_BTD in the padded layout, zeros on padding (for consumers that need rows, e.g. SARCSE's autoencoder)."""
        out = h_ND.new_zeros((self.num_rows * self.width, h_ND.shape[1])).index_copy(0, self.index_N, h_ND)
        return out.view(self.num_rows, self.width, h_ND.shape[1])


def keep_mask(mask_BT: torch.Tensor, padded: bool | None) -> torch.Tensor | None:
    """keep_B11T (True = a real key token) of a padded batch's mask, shared by every layer; None when the batch has
    no padding, so SDPA may pick its flash kernel (a mask rules it out on CUDA). ``padded``: whether the mask has
    padding, when the host knows it; None looks on the device (a host sync), except in a compiled step, which
    applies every mask."""
    if padded is None:
        padded = torch.compiler.is_compiling() or not bool(mask_BT.all())
    return mask_BT.bool()[:, None, None, :] if padded else None


def padded_stream(blocks: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Packed:
    """Padded batches one after the other as one stream, padding included: train.joint_pass on the padded path (the
    compiled step's). Each block (ids_BT, keep_B11T or None, ``keep_mask``) is one attention group of its B rows
    at its width T, and the stream is already in the groups' slot order, so attention gathers nothing
    (``gather_P``/``back_N`` None). Positions are each row's columns, as the padded path's. Device tensors and
    static shapes: nothing here reads a value, so it traces into a compiled step. Only the encoder runs over it
    (no pooling fields): its h_ND, split at the blocks' B * T, is each block's padded pass."""
    ids = torch.cat([ids_BT.reshape(-1) for ids_BT, _ in blocks])
    positions = torch.cat([torch.arange(ids_BT.shape[1], device=ids.device).repeat(ids_BT.shape[0])
                           for ids_BT, _ in blocks])
    groups = tuple(AttentionGroup(keep, ids_BT.shape[0], ids_BT.shape[1]) for ids_BT, keep in blocks)
    return Packed(ids_N=ids, position_ids_N=positions, row_N=None, first_B=None, lengths_B=None, index_N=None,
                  back_N=None, gather_P=None, groups=groups, num_rows=sum(g.num_rows for g in groups),
                  width=max(g.length for g in groups))


def check_rows(rows_S: torch.Tensor | None, all_layers: bool) -> None:
    """An encoder's ``rows_S`` (the tokens whose last-layer states are wanted) gives one output layer."""
    if rows_S is not None and all_layers:
        raise ValueError("rows_S (the last layer's rows) gives the last layer only; it cannot go with all_layers")


def take_rows(x: torch.Tensor, rows_S: torch.Tensor | None) -> torch.Tensor:
    """x_SD: the tokens ``rows_S`` of x_ND (stream positions) or of x_BTD (flat indices into B*T); x itself without
    ``rows_S``."""
    return x if rows_S is None else gather_unique(x.flatten(0, -2), rows_S)


LAYOUTS = ("groups", "varlen", "fixed")
"""A stream's attention layouts (train.unpadded_attention): ``groups`` (attention groups, any device, any model),
``varlen`` (``cu_seqlens_B1``: one nested-jagged SDPA a layer; CUDA, BERT) or ``fixed`` (the compiled step's
groups: always ``FIXED_GROUPS`` of them, each masked, see ``plan_fixed``)."""
FIXED_GROUPS = 4
"""Attention groups of the ``fixed`` layout. Every batch has as many (of at least two rows each), so a compiled step
sees the same structure every step and the groups' sizes are symbolic: one graph. Books' MLM rows: 9% of the
scores padding with 4 groups against 27% with one (``MAX_GROUPS``' note); the linear layers compute none."""


def pack(parts: list[tuple[np.ndarray, np.ndarray]], attention: bool | str = True) -> Packed:
    """The rows of the padded (ids_BT, mask_BT) pairs in ``parts``, stacked (rows of the first pair, then of the
    next, as ``torch.cat`` of the padded pairs right-padded to the widest), as one stream (host tensors).
    ``attention``: the attention layout, one of ``LAYOUTS`` (True: groups); False: none (no groups, empty
    ``gather_P``/``back_N``; most of the packing's host time), for a stream the encoder does not run over
    (pooling, labels and unpacking only)."""
    width = max(ids.shape[1] for ids, _ in parts)
    lengths, ids, index, base = [], [], [], 0
    for ids_BT, mask_BT in parts:
        mask_BT = np.asarray(mask_BT, dtype=bool)
        lengths_B = mask_BT.sum(1)
        if not np.array_equal(mask_BT, np.arange(mask_BT.shape[1]) < lengths_B[:, None]):
            raise ValueError("unpadded sequences need right-padded masks (real tokens first in every row)")
        rows, cols = np.nonzero(mask_BT)
        index.append((rows + base) * width + cols)
        ids.append(np.asarray(ids_BT)[rows, cols])
        lengths.append(lengths_B)
        base += mask_BT.shape[0]
    return _stream(np.concatenate(ids), np.concatenate(lengths), np.concatenate(index), width, attention)


def join(streams: list[Packed], attention: bool | str = True) -> Packed:
    """Host streams one after the other as one stream with its attention layout (as ``pack``'s): what ``pack`` of
    all their parts gives (``index_N`` into their rows stacked at the widest width), from their tokens, not their
    masks again. train.joint_pass's stream is the MLM rows' and the views' (training/step.py: host_facts)."""
    width = max(s.width for s in streams)
    ids, lengths, index, base = [], [], [], 0
    for s in streams:
        rows, cols = np.divmod(s.index_N.numpy(), s.width)
        index.append((rows + base) * width + cols)
        ids.append(s.ids_N.numpy())
        lengths.append(s.lengths_B.numpy())
        base += s.num_rows
    return _stream(np.concatenate(ids), np.concatenate(lengths), np.concatenate(index), width, attention)


def _stream(ids_N: np.ndarray, lengths_B: np.ndarray, index_N: np.ndarray, width: int,
            attention: bool | str) -> Packed:
    """The Packed of real tokens ``ids_N`` in rows of ``lengths_B`` (``pack``, ``join``)."""
    layout = "groups" if attention is True else attention
    if layout and layout not in LAYOUTS:
        raise ValueError(f"unknown attention layout {attention!r}; one of {', '.join(LAYOUTS)}")
    lengths_B = lengths_B.astype(np.int64)
    if lengths_B.size and lengths_B.min() < 1:
        raise ValueError("unpadded sequences need at least one token per row; got an empty row")
    offsets_B = np.concatenate([[0], np.cumsum(lengths_B)[:-1]]).astype(np.int64)
    row_N = np.repeat(np.arange(len(lengths_B)), lengths_B)
    cu_seqlens = None
    if layout in ("groups", "fixed"):
        groups, back_N, gather_P = _attention_groups(lengths_B, offsets_B, fixed=layout == "fixed")
    elif layout == "varlen":  # the stream is its own slots
        groups, back_N, gather_P = (), None, None
        cu_seqlens = np.append(offsets_B, row_N.size)
    else:
        groups, back_N, gather_P = (), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

    def t(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return Packed(ids_N=t(ids_N), position_ids_N=t(np.arange(row_N.size) - offsets_B[row_N]), row_N=t(row_N),
                  first_B=t(offsets_B), lengths_B=t(lengths_B), index_N=t(index_N), back_N=t(back_N),
                  gather_P=t(gather_P), groups=groups, num_rows=len(lengths_B), width=width,
                  cu_seqlens_B1=None if cu_seqlens is None else torch.from_numpy(cu_seqlens.astype(np.int32)),
                  min_length=int(lengths_B.min()) if lengths_B.size else 0,
                  max_length=int(lengths_B.max()) if lengths_B.size else 0)


def _attention_groups(lengths_B: np.ndarray, offsets_B: np.ndarray, fixed: bool = False
                      ) -> tuple[tuple[AttentionGroup, ...], np.ndarray, np.ndarray]:
    """The groups of ``plan_groups`` (``fixed``: ``plan_fixed``, every group with its key mask, full or not) with
    their key masks, back_N and gather_P (see ``Packed``)."""
    back_N = np.empty(int(lengths_B.sum()), dtype=np.int64)
    groups, gather, base = [], [], 0
    for rows in (plan_fixed(lengths_B) if fixed else plan_groups(lengths_B)):
        lens_n, t = lengths_B[rows], int(lengths_B[rows].max())
        col_t = np.arange(t)
        keep_nt = col_t < lens_n[:, None]
        slot_nt = offsets_B[rows][:, None] + np.minimum(col_t, lens_n[:, None] - 1)
        back_N[slot_nt[keep_nt]] = base + np.flatnonzero(keep_nt)
        keep = None if keep_nt.all() and not fixed else torch.from_numpy(keep_nt[:, None, None, :].copy())
        groups.append(AttentionGroup(keep, len(rows), t))
        gather.append(slot_nt.reshape(-1))
        base += len(rows) * t
    return tuple(groups), back_N, np.concatenate(gather) if gather else np.zeros(0, dtype=np.int64)


def plan_groups(lengths_B: np.ndarray, max_groups: int = MAX_GROUPS, max_waste: float = MAX_WASTE,
                min_rows: int = 1) -> list[np.ndarray]:
    """Rows of each attention group, longest first: the sequences sorted by length, cut into runs so that the
    scores computed, sum over groups of n * t^2, are fewest for the number of groups; the fewest groups whose
    padding share is <= ``max_waste``, else ``max_groups``; no group of fewer than ``min_rows`` rows (the batch
    has at least that many). Exact dynamic programme over the U distinct lengths (O(max_groups * U^2), U <= T)."""
    order = np.argsort(-lengths_B, kind="stable")
    sorted_B = lengths_B[order]
    neg_u, start_U = np.unique(-sorted_B, return_index=True)  # distinct lengths, longest first
    size_U = -neg_u.astype(np.float64)
    end_U = np.append(start_U[1:], len(sorted_B))
    # cost_UU[k, m]: one group from distinct length k to m (k <= m): its rows times its longest length squared.
    rows_UU = end_U[None, :] - start_U[:, None]
    cost_UU = rows_UU * size_U[:, None] ** 2
    cost_UU[np.tril_indices(len(size_U), -1)] = np.inf
    cost_UU[rows_UU < min_rows] = np.inf
    budget = float((sorted_B.astype(np.float64) ** 2).sum()) / (1.0 - max_waste)
    best_U, starts = cost_UU[0].copy(), [np.zeros(len(size_U), dtype=np.int64)]
    while best_U[-1] > budget and len(starts) < max_groups:
        # The last group starts at distinct length k: k = 0 is one group for all, k >= 1 follows the best of
        # one group fewer over lengths 0..k-1.
        cand_UU = np.vstack([cost_UU[:1], best_U[:-1, None] + cost_UU[1:]])
        starts.append(cand_UU.argmin(0))
        best_U = cand_UU.min(0)
    groups, m = [], len(size_U) - 1
    for level in range(len(starts) - 1, -1, -1):
        k = int(starts[level][m])
        groups.append(order[start_U[k]:end_U[m]])
        if k == 0:
            break
        m = k - 1
    return groups[::-1]


def plan_fixed(lengths_B: np.ndarray, count: int = FIXED_GROUPS) -> list[np.ndarray]:
    """The ``fixed`` layout's groups, longest first: ``plan_groups``' cheapest cut into at most ``count`` groups of
    at least two rows, then the group with the most rows halved (by rows: the scores computed do not grow) until
    there are ``count``; where no group has four rows left to halve, ``_exact_cut``. Fewer groups only when the
    batch has fewer than 2 * ``count`` rows. Two rows at least, because a compiled graph treats a size of 1 as a
    constant: a group of one row would be another graph."""
    want = max(1, min(count, len(lengths_B) // 2))
    groups = plan_groups(lengths_B, max_groups=want, max_waste=0.0, min_rows=min(2, len(lengths_B)))
    while len(groups) < want:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[i]) < 4:  # few rows in odd runs (3 + 2 + 3 of 8): the cheapest cut into exactly ``want``
            return _exact_cut(lengths_B, want)
        half = len(groups[i]) // 2
        groups[i:i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def _exact_cut(lengths_B: np.ndarray, count: int) -> list[np.ndarray]:
    """The sorted rows cut into exactly ``count`` runs of at least two rows, fewest scores first: a dynamic
    programme over row positions, O(count * B^2), for the few-row batches ``plan_fixed`` hands it (B < 4 * count)."""
    order = np.argsort(-lengths_B, kind="stable")
    sq = lengths_B[order].astype(np.float64) ** 2
    b = len(order)
    best = np.full((count + 1, b + 1), np.inf)
    cut = np.zeros((count + 1, b + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for g in range(1, count + 1):
        for j in range(2 * g, b + 1):
            i = np.arange(2 * (g - 1), j - 1)  # the run is rows i..j-1, two at least
            cost = best[g - 1, i] + (j - i) * sq[i]
            cut[g, j] = i[int(cost.argmin())]
            best[g, j] = cost.min()
    runs, j = [], b
    for g in range(count, 0, -1):
        runs.append(order[cut[g, j]:j])
        j = cut[g, j]
    return runs[::-1]


def compute_counts(packed: Packed) -> dict[str, int]:
    """What each path computes for this batch, per layer (scores also per head): ``real_tokens`` (N, also what the
    unpadded path's linear layers see), ``padded_tokens`` (B * T: every row at the padded width, the padded path),
    ``real_scores`` (sum of L^2: each token against its own sequence), ``padded_scores`` (B * T^2) and
    ``unpadded_scores`` (sum over attention groups of n * t^2; the varlen layout's are the real ones).
    tools/padding_share.py sums them over real batches."""
    lengths_B = packed.lengths_B.cpu().numpy().astype(np.int64)
    real_scores = int((lengths_B**2).sum())
    return {"real_tokens": int(lengths_B.sum()), "padded_tokens": packed.num_rows * packed.width,
            "real_scores": real_scores, "padded_scores": packed.num_rows * packed.width**2,
            "unpadded_scores": real_scores if packed.cu_seqlens_B1 is not None
            else sum(g.num_rows * g.length**2 for g in packed.groups)}
