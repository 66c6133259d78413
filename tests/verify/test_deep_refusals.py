"""``verify --deep REF`` where REF is not this build's source (#41 item 7), through the real CLI.

Another model's checkpoint or build is a mismatch (exit 1, like a tensor whose bytes differ): one
line naming the config key or the tensor that differs, and no tensor compared. It used to be a
``KeyError`` traceback (another architecture), or "all good" for a checkpoint whose first layers
happened to hold the build's bytes (a 3-layer model, same seed, against a 2-layer build). A
reference that does not exist or is not a checkpoint is bad input (exit 2), one line naming
``--deep``, not ``--source``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import one_line, shardc
from plan_helpers import plan

from shardc.compiler.compile import build
from shardc.compiler.synthetic import llama_config, write_checkpoint
from shardc.errors import SourceError
from shardc.formats.manifest import load
from shardc.verify.checks import verify_build


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer Llama checkpoint, its tp = 1 build, and references of other models: 3 layers
    (layers 0 and 1 the same bytes: seeded per tensor name), another hidden size, another
    architecture of the same shapes (Qwen2: biased q/k/v), and the tp = 1 build of the 3-layer one."""
    root = tmp_path_factory.mktemp("deep_refs")
    src = write_checkpoint(root / "src", llama_config(num_layers=2), seed=3)
    out = {"src": src, "build": build(plan(1, name="src-tp1", source=src), root / "build").out_dir,
           "layers": write_checkpoint(root / "layers", llama_config(num_layers=3), seed=3),
           "hidden": write_checkpoint(root / "hidden", llama_config(num_layers=2, hidden_size=128), seed=3),
           "qwen2": write_checkpoint(root / "qwen2", llama_config(num_layers=2, architecture="Qwen2ForCausalLM"),
                                     seed=3)}
    out["layers-build"] = build(plan(1, name="layers-tp1", source=out["layers"]), root / "layers-build").out_dir
    return out


def _deep(work: dict[str, Path], ref: object):
    return shardc("verify", "--manifest", work["build"] / "manifest.json", "--deep", ref)


MISMATCHES = {
    "layers": "its config has num_hidden_layers=3, this build's 2",
    "hidden": "its config has hidden_size=128, this build's 64",
    "qwen2": "its config has architectures='Qwen2ForCausalLM', this build's 'LlamaForCausalLM'",
    "layers-build": "its config has num_hidden_layers=3, this build's 2",
}


def test_another_models_reference_is_one_mismatch_line(work):
    """Exit 1, one line on stderr naming the key, the rank's own checks still reported (no 'deep'
    among them: nothing was compared); in the library, the report's one problem, for a
    checkpoint or a build of another model."""
    r = _deep(work, work["qwen2"])
    assert one_line(r, code=1) == f"error: the reference {work['qwen2']} is another model: {MISMATCHES['qwen2']} (deep check)"
    assert r.stdout.splitlines() == ["ok   model-tp00-pp00.safetensors (rank 0: tp 0, pp 0)  present size sha256 "
                                     "header metadata tensor-set dtype-shape extent", "src-tp1: 1 problem(s)"]
    for ref, line in MISMATCHES.items():
        report = verify_build(load(work["build"] / "manifest.json"), work["build"], deep=str(work[ref]))
        assert report.problems == (f"the reference {work[ref]} is another model: {line} (deep check)",), ref
        assert [r.ok for r in report.ranks] == [True] and "deep" not in report.ranks[0].checks


def test_a_checkpoint_lacking_a_tensor_is_named(work, tmp_path):
    """Same config, a tensor gone: the line names it (it was a KeyError traceback)."""
    ref = write_checkpoint(tmp_path / "lacking", llama_config(num_layers=2), seed=3)
    from safetensors.numpy import load_file, save_file

    (file,) = ref.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    r = _deep(work, ref)
    assert one_line(r, code=1) == (
        f"error: the reference {ref} is not a checkpoint of this build's model: tensor "
        f"'model.layers.1.mlp.up_proj.weight' is missing from the checkpoint at {ref} (deep check)")


def test_its_own_source_and_build_still_pass(work):
    """The refusals above are not a deep check that refuses everything: the source itself and
    its build (file:// too) pass, with 'deep' among the checks."""
    for ref in (work["src"], work["build"], f"file://{work['build'] / 'manifest.json'}"):
        report = verify_build(load(work["build"] / "manifest.json"), work["build"], deep=str(ref))
        assert report.ok and report.ranks[0].checks[-1] == "deep", (ref, report.problems)


def test_a_reference_that_is_not_there_names_deep(work, tmp_path):
    """Bad input, exit 2, the flag given (--deep) in the line and a hint that does not say
    --source: a missing path, a directory with no config.json; an unknown scheme is keyed the
    same way (the CLI's line names the flag from the key)."""
    hint = "(hint: pass a source checkpoint directory, or a build (its directory or manifest.json), that exists)"
    gone = tmp_path / "gone"
    assert one_line(_deep(work, gone)) == f"error: --deep: the reference {gone} does not exist {hint}"
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line(_deep(work, empty), f"error: --deep: cannot read config file {empty / 'config.json'}")
    assert "--source" not in line
    with pytest.raises(SourceError) as exc:
        verify_build(load(work["build"] / "manifest.json"), work["build"], deep="s3://bucket/ckpt")
    assert (exc.value.key, exc.value.message, exc.value.hint) == (
        "deep", "unsupported source scheme 's3' in 's3://bucket/ckpt'", "use a local directory, file://DIR or hf://org/repo[@rev]")
