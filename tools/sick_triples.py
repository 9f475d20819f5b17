"""(premise, entailed, contradicted) triples from SICK's train + trial splits: a stand-in for SimCSE's NLI triples.

Supervised SimCSE trains on SNLI + MNLI triples (``nli_for_simcse.csv``), which are not in the shared data. SICK
(Marelli et al. 2014) labels sentence pairs ENTAILMENT / NEUTRAL / CONTRADICTION, so every sentence_A of
``SICK_train.txt`` / ``SICK_trial.txt`` that has both an entailed and a contradicted sentence gives triples of the
same shape. It is small (a few hundred triples) and SICK-R is one of the STS test sets: use it to check that the
recipe runs and its term leaves chance (issue 29 items 1-2), never to report SICK-R of a model trained on it.

    python tools/sick_triples.py [SICK_train.txt] OUT.csv   (default: $PRETRAIN_DATA_DIR/sts/SICK/SICK_{train,trial}.txt)
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sick_triples(*paths: Path) -> list[tuple[str, str, str]]:
    """A triple for every (premise, entailed hypothesis) pair whose premise also has a contradicted sentence:
    entailment read A -> B as SICK labels it, contradiction both ways (a contradiction is mutual); a premise's
    contradicted sentences are taken in turn by its entailed ones. In file order."""
    entailed: dict[str, list[str]] = {}
    contradicted: dict[str, list[str]] = {}
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            rows = csv.DictReader(f, delimiter="\t")
            needed = {"sentence_A", "sentence_B", "entailment_judgment"}
            if not needed <= set(rows.fieldnames or ()):
                raise ValueError(f"{path}: not a SICK file (columns {rows.fieldnames}, need {sorted(needed)})")
            for row in rows:
                a, b, label = row["sentence_A"].strip(), row["sentence_B"].strip(), row["entailment_judgment"]
                if label == "ENTAILMENT":
                    entailed.setdefault(a, []).append(b)
                elif label == "CONTRADICTION":
                    contradicted.setdefault(a, []).append(b)
                    contradicted.setdefault(b, []).append(a)
    return [(a, e, contradicted[a][i % len(contradicted[a])])
            for a, hyps in entailed.items() if a in contradicted for i, e in enumerate(hyps)]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    data = Path(os.environ.get("PRETRAIN_DATA_DIR", ROOT.parent / "shared" / "data"))
    srcs = [Path(args[0])] if len(args) == 2 else [data / "sts" / "SICK" / f"SICK_{s}.txt" for s in ("train", "trial")]
    missing = [str(s) for s in srcs if not s.is_file()]
    if missing:
        print(f"sick_triples: {', '.join(missing)} not found (pass the path of SICK_train.txt)", file=sys.stderr)
        return 2
    triples = sick_triples(*srcs)
    out = Path(args[-1])
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(("sent0", "sent1", "hard_neg"))
        w.writerows(triples)
    tmp.replace(out)
    print(f"{len(triples):,} triples from {', '.join(map(str, srcs))} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
