import json
from pathlib import Path

DATA_DIR_ENV = "PRETRAIN_DATA_DIR"
DEFAULT_DATA_DIR = "../shared/data"
"""The documented default, tried from the working directory, then beside the repository."""
RESULT_FILES = ("eval.json", "eval.md")
"""What ``pretrain-eval --out`` holds after a finished evaluation (transfer_partial.json, an unfinished one's, is
resumed); it refuses to replace them without --overwrite (``check_out``)."""


def data_dir_candidates(explicit: str = "") -> list[tuple[str, str]]:
    """(directory, where the name came from) in the order the one rule tries them: an explicit setting (a
    --data-dir flag, eval.data_dir) alone when given; else $PRETRAIN_DATA_DIR alone when set; else the default
    ../shared/data from the working directory, then from the repository root."""
    import os
    from pathlib import Path

    if explicit:
        return [(explicit, "as given")]
    if os.environ.get(DATA_DIR_ENV):
        return [(os.environ[DATA_DIR_ENV], f"${DATA_DIR_ENV}")]
    repo = Path(__file__).resolve().parents[2]
    return [(DEFAULT_DATA_DIR, "the default, from the working directory"),
            (str(repo.parent / "shared" / "data"), "the default, beside the repository")]


def find_data_dir(explicit: str = "", *, need: str = "", what: str = "shared data", flag: str = "") -> str:
    """The shared data root every tool and ``eval.*`` read, by one rule (``data_dir_candidates``): the first
    candidate holding ``need`` (a relative path, e.g. "sts/STSBenchmark"; "" = the directory itself).
    FileNotFoundError naming every place looked at and how to point at the data (``flag``: the tool's option)."""
    import os

    tried = []
    for path, origin in data_dir_candidates(explicit):
        if os.path.isdir(os.path.join(path, need) if need else path):
            return path
        tried.append(f"{os.path.join(path, need) if need else path} ({origin})")
    raise FileNotFoundError(
        f"{what} not found; looked in: {'; '.join(tried)}. Set {DATA_DIR_ENV}"
        f"{f' or pass {flag}' if flag else ''} to the directory holding {need or 'sts/, senteval/ and glue/'} (the shared data, see its MANIFEST.md)")


def default_data_dir() -> str:
    """The shared data root by the one rule (``find_data_dir``), or the first candidate when none exists (the
    error then comes from the reader, naming the path)."""
    try:
        return find_data_dir()
    except FileNotFoundError:
        return data_dir_candidates()[0][0]


def fail(prog: str, error) -> None:
    """One line on stderr naming what is wrong, exit status 2 (no traceback)."""
    import sys

    print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def check_out(out: str | None, results: tuple[str, ...], *, overwrite: bool = False) -> None:
    """ValueError when ``--out`` cannot take the results: it (or a directory above it) is a file, or it holds
    ``results`` of an earlier evaluation and ``overwrite`` is not given (a 7-task table is not silently replaced by
    a 1-task one). Both pretrain-eval and pretrain-finetune-glue (which keeps runs of one model and recipe per --out, no
    ``results``) call it first."""
    if not out:
        return
    path = Path(out)
    blocker = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is a file" if blocker == path else f"lies under {blocker}, a file"
        raise ValueError(f"--out {out} {what}, not a directory; choose a directory for the results")
    held = [name for name in results if (path / name).exists()]
    if held and not overwrite:
        raise ValueError(f"--out {out} already holds the results of an earlier evaluation ({_describe(path, held)}); "
                         f"pass --overwrite to replace them, or choose another --out")


def _describe(out: Path, held: list[str]) -> str:
    """The result files ``held`` in ``out``, with the model and STS tasks of its eval.json when it reads."""
    try:
        res = json.loads((out / "eval.json").read_text(encoding="utf-8"))
        model, tasks = res["checkpoint"]["path"], len(res.get("sts") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return ", ".join(held)
    return ", ".join(held) + f": {model}" + (f", {tasks} STS task{'s' if tasks != 1 else ''}" if tasks else "")
