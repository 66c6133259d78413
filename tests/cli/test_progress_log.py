"""#43: a long command's progress in a log (stderr not a terminal): plain lines, at most one per
interval (SHARDC_PROGRESS_EVERY seconds, default 5), none for an operation shorter than one
interval, no carriage returns; `--quiet` and `--json` print none."""

from __future__ import annotations

from cli_run import shardc
from plan_helpers import write_plan


def _plan(tmp_path):
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    src = write_checkpoint(tmp_path / "src", llama_config(num_layers=2, hidden_size=64, intermediate_size=96))
    return write_plan(tmp_path / "p.yaml", 2, name="progress", source=src)


def test_a_build_logs_progress_lines(tmp_path):
    plan = _plan(tmp_path)
    r = shardc("build", plan, "--out", tmp_path / "b", env={"SHARDC_PROGRESS_EVERY": "0.000001"})
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("build progress:")]
    assert lines and lines[-1].startswith("build progress: 100%"), r.stderr


def test_a_short_build_logs_nothing_and_quiet_nothing_ever(tmp_path):
    plan = _plan(tmp_path)
    r = shardc("build", plan, "--out", tmp_path / "b")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = shardc("build", plan, "--out", tmp_path / "c", "--quiet", env={"SHARDC_PROGRESS_EVERY": "0.000001"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
