"""pretrain: distributed pretraining of Transformer sentence encoders."""

__version__ = "0.1.0"
