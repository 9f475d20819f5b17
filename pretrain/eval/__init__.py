


def default_data_dir() -> str:
    """The shared data root the eval tools read: $PRETRAIN_DATA_DIR (as the trainer and tests), else ../shared/data."""
    import os

    return os.environ.get("PRETRAIN_DATA_DIR") or "../shared/data"


def fail(prog: str, error) -> None:
    """One line on stderr naming what is wrong, exit status 2 (no traceback)."""
    import sys

    print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)
