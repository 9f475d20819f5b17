"""What reaches the console: ``--verbose`` (third-party output shown or kept back), progress bars only on
terminals, one-line warnings for the command-line tools. The lowest layer: any module may use it."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings

VERBOSE_ENV = "PRETRAIN_VERBOSE"
"""Set to 1 by ``--verbose`` (pretrain-train, -eval, -convert, -finetune-glue); inherited by workers."""


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def set_verbose(on: bool) -> None:
    """``--verbose``: third-party output (DeepSpeed, transformers, scikit-learn) reaches the console, in this
    process and the ones it starts."""
    if on:
        os.environ[VERBOSE_ENV] = "1"


def show_progress(requested: bool = True) -> bool:
    """Progress bars only on a terminal: in a log file (Slurm, nohup, CI) each redraw would be a line."""
    return requested and sys.stderr.isatty()


class quiet_third_party:
    """Context manager: what third-party code prints (DeepSpeed's "built successfully" and checkpoint-reader
    lines, tqdm bars) is kept out of the console unless ``verbose()``; if the block raises, the captured text is
    written to stderr first, so nothing that explains an error is lost."""

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        if not verbose():
            self._buf = io.StringIO()
            self._stack.enter_context(contextlib.redirect_stdout(self._buf))
            self._stack.enter_context(contextlib.redirect_stderr(self._buf))
        return self

    def __exit__(self, exc_type, exc, tb):
        self._stack.close()
        if exc_type is not None and not verbose() and self._buf.getvalue():
            sys.stderr.write(self._buf.getvalue())
        return False


def one_line_warnings(prog: str) -> None:
    """Warnings of this process as one line each, ``prog: warning: message`` on stderr, instead of Python's
    "file:line: UserWarning: ..." plus a source line (for the command-line tools)."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show
