"""Tokenizer training and loading: WordPiece / byte-level BPE (``tokenizers``) and unigram (``sentencepiece``).

Every kind ends up as one HF ``tokenizer.json`` (unigram also keeps its ``.spm.model`` next to it), loadable
later by ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``. Special tokens have ids 0..5 in the
order of ``SPECIAL_TOKENS``. ``Tokenizer.encode`` never adds [CLS]/[SEP]; the saved post-processor does,
for the HF export only.

WordPiece training is not reproducible bit for bit: ``tokenizers``' trainer (0.23) numbers the continuing-subword
pieces ("##x") in hash-map order, which changes from process to process, and breaks ties between equally frequent
merges by those numbers (huggingface/tokenizers#1794; measured 2026-12-08 on an 8,192-piece vocabulary: 2,454 ids
and 12 pieces differed between two runs on the same text). BPE and unigram gave the same file twice. Keep the
tokenizer.json a dataset was made with: its sha256 is recorded in every dataset manifest and checkpoint, and a
dataset or checkpoint of another tokenizer is refused by name.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import (
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from pretrain.console import one_line_warnings, show_progress
from pretrain.data.indexed import file_sha256
from pretrain.prep.readers import ReadStats, iter_documents
from pretrain.prep.sentence_split import split_sentences

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEL]")
ROBERTA_SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>", "<mask>")
"""RoBERTa's names for pad, unk, cls, sep and mask (an imported RoBERTa vocabulary: <s>=0, <pad>=1, </s>=2, ...)."""


def special_token_names(tok) -> tuple[str, ...]:
    """The five special tokens (pad, unk, cls, sep, mask) of ``tok`` (anything with ``token_to_id``): BERT's
    [PAD] ... [MASK] (ours, imported BERT) or, for a vocabulary with none of those, RoBERTa's <pad> ... <mask>.
    ValueError naming what is missing otherwise."""
    for names in (SPECIAL_TOKENS[:5], ROBERTA_SPECIAL_TOKENS):
        missing = [t for t in names if tok.token_to_id(t) is None]
        if not missing:
            return names
        if names == SPECIAL_TOKENS[:5] and len(missing) < len(names):
            break  # a BERT-style vocabulary with a gap: name its gap, not RoBERTa's
    raise ValueError(f"the vocabulary has no {', '.join(missing)} token(s); pretrain needs {', '.join(names)} "
                     f"(BERT's, made by pretrain-tokenizer) or RoBERTa's {', '.join(ROBERTA_SPECIAL_TOKENS)}")
KINDS = ("wordpiece", "bpe", "unigram")
_MODEL_KIND = {"WordPiece": "wordpiece", "BPE": "bpe", "Unigram": "unigram"}


def _has_lowercase(node) -> bool:
    """True when a serialized normalizer (possibly a Sequence) lowercases."""
    if isinstance(node, dict):
        if node.get("type") == "Lowercase" or (node.get("type") == "BertNormalizer" and node.get("lowercase")):
            return True
        return any(_has_lowercase(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_lowercase(v) for v in node)
    return False


class Tokenizer:
    """A loaded tokenizer.json with the project's special tokens; pickles by path."""

    def __init__(self, path: str, *, expected_sha256: str | None = None) -> None:
        if not path:
            raise FileNotFoundError("no tokenizer file given (an empty path; for training: data.tokenizer); "
                                    "train one with pretrain-tokenizer")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} not found; train one with pretrain-tokenizer")
        self.path = str(path)
        self.sha256 = file_sha256(self.path)
        if expected_sha256 is not None and expected_sha256 != self.sha256:
            raise ValueError(f"tokenizer file {path} changed since it was opened (sha256 {self.sha256[:12]} "
                             f"!= {expected_sha256[:12]}); do not overwrite a tokenizer in use")
        try:
            self._tok = HFTokenizer.from_file(self.path)
            spec = json.loads(self._tok.to_str())
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise ValueError(f"{path} is not a valid tokenizers tokenizer.json ({e}); "
                             f"re-create it with pretrain-tokenizer") from None
        # Sequences are cut and padded by the data pipeline; a tokenizer.json saved with truncation or padding
        # (as HF model directories often are) would silently shorten or pad every sentence here.
        self._tok.no_truncation()
        self._tok.no_padding()
        model_type = spec.get("model", {}).get("type")
        if model_type not in _MODEL_KIND:
            raise ValueError(f"{path}: unsupported tokenizer model {model_type!r}; expected one of {list(_MODEL_KIND)}")
        self.kind = _MODEL_KIND[model_type]
        self.lowercase = _has_lowercase(spec.get("normalizer"))
        # Special ids are looked up by string: ours are 0..5 (pretrain-tokenizer), an imported HF BERT
        # vocabulary has its own ([PAD]=0, [UNK]=100, [CLS]=101, ...) and usually no [DEL]; an imported RoBERTa
        # one has <pad>, <unk>, <s>, </s>, <mask> instead.
        try:
            names = special_token_names(self._tok)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        self.roberta_specials = names == ROBERTA_SPECIAL_TOKENS
        """RoBERTa's vocabulary: a sentence pair is <s> a </s></s> b </s>, all token type 0 (eval/encoder.py)."""
        ids = {tok: self._tok.token_to_id(tok) for tok in (*names, "[DEL]")}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (ids[t] for t in names)
        self.del_id: int | None = ids["[DEL]"]
        """None for vocabularies without [DEL] (e.g. imported HF BERT): deletion views then drop words."""
        self.special_ids = frozenset(i for i in ids.values() if i is not None)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.splits_at_whitespace = _splits_at_whitespace(spec)
        """Tokens never span whitespace and nothing is added at a text's start (WordPiece behind a whitespace
        pre-tokenizer): a paragraph's tokens are then its sentences' tokens, cut where each sentence starts."""
        self._word_start: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], expected_sha256=state["sha256"])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, kind={self.kind}, vocab_size={self.vocab_size}, lowercase={self.lowercase})"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no [CLS]/[SEP]."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text (no specials); same result as ``encode`` on each."""
        if not texts:
            return []
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_sentences(self, paragraphs: list[str],
                         spans: list[list[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the sentences ``paragraphs[i][a:b]`` for each (a, b) in ``spans[i]``, in order: (all ids
        concatenated as int32, int64 token count per sentence) — equal to ``encode_batch`` on the sentence texts.

        When the tokenizer ``splits_at_whitespace``, each paragraph is encoded once and cut at the token where
        each sentence starts (about 15% less work in ``tokenizers`` than many short items); a paragraph whose
        cut is not clean (a sentence starting with a character that yields no token) is encoded sentence by
        sentence instead."""
        if not self.splits_at_whitespace:
            texts = [p[a:b] for p, sp in zip(paragraphs, spans) for a, b in sp]
            ids = self.encode_batch(texts)
            sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(sizes.sum())), sizes
        encs = self._tok.encode_batch(list(paragraphs), add_special_tokens=False)
        sizes: list[int] = []
        pieces: list[list[int]] = []
        for p, sp, enc in zip(paragraphs, spans, encs):
            ids = enc.ids
            if len(sp) <= 1:
                if not sp:
                    continue
                sizes.append(len(ids))
                pieces.append(ids)
                continue
            cuts = [0] + [enc.char_to_token(a) for a, _ in sp[1:]] + [len(ids)]
            if None in cuts or any(x > y for x, y in zip(cuts, cuts[1:])):
                for one in self.encode_batch([p[a:b] for a, b in sp]):
                    sizes.append(len(one))
                    pieces.append(one)
                continue
            sizes.extend(y - x for x, y in zip(cuts, cuts[1:]))
            pieces.append(ids)
        size_arr = np.asarray(sizes, dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32, count=int(size_arr.sum()))
        return flat, size_arr

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, tok: str) -> int | None:
        return self._tok.token_to_id(tok)

    def id_to_token(self, i: int) -> str:
        tok = self._tok.id_to_token(int(i))
        if tok is None:
            raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size}) of {self.path}")
        return tok

    def word_start_mask(self) -> np.ndarray:
        """bool [vocab]: token begins a new word (specials count as word starts)."""
        if self._word_start is None:
            mask = np.zeros(self.vocab_size, dtype=bool)
            for i in range(self.vocab_size):
                tok = self._tok.id_to_token(i) or ""
                if i in self.special_ids:
                    mask[i] = True
                elif self.kind == "wordpiece":
                    mask[i] = not tok.startswith("##")
                elif self.kind == "bpe":
                    mask[i] = tok.startswith("\u0120")
                else:
                    mask[i] = tok.startswith("\u2581")
            self._word_start = mask
        return self._word_start


_WHITESPACE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip"}
"""Normalizers that act on characters where they are (none joins or moves text across whitespace)."""


def _splits_at_whitespace(spec: dict) -> bool:
    """A WordPiece tokenizer whose pre-tokenizer splits at whitespace and whose normalizer is character-local."""
    def types(node) -> list[str]:
        if not node:
            return []
        if node.get("type") == "Sequence":
            return [t for sub in node.get("pretokenizers", node.get("normalizers", [])) for t in types(sub)]
        return [node.get("type")]

    pre, norm = types(spec.get("pre_tokenizer")), types(spec.get("normalizer"))
    return (spec.get("model", {}).get("type") == "WordPiece" and bool(set(pre) & _WHITESPACE_PRE_TOKENIZERS)
            and set(pre) <= _WHITESPACE_PRE_TOKENIZERS | {"Punctuation", "Digits"}
            and set(norm) <= _LOCAL_NORMALIZERS)


def load_tokenizer(path: str) -> Tokenizer:
    """Open a tokenizer.json written by ``train_tokenizer`` (FileNotFoundError/ValueError when unusable)."""
    return Tokenizer(path)


def _text_batches(files: list[str], max_bytes: int | None, *, sentences: bool,
                  say=None, stats: ReadStats | None = None) -> Iterator[list[str]]:
    """Paragraphs (or sentences) from the project readers, in batches, stopping after ~max_bytes; ``say(line)``
    hears how far reading has got every few seconds and once at the end. Lines with invalid UTF-8 are read with
    U+FFFD and counted in ``stats`` (with where the first one is)."""
    stats = stats if stats is not None else ReadStats()
    seen, docs, last = 0, 0, time.perf_counter()
    batch: list[str] = []
    for doc in iter_documents(files, stats, errors="replace"):
        docs += 1
        for p in doc.paragraphs:
            batch.extend(split_sentences(p) if sentences else [p])
            seen += len(p)
        if len(batch) >= 1000:
            yield batch
            batch = []
        if say is not None and time.perf_counter() - last >= 5:
            say(f"read {seen / 1e6:.1f} M characters ({docs:,} documents)")
            last = time.perf_counter()
        if max_bytes is not None and seen >= max_bytes:
            break
    if batch:
        yield batch
    if say is not None:
        say(f"read {seen / 1e6:.1f} M characters ({docs:,} documents); building the vocabulary")


def format_read_report(stats: ReadStats) -> str:
    """What reading changed or left out, as ``pretrain-preprocess`` reports it ("" when nothing)."""
    lines = []
    if stats.skipped:
        lines.append("skipped lines: " + ", ".join(f"{k}={v:,}" for k, v in sorted(stats.skipped.items())))
    if stats.skipped.get("replaced_utf8"):
        lines.append(f"warning: {stats.skipped['replaced_utf8']:,} line(s) had invalid UTF-8 replaced by U+FFFD"
                     + (f"; the first: {stats.first_bad_utf8}" if stats.first_bad_utf8 else ""))
    return "\n".join(lines)


def _post_processor() -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                         special_tokens=[("[CLS]", 2), ("[SEP]", 3)])


def _unigram_normalizer(lowercase: bool) -> normalizers.Normalizer:
    steps = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
    return normalizers.Sequence(steps + [normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()])


def _train_unigram(batches: Iterable[list[str]], out_path: str, vocab_size: int, lowercase: bool) -> HFTokenizer:
    """Train sentencepiece on text normalized exactly like the tokenizer.json will, then convert."""
    import sentencepiece as spm

    norm = _unigram_normalizer(lowercase)

    def sentences() -> Iterator[str]:
        for batch in batches:
            for s in batch:
                s = norm.normalize_str(s)
                if s:
                    yield s

    prefix = str(Path(out_path).with_suffix("")) + ".spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_prefix=prefix, model_type="unigram", vocab_size=vocab_size,
        hard_vocab_limit=False, normalization_rule_name="identity", character_coverage=0.9995,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="[PAD]", unk_piece="[UNK]", bos_piece="[CLS]",
        eos_piece="[SEP]", control_symbols=["[MASK]", "[DEL]"], input_sentence_size=2_000_000,
        shuffle_input_sentence=True, max_sentence_length=16384, num_threads=os.cpu_count() or 1,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    vocab = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    tok = HFTokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=False))
    tok.normalizer = norm
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    return tok


def train_tokenizer(files: list[str], out_path: str, *, kind: str = "wordpiece", vocab_size: int = 30522,
                    lowercase: bool = True, min_frequency: int = 2, max_bytes: int | None = None,
                    progress: bool = False, stats: ReadStats | None = None) -> Tokenizer:
    """Train on files/directories (read with the preprocessing readers), save ``out_path``, return it loaded.

    ``max_bytes`` limits training to roughly the first that many characters of text. ``progress``: a line on
    stderr every few seconds while reading, and the trainer's own bar on a terminal. ``stats`` (a
    ``ReadStats``) hears the lines the readers replaced or skipped and where the first is (``format_read_report``).
    """
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind must be one of {KINDS}, got {kind!r}")
    if vocab_size <= len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be > {len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(f"pretrain-tokenizer: {line}", file=sys.stderr, flush=True)

    batches = _text_batches(files, max_bytes, sentences=(kind == "unigram"), say=say if progress else None,
                            stats=stats)
    bar = show_progress(progress)
    if kind == "unigram":
        tok = _train_unigram(batches, out_path, vocab_size, lowercase)
    else:
        if kind == "wordpiece":
            tok = HFTokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
            tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                        strip_accents=None, lowercase=lowercase)
            tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
            tok.decoder = decoders.WordPiece(prefix="##")
            trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                                special_tokens=list(SPECIAL_TOKENS),
                                                continuing_subword_prefix="##", show_progress=bar)
        else:
            tok = HFTokenizer(models.BPE(unk_token="[UNK]"))
            steps = [normalizers.NFC()] + ([normalizers.Lowercase()] if lowercase else [])
            tok.normalizer = normalizers.Sequence(steps)
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                          special_tokens=list(SPECIAL_TOKENS), show_progress=bar,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(batches, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = _post_processor()
    if tok.get_vocab_size() <= len(SPECIAL_TOKENS):
        raise ValueError(f"no text found in {files} to train a tokenizer on")
    # Atomic publish: a half-written tokenizer.json is never visible under out_path. The temporary name is made
    # here, not by mkstemp, whose 0600 file would keep that mode after the rename (the user's umask applies).
    tmp = str(Path(out_path).parent / f".{Path(out_path).name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tok.save(tmp, pretty=True)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return Tokenizer(out_path)


def main(argv: list[str] | None = None) -> int:
    """Console script ``pretrain-tokenizer``."""
    ap = argparse.ArgumentParser(prog="pretrain-tokenizer", description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="files or directories, as pretrain-preprocess reads them (.txt, .jsonl, "
                                              "WikiExtractor output, books, .parquet, datasets save_to_disk "
                                              "directories; text formats also as .gz/.zst/.bz2/.xz)")
    ap.add_argument("--out", required=True, help="output tokenizer.json path")
    ap.add_argument("--kind", choices=KINDS, default="wordpiece")
    ap.add_argument("--vocab-size", type=int, default=30522)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--cased", action="store_true", help="keep case (default: lowercase)")
    ap.add_argument("--max-bytes", type=float, default=None, help="train on about the first N characters only")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines while reading")
    args = ap.parse_args(argv)

    one_line_warnings("pretrain-tokenizer")
    t0 = time.perf_counter()
    stats = ReadStats()
    try:
        tok = train_tokenizer(args.inputs, args.out, kind=args.kind, vocab_size=args.vocab_size,
                              lowercase=not args.cased, min_frequency=args.min_frequency,
                              max_bytes=int(args.max_bytes) if args.max_bytes else None,
                              progress=not args.no_progress, stats=stats)
    except (FileNotFoundError, ValueError) as e:
        print(f"pretrain-tokenizer: error: {e}", file=sys.stderr)
        return 2
    report = format_read_report(stats)
    if report:
        print(report)
    print(f"wrote {tok.path}: kind={tok.kind} vocab_size={tok.vocab_size} lowercase={tok.lowercase} "
          f"sha256={tok.sha256[:16]}… in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
