"""Progress of the long commands (build, reshard, push, pull): a tqdm bar on a terminal, and where
stderr is not one (a CI log, a pipe) a plain line at most every few seconds, so a log of a 70B build
is neither silent for minutes nor full of carriage returns. A leaf: the library's long operations
make their bar here (their callers say whether to show one: `--quiet`, `--json`)."""

from __future__ import annotations

import sys
import time
from typing import Any

LOG_EVERY = 5.0  # seconds between two progress lines in a log; SHARDC_PROGRESS_EVERY sets another


def every() -> float:
    """Seconds between two lines in a log: SHARDC_PROGRESS_EVERY when it is a positive number."""
    import os

    try:
        value = float(os.environ.get("SHARDC_PROGRESS_EVERY", LOG_EVERY))
    except ValueError:
        return LOG_EVERY
    return value if value > 0 else LOG_EVERY


class _Lines:
    """What tqdm writes, as whole lines: each refresh (a carriage-return-led status) on a line of
    its own, empty ones dropped, and nothing in the first ``quiet_for`` seconds: an operation shorter
    than one interval logs nothing (an explicit refresh, a postfix or the close would otherwise
    print its line anyway)."""

    def __init__(self, quiet_for: float) -> None:
        self.until = time.monotonic() + quiet_for

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip("\n")
        if line.strip() and time.monotonic() >= self.until:
            sys.stderr.write(line + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def terminal() -> bool:
    """Whether stderr is a terminal (a bar redrawn in place) or a log (lines)."""
    return sys.stderr.isatty()


def bar(total: int, desc: str, *, enabled: bool = True, leave: bool = False) -> Any:
    """A byte-counting tqdm bar on stderr (``enabled=False``: a disabled one, same interface)."""
    from tqdm import tqdm

    common: dict[str, Any] = {"total": total, "unit": "B", "unit_scale": True, "unit_divisor": 1024, "desc": desc,
                              "disable": not enabled}
    if terminal():
        return tqdm(**common, file=sys.stderr, leave=leave)
    # a log: no bar redrawn in place; a line every interval, and one at the end
    gap = every()
    return tqdm(**common, file=_Lines(gap), mininterval=gap, maxinterval=gap, ascii=True, ncols=100,
                dynamic_ncols=False, leave=True)
