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
from plan_helpers import plan as make_plan

from shardc.compiler.compile import build
from shardc.compiler.synthetic import llama_config, write_checkpoint

PLANS = {  # name: (tp, pp, dtype)
    "g-tp2pp2-bf16": (2, 2, "bf16"),
    "g-tp2pp1-int8": (2, 1, "int8"),
    "g-tp1pp2-fp8": (1, 2, "fp8"),
}

GOLDEN: dict[str, dict[str, str]] = {
    "g-tp1pp2-fp8": {
        "config.json": "573f3917d24434a3c5a6a897495adc9009a5c4ff9e605c01a965d55fb0a8ffc6",
        "manifest.json": "d6f75963727c93e9f8385e3db42fca3306762bd450c3609fd0e89187e8f4b1c1",
        "model-tp00-pp00.safetensors": "72f57a4c1fcd5f4b4f269cf86e883ba21535fd7bc3f4a7260a69ed500841b2cd",
        "model-tp00-pp01.safetensors": "5fd71cf3d45981499fde8434385ce8dd776b42533a30808d92bde5dd5a5718a1",
        "model.safetensors.index.json": "e580c943263d6ebadcd5beb66ff7f99b43e6057c7aa012bb8bfad77a40c3e851",
    },
    "g-tp2pp1-int8": {
        "config.json": "fb51ef8ec178f1a218195ac6dabb4ab51ad67cd0ea552590cd8797dd8cd75ee0",
        "manifest.json": "14e597270358ffe2e3f3da2108ee6d123e4f891362fc2d46fc3e42e0d0e93461",
        "model-tp00-pp00.safetensors": "0d931345df88593b8cfafacaa72b10187d2cab0c6dbd2d041b619a89fb189f86",
        "model-tp01-pp00.safetensors": "8c93bd284ae577d77ad3d26428024c696f9d1e425486d471ba733fcf23deb071",
    },
    "g-tp2pp2-bf16": {
        "config.json": "2e09e4292776916c310687e90822c44700f192ba7187bb28cc781b8a7ccd5b24",
        "manifest.json": "18295d7d4cd97b0b1f1339d1db85bbcfcc60cde788ad1fb5a1b3eb6663b97ec7",
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
    plan = make_plan(tp, pp, dtype, name=name)
    # the manifest records the plan's own words for the source, not the temporary path
    plan = dataclasses.replace(plan, source=str(ckpt), source_label="synthetic")
    got = _digests(build(plan, tmp_path / "o").out_dir)
    if os.environ.get("SHARDC_PRINT_GOLDEN"):
        print(name, json.dumps(got, indent=1, sort_keys=True))
    assert got == GOLDEN[name]
