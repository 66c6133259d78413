"""A real ``shardc`` process and the one-line error contract, written once for the tests that run
the CLI as a user does (``docs/architecture.md §7``: one line on stderr, no traceback, the exit
code of the error's class). Import by name: ``from cli_run import one_line, shardc``; ``shardc_in``
runs the same command in the test's own process, for the many tests about what a command does rather
than about the process (a file keeps a real process where exit codes and stderr are its subject)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shardc(*args: object, env: dict[str, str] | None = None, fault: str | None = None,
           timeout: float = 120, cwd: Path = ROOT,
           preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """``python -m shardc.cli ARGS`` with this checkout's package first on PYTHONPATH, run from
    the repository root. ``fault`` sets ``SHARDC_FAULT`` (the kill hooks of switch and export);
    an inherited one is dropped, so that no test is killed by another's hook. ``preexec_fn`` runs
    in the child before the CLI starts (a resource limit: a file-size cap)."""
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    full.pop("SHARDC_FAULT", None)
    if fault:
        full["SHARDC_FAULT"] = fault
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "shardc.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=full, cwd=cwd, preexec_fn=preexec_fn)


def shardc_in(*args: object, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``shardc ARGS`` run in this process (click's CliRunner on ``shardc.cli.main``), answered as
    ``shardc`` answers: exit code, stdout, stderr. For tests about what a command does, not about
    the process: it saves the interpreter's start and the imports (numpy, ml_dtypes: about 2 s of
    CPU a call). What a real process would add to stderr is added here too, so ``one_line`` is as
    strict: an uncaught exception's traceback (exit 1) and the warnings Python's default filters
    print. Never with ``SHARDC_FAULT`` (its hooks end the process): use ``shardc`` for those; an
    inherited one is dropped, as ``shardc`` drops it."""
    from click.testing import CliRunner

    from shardc.cli import main

    full: dict[str, str | None] = {"SHARDC_FAULT": None, **(env or {})}
    with warnings.catch_warnings(record=True) as caught, contextlib.chdir(cwd):
        warnings.resetwarnings()  # Python's default filters, as a fresh interpreter has them
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        r = CliRunner().invoke(main, [str(a) for a in args], env=full)
    stderr, code = r.stderr, r.exit_code
    stderr += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
                      for w in caught)
    if r.exception is not None and r.exc_info is not None and not isinstance(r.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*r.exc_info))
        code = 1
    return subprocess.CompletedProcess(["shardc", *map(str, args)], code, r.stdout, stderr)


def one_line(r: subprocess.CompletedProcess, needle: str = "", code: int = 2) -> str:
    """The process exited with ``code`` and said one line on stderr (no traceback) containing
    ``needle``; returns that line."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0], lines[0]
    return lines[0]
