"""Hostile names on every emitter of `shardc plan` (#41 item 1): a model directory's name reaches a
YAML comment, a pod spec, a shell line, a plan file, the table and the picture. Each output is parsed
back the way its reader would (``yaml.safe_load_all``: one document and the name exactly;
``shlex.split``: the exact argv; ``load_plan``; an XML parser) and compared; a name holding a control
character is refused with one line, exit 2, nothing written.

Real CLI processes (``cli_run.shardc``) on real directories of a real config.json (Llama-3.1-8B's
preset: tp=2 fits one H100 pair); the 2,000-character name, longer than a file name may be, goes
through the library with the emitters the CLI calls."""

from __future__ import annotations

import json
import os
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from cli_run import one_line, shardc

from shardc.commands.plan import write_plan
from shardc.commands.plan_emit import emit_config
from shardc.errors import PlanError
from shardc.layout.model import load_model
from shardc.layout.plan import load_plan, plan_from_dict
from shardc.planner.deploy import comment, init_command, pod_name, pod_spec, vllm_command
from shardc.planner.formulas import Workload
from shardc.planner.gpus import Cluster, get_gpu
from shardc.planner.search import search

PICK = ("--gpu", "h100-sxm", "--dtype", "bf16", "--tp", "2")
LABEL = "tp=2 pp=1 bf16"
URI = "s3://b/$(touch pwned) `id` 'q' \"d\" #x/m.json"  # a manifest URI a shell must not run
IMAGE = "registry.example.com/shardc-vllm:0.1"  # --emit k8s's image (it holds shardc and vLLM)
OUT_NAME = "$(id) 'p' #.yaml"
# Names a directory may have: YAML's document marker, a comment sign, a mapping, both quotes, a
# command substitution, backticks, a leading dash (an option to vLLM's argparse), XML's and
# mathtext's characters, non-ASCII, and 250 characters (near NAME_MAX, 255 bytes).
HOSTILE = [
    "m---apiVersion: v1",
    "--- # not a comment",
    "key: value #x",
    "it's \"quoted\"",
    "$(touch pwned)",
    "`id`",
    "-served",
    "a --> <b> & $\\frac{x}$",
    "modèle ✓",
    "n" * 250,
]
DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@pytest.fixture(scope="module")
def config() -> str:
    return json.dumps(load_model("llama-3.1-8b").config)


def model_dir(root: Path, name: str | bytes, config: str) -> Path:
    """A checkpoint directory named ``name`` (bytes: a name that is not UTF-8) holding config.json."""
    path = Path(os.fsdecode(os.path.join(os.fsencode(root), os.fsencode(name))))
    path.mkdir(parents=True)
    (path / "config.json").write_text(config)
    return path


def unfold(line: str) -> str:
    """A shell line as sh reads it: a backslash that ends a line continues it."""
    return line.replace("\\\n", "")


def served_name(args: list[str]) -> str:
    """The value of vLLM's --served-model-name, in either of its two spellings."""
    if "--served-model-name" in args:
        return args[args.index("--served-model-name") + 1]
    (joined,) = [a for a in args if a.startswith("--served-model-name=")]
    return joined.split("=", 1)[1]


def check_pod(stdout: str, name: str, source: Path, uri: str) -> dict:
    """The --emit k8s output parsed back: one comment line, one document, every string exact."""
    assert stdout.splitlines()[0] == f"# shardc plan: {name} as {LABEL} on 2 x h100-sxm"
    assert [x for x in stdout.splitlines() if x.startswith("#")] == [stdout.splitlines()[0]]
    docs = list(yaml.safe_load_all(stdout))
    assert len(docs) == 1 and docs[0]["kind"] == "Pod", docs
    pod = docs[0]
    pod_id = pod["metadata"]["name"]
    assert DNS_1123.fullmatch(pod_id) and len(pod_id) <= 63 and pod["metadata"]["labels"]["shardc/plan"] == pod_id
    (vllm,) = pod["spec"]["containers"]
    # vLLM serves the verified build (the load format), never the source path
    assert vllm["command"] == ["vllm", "serve"] and vllm["args"][:3] == [f"/models/{pod_id}", "--load-format", "shardc"]
    assert str(source) not in json.dumps(pod)
    assert served_name(vllm["args"]) == name
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][:2] == ["sh", "-c"] and len(init["command"]) == 3
    assert shlex.split(init["command"][2]) == [
        "shardc", "pull", "--manifest", uri, "--all", "--dest", f"/models/{pod_id}", "&&",
        "shardc", "verify", "--manifest", f"/models/{pod_id}/manifest.json", "--device", "cuda"]
    assert vllm["image"] == init["image"] == IMAGE
    return pod


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_directory_name_round_trips_through_every_emitter(tmp_path, config, name):
    src = model_dir(tmp_path, name, config).resolve()
    # --emit vllm: the shell line splits into the exact argv
    r = shardc("plan", "--model", src, *PICK, "--emit", "vllm")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(unfold(r.stdout))
    assert argv[:4] == ["vllm", "serve", str(src), "--tensor-parallel-size"]
    assert all(line.endswith(" \\") for line in r.stdout.splitlines()[:-1])
    # --emit k8s: one document, the name and path exact, the init line's argv exact; --check reads it back
    r = shardc("plan", "--model", src, *PICK, "--emit", "k8s", "--manifest-uri", URI, "--image", IMAGE)
    assert r.returncode == 0, r.stderr
    pod = check_pod(r.stdout, name, src, URI)
    if name == "-served":  # a value vLLM's argparse would take for an option is joined to its flag
        assert "--served-model-name=-served" in pod["spec"]["containers"][0]["args"]
    pod_file = tmp_path / "pod.yaml"
    pod_file.write_text(r.stdout)
    r = shardc("plan", "--model", src, *PICK, "--check", pod_file)
    assert r.returncode == 0 and "agrees with the plan" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("name", [HOSTILE[0], HOSTILE[3], HOSTILE[7]], ids=["dashes", "quotes", "markup"])
def test_the_plan_file_the_table_and_the_picture_keep_a_hostile_name(tmp_path, config, name):
    pytest.importorskip("matplotlib")
    src = model_dir(tmp_path, name, config).resolve()
    out, svg = tmp_path / "plans" / OUT_NAME, tmp_path / "p.svg"
    r = shardc("plan", "--model", src, *PICK, "--out", out, "--plot", svg)
    assert r.returncode == 0, r.stderr
    (model_line,) = [x for x in r.stdout.splitlines() if x.startswith("model   ")]
    assert model_line.startswith(f"model   {name}: 8.03 B parameters")
    # the plan: two comment lines, one document, its source the directory, a build's name
    text = out.read_text()
    assert text.splitlines()[:2] == [f"# shardc plan: {name} on 2 x h100-sxm, {LABEL}", text.splitlines()[1]]
    assert [x for x in text.splitlines() if x.startswith("#")] == text.splitlines()[:2]
    (doc,) = yaml.safe_load_all(text)
    assert (out.parent / doc["model"]["source"]).resolve() == src
    plan = load_plan(out)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*-tp2pp1-bf16", plan.name), plan.name
    # the shell line printed after it runs `shardc build` on exactly that file
    (wrote,) = [x for x in r.stdout.splitlines() if x.startswith("wrote ") and "build it with" in x]
    assert wrote.endswith(")") and shlex.split(wrote.split("build it with: ", 1)[1][:-1]) == ["shardc", "build",
                                                                                               str(out)]
    # the picture: well-formed XML whose title is the name as text
    titles = [e.text for e in ET.parse(svg).iter() if e.text and e.text.startswith(name + " on h100-sxm")]
    assert titles == [f"{name} on h100-sxm: isl 1,536, osl 1,024"]


def test_a_two_thousand_character_path(tmp_path, config):
    """A path of 2,000+ characters (eight directories of 249, the last the checkpoint) through --emit
    and --out, the name and the path exact."""
    parts = [f"{i}" + "-#'$`" * 49 + "xyz" for i in range(8)]
    assert all(len(p) == 249 for p in parts)
    src = model_dir(tmp_path, os.path.join(*parts), config).resolve()
    assert len(str(src)) > 2000
    r = shardc("plan", "--model", src, *PICK, "--emit", "k8s", "--manifest-uri", URI, "--image", IMAGE)
    assert r.returncode == 0, r.stderr
    check_pod(r.stdout, parts[-1], src, URI)
    r = shardc("plan", "--model", src, *PICK, "--emit", "vllm")
    assert shlex.split(unfold(r.stdout))[:3] == ["vllm", "serve", str(src)]


def _search(name: str, source: str = "/models/x"):
    return search(load_model("llama-3.1-8b"), Cluster(get_gpu("h100-sxm")), Workload(), tps=[2], dtypes=["bf16"],
                  model_name=name, source=source)


def test_a_two_thousand_character_name_through_the_library(tmp_path, capsys):
    """Longer than any file name: the emitters the CLI calls, each output parsed back."""
    name = ("--- #'\"$(id)`x` " * 125)[:2000]
    assert len(name) == 2000
    result = _search(name, "/m/" + name)
    rec = result.require_recommendation()
    emit_config(result, "k8s", URI, IMAGE)
    check_pod(capsys.readouterr().out, name, Path("/m/" + name), URI)
    assert shlex.split(unfold(vllm_command(result, rec)))[:3] == ["vllm", "serve", "/m/" + name]
    out = tmp_path / "plan.yaml"
    write_plan(result.plan_for(rec), out, result, rec)
    text = out.read_text()
    assert text.splitlines()[0] == f"# shardc plan: {name} on 2 x h100-sxm, {LABEL}"
    (doc,) = yaml.safe_load_all(text)
    assert doc["model"]["source"] == "/m/" + name and plan_from_dict(doc).name == load_plan(out).name
    assert 0 < len(pod_name(rec)) <= 63 and DNS_1123.fullmatch(pod_name(rec))


@pytest.mark.parametrize("bad", ["\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\u2028", "\u2029"])
def test_the_library_refuses_a_control_character_and_comments_cannot_break(bad):
    result = _search(f"m{bad}---")
    rec = result.require_recommendation()
    for make in (lambda: vllm_command(result, rec), lambda: pod_spec(result, rec, "true", IMAGE)):
        with pytest.raises(PlanError) as err:
            make()
        assert err.value.key == "model" and f"(U+{ord(bad):04X}) at character 2: " in err.value.message
    with pytest.raises(PlanError) as err:
        init_command(f"s3://b/m{bad}.json", "x")
    assert err.value.key == "manifest_uri"
    line = comment(f"a{bad}---{bad}kind: Pod")
    assert line.count("\n") == 1 and line.endswith("\n") and list(yaml.safe_load_all(line + "a: 1\n")) == [{"a": 1}]
    assert line == f"# a{repr(bad)[1:-1]}---{repr(bad)[1:-1]}kind: Pod\n"


def test_the_issue_s_pod_injection_is_one_line_and_nothing_is_printed(tmp_path, config):
    """#41's example, a directory named to append a second document (a Pod running any image)."""
    name = "m\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: evil}\nspec: {containers: [{name: x, image: evil}]}"
    model_dir(tmp_path, name, config)
    for extra in (("--emit", "k8s", "--image", IMAGE), ("--emit", "vllm"), ("--out", "p.yaml"), ()):
        r = shardc("plan", "--model", name, *PICK, *extra, cwd=tmp_path)
        assert one_line(r) == (
            "error: --model: the model path holds a control character (U+000A) at character 2: "
            "'m\\n---\\napiVersion: v1\\nkind'... (hint: rename it (or link it under a plain name): a name "
            "written into a pod spec, a shell line or a plan file may not hold control characters)")
        assert r.stdout == ""
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("bad", ["\r", "\t", "\x1b", "\x7f", "\x85", "\u2028", b"\xff"],
                         ids=["cr", "tab", "esc", "del", "nel", "line-sep", "not-utf8"])
def test_a_control_character_in_the_directory_name_is_refused(tmp_path, config, bad):
    raw = b"m" + (bad if isinstance(bad, bytes) else bad.encode()) + b"x"
    src = model_dir(tmp_path, raw, config)
    code = f"U+{ord(os.fsdecode(raw)[1]):04X}"
    kind = "a byte that is not UTF-8" if isinstance(bad, bytes) else (
        "a line separator" if bad == "\u2028" else "a control character")
    r = shardc("plan", "--model", src, *PICK, "--out", tmp_path / "p.yaml")
    line = one_line(r, f"error: --model: the model path holds {kind} ({code}) at character ")
    assert r.stdout == "" and not (tmp_path / "p.yaml").exists() and line.isprintable()
    # a plain name that links to it: the path as resolved is refused the same
    (tmp_path / "plain").symlink_to(src)
    r = shardc("plan", "--model", tmp_path / "plain", *PICK, "--emit", "k8s", "--image", IMAGE)
    one_line(r, f"error: --model: the model path holds {kind} ({code}) at character ")
    assert r.stdout == ""


def test_control_characters_in_the_other_strings_are_refused(tmp_path, config):
    src = model_dir(tmp_path, "plain", config)
    cases = [("--manifest-uri", ("--emit", "k8s", "--image", IMAGE, "--manifest-uri", "s3://b/m.json\nkind: Pod")),
             ("--out", ("--out", tmp_path / "p\n.yaml")), ("--plot", ("--plot", tmp_path / "p\r.svg")),
             ("--check", ("--check", tmp_path / "pod\x1b.yaml")), ("--draft-model", ("--draft-model", "x\ny"))]
    for flag, extra in cases:
        r = shardc("plan", "--model", src, *PICK, *extra)
        one_line(r, f"error: {flag}: the ")
        assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


@pytest.mark.parametrize("bad", ["t\n", "t\r", "t\tx", "-t", "t/x", "", "t" * 129])
def test_a_plan_name_is_a_plain_name(bad):
    """A plan's name names the build directory: `$` in a pattern matched before a final newline, so
    "t\\n" was a name; now each of these is one PlanError naming replica_group.name."""
    data = {"replica_group": {"name": bad, "tp_degree": 1, "pp_degree": 1, "dtype": "bf16", "gpus_per_replica": 1},
            "model": {"source": "synthetic"}}
    with pytest.raises(PlanError) as err:
        plan_from_dict(data)
    assert err.value.key == "replica_group.name" and err.value.message.startswith("must be 1-128 characters")


def test_check_reads_words_whole_and_a_shell_line_as_sh_would(tmp_path, config):
    """--check, the reader of what --emit writes: a container's words are its argv (a served name
    holding spaces, quotes or a flag is one word), a `sh -c` line is split as sh splits it, and what
    sh could not read, or a GPU count that is no number, is one line naming --check."""
    src = model_dir(tmp_path, "plain", config).resolve()
    line = shardc("plan", "--model", src, *PICK, "--emit", "vllm").stdout.strip()
    pod = {"kind": "Pod", "spec": {"containers": [
        {"name": "v", "command": ["/bin/sh", "-c", line + " --served-model-name 'x --tensor-parallel-size 8'"],
         "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}
    cases = {"shell.yaml": (pod, 0, "agrees with the plan"),
             "argv.yaml": ({"spec": {"containers": [{"command": ["vllm", "serve"], "args": [
                 *shlex.split(line)[2:], "--served-model-name", "y --tensor-parallel-size 8 'q"]}]}}, 0,
                 "agrees with the plan"),
             "wide.yaml": ({"spec": {"containers": [{"command": ["bash", "-lc", line.replace("size 2", "size 8")]}]}},
                           1, "--tensor-parallel-size: the deployment has 8, the plan 2")}
    for file, (doc, code, needle) in cases.items():
        (tmp_path / file).write_text(yaml.safe_dump(doc))
        r = shardc("plan", "--model", src, *PICK, "--check", tmp_path / file)
        assert r.returncode == code and needle in r.stdout, (file, r.stdout, r.stderr)
    bad = {"quote.yaml": ({"spec": {"containers": [{"command": ["sh", "-c", "vllm serve 'x"]}]}},
                          "error: --check: cannot read the shell line \"vllm serve 'x\": No closing quotation"),
           "count.yaml": ({"spec": {"containers": [{"command": ["vllm", "serve"],
                                                    "resources": {"limits": {"nvidia.com/gpu": "lots"}}}]}},
                          "error: --check: nvidia.com/gpu must be a number, found 'lots' (hint: give GPU counts, lengths "
                          "and the utilization as numbers)"),
           "line.yaml": ("vllm serve --tensor-parallel-size 2 '", "error: --check: cannot read the shell line")}
    for file, (doc, needle) in bad.items():
        (tmp_path / file).write_text(yaml.safe_dump(doc))
        r = shardc("plan", "--model", src, *PICK, "--check", tmp_path / file)
        assert one_line(r, needle).startswith(needle) and r.stdout == ""
