"""Model configuration: encoder sizes and heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ModelConfig:
    arch: Literal["bert", "modernbert"] = "bert"
    """bert: learned absolute positions, post- or pre-LN, biases (BERT/RoBERTa). modernbert: ModernBERT's design
    (Warner et al. 2024): rotary positions, GeGLU feed-forward (ffn_size is the gated width), no biases in linear
    layers and norms, pre-norm with embedding and final norms, sliding-window local attention with a global layer
    every ``global_every``; ``norm``, ``type_vocab_size`` and the position table do not apply, and there is no
    BERT pooler (set pooler: false)."""
    vocab_size: int = 0
    """Vocabulary size; 0 means take it from the tokenizer."""
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_size: int = 3072
    max_position: int = 512
    """Number of learned absolute positions (rows of the position table, offset rows included)."""
    position_offset: int = 0
    """Row of the position table a sequence's first token takes: 0 for BERT; RoBERTa's pad_token_id + 1 = 2 (its
    514 rows hold 512 tokens). With an offset the i-th real token of a sequence takes row offset + i and padding
    takes row offset - 1, as RoBERTa's create_position_ids_from_input_ids (which counts non-pad tokens only)."""
    type_vocab_size: int = 2
    """Token-type embeddings, kept for BERT checkpoint compatibility (always type 0 here)."""
    local_window: int = 128
    """modernbert: width of a local layer's attention window (ModernBERT's ``local_attention``): a token attends
    to those at most local_window // 2 positions away, within its own sequence."""
    global_every: int = 3
    """modernbert: layer i attends globally when i % global_every == 0 (layers 0, N, 2N, ...), locally otherwise."""
    rope_theta: float = 160000.0
    """modernbert: rotary base of the global layers."""
    rope_theta_local: float = 10000.0
    """modernbert: rotary base of the local (sliding-window) layers."""
    dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    norm: Literal["post", "pre"] = "post"
    """post-LN as in BERT/RoBERTa (default) or pre-LN (adds a final LayerNorm)."""
    activation: Literal["gelu", "gelu_tanh", "relu"] = "gelu"
    init_std: float = 0.02
    pooling: Literal["cls", "mean", "cls_before_pooler", "first_last_avg"] = "cls"
    """Sentence embedding used by contrastive objectives and evaluation; first_last_avg (SimCSE's evaluation pooling,
    e.g. an imported model's) for evaluation and MLM-only training: a config with a term that embeds sentences
    refuses it (config/run.py)."""
    projection_dim: int = 0
    """Output size of the contrastive projection head (CLEAR's g(.)); 0 = hidden_size."""
    projection_layers: int = 2
    """Linear layers in the projection MLP (CLEAR uses a 2-layer MLP with a nonlinearity); 0: none, the terms
    compare the pooled embedding itself (SimCSE's MLP over [CLS], dense + tanh, is BERT's pooler with
    ``pooler: true`` and ``pooling: cls``: the SimCSE, ArcCSE and RankCSE recipes)."""
    projection_activation: Literal["relu", "tanh"] = "relu"
    """Nonlinearity between projection layers (SimCLR/CLEAR: ReLU)."""
    pooler: bool = True
    """Keep BERT's pooler (dense+tanh over [CLS]); "cls" pooling goes through it when present."""
    dense_dim: int = 0
    """Output size of a Dense layer applied after pooling (sentence-transformers' Dense module, as some imported
    models carry one); 0 = none. Not BERT's pooler (see pooler)."""
    dense_activation: Literal["tanh", "identity", "relu", "gelu"] = "tanh"
    """Activation after that Dense layer."""
    dense_bias: bool = True
    normalize: bool = False
    """L2-normalise sentence embeddings after pooling (sentence-transformers' Normalize module, e.g.
    all-MiniLM-L6-v2); cosine similarities are unchanged, dot products become cosines."""

    @property
    def bias(self) -> bool:
        """Whether linear layers and norms carry a bias (BERT's do, ModernBERT's do not)."""
        return self.arch == "bert"

    @property
    def sentence_dim(self) -> int:
        """Size of a sentence embedding (what ``PretrainModel.pool`` returns)."""
        return self.dense_dim or self.hidden_size

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "ffn_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size must be >= 0 (0 = from tokenizer), got {self.vocab_size}")
        if not 0 <= self.position_offset < self.max_position:
            raise ValueError(f"model.position_offset must be in [0, model.max_position={self.max_position}), got "
                             f"{self.position_offset}")
        if self.arch == "modernbert" and self.position_offset:
            raise ValueError("model.position_offset applies to model.arch=bert only (ModernBERT has rotary positions); "
                             "set model.position_offset=0")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.arch not in ("bert", "modernbert"):
            raise ValueError(f"model.arch must be bert or modernbert, got {self.arch!r}")
        if self.arch == "modernbert":
            if self.pooler:
                raise ValueError("model.pooler must be false with model.arch=modernbert: ModernBERT has no pooler "
                                 "(pooling 'cls' then takes the first token as it is); set model.pooler=false")
            if self.local_window < 2 or self.global_every < 1:
                raise ValueError(f"model.local_window must be >= 2 and model.global_every >= 1, got "
                                 f"{self.local_window} and {self.global_every}")
            if (self.hidden_size // self.num_heads) % 2:
                raise ValueError(f"model.arch=modernbert needs an even head size for rotary positions; "
                                 f"hidden_size / num_heads = {self.hidden_size // self.num_heads}")
            if self.rope_theta <= 0 or self.rope_theta_local <= 0:
                raise ValueError("model.rope_theta and model.rope_theta_local must be positive")
        if self.dense_dim < 0:
            raise ValueError(f"model.dense_dim must be >= 0 (0 = no Dense layer after pooling), got {self.dense_dim}")
        if self.projection_dim < 0 or self.projection_layers < 0:
            raise ValueError("model.projection_dim and model.projection_layers must be >= 0")
        if self.projection_layers == 0 and self.projection_dim:
            raise ValueError(f"model.projection_dim={self.projection_dim} with model.projection_layers=0: no layer "
                             f"to project to that size; set model.projection_layers >= 1 or model.projection_dim=0")
