"""Shared fixtures: tiny seeded checkpoints and the bundled demo model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`) each worker gets a temp directory of its own, inherited by
    the processes its tests start: the other worker's scratch files (a gate's logits, a job's
    directory) never appear where a test looks for what it left behind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        import tempfile

        own = Path(tempfile.gettempdir()) / f"shardc-tests-{worker}"
        own.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(own)
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The SmolLM2-135M demo checkpoint (converted once, cached under .cache/demo)."""
    from setup_demo import ensure_demo_model

    return ensure_demo_model(Path(os.environ.get("SHARDC_DEMO_DIR", ROOT / ".cache" / "demo")))


@pytest.fixture(scope="module")
def s3():
    """A real S3 server (moto, 127.0.0.1) and a fault proxy in front of it, one per test module:
    (server, proxy). store/test_push_pull.py has its own ``s3`` (the server alone) and ``proxy``."""
    from s3server import FaultProxy, S3Server

    server = S3Server().start()
    proxy = FaultProxy(server.endpoint).start()
    yield server, proxy
    proxy.stop()
    server.stop()


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


def edit_at(d: dict, path: tuple, value) -> None:
    """Plant a fault in a manifest held as data: set ``d[path...]`` to ``value``, or delete that
    key when ``value`` is ``KeyError``."""
    *head, last = path
    for k in head:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value


def sealed(data: bytes, chunk_size: int | None) -> dict:
    """What a manifest's shard entry records of these bytes: size, sha256 and, with a chunk size
    (format_version 3), the sha256 of every chunk (cut here, independently of shardc)."""
    import hashlib

    out = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if chunk_size is not None:
        out["chunks"] = [hashlib.sha256(data[i : i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)]
    return out


def reseal(entry, data: bytes) -> None:
    """Make a shard entry (a manifest dict's or a ShardEntry) match ``data``: a test that plants
    bytes the hashes must not catch (a NaN under a matching sha256) reseals the entry."""
    if isinstance(entry, dict):
        entry.update(sealed(data, entry.get("chunk_size")))
        return
    for key, value in sealed(data, entry.chunk_size).items():
        setattr(entry, key, tuple(value) if key == "chunks" else value)
