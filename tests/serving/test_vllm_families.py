"""Every family shardc supports, loaded by vLLM with ``--load-format shardc``, holds exactly the
bytes vLLM's own default loader puts there from the source checkpoint: every parameter of every
worker, compared bit for bit, at tp=1, tp=2, pp=2 and tp=2 with expert parallelism. vLLM's CPU
model runner cannot run pp or expert parallelism on this version, so these run vLLM's workers
without its engine (vllm_workers.py: vLLM's own parallel state, model classes and loaders, gloo on
CPU). Same parameters in the same model class means the same tokens from the same engine;
test_vllm_engine.py shows that on the engine itself.

And the mapping's facts checked against vLLM's own functions: its pipeline layer partition
(``get_pp_indices``) and its expert placement (``determine_expert_map``) against shardc's Layout,
over a grid of layer and expert counts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from moe_plans import moe_plan
from plan_helpers import plan as make_plan
from vllm_models import FAMILIES, save
from vllm_run import run_workers

pytest.importorskip("transformers")
pytestmark = pytest.mark.heavy

from shardc.compiler.compile import build  # noqa: E402

# gpt-oss stores its experts stacked, transposed and with gate and up interleaved; vLLM's model
# reorders them in its own load_weights, which the load format does not imitate: refused
REFUSED = {"gpt_oss": "shardc load format: architectures: the build gpt_oss-tp{tp} holds GptOssForCausalLM's "
                      "experts stacked"}

# vLLM CPU 0.32 builds no sparse attention (platforms/cpu.py): DSA's models stop at construction,
# before any loader runs, from the source with vLLM's own loader as well
NO_CPU = {name: "Sparse Attention is not supported on CPU." for name in ("deepseek_v32", "glm_moe_dsa")}
# vLLM 0.32's Qwen3.5 model module imports its vision model, which imports torchvision; this venv has
# none (the registry's is a CUDA build that breaks vLLM's import: Makefile vllm-venv), so vLLM cannot
# even inspect the architecture here ("No module named 'torchvision'"): not loaded
NO_IMPORT = {"qwen3_5", "qwen3_5_moe"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-families")
    return {name: save(root / "src", name) for name in FAMILIES}


def _builds(sources: dict[str, Path], root: Path, tp: int) -> list[dict]:
    return [{"name": name, "source": str(src),
             "build": str(build(make_plan(tp, name=f"{name}-tp{tp}", source=src), root / f"{name}-tp{tp}").out_dir)}
            for name, src in sources.items() if name not in NO_IMPORT]


def _check(results: list[list[dict]], tp: int, names: set[str] | None = None) -> None:
    seen = {}
    for rank, cases in enumerate(results):
        for case in cases:
            name = case["name"]
            if name in REFUSED:
                assert case.get("error", "").startswith(REFUSED[name].format(tp=tp)), case
                continue
            if name in NO_CPU:
                assert case.get("error") == NO_CPU[name], case
                continue
            assert "error" not in case, f"rank {rank} {name}: {case.get('traceback')}"
            assert case["differ"] == [], f"rank {rank} {name}: these parameters differ from vLLM's own load"
            assert case["parameters"] > 0
            seen[name] = case["parameters"]
    assert set(seen) == (set(FAMILIES) if names is None else names) - set(REFUSED) - set(NO_CPU) - NO_IMPORT


@pytest.mark.parametrize("tp", [1, 2])
def test_every_family_loads_the_bytes_vllms_own_loader_loads(vllm_python, sources, tmp_path, tp):
    _check(run_workers(vllm_python, tmp_path, _builds(sources, tmp_path, tp), tp), tp)


def test_pipeline_stages_and_expert_parallel_ranks_load_as_vllm_places_them(vllm_python, sources, tmp_path):
    llama = sources["llama"]
    staged = build(make_plan(1, 2, name="llama-pp2", source=llama), tmp_path / "pp2").out_dir
    results = run_workers(vllm_python, tmp_path, [{"name": "llama", "build": str(staged), "source": str(llama)}],
                          tp=1, pp=2)
    assert len(results) == 2
    _check(results, 1, {"llama"})
    mixtral = sources["mixtral"]
    ep = build(moe_plan(mixtral, 2, ep=True), tmp_path / "ep").out_dir
    ep_tmp = tmp_path / "ep-run"
    ep_tmp.mkdir()
    results = run_workers(vllm_python, ep_tmp, [{"name": "mixtral", "build": str(ep), "source": str(mixtral)}],
                          tp=2, expert_parallel=True)
    _check(results, 2, {"mixtral"})


VLLM_FACTS = r"""
import json, os, sys
from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
import vllm.envs as envs
from vllm.distributed.utils import get_pp_indices
grid = json.loads(sys.argv[1])
out = {"stages": {}, "experts": {}}
for layers, pp, partition in grid["stages"]:
    if partition:
        os.environ["VLLM_PP_LAYER_PARTITION"] = partition
    else:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    envs.disable_envs_cache() if hasattr(envs, "disable_envs_cache") else None
    out["stages"][f"{layers},{pp},{partition}"] = [list(get_pp_indices(layers, r, pp)) for r in range(pp)]
for experts, ep in grid["experts"]:
    ranks = []
    for r in range(ep):
        _, emap, _ = determine_expert_map(ep, r, experts, "linear")
        ranks.append([g for g, i in enumerate(emap.tolist()) if i >= 0])
    out["experts"][f"{experts},{ep}"] = ranks
print(json.dumps(out))
"""


def test_stages_and_expert_placement_against_vllms_own_functions(vllm_python, tmp_path):
    """shardc's even split gives the remainder to the first stages, vLLM's to the middle ones: where
    they differ the load format refuses, and its hint (VLLM_PP_LAYER_PARTITION) makes vLLM's own
    function give the build's stages. shardc's expert-parallel placement is vLLM's linear one."""
    from shardc.errors import ServeError
    from shardc.layout.model import model_from_config
    from shardc.layout.ranks import build_layout
    from shardc.serving.fill import Engine, check_engine

    cases = [(layers, pp) for layers in (2, 3, 5, 7, 9, 10, 61) for pp in (2, 3, 4) if pp <= layers]
    stage_grid = [(layers, pp, None) for layers, pp in cases]
    shardc_stages = {}
    for layers, pp in cases:
        cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
        layout = build_layout(model_from_config(cfg), make_plan(1, pp, name="g"))
        shardc_stages[(layers, pp)] = [list(s) for s in layout.stages]
        stage_grid.append((layers, pp, ",".join(str(b - a) for a, b in layout.stages)))
    expert_grid = [(e, ep) for e in (4, 6, 8, 60, 64) for ep in (2, 4, 8) if ep <= e]
    run = subprocess.run([str(vllm_python), "-c", VLLM_FACTS, json.dumps({"stages": stage_grid,
                                                                          "experts": expert_grid})],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    differ = 0
    for (layers, pp), ours in shardc_stages.items():
        theirs = facts["stages"][f"{layers},{pp},None"]
        engine = Engine(tp=1, pp=pp, dp=1, expert_parallel=False, stages=tuple(map(tuple, theirs)))
        if theirs == ours:
            check_engine("g", 1, pp, 1, False, tuple(map(tuple, ours)), engine)
        else:
            differ += 1
            with pytest.raises(ServeError) as err:
                check_engine("g", 1, pp, 1, False, tuple(map(tuple, ours)), engine)
            assert "VLLM_PP_LAYER_PARTITION=" in err.value.one_line()
            hinted = facts["stages"][f"{layers},{pp},{','.join(str(b - a) for a, b in ours)}"]
            assert hinted == ours, (layers, pp)
    assert differ > 0  # the grid reaches the cases where the two splits part (7 layers over 3: 3,2,2 / 2,3,2)
    mixtral = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 256,
               "num_local_experts": 0, "num_experts_per_tok": 2}
    from shardc.layout.plan import plan_from_dict

    for experts, ep in expert_grid:
        spec = model_from_config({**mixtral, "num_local_experts": experts})
        plan = plan_from_dict({"replica_group": {"name": "e", "tp_degree": ep, "pp_degree": 1, "dtype": "bf16",
                                                 "gpus_per_replica": ep, "expert_parallel": True},
                               "model": {"source": "synthetic"}})
        layout = build_layout(spec, plan)
        ours = [list(layout.rank(r, 0).experts) for r in range(ep)]
        assert ours == facts["experts"][f"{experts},{ep}"], (experts, ep)
