"""The gate's baseline cache is bound to its content and kept out of builds (#25 item 6).

The attacks of the issue: a cache made from another build with its recorded manifest sha256
edited made a broken candidate pass (delta 0.0); a cache path naming one of the baseline's shards
overwrote it with logits. Unit tests drive the cache functions on files written here with the
safetensors library; the end-to-end cases run the real gate CLI on tiny synthetic builds.

Oracles: the HMAC written out here with hmac/hashlib over bytes the safetensors library wrote,
tensors read back with the safetensors library, files' bytes before and after.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest
from cli_run import shardc_in

torch = pytest.importorskip("torch")

from shardc.runtime.gate import golden_text  # noqa: E402
from shardc.runtime.gate_cache import (  # noqa: E402
    CACHE_DIGEST,
    CACHE_META,
    SECRET_ENV,
    GateCacheError,
    check_cache,
    check_cache_location,
    seal_cache,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = {"cpu_threads": 1, "baseline_manifest_sha256": "a" * 64, "golden_sha256": "b" * 64,
       "window": 6, "max_tokens": 12, "windows_sha256": "c" * 64}
OTHER = {**KEY, "baseline_manifest_sha256": "f" * 64}
LOGITS = torch.arange(2 * 5 * 7, dtype=torch.float32).reshape(2, 5, 7).div(8).to(torch.bfloat16)


def scratch(path: Path, key: dict, logits: torch.Tensor = LOGITS) -> Path:
    """What the baseline pass leaves: the logits and the key, written by the safetensors library."""
    from safetensors.torch import save_file

    save_file({"logits": logits}, str(path), metadata={CACHE_META: json.dumps(key, sort_keys=True)})
    return path


def sealed(tmp_path: Path, key: dict = KEY, name: str = "cache.safetensors") -> Path:
    path = tmp_path / name
    seal_cache(scratch(tmp_path / f"{name}.scratch", key), path, key)
    return path


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def rewrite(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def read_logits(path: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("logits")


# -- the digest -------------------------------------------------------------------------------------------
def test_a_sealed_cache_is_a_hit_and_carries_the_digest_of_key_and_bytes(tmp_path):
    path = sealed(tmp_path)
    header, data = split(path)
    _, want_data = split(tmp_path / "cache.safetensors.scratch")
    assert data == want_data  # the logits bytes as the library wrote them
    table = {"logits": {"dtype": "BF16", "shape": [2, 5, 7], "data_offsets": [0, 2 * 5 * 7 * 2]}}
    msg = json.dumps({"key": KEY, "tensors": table}, sort_keys=True, separators=(",", ":")).encode()
    want = hmac.new(bytes.fromhex("a" * 64), msg + b"\0" + data, hashlib.sha256).hexdigest()
    assert header["__metadata__"] == {CACHE_META: json.dumps(KEY, sort_keys=True), CACHE_DIGEST: want}
    copy = tmp_path / "copy.safetensors"
    assert check_cache(path, KEY, copy_to=copy) == ("hit", "")
    assert torch.equal(read_logits(copy), LOGITS) and split(copy)[1] == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.safetensors", "cache.safetensors.scratch",
                                                          "copy.safetensors"]  # no temp left


def test_another_baselines_cache_with_its_key_edited_is_refused(tmp_path):
    """The issue's attack: the recorded manifest sha256 edited to this baseline's."""
    path = sealed(tmp_path, OTHER)
    assert check_cache(path, KEY) == ("stale", f"baseline_manifest_sha256 {'f' * 12} != {'a' * 12}")
    header, data = split(path)
    header["__metadata__"][CACHE_META] = json.dumps(KEY, sort_keys=True)
    rewrite(path, header, data)
    copy = tmp_path / "copy.safetensors"
    assert check_cache(path, KEY, copy_to=copy) == ("mismatch", "edited or damaged since it was written")
    assert not copy.exists()


def _flip_byte(header: dict, data: bytes, other: Path) -> tuple[dict, bytes]:
    return header, data[:10] + bytes([data[10] ^ 1]) + data[11:]


def _reshape(header: dict, data: bytes, other: Path) -> tuple[dict, bytes]:
    header["logits"]["shape"] = [5, 2, 7]  # the same bytes read as other rows
    return header, data


def _foreign_digest(header: dict, data: bytes, other: Path) -> tuple[dict, bytes]:
    header["__metadata__"][CACHE_DIGEST] = split(other)[0]["__metadata__"][CACHE_DIGEST]
    return header, data


def _other_logits(header: dict, data: bytes, other: Path) -> tuple[dict, bytes]:
    return header, split(other)[1]


@pytest.mark.parametrize("recorded, want", [
    ({"name": "transformers", "revision": "r1"}, "transformers"),  # a reference by its name
    (None, "shardc"),  # no reference: shardc's own baseline
    ("a-reference-spelled-as-a-long-string", "a-reference-"),  # neither: its first 12 characters
    (12345678901234567, "123456789012"),
])
def test_a_stale_caches_reference_is_shown_by_name(tmp_path, recorded, want):
    """The stale line names the reference each side was scored by: a dict by its name, none as
    shardc, anything else (a hand-edited cache) by its first 12 characters."""
    key = {**KEY, "reference": {"name": "hf-ref", "revision": "r2"}}
    path = sealed(tmp_path, {**KEY, "reference": recorded})
    assert check_cache(path, key) == ("stale", f"reference {want} != hf-ref")


@pytest.mark.parametrize("edit", [_flip_byte, _reshape, _foreign_digest, _other_logits])
def test_edited_caches_do_not_match_their_digest(tmp_path, edit):
    path = sealed(tmp_path)
    other = tmp_path / "other.safetensors"
    seal_cache(scratch(tmp_path / "o.scratch", KEY, LOGITS * 2), other, KEY)
    rewrite(path, *edit(*split(path), other))
    assert check_cache(path, KEY) == ("mismatch", "edited or damaged since it was written")


@pytest.mark.parametrize("edit,want", [
    (lambda h, d: (h, d[:-2]), ("mismatch", "damaged: the tensors' data ends at 140, the file's data "
                                "section holds 138 bytes (the file is cut short)")),
    (lambda h, d: ({**h, "__metadata__": {CACHE_META: h["__metadata__"][CACHE_META]}}, d),
     ("stale", "it carries no digest (an older shardc's cache)")),
    (lambda h, d: ({**h, "extra": {"dtype": "U8", "shape": [0], "data_offsets": [140, 140]}}, d),
     ("mismatch", "damaged: it holds the tensors ['extra', 'logits'], not logits alone")),
    (lambda h, d: ({**h, **{c: {"dtype": "U8", "shape": [0], "data_offsets": [140, 140]} for c in "abc"}}, d),
     ("mismatch", "damaged: it holds the tensors ['a', 'b', 'c'], not logits alone")),
    (lambda h, d: (h, b""), ("mismatch", "damaged: the tensors' data ends at 140, the file's data section "
                             "holds 0 bytes (the file is cut short)")),
])
def test_damaged_caches_name_what_is_wrong(tmp_path, edit, want):
    path = sealed(tmp_path)
    rewrite(path, *edit(*split(path)))
    assert check_cache(path, KEY) == want


@pytest.mark.parametrize("digits", range(1, 10))
def test_seals_of_every_header_length_hit(tmp_path, digits):
    """Keys of nine lengths (max_tokens of 1..9 digits) give headers of every length mod 8: the
    sealed file's header is written twice (a placeholder digest first) and must come out whole."""
    key = {**KEY, "max_tokens": 10 ** (digits - 1)}
    path = sealed(tmp_path, key)
    assert check_cache(path, key) == ("hit", "") and torch.equal(read_logits(path), LOGITS)


def test_short_and_exact_headers(tmp_path):
    """The length prefix's bounds: a file shorter than 8 bytes, a length one past the file, and a
    header that fills the file exactly (no data: then it is judged as a cache, not as unreadable)."""
    path = tmp_path / "c"
    path.write_bytes(b"\x01\x00")
    assert check_cache(path, KEY) == ("stale", "unreadable: shorter than a safetensors header")
    body = b'{"__metadata__":{"x":"y"}}'
    path.write_bytes(struct.pack("<Q", len(body) + 1) + body)
    assert check_cache(path, KEY) == ("stale", f"unreadable: header length {len(body) + 1} does not fit the file")
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    assert check_cache(path, KEY) == ("stale", "not a shardc baseline cache")


def test_the_secret_keys_the_digest(tmp_path, monkeypatch):
    """With SHARDC_GATE_CACHE_SECRET set, a cache sealed without it (anyone can compute that
    digest from the manifest) or with another secret is not trusted."""
    plain = sealed(tmp_path, name="plain.safetensors")
    monkeypatch.setenv(SECRET_ENV, "ci-secret")
    assert check_cache(plain, KEY)[0] == "mismatch"
    keyed = sealed(tmp_path, name="keyed.safetensors")
    assert check_cache(keyed, KEY) == ("hit", "")
    monkeypatch.setenv(SECRET_ENV, "another")
    assert check_cache(keyed, KEY)[0] == "mismatch"
    monkeypatch.delenv(SECRET_ENV)
    assert check_cache(plain, KEY) == ("hit", "") and check_cache(keyed, KEY)[0] == "mismatch"


def test_what_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(GateCacheError) as exc:
        check_cache(fifo, KEY)
    assert exc.value.one_line() == f"baseline cache {fifo} is not a regular file (hint: name a file)"
    with pytest.raises(GateCacheError) as exc:
        check_cache_location(tmp_path, [], [])
    assert exc.value.one_line() == f"baseline cache {tmp_path} is a directory (hint: name a file)"
    assert check_cache(tmp_path / "dangling", KEY) == ("new", "")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert check_cache(tmp_path / "link", KEY) == ("new", "")


def test_disk_failures_are_one_error(tmp_path):
    """Writing the cache where no file can be made is OutputError (exit 1), nothing left; a copy
    that cannot be made is GateCacheError naming the copy."""
    from shardc.errors import OutputError

    src = scratch(tmp_path / "s", KEY)
    with pytest.raises(OutputError) as exc:
        seal_cache(src, tmp_path / "no" / "c", KEY)
    assert exc.value.one_line() == (f"cannot write baseline cache {tmp_path}/no/c: No such file or directory "
                                    "(hint: check free space and permissions, or name another file)")
    assert exc.value.exit_code == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    path = sealed(tmp_path)
    with pytest.raises(GateCacheError) as exc:
        check_cache(path, KEY, copy_to=tmp_path / "no" / "copy")
    assert re.fullmatch(f"cannot read baseline cache {path} \\({tmp_path}/no/\\.copy\\.[0-9a-f]{{16}}\\.tmp\\): "
                        "No such file or directory", exc.value.message), exc.value.message
    assert exc.value.hint == "check its permissions and free space in the temp directory"


# -- where a cache may live (real builds) ------------------------------------------------------------------
def _build(src: Path, out: Path, pp: int) -> Path:
    from plan_helpers import plan as make_plan

    from shardc.compiler.compile import build

    name = f"{src.name}-pp{pp}"
    plan = make_plan(1, pp, name=name, source=src)
    return build(plan, out_dir=out / name).manifest_path


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """A baseline (tp1pp1), a good candidate (tp1pp2) and a broken one (other weights), each with
    a tiny word-level tokenizer, as in runtime/test_gate.py."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardc.compiler.synthetic import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("gate-cache")
    vocab = {"[UNK]": 0}
    for w in golden_text("pydoc")[0].split()[:5000]:
        if len(vocab) < 96:
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    srcs = {}
    for name, seed in (("model", 0), ("broken", 5)):
        srcs[name] = write_checkpoint(root / name, llama_config(num_layers=2), seed=seed)
        tok.save(str(srcs[name] / "tokenizer.json"))
    return {"root": root, "base": _build(srcs["model"], root / "b", 1), "good": _build(srcs["model"], root / "b", 2),
            "broken": _build(srcs["broken"], root / "b", 1)}


def test_cache_paths_in_builds_are_refused(builds, tmp_path):
    from shardc.runtime.api import open_build

    refs = [open_build(builds["base"]), open_build(builds["good"])]
    base_dir, good_dir = builds["base"].parent, builds["good"].parent
    golden = tmp_path / "golden.txt"
    golden.write_text("text")
    unrelated = tmp_path / "other-build"
    unrelated.mkdir()
    (unrelated / "manifest.json").write_text("{}")
    (tmp_path / "to-shard").symlink_to(base_dir / "model-tp00-pp00.safetensors")
    (tmp_path / "to-dir").symlink_to(good_dir)
    (good_dir / "link-out").symlink_to(tmp_path / "somewhere.safetensors")
    cases = {
        base_dir / "model-tp00-pp00.safetensors": "is model-pp1's model-tp00-pp00.safetensors",
        builds["good"]: "is model-pp2's manifest",
        good_dir / "config.json": "is model-pp2's config.json",
        tmp_path / "to-shard": "is model-pp1's model-tp00-pp00.safetensors",
        good_dir / "new.safetensors": f"is in the build directory {good_dir}",
        tmp_path / "to-dir" / "new.safetensors": "is in the build directory",
        good_dir / "link-out": f"is in the build directory {good_dir}",
        unrelated / "c.safetensors": f"is in the build directory {unrelated}",
        golden: f"is the golden text or tokenizer {golden}",
    }
    before = {p: p.read_bytes() for p in base_dir.iterdir() if p.is_file()}
    for path, needle in cases.items():
        with pytest.raises(GateCacheError) as exc:
            check_cache_location(path, refs, [golden])
        line = exc.value.one_line()
        assert line.startswith(f"baseline cache {path} ") and needle in line, line
        assert exc.value.hint == ("keep baseline caches outside build directories, e.g. --baseline-cache "
                                  "caches/<baseline>.safetensors")
    check_cache_location(tmp_path / "fine.safetensors", refs, [golden])  # no error
    assert {p: p.read_bytes() for p in base_dir.iterdir() if p.is_file()} == before


# -- end to end: the real gate CLI -------------------------------------------------------------------------
GATE = ["--max-tokens", "128", "--window", "64", "--timeout", "60", "--min-top1", "0.9"]


def _gate(*args: str) -> subprocess.CompletedProcess:
    return shardc_in("gate", *args, env={SECRET_ENV: None})  # the key unset, as a user without one


@pytest.mark.heavy
def test_gate_cli_refuses_a_cache_on_the_baselines_shard(builds):
    shard = builds["base"].parent / "model-tp00-pp00.safetensors"
    before = shard.read_bytes()
    p = _gate("--baseline", str(builds["base"]), "--candidate", str(builds["good"]), "--baseline-cache",
              str(shard), *GATE)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"error: baseline cache {shard} is model-pp1's model-tp00-pp00.safetensors; the gate would "
        "overwrite it (hint: keep baseline caches outside build directories, e.g. --baseline-cache "
        "caches/<baseline>.safetensors)"]
    assert shard.read_bytes() == before and p.stdout == ""


@pytest.mark.heavy
def test_a_forged_cache_does_not_let_a_broken_candidate_pass(builds, tmp_path):
    """The broken build's own logits cached, the recorded baseline manifest sha256 edited to the
    real baseline's: before #25 the broken candidate passed with delta 0.0. Now the cache does not
    match its digest, is recomputed (one line says so) and the gate fails as a fresh one does."""
    cache = tmp_path / "forged.safetensors"
    p = _gate("--baseline", str(builds["broken"]), "--candidate", str(builds["broken"]),
              "--baseline-cache", str(cache), "--json", *GATE)
    assert p.returncode == 0 and json.loads(p.stdout)["ppl_delta_pct"] == 0.0, p.stderr
    header, data = split(cache)
    meta = header["__metadata__"]
    key = json.loads(meta[CACHE_META])
    key["baseline_manifest_sha256"] = hashlib.sha256(builds["base"].read_bytes()).hexdigest()
    meta[CACHE_META] = json.dumps(key, sort_keys=True)
    rewrite(cache, header, data)

    p = _gate("--baseline", str(builds["base"]), "--candidate", str(builds["broken"]),
              "--baseline-cache", str(cache), "--json", *GATE)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"baseline cache {cache} does not match its digest (edited or damaged since it was written); "
        "recomputing it"]
    r = json.loads(p.stdout)
    assert not r["pass"] and r["top1_agreement"] < 0.5 and r["baseline_cache"]["status"] == "mismatch"
    fresh = json.loads(_gate("--baseline", str(builds["base"]), "--candidate", str(builds["broken"]),
                             "--json", *GATE).stdout)
    assert {k: v for k, v in r.items() if k not in ("seconds", "baseline_cache")} == \
        {k: v for k, v in fresh.items() if k not in ("seconds", "baseline_cache")}
    assert check_cache(cache, key) == ("hit", "")  # rewritten as the real baseline's cache
