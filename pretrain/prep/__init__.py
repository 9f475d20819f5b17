"""One-time data preparation: reading raw text, sentence splitting, tokenizer training, preprocessing into
sharded binary datasets (the format itself lives in ``pretrain.data``), and the embedded quickstart corpus."""
