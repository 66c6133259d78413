"""Shared fixtures: tiny seeded checkpoints and the bundled demo model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The SmolLM2-135M demo checkpoint (converted once, cached under .cache/demo)."""
    from setup_demo import ensure_demo_model

    return ensure_demo_model(Path(os.environ.get("SHARDC_DEMO_DIR", ROOT / ".cache" / "demo")))


@pytest.fixture(scope="module")
def s3():
    """A real S3 server (moto, 127.0.0.1) and a fault proxy in front of it, one per test module:
    (server, proxy). test_store.py has its own ``s3`` (the server alone) and ``proxy``."""
    from s3server import FaultProxy, S3Server

    server = S3Server().start()
    proxy = FaultProxy(server.endpoint).start()
    yield server, proxy
    proxy.stop()
    server.stop()


@pytest.fixture
def make_ckpt(tmp_path):
    """Factory: make_ckpt(name="ck", num_files=1, seed=0, **llama_config kwargs) -> checkpoint dir."""
    from shardc.build.synthetic import llama_config, write_checkpoint

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
