"""The embedded default corpus: English prose that ships with every CPython installation.

Sources: the language reference topics of ``pydoc_data.topics`` (the text ``help()`` shows)
and the docstrings of the pure-Python standard library modules, classes and functions.
It is real, edited English, needs no network and no ``../shared``, and is identical on every
machine with the same Python version. Code blocks and grammar productions are dropped; each
topic or module becomes one document, one paragraph per line (the ``.txt`` corpus format).
"""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

_WORDY = re.compile(r"[A-Za-z]{2,}")


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a reST-ish text: unindented blocks, mostly words, joined to one line."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(line.startswith((" ", "\t")) for line in lines):
            continue  # code examples, grammar, tables, indented literal blocks
        para = " ".join(line.strip() for line in lines)
        if set(para) <= set("*=-~^#+ ") or ">>>" in para or "::=" in para:
            continue  # section underlines, doctests, grammar
        words = _WORDY.findall(para)
        if len(words) < 6 or len(words) < 0.5 * len(para.split()):
            continue
        out.append(para)
    return out


def _topic_documents() -> list[list[str]]:
    from pydoc_data.topics import topics

    return [p for p in (_paragraphs(topics[k]) for k in sorted(topics)) if p]


def _docstring_documents(max_files: int | None = None) -> list[list[str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    files += sorted(p for p in stdlib.glob("*/*.py")
                    if not any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3")
                               for part in p.relative_to(stdlib).parts))
    docs = []
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        paras = []
        for node in [tree] + [n for n in ast.walk(tree)
                              if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]:
            doc = ast.get_docstring(node, clean=True)
            if doc:
                paras.extend(_paragraphs(doc))
        if len(paras) >= 2:
            docs.append(paras)
    return docs


def write_embedded_corpus(out_dir: str | Path, *, valid_every: int = 20) -> tuple[Path, Path]:
    """Write ``train.txt`` and ``valid.txt`` (every ``valid_every``-th document held out)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = _topic_documents() + _docstring_documents()
    train = [d for i, d in enumerate(docs) if i % valid_every != valid_every - 1]
    valid = [d for i, d in enumerate(docs) if i % valid_every == valid_every - 1]
    paths = []
    for name, subset in (("train.txt", train), ("valid.txt", valid)):
        path = out_dir / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n\n".join("\n".join(d) for d in subset) + "\n", encoding="utf-8")
        tmp.replace(path)
        paths.append(path)
    return paths[0], paths[1]
