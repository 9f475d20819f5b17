"""Weights in and out of a run: Hugging Face / sentence-transformers conversion both ways, opening any weights
(``resolve.open_weights``: our checkpoints, converted or HF directories) and the model card."""
