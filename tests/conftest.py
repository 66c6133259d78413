"""Shared fixtures: tiny seeded checkpoints and the bundled demo model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`) each worker gets a temp directory of its own, inherited by
    the processes its tests start: the other worker's scratch files (a gate's logits, a job's
    directory) never appear where a test looks for what it left behind."""
    # Commands' stderr is checked line for line (one error line, or nothing); a build that runs
    # longer than the progress interval on a loaded runner would log progress lines beside it. The
    # suite's processes log progress once an hour; tests/cli/test_progress_log.py sets its own.
    os.environ.setdefault("SHARDC_PROGRESS_EVERY", "3600")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        import tempfile

        own = Path(tempfile.gettempdir()) / f"shardc-tests-{worker}"
        own.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(own)
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again


# The files that take far longest (minutes of CPU each), started first under `make test`. xdist's
# loadfile scheduler hands out files with the most tests first, which put the README's gate figures
# (3 tests, 4 single-threaded bf16 passes of the demo model over 8,192 tokens: a good part of the
# suite's CPU) near the very end, where its baseline pass ran on one core while the other idled.
# Started first, its passes share the cores with the other worker's files instead.
LONG_FILES = ("tests/docs/test_readme_gate_figures.py",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 (xdist's types)
    """``--dist loadfile`` with ``LONG_FILES`` first; any other mode: xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):  # noqa: ANN001, ANN202
            for scope in reversed(LONG_FILES):  # a file's scope is its node id's path
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongFilesFirst(config, log)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The SmolLM2-135M demo checkpoint (converted once, cached under .cache/demo)."""
    from setup_demo import ensure_demo_model

    return ensure_demo_model(Path(os.environ.get("SHARDC_DEMO_DIR", ROOT / ".cache" / "demo")))


@pytest.fixture(scope="module")
def s3_server():
    """A real S3 server (moto on 127.0.0.1, real HTTP), one per test module."""
    from s3server import S3Server

    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_proxy(s3_server):
    """The fault proxy (tests/s3server.py) in front of the module's S3 server."""
    from s3server import FaultProxy

    proxy = FaultProxy(s3_server.endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def s3(s3_server, s3_proxy):
    """(server, proxy). store/test_push_pull.py names them ``s3`` (the server alone) and ``proxy``."""
    return s3_server, s3_proxy


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Dummy S3 credentials for this process and the shardc subprocesses it starts, isolated from
    any AWS configuration of the machine (profile, endpoint, session, retry settings, config files):
    a test must never reach a real account. Yields the monkeypatch, so that a file's own
    ``aws_env`` (same name, requesting this one) sets what it needs on top, such as
    ``SHARDC_S3_MAX_ATTEMPTS``."""
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN",
                "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    return monkeypatch


@pytest.fixture
def tmpfs(tmp_path):
    """Factory: tmpfs(name, size) -> a real tmpfs of ``size`` ("160k", "1M") mounted at
    tmp_path/name, for disk-full and read-only cases; unmounted after the test. Needs root: the
    test is skipped where the mount is refused."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


@pytest.fixture
def make_ckpt(tmp_path):
    """Factory: make_ckpt(name="ck", num_files=1, seed=0, **llama_config kwargs) -> checkpoint dir."""
    from shardc.compiler.synthetic import llama_config, write_checkpoint

    def make(name: str = "ck", *, num_files: int = 1, seed: int = 0, **cfg) -> Path:
        return write_checkpoint(tmp_path / name, llama_config(**cfg), num_files=num_files, seed=seed)

    return make


@pytest.fixture(autouse=True, scope="session")
def _isolated_hash_cache(tmp_path_factory):
    """Keep the source-hash cache of test runs out of the user's ~/.cache."""
    os.environ["SHARDC_CACHE_DIR"] = str(tmp_path_factory.mktemp("shardc-cache"))


@pytest.fixture(autouse=True, scope="module")
def _isolated_module_records(tmp_path_factory):
    """The rollout records of every build and reshard a test runs without ``--manifests-dir`` (the
    CLI's default is ``manifests/`` of the working directory: this checkout) go to a temp directory,
    one per test module for its module fixtures and one per test (below): the suite leaves the
    checkout as it found it (#41 item 9; `.ci/run` checks), and two tests' builds of one plan name
    never meet at one record (a build refuses to replace another build's record)."""
    before = os.environ.get("SHARDC_MANIFESTS_DIR")
    os.environ["SHARDC_MANIFESTS_DIR"] = str(tmp_path_factory.mktemp("manifests"))
    yield
    if before is None:
        os.environ.pop("SHARDC_MANIFESTS_DIR", None)
    else:
        os.environ["SHARDC_MANIFESTS_DIR"] = before


@pytest.fixture(autouse=True)
def _isolated_records(_isolated_module_records, tmp_path_factory, monkeypatch):
    """Each test's own records directory (see above)."""
    monkeypatch.setenv("SHARDC_MANIFESTS_DIR", str(tmp_path_factory.mktemp("manifests")))


@pytest.fixture(scope="session")
def tiny_families(tmp_path_factory):
    """The families' tiny models and their builds, each made once per session (tests/family_models.py
    ``TinyFamilies``: ``source(case)``, ``build(plan)``, ``built(case, tp, ep, dtype, dp, pp)``)."""
    from family_models import TinyFamilies

    return TinyFamilies(tmp_path_factory.mktemp("families"))
