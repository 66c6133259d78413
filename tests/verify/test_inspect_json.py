"""#43: `shardc inspect --json` of a build carries the build as data, not only the human lines: the
plan, its degrees and dtypes, every shard (rank, file, size, digest, experts) and what the directory
loads as, each equal to the manifest's record."""

from __future__ import annotations

import json

from cli_run import shardc_in
from tiny_builds import tiny_build

from shardc.formats.manifest import load


def test_inspect_json_is_the_build_as_data(tmp_path):
    build = tiny_build(tmp_path, "inspect-json")
    r = shardc_in("inspect", build, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    m = load(build / "manifest.json")
    plan = data["plan"]
    assert (plan["name"], plan["sha256"], plan["tp"], plan["pp"], plan["dp"], plan["dtype"]) == (
        m.name, m.plan_sha256, 2, 1, 1, "bf16")
    assert plan["architecture"] == "LlamaForCausalLM" and plan["stages"] == [list(x) for x in m.layout.stages]
    assert [(s["file"], s["rank"], s["size"], s["sha256"], s["experts"]) for s in data["shards"]] == [
        (s.file, s.rank, s.size, s.sha256, list(s.experts)) for s in m.shards]
    assert data["loads_as"] == {"hf_checkpoint": False, "vllm_load_format": "shardc", "vllm_why_not": None,
                                "hf_checkpoint_why_not": "it is split tp=2: each rank holds a slice of the same "
                                                         "tensor names"}
    assert data["lines"][0].startswith(f"plan       {m.name}")  # the human summary is still there
