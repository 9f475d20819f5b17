"""SARCSE's TextCNN autoencoder over the encoder's token states.

Shape legend: B = batch, T = content tokens ([CLS]/[SEP] removed, right-padded), D = hidden
size, C = TextCNN channels (co_t), K = number of kernel sizes, L = T - ks + 1 window starts,
E = sentence-embedding size co_c * (C - 1).

Encoder (SARCSE eqs. 3-4): per kernel size ks a TextCNN (Conv1d D -> C over ks tokens, ReLU,
max over the window starts) gives H_ks in R^C; the K vectors stacked as a 1 x K x C image go
through a Conv2d with a K x 2 kernel (3 x 2 for ks = 3, 4, 5) and co_c channels, flattened to Z.
Decoder (eqs. 5-7): a ConvTranspose2d with the same kernel maps Z back to K x C rows H'_ks;
each is un-pooled to the window start its encoder max came from (the paper leaves open how
the time axis is recovered; this is the exact transpose of max-over-time), a ConvTranspose1d
C -> D over ks tokens reconstructs the tokens, and the K reconstructions are averaged.
Sequences shorter than the largest kernel are zero-padded to it and the output cut back to T.
"""

from __future__ import annotations

import torch
from torch import nn


class TextCNNAutoencoder(nn.Module):
    """forward(x_BTD, mask_BT) -> (z_BE, recon_BTD); E = integrate_channels * (channels - 1)."""

    def __init__(
        self,
        hidden_size: int,
        kernel_sizes: tuple[int, ...] = (3, 4, 5),
        channels: int = 500,
        integrate_channels: int = 3,
    ) -> None:
        super().__init__()
        if not kernel_sizes or min(kernel_sizes) < 1 or channels < 2 or integrate_channels < 1:
            raise ValueError(
                f"TextCNNAutoencoder needs kernel sizes >= 1, channels >= 2, integrate_channels >= 1; got "
                f"{kernel_sizes}, {channels}, {integrate_channels}"
            )
        self.kernel_sizes = tuple(int(k) for k in kernel_sizes)
        self.channels = channels
        self.integrate_channels = integrate_channels
        num_k = len(self.kernel_sizes)
        self.text_cnns = nn.ModuleList(nn.Conv1d(hidden_size, channels, ks) for ks in self.kernel_sizes)
        self.integrate = nn.Conv2d(1, integrate_channels, kernel_size=(num_k, 2))
        self.expand = nn.ConvTranspose2d(integrate_channels, 1, kernel_size=(num_k, 2))
        self.text_decoders = nn.ModuleList(
            nn.ConvTranspose1d(channels, hidden_size, ks) for ks in self.kernel_sizes
        )

    @property
    def embed_dim(self) -> int:
        return self.integrate_channels * (self.channels - 1)

    def forward(self, x_BTD: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_tok, _ = x_BTD.shape
        h_BKC, argmax = self._encode_scales(x_BTD, mask_BT)
        z_BE = self.integrate(h_BKC[:, None]).flatten(1)
        h_rec_BKC = self.expand(z_BE.view(batch, self.integrate_channels, 1, self.channels - 1))[:, 0]
        recon = []
        for k, (decoder, idx_BC) in enumerate(zip(self.text_decoders, argmax)):
            num_starts = self._padded_len(num_tok) - self.kernel_sizes[k] + 1
            unpooled_BCL = h_rec_BKC.new_zeros(batch, self.channels, num_starts)
            unpooled_BCL = unpooled_BCL.scatter(2, idx_BC[..., None], h_rec_BKC[:, k, :, None])
            recon.append(decoder(unpooled_BCL)[:, :, :num_tok])
        recon_BTD = torch.stack(recon, 0).mean(0).transpose(1, 2)
        return z_BE, recon_BTD

    def embed(self, x_BTD: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """Sentence embedding Z only (inference): no decoder work."""
        h_BKC, _ = self._encode_scales(x_BTD, mask_BT)
        return self.integrate(h_BKC[:, None]).flatten(1)

    def _padded_len(self, num_tok: int) -> int:
        return max(num_tok, max(self.kernel_sizes))

    def _encode_scales(self, x_BTD, mask_BT) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Masked TextCNN max-pooling per kernel size -> (H_BKC, argmax window start per scale)."""
        batch, num_tok, _ = x_BTD.shape
        mask_BT = mask_BT.to(torch.bool)
        x_BDT = (x_BTD * mask_BT[..., None].to(x_BTD.dtype)).transpose(1, 2)
        pad = self._padded_len(num_tok) - num_tok
        if pad:
            x_BDT = nn.functional.pad(x_BDT, (0, pad))
        num_valid_B = mask_BT.sum(1)
        pooled, argmax = [], []
        for ks, conv in zip(self.kernel_sizes, self.text_cnns):
            a_BCL = torch.relu(conv(x_BDT))
            # A window is valid when it lies inside the sentence; a sentence shorter than ks keeps start 0.
            last_start_B = (num_valid_B - ks).clamp_min(0)
            valid_BL = torch.arange(a_BCL.shape[-1], device=a_BCL.device)[None] <= last_start_B[:, None]
            a_BCL = a_BCL.masked_fill(~valid_BL[:, None, :], float("-inf"))
            h_BC, idx_BC = a_BCL.max(dim=-1)
            pooled.append(h_BC)
            argmax.append(idx_BC)
        return torch.stack(pooled, 1), argmax


SPECIAL_TOKENS = 2
"""Tokens of each row that ``content_tokens`` drops: [CLS] and [SEP]."""


def sentences_with_content(lengths_B) -> int:
    """How many rows of these token counts keep a content token after ``content_tokens`` (SARCSE's count; the host
    reads it from the batch's masks before the step, training/step.py: host_facts)."""
    return int((lengths_B > SPECIAL_TOKENS).sum())


def content_tokens(
    h_BTD: torch.Tensor, mask_BT: torch.Tensor, ids_BT: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drop [CLS] (position 0) and [SEP] (last valid position) of right-padded rows (``SPECIAL_TOKENS``).

    Returns (h_B(T-2)D, mask_B(T-2), ids_B(T-2) or None): the AE's input, SARCSE section 2.1.
    """
    mask_BT = mask_BT.to(torch.bool).clone()
    rows_B = torch.arange(mask_BT.shape[0], device=mask_BT.device)
    last_B = mask_BT.sum(1) - 1
    mask_BT[rows_B, last_B.clamp_min(0)] = False
    end = h_BTD.shape[1] - 1
    ids = ids_BT[:, 1:end] if ids_BT is not None else None
    return h_BTD[:, 1:end], mask_BT[:, 1:end], ids


AUTOENCODER_Z = "autoencoder_z"
"""The pooling name of SARCSE's inference embedding: the autoencoder's Z over the content tokens (Sec. 2.2)."""

HEADS_FILE = "heads.safetensors"
"""The objective's trainable heads (``heads.*`` keys, e.g. ``heads.autoencoder.integrate.weight``), fp32, beside a
checkpoint's or an init dir's model.safetensors: what ``AUTOENCODER_Z`` evaluation needs besides the encoder."""


def autoencoder_from_state(state: dict, prefix: str = "heads.autoencoder.") -> TextCNNAutoencoder | None:
    """The TextCNNAutoencoder whose weights are ``state``'s ``prefix*`` keys (its shape read from them: kernel sizes
    and channels from the TextCNNs, the integrating channels from the Conv2d); None when there are none."""
    own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not own:
        return None
    try:
        convs = sorted((int(k.split(".")[1]), v) for k, v in own.items()
                       if k.startswith("text_cnns.") and k.endswith(".weight"))
        channels, hidden, _ = convs[0][1].shape
        kernel_sizes = tuple(int(v.shape[2]) for _, v in convs)
        ae = TextCNNAutoencoder(int(hidden), kernel_sizes, int(channels), int(own["integrate.weight"].shape[0]))
        ae.load_state_dict({k: v.float() for k, v in own.items()})
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        raise ValueError(f"the autoencoder's weights ({prefix}*) do not make a SARCSE TextCNN autoencoder: "
                         f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    return ae


class ZEmbedding(nn.Module):
    """A model whose sentence embedding is SARCSE's Z (its inference embedding, Sec. 2.2): ``encode`` is the
    model's, ``pool`` runs the autoencoder's encoder over the content tokens, as the training objective does
    (``objective/forward.py: autoencoded``). For ``SentenceEncoder`` (pooling ``AUTOENCODER_Z``)."""

    def __init__(self, model: nn.Module, autoencoder: TextCNNAutoencoder) -> None:
        super().__init__()
        self.model, self.autoencoder = model, autoencoder
        self.training = model.training  # a wrapper in train mode would put an eval-mode model back in train mode

    def encode(self, *args, **kwargs):
        return self.model.encode(*args, **kwargs)

    def pool(self, h_BTD: torch.Tensor, mask_BT: torch.Tensor, pooling: str = AUTOENCODER_Z,
             all_layers=None) -> torch.Tensor:
        if pooling != AUTOENCODER_Z:
            raise ValueError(f"ZEmbedding pools by {AUTOENCODER_Z}, not {pooling!r}")
        x_BTD, content_BT, _ = content_tokens(h_BTD, mask_BT)
        return self.autoencoder.embed(x_BTD.to(self.autoencoder.integrate.weight.dtype), content_BT)
