"""A minimal WordNet reader: single-word synonyms from the Princeton database files.

Reads ``data.{noun,verb,adj,adv}`` (Debian's ``wordnet-base``, /usr/share/wordnet).
Each synset line is ``offset lex_filenum ss_type w_cnt(hex) word lex_id ... | gloss``;
two words are synonyms when they share a synset. Only lowercase alphabetic,
single-word lemmas are kept (multi-word lemmas contain ``_``).
"""

from __future__ import annotations

import functools
from pathlib import Path

DATA_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")


def _missing(directory: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"WordNet database not found in {directory} (need {', '.join(DATA_FILES)}); synonym substitution "
        "('subs') needs it: run `apt-get install wordnet-base` or set data.augment.wordnet_dir to a WordNet "
        "dict directory"
    )


def check_wordnet_dir(directory: str | Path) -> Path:
    """Return the directory as a Path, or raise FileNotFoundError saying how to install WordNet."""
    d = Path(directory)
    if not all((d / name).is_file() for name in DATA_FILES):
        raise _missing(d)
    return d


def parse_synset_words(line: str) -> list[str]:
    """Lemmas of one data-file line (lowercased, adjective markers like ``(a)`` removed)."""
    fields = line.split(" ", 4 + 2 * 256)
    num_words = int(fields[3], 16)
    words = []
    for k in range(num_words):
        word = fields[4 + 2 * k].lower()
        paren = word.find("(")
        if paren > 0:  # adjective syntactic marker: "galore(ip)"
            word = word[:paren]
        words.append(word)
    return words


def read_synonyms(directory: str | Path) -> dict[str, tuple[str, ...]]:
    """Map each single-word lemma to its sorted single-word synonyms (itself excluded)."""
    d = check_wordnet_dir(directory)
    groups: dict[str, set[str]] = {}
    for name in DATA_FILES:
        with open(d / name, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):  # licence header
                    continue
                words = [w for w in parse_synset_words(line) if w.isalpha() and w.isascii()]
                if len(words) < 2:
                    continue
                for w in words:
                    groups.setdefault(w, set()).update(words)
    return {w: tuple(sorted(s - {w})) for w, s in groups.items() if len(s) > 1}


@functools.lru_cache(maxsize=4)
def load_synonyms(directory: str) -> dict[str, tuple[str, ...]]:
    """``read_synonyms`` memoised per process, so each DataLoader worker parses WordNet once."""
    return read_synonyms(directory)
