"""Golden bytes: a seeded synthetic checkpoint built with three plans gives exactly these files.

Refactors must keep every output byte (shards, config.json, manifest.json) the same; change a
hash here only on a deliberate format change, and say so in the commit. ``SHARDC_PRINT_GOLDEN=1``
prints the current hashes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from shardc.build.compile import build
from shardc.build.synthetic import llama_config, write_checkpoint
from shardc.spec.plan import plan_from_dict

PLANS = {  # name: (tp, pp, dtype)
    "g-tp2pp2-bf16": (2, 2, "bf16"),
    "g-tp2pp1-int8": (2, 1, "int8"),
    "g-tp1pp2-fp8": (1, 2, "fp8"),
}

GOLDEN: dict[str, dict[str, str]] = {
    "g-tp1pp2-fp8": {
        "config.json": "dbd71f81dba1086d2deb50d8097192896ab4f457b779bdf026dd654410263d6a",
        "manifest.json": "45de058701bb648a1bf4d9f1678fed9e0530b8c3583996b5312acfbde30a6c20",
        "model-tp00-pp00.safetensors": "72f57a4c1fcd5f4b4f269cf86e883ba21535fd7bc3f4a7260a69ed500841b2cd",
        "model-tp00-pp01.safetensors": "5fd71cf3d45981499fde8434385ce8dd776b42533a30808d92bde5dd5a5718a1",
    },
    "g-tp2pp1-int8": {
        "config.json": "b82af120322aaad384fcdc74fd6e198f54be9b195908b2cc5b687a43977b2a1b",
        "manifest.json": "d921aa465a59c48067633006d409560288270dece0ec05608c00c8eac5eb472a",
        "model-tp00-pp00.safetensors": "793437f00353c40b53253858f03f5480662bc823c9e5799e3313e18a8127c5d0",
        "model-tp01-pp00.safetensors": "b8233502de1735a49676a016c501314208bbcea8882d71b532464931050f6c14",
    },
    "g-tp2pp2-bf16": {
        "config.json": "2e09e4292776916c310687e90822c44700f192ba7187bb28cc781b8a7ccd5b24",
        "manifest.json": "4d950eaddebee31aa2f764c2d8c140c5c8a7c3cc93480d4f62170a9c14033dcd",
        "model-tp00-pp00.safetensors": "8ebec9afe006a76b40694926388efa2e26263128415cd83e1593e052a5bd4b94",
        "model-tp00-pp01.safetensors": "cc72cfb3e0c7f5412c52e17af5e4694ea12396891f84ee873be4e6c041933213",
        "model-tp01-pp00.safetensors": "0cf3e89d40db2e1e21e91ea919e58cfe1d751ce6376ff414dd6a503c21125eeb",
        "model-tp01-pp01.safetensors": "a34d25da9120d365f53beb4d6089e1a1c57a0a9af99a81ad799664cbd00d181e",
    },
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    cfg = llama_config(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                       num_kv_heads=2, vocab_size=50)
    return write_checkpoint(tmp_path_factory.mktemp("golden") / "src", cfg, num_files=2, seed=7)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir()) if not p.name.startswith(".")}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_build_bytes_are_golden(ckpt, tmp_path, name):
    tp, pp, dtype = PLANS[name]
    plan = plan_from_dict({
        "replica_group": {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                          "gpus_per_replica": tp * pp},
        "model": {"source": "synthetic"},
    })
    # the manifest records the plan's own words for the source, not the temporary path
    plan = dataclasses.replace(plan, source=str(ckpt), source_label="synthetic")
    got = _digests(build(plan, tmp_path / "o").out_dir)
    if os.environ.get("SHARDC_PRINT_GOLDEN"):
        print(name, json.dumps(got, indent=1, sort_keys=True))
    assert got == GOLDEN[name]
