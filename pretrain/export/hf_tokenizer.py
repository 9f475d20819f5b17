"""Tokenizer files of a Hugging Face export and import: the special tokens (BERT's or RoBERTa's), a clean
``tokenizers.Tokenizer`` (no padding or truncation, the family's post-processor), and the files transformers reads
beside tokenizer.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import tokenizers

from pretrain.checkpoint.files import write_json
from pretrain.prep.tokenizer import special_token_names

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def special_tokens(tok) -> dict[str, str]:
    """{pad, unk, cls, sep, mask: token} of ``tok``: BERT's [PAD]... or RoBERTa's <pad>... (ValueError if neither)."""
    try:
        return dict(zip(SPECIAL_TOKENS, special_token_names(tok)))
    except ValueError as e:
        raise ValueError(f"tokenizer: {e}") from None


def clean_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` ready for export: no padding/truncation, a [CLS] A [SEP] post-processor
    (RoBERTa's vocabulary: <s> A </s>, pairs <s> A </s></s> B </s>, one token type as RoBERTa's)."""
    from tokenizers.processors import TemplateProcessing

    names = special_tokens(tok)
    cls, sep = names["cls"], names["sep"]
    tok.no_padding()
    tok.no_truncation()
    pair = f"{cls} $A {sep} $B:1 {sep}:1" if cls == "[CLS]" else f"{cls} $A {sep} {sep} $B {sep}"
    tok.post_processor = TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair,
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    return tok


def write_tokenizer_files(tok, out: Path, model_max_length: int, *, token_types: bool = True) -> None:
    """tokenizer.json, special_tokens_map.json and tokenizer_config.json. ``token_types``: the tokenizer returns
    token_type_ids (a model with segment embeddings: a pair's second segment is type 1, as ours encodes it);
    transformers 5's generic tokenizer returns only input_ids and attention_mask unless model_input_names says so."""
    tok.save(str(out / "tokenizer.json"))
    special = {f"{name}_token": t for name, t in special_tokens(tok).items()}
    write_json(out / "special_tokens_map.json", special)
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    write_json(
        out / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
         "model_input_names": names, **special},
    )


def write_clean_tokenizer(hf_dir: str | os.PathLike, out_path: str | os.PathLike) -> str:
    """Write the HF directory's tokenizer as a plain tokenizer.json (no padding/truncation) to out_path; a
    sentence-transformers model that lowercases its input (sentence_bert_config.json: do_lower_case) gets the
    Lowercase normalizer sentence-transformers puts in front, so that it tokenizes as SentenceTransformer does."""
    d = Path(hf_dir)
    if (d / "tokenizer.json").is_file():
        tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    else:  # e.g. only vocab.txt: let transformers build the fast tokenizer
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False).backend_tokenizer
    tok = clean_tokenizer(tok)
    if st_lowercases(d):
        lowercase_first(tok)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return str(out_path)


def st_lowercases(d: str | os.PathLike) -> bool:
    """Whether the sentence-transformers directory ``d`` asks for its input lowercased (sentence_bert_config.json:
    do_lower_case), which SentenceTransformer does in front of the tokenizer."""
    st_config = Path(d) / "sentence_bert_config.json"
    return st_config.is_file() and bool(json.loads(st_config.read_text(encoding="utf-8")).get("do_lower_case"))


def lowercase_first(tok) -> None:
    """Put Lowercase in front of ``tok``'s normalizer unless it has one, as sentence-transformers' Transformer
    module does for do_lower_case=true (it lowercases the text before the tokenizer sees it)."""
    from tokenizers.normalizers import Lowercase, Sequence

    norm = tok.normalizer
    parts = [] if norm is None else list(norm) if isinstance(norm, Sequence) else [norm]
    if not any(isinstance(n, Lowercase) for n in parts):
        tok.normalizer = Sequence([Lowercase(), *parts])
