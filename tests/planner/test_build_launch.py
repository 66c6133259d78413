"""A build's own launch (#42 item 6): `shardc plan --model BUILD_DIR --emit vllm|k8s` and `--check`.

Real builds made by shardc's own compiler (the loader tests' tp=2 build, an int8 tp=2 build over an
fp16 base, a pp=2 build whose stages are not vLLM's default split, an expert-parallel dp=2 Mixtral),
real CLI processes (``cli_run.shardc``), every output parsed back the way its reader would
(``shlex.split`` for the shell line, ``yaml.safe_load`` for the pod). vLLM is not started here: the
lead's serving test starts it with the printed line.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from cli_run import one_line, shardc
from plan_helpers import plan
from tiny_builds import tiny_build

from shardc.planner.launch import BuildLaunch, build_vllm_command, check_build, vllm_default_stages

IMAGE = "registry.example.com/shardc-vllm:0.1"
URI = "s3://models/tiny/manifest.json"
PLAN_URI = "s3://models/from-plan/manifest.json"


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """name -> build directory: tp2 (bf16), int8 (tp2 over an fp16 base), pp2 (stages 1 + 2 layers,
    the plan naming a manifest_uri), rel (tp1, the plan's manifest_uri a relative path), ep (Mixtral,
    4 experts over dp=2 with expert parallelism); checkpoint: the source of int8, pp2 and rel."""
    from shardc.compiler.compile import build
    from shardc.compiler.synthetic import llama_config, write_checkpoint
    from shardc.layout.plan import plan_from_dict

    root = tmp_path_factory.mktemp("launch")
    out = {"tp2": tiny_build(root / "tiny", "tiny-tp2")}
    src = write_checkpoint(root / "src", llama_config(num_layers=3, hidden_size=64, intermediate_size=96))
    int8 = plan(2, dtype="int8", name="tiny-int8", source=src, quantization={"base_dtype": "fp16"})
    out["int8"] = build(int8, out_dir=root / "int8").out_dir
    pp2 = plan(1, 2, name="tiny-pp2", source=src, model={"pp_layers": [1, 2]},
               group={"checkpoint": {"manifest_uri": PLAN_URI}})
    out["pp2"] = build(pp2, out_dir=root / "pp2").out_dir
    rel = plan(1, name="tiny-rel", source=src, group={"checkpoint": {"manifest_uri": "store/tiny-rel/manifest.json"}})
    out["rel"] = build(rel, out_dir=root / "rel").out_dir
    cfg = {**llama_config(num_layers=2, hidden_size=64, intermediate_size=64),
           "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2}
    moe = write_checkpoint(root / "moe", cfg)
    ep = plan_from_dict({"replica_group": {"name": "moe-ep2", "tp_degree": 1, "pp_degree": 1, "dp_degree": 2,
                                           "expert_parallel": True, "dtype": "bf16", "gpus_per_replica": 2},
                         "model": {"source": str(moe)}})
    out["ep"] = build(ep, out_dir=root / "ep").out_dir
    out["checkpoint"] = src
    return out


def _argv(line: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(environment words, `vllm serve` and its model, the options) of a printed line."""
    words = shlex.split(line)
    i = words.index("vllm")
    env = dict(w.split("=", 1) for w in words[:i])
    return env, words[i:i + 3], words[i + 3:]


def _options(words: list[str]) -> dict[str, str | None]:
    """`--name value` pairs and `--switch`es, in order."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        assert words[i].startswith("--"), words
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[words[i][2:]] = words[i + 1]
            i += 2
        else:
            out[words[i][2:]] = None
            i += 1
    return out


def _emit(build: Path, *args: str) -> str:
    r = shardc("plan", "--model", build, "--emit", "vllm", *args)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.count("\n") == 1
    return r.stdout.strip()


def test_vllm_line_of_a_tp2_build(builds):
    line = _emit(builds["tp2"])
    env, head, opts = _argv(line)
    assert env == {}
    assert head == ["vllm", "serve", str(builds["tp2"].resolve())]
    assert opts == ["--load-format", "shardc", "--tensor-parallel-size", "2", "--dtype", "bfloat16",
                    "--max-model-len", "2048"]  # llama_config's max_position_embeddings
    # the lead's server test swaps the entry point: `vllm serve M` is one piece of the line
    model = shlex.quote(str(builds["tp2"].resolve()))
    assert line.count(f"vllm serve {model}") == 1
    swapped = line.replace(f"vllm serve {model}", f"python -m vllm.entrypoints.openai.api_server --model {model}")
    assert shlex.split(swapped)[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                                        str(builds["tp2"].resolve())]


def test_vllm_line_of_a_relative_path_is_absolute(builds):
    """The line runs from any directory: the build is named by its absolute path."""
    r = shardc("plan", "--model", builds["tp2"].name, "--emit", "vllm", cwd=builds["tp2"].parent)
    assert r.returncode == 0, r.stderr
    assert _argv(r.stdout)[1][2] == str(builds["tp2"].resolve())


def test_quantized_build_adds_no_quantization_flag(builds):
    """int8 over an fp16 base: the build's config.json carries its quantization_config, which vLLM
    reads; the line adds no --quantization to contradict it, and --dtype is the base's."""
    config = json.loads((builds["int8"] / "config.json").read_text())
    assert "quantization_config" in config
    opts = _options(_argv(_emit(builds["int8"]))[2])
    assert "quantization" not in opts
    assert opts == {"load-format": "shardc", "tensor-parallel-size": "2", "dtype": "float16", "max-model-len": "2048"}


def test_pipeline_build_passes_its_stages(builds):
    """pp=2 with stages of 1 and 2 layers: vLLM's own split of 3 layers is 2 + 1, so the line sets
    VLLM_PP_LAYER_PARTITION to the build's."""
    env, _, words = _argv(_emit(builds["pp2"]))
    assert env == {"VLLM_PP_LAYER_PARTITION": "1,2"}
    assert _options(words) == {"load-format": "shardc", "tensor-parallel-size": "1", "pipeline-parallel-size": "2",
                               "dtype": "bfloat16", "max-model-len": "2048"}


def test_expert_parallel_build(builds):
    opts = _options(_argv(_emit(builds["ep"]))[2])
    assert opts == {"load-format": "shardc", "tensor-parallel-size": "1", "data-parallel-size": "2",
                    "enable-expert-parallel": None, "dtype": "bfloat16", "max-model-len": "2048"}


def test_max_model_len_shorter_than_the_models(builds):
    assert _options(_argv(_emit(builds["tp2"], "--max-model-len", "512"))[2])["max-model-len"] == "512"


def test_vllm_default_stages_as_vllm_splits():
    """vllm/distributed/utils.py get_pp_indices: the remainder goes one each to the stages before
    the last, from the back (worked by hand)."""
    assert vllm_default_stages(6, 4) == (1, 2, 2, 1)
    assert vllm_default_stages(30, 4) == (7, 8, 8, 7)
    assert vllm_default_stages(3, 2) == (2, 1)
    assert vllm_default_stages(30, 2) == (15, 15)


def _pod(build: Path, *args: str) -> dict:
    r = shardc("plan", "--model", build, "--emit", "k8s", "--image", IMAGE, *args)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    assert len(docs) == 1 and r.stdout.startswith("# shardc plan: the build ")
    return docs[0]


def test_pod_serves_the_verified_directory(builds):
    pod = _pod(builds["tp2"], "--manifest-uri", URI)
    spec = pod["spec"]
    assert pod["metadata"]["name"] == "tiny-tp2"
    [init] = spec["initContainers"]
    [main] = spec["containers"]
    assert init["image"] == main["image"] == IMAGE
    assert init["command"][:2] == ["sh", "-c"]
    pull, verify = (shlex.split(part) for part in init["command"][2].split(" && "))
    assert pull == ["shardc", "pull", "--manifest", URI, "--all", "--dest", "/models/tiny-tp2"]
    assert verify == ["shardc", "verify", "--manifest", "/models/tiny-tp2/manifest.json", "--device", "cuda"]
    assert init["resources"]["limits"]["nvidia.com/gpu"] == 2
    # vLLM serves the directory the init container verified, from the shared emptyDir: no second download
    assert main["command"] == ["vllm", "serve"]
    assert main["args"] == ["/models/tiny-tp2", "--load-format", "shardc", "--tensor-parallel-size", "2",
                            "--dtype", "bfloat16", "--max-model-len", "2048", "--served-model-name", "tiny-tp2"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}  # 2 GiB per GPU
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "models": "/models"} and init["volumeMounts"] == [
        {"name": "models", "mountPath": "/models"}]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == main["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert main["resources"]["limits"]["memory"] == "17Gi"  # the shards (KiB) + 16 GiB
    assert {"name": "SHARDC_MODEL_DIR", "value": "/models/tiny-tp2"} in main["env"]


def test_pod_manifest_uri_from_the_plan_and_stages_in_env(builds):
    pod = _pod(builds["pp2"])
    init, main = pod["spec"]["initContainers"][0], pod["spec"]["containers"][0]
    assert shlex.split(init["command"][2].split(" && ")[0])[3] == PLAN_URI
    assert {"name": "VLLM_PP_LAYER_PARTITION", "value": "1,2"} in main["env"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 2
    # --manifest-uri, given, wins over the plan's
    pod = _pod(builds["pp2"], "--manifest-uri", URI)
    assert shlex.split(pod["spec"]["initContainers"][0]["command"][2].split(" && ")[0])[3] == URI


def test_hostile_directory_name_parses_back(builds, tmp_path):
    """A build directory's name reaches the shell line: quoted, it parses back to the exact path."""
    hostile = tmp_path / "b $(touch pwned) `id` 'q' \"d\" #x"
    shutil.copytree(builds["tp2"], hostile)
    _, head, _ = _argv(_emit(hostile))
    assert head[2] == str(hostile.resolve())


# --- --check --------------------------------------------------------------------------------------

def test_check_agrees_with_the_emitted_pod_and_line(builds, tmp_path):
    for name, extra in (("tp2", ("--manifest-uri", URI)), ("pp2", ()), ("ep", ("--manifest-uri", URI))):
        pod = tmp_path / f"{name}.yaml"
        pod.write_text(yaml.safe_dump(_pod(builds[name], *extra)))
        r = shardc("plan", "--model", builds[name], "--check", pod)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith(f"{pod}: agrees with the build (")
        line = tmp_path / f"{name}-line.yaml"
        line.write_text(yaml.safe_dump(_emit(builds[name])))
        r = shardc("plan", "--model", builds[name], "--check", line)
        assert r.returncode == 0 and "agrees with the build" in r.stdout, r.stdout + r.stderr
    assert "(tp=1 pp=1 dp=2 expert_parallel bf16 on 2 GPUs)" in r.stdout


def test_check_names_each_disagreement(builds, tmp_path):
    pod = _pod(builds["tp2"], "--manifest-uri", URI)
    main = pod["spec"]["containers"][0]
    main["args"] = ["/models/tiny-tp2", "--tensor-parallel-size", "4", "--quantization", "fp8",
                    "--dtype", "half", "--max-model-len", "4096"]
    main["resources"]["limits"]["nvidia.com/gpu"] = 4
    pod["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "1Gi"
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    r = shardc("plan", "--model", builds["tp2"], "--check", path)
    assert r.returncode == 1, r.stderr
    assert r.stdout.splitlines() == [
        f"{path}: --load-format: the deployment has auto, the build shardc",
        f"{path}: --tensor-parallel-size: the deployment has 4, the build 2",
        f"{path}: --quantization: the deployment has fp8, the build none",
        f"{path}: --dtype: the deployment has half, the build's tensors are bfloat16",
        f"{path}: --max-model-len: the deployment asks 4096, the model's bound is 2048",
        f"{path}: nvidia.com/gpu: the deployment requests 4, the build needs 2 (tp 2 x pp 1 x dp 1)",
        f"{path}: /dev/shm: the deployment gives 1Gi, the build's launch sizes 4Gi (2 GiB per GPU)",
    ]


def test_check_pipeline_partition(builds, tmp_path):
    """The pp2 build's stages (1, 2) are not vLLM's default split (2, 1): a line without
    VLLM_PP_LAYER_PARTITION disagrees. Stages that are vLLM's split need no variable."""
    env, head, words = _argv(_emit(builds["pp2"]))
    path = tmp_path / "line.yaml"
    path.write_text(yaml.safe_dump(shlex.join(head + words)))
    r = shardc("plan", "--model", builds["pp2"], "--check", path)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"{path}: VLLM_PP_LAYER_PARTITION: the deployment has none (vLLM splits the "
                                     "layers its own way), the build's stages hold 1,2 layers"]
    even = BuildLaunch(directory="/b", name="b", tp=1, pp=2, dp=1, expert_parallel=False, stages=(2, 1),
                       dtype="bf16", base_dtype="BF16", max_model_len=None, shard_bytes=1)
    line = build_vllm_command(even)
    assert line.startswith("VLLM_PP_LAYER_PARTITION=2,1 vllm serve /b ")
    assert check_build(even, line) == [] and check_build(even, line.split(" ", 1)[1]) == []
    assert check_build(even, "VLLM_PP_LAYER_PARTITION=1,2 " + line.split(" ", 1)[1]) == [
        "VLLM_PP_LAYER_PARTITION: the deployment has 1,2, the build's stages hold 2,1 layers"]


# --- bad input: one line, exit 2, nothing on stdout -----------------------------------------------

def _refused(r, needle: str) -> str:
    line = one_line(r, needle)
    assert r.stdout == ""
    return line


def test_a_directory_without_manifest_is_a_checkpoint(builds):
    src = builds["checkpoint"]
    assert _refused(shardc("plan", "--model", src, "--emit", "vllm"), "") == (
        f"error: --model: {src} holds no manifest.json, so it is not a shardc build, and sizing it as a checkpoint "
        "needs --gpu (hint: give --gpu PRESET (a100-80gb, h100-sxm, h200, ...), or --model a build's directory "
        "(shardc build's --out, holding manifest.json) to print its launch)")
    # with --gpu it is planned as a checkpoint, as before: the source served, no shardc loader
    r = shardc("plan", "--model", src, "--gpu", "h100-sxm", "--emit", "vllm")
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    assert words[:3] == ["vllm", "serve", str(src.resolve())] and "--load-format" not in words
    assert _refused(shardc("plan", "--model", "llama-3.1-8b", "--emit", "vllm"), "") == (
        "error: --gpu: is required to size a deployment (hint: give --gpu PRESET (a100-80gb, h100-sxm, h200, ...), "
        "or --model a build's directory (shardc build's --out, holding manifest.json) to print its launch)")


def _edited(build: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(build, out)
    data = json.loads((out / "manifest.json").read_text())
    edit(data)
    (out / "manifest.json").write_text(json.dumps(data))
    return out


def test_a_manifest_that_does_not_parse(builds, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(builds["tp2"], bad)
    (bad / "manifest.json").write_text("{")
    assert _refused(shardc("plan", "--model", bad, "--emit", "vllm"), "") == (
        f"error: --model: {bad}/manifest.json is not JSON (hint: pass the manifest.json that shardc build wrote)")


def test_a_manifest_failing_shardcs_checks(builds, tmp_path):
    def tp3(m):
        m["plan"]["replica_group"]["tp_degree"] = 3

    out = _edited(builds["tp2"], tmp_path, tp3)
    _refused(shardc("plan", "--model", out, "--emit", "vllm"),
             f"error: shards: {out}/manifest.json: lists 2 shard(s); its plan (tp_degree=3, pp_degree=1) has 3")


def test_a_manifest_whose_model_does_not_lay_out(builds, tmp_path):
    def heads(m):
        m["model"]["config"]["num_attention_heads"] = 5

    out = _edited(builds["tp2"], tmp_path, heads)
    assert _refused(shardc("plan", "--model", out, "--emit", "k8s", "--image", IMAGE), "") == (
        f"error: model.config.num_key_value_heads: {out}/manifest.json: its plan and model config do not lay out: "
        "num_attention_heads=5 is not a multiple of num_key_value_heads=2 (hint: the manifest is damaged; rebuild, "
        "or pass the manifest.json that shardc build wrote)")


def test_an_interrupted_rebuild(tmp_path):
    d = tmp_path / "switching"
    d.mkdir()
    (d / ".shardc-switch.json").write_text("{}")
    _refused(shardc("plan", "--model", d, "--emit", "vllm"),
             "has no manifest.json: a rebuild was interrupted while switching its files in")


@pytest.mark.parametrize("args, flag", [
    (("--gpu", "h100-sxm"), "--gpu"), (("--gpus", "4"), "--gpus"), (("--tp", "2"), "--tp"),
    (("--dtype", "int8"), "--dtype"), (("--objective", "fit"), "--objective"), (("--explain",), "--explain"),
])
def test_search_flags_do_not_apply_to_a_build(builds, args, flag):
    line = _refused(shardc("plan", "--model", builds["tp2"], "--emit", "vllm", *args), f"error: {flag}: ")
    assert line == (f"error: {flag}: does not apply to a build's launch: {builds['tp2']} is a shardc build, whose "
                    f"plan fixed its GPUs, degrees and dtype (hint: drop {flag} (a build's launch takes --emit, "
                    "--check, --manifest-uri, --image, --max-model-len); to size a new deployment, plan the model's "
                    "checkpoint or config.json with --gpu)")


def test_out_does_not_apply_and_writes_nothing(builds, tmp_path):
    out = tmp_path / "p.yaml"
    _refused(shardc("plan", "--model", builds["tp2"], "--emit", "vllm", "--out", out), "error: --out: does not apply")
    assert not out.exists()


def test_a_build_without_emit(builds):
    _refused(shardc("plan", "--model", builds["tp2"]),
             f"error: --model: {builds['tp2']} is a shardc build (it holds manifest.json): plan prints its launch, "
             "it does not search (hint: add --emit vllm, --emit k8s --image IMAGE or --check FILE")


def test_pod_needs_an_image_and_a_manifest_uri(builds):
    assert _refused(shardc("plan", "--model", builds["tp2"], "--emit", "k8s", "--manifest-uri", URI), "") == (
        "error: --image: a build's pod needs the image its two containers run, which must hold both shardc "
        "(`shardc pull`, `shardc verify`) and vLLM with shardc installed (`--load-format shardc`) (hint: build one "
        "(pip install shardc vllm) and give --image REGISTRY/NAME:TAG; no public image holds both)")
    assert _refused(shardc("plan", "--model", builds["tp2"], "--emit", "k8s", "--image", IMAGE), "") == (
        "error: --manifest-uri: the pod pulls the build from its store, and neither --manifest-uri nor the build's "
        "plan (replica_group.checkpoint.manifest_uri) says where it is (hint: give --manifest-uri "
        "s3://BUCKET/PREFIX/manifest.json, where shardc push put it)")
    _refused(shardc("plan", "--model", builds["tp2"], "--emit", "vllm", "--image", IMAGE),
             "error: --image: applies to --emit k8s only (the pod's image) (hint: drop --image)")


@pytest.mark.parametrize("flag", ["--image", "--manifest-uri"])
def test_control_characters_refused(builds, flag):
    args = {"--image": IMAGE, "--manifest-uri": URI}
    args[flag] += "\n---\nkind: Pod"
    _refused(shardc("plan", "--model", builds["tp2"], "--emit", "k8s", *[w for kv in args.items() for w in kv]),
             f"error: {flag}: ")


def test_max_model_len_beyond_the_models(builds):
    _refused(shardc("plan", "--model", builds["tp2"], "--emit", "vllm", "--max-model-len", "4096"),
             "error: --max-model-len: 4,096 exceeds the model's max_position_embeddings 2,048 "
             "(hint: use --max-model-len <= 2048, or drop it (the model's))")


def test_a_relative_manifest_uri_names_nothing_in_the_pod(builds):
    """The demo plan's manifest_uri is a local store relative to the working directory: a pod has no
    such directory, so its URI (from the plan or typed) is refused, naming the flag that fixes it."""
    assert _refused(shardc("plan", "--model", builds["tp2"], "--emit", "k8s", "--image", IMAGE, "--manifest-uri",
                           ".cache/store/x/manifest.json"), "") == (
        "error: --manifest-uri: --manifest-uri gives '.cache/store/x/manifest.json', a relative path, which names "
        "nothing inside the pod (hint: give --manifest-uri s3://BUCKET/PREFIX/manifest.json (where shardc push put "
        "it), or an absolute path mounted in the pod)")
    _refused(shardc("plan", "--model", builds["rel"], "--emit", "k8s", "--image", IMAGE),
             "error: --manifest-uri: the build's plan (replica_group.checkpoint.manifest_uri) gives "
             "'store/tiny-rel/manifest.json', a relative path")
    # the vLLM line serves the directory itself: the URI plays no part in it
    assert _argv(_emit(builds["rel"]))[1][2] == str(builds["rel"].resolve())
