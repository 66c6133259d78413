"""Which rank owns which slice of which tensor, with every expectation written out by hand.

The case has both awkward rules at once: vocabulary 10 at tp=4 (padded to 12, the last rank holds
one real row and two zero rows) and 2 KV heads at tp=4 (each KV head replicated on two ranks). The
expected bytes of every shard file are derived here from the source tensors and the safetensors
format itself (8-byte header length, compact JSON header with sorted names, space padding to 8),
not from shardc's layout or writer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from plan_helpers import plan
from safetensors import safe_open
from safetensors.torch import save_file

from shardc.compiler.compile import build

# hidden 32, 4 heads of 8, 2 KV heads, intermediate 64, vocab 10, 2 layers; tp=4, pp=2.
CFG = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           vocab_size=10)
TP, PP = 4, 2

# Hand-written ownership: (rows or columns) per tp rank, for each rule.
Q_ROWS = {0: (0, 8), 1: (8, 16), 2: (16, 24), 3: (24, 32)}  # 4 heads x 8, one head per rank
KV_ROWS = {0: (0, 8), 1: (0, 8), 2: (8, 16), 3: (8, 16)}  # KV head 0 on ranks 0,1; head 1 on 2,3
O_COLS = Q_ROWS
MLP_ROWS = {0: (0, 16), 1: (16, 32), 2: (32, 48), 3: (48, 64)}
DOWN_COLS = MLP_ROWS
VOCAB_ROWS = {0: (0, 3), 1: (3, 6), 2: (6, 9), 3: (9, 10)}  # 12 padded rows, 3 per rank
VOCAB_PAD = {0: 0, 1: 0, 2: 0, 3: 2}
STAGE_LAYERS = {0: (0, 1), 1: (1, 2)}


def _source(path: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint whose every value is distinct within a tensor (arange), so a wrong slice shows."""
    from shardc.compiler.synthetic import llama_config

    cfg = llama_config(**CFG, tie_word_embeddings=tied)
    h, inter, v = 32, 64, 10
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (32, h), p + "self_attn.k_proj.weight": (16, h),
            p + "self_attn.v_proj.weight": (16, h), p + "self_attn.o_proj.weight": (h, 32),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    tensors = {}
    for j, (name, shape) in enumerate(sorted(shapes.items())):
        n = 1
        for d in shape:
            n *= d
        # bf16 holds integers below 256 exactly: k/8 with |k| < 160; the prime period 251 keeps
        # every row of 8..64 values distinct from every other row of the tensor
        vals = (torch.arange(n) % 251 - 125 + j) / 8
        tensors[name] = vals.reshape(shape).to(torch.bfloat16)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return tensors


def _plan(src: Path, name: str = "oracle"):
    return plan(TP, PP, name=name, source=src)


def expected_shard(src: dict[str, torch.Tensor], t: int, s: int, tied: bool) -> dict[str, torch.Tensor]:
    """Rank (tp t, stage s)'s tensors, sliced by hand from the source."""
    out: dict[str, torch.Tensor] = {}

    def vocab(w: torch.Tensor) -> torch.Tensor:
        a, b = VOCAB_ROWS[t]
        return torch.cat([w[a:b], torch.zeros(VOCAB_PAD[t], w.shape[1], dtype=w.dtype)])

    if s == 0:
        out["model.embed_tokens.weight"] = vocab(src["model.embed_tokens.weight"])
    if s == PP - 1:
        out["model.norm.weight"] = src["model.norm.weight"]
        out["lm_head.weight"] = vocab(src["model.embed_tokens.weight" if tied else "lm_head.weight"])
    lo, hi = STAGE_LAYERS[s]
    for i in range(lo, hi):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = src[p + n]
        a, b = Q_ROWS[t]
        out[p + "self_attn.q_proj.weight"] = src[p + "self_attn.q_proj.weight"][a:b]
        a, b = KV_ROWS[t]
        for n in ("k_proj", "v_proj"):
            out[p + f"self_attn.{n}.weight"] = src[p + f"self_attn.{n}.weight"][a:b]
        a, b = O_COLS[t]
        out[p + "self_attn.o_proj.weight"] = src[p + "self_attn.o_proj.weight"][:, a:b]
        a, b = MLP_ROWS[t]
        for n in ("gate_proj", "up_proj"):
            out[p + f"mlp.{n}.weight"] = src[p + f"mlp.{n}.weight"][a:b]
        a, b = DOWN_COLS[t]
        out[p + "mlp.down_proj.weight"] = src[p + "mlp.down_proj.weight"][:, a:b]
    return out


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors format written out: u64 header length, compact JSON header (metadata, then
    tensors by name, offsets in file order), padded with spaces to a multiple of 8, then the data."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    data, off = [], 0
    for name in sorted(tensors):
        b = tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        data.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(data)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_shard_is_the_hand_derived_file(tmp_path, tied):
    src = _source(tmp_path / "src", tied=tied)
    res = build(_plan(tmp_path / "src"), tmp_path / "out")
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["layout"]["tp_degree"] == TP and m["layout"]["pp_degree"] == PP
    assert m["format_version"] == 3  # 3: shards carry chunk digests (2's object keyed by file name)
    by_file = m["shards"]
    assert sorted(by_file) == sorted(f"model-tp{t:02d}-pp{s:02d}.safetensors" for t in range(TP) for s in range(PP))
    for s in range(PP):
        for t in range(TP):
            f = f"model-tp{t:02d}-pp{s:02d}.safetensors"
            path = res.out_dir / f
            want = expected_shard(src, t, s, tied)
            with safe_open(str(path), "pt") as g:
                meta = g.metadata()
                got = {k: g.get_tensor(k) for k in g.keys()}  # noqa: SIM118
            assert sorted(got) == sorted(want), f
            for k in want:
                assert torch.equal(got[k], want[k]), f"{f}:{k}"
            # the file's own ranks, and the manifest's
            assert meta["shardc.tp_rank"] == str(t) and meta["shardc.pp_stage"] == str(s), f
            assert meta["shardc.rank"] == str(s * TP + t) and meta["shardc.tp_degree"] == str(TP)
            assert meta["shardc.pp_degree"] == str(PP)
            assert meta["shardc.layers"] == "{}:{}".format(*STAGE_LAYERS[s])
            e = by_file[f]
            assert (e["tp_rank"], e["pp_stage"], e["rank"]) == (t, s, s * TP + t)
            assert list(e["layers"]) == list(STAGE_LAYERS[s])
            # golden bytes: the whole file, derived here
            golden = safetensors_bytes(want, meta)
            assert path.read_bytes() == golden, f
            assert e["sha256"] == hashlib.sha256(golden).hexdigest() and e["size"] == len(golden)


def test_padding_rows_are_zero_and_replicas_identical(tmp_path):
    """The two properties stated on their own, so a failure says which rule broke."""
    src = _source(tmp_path / "src")
    res = build(_plan(tmp_path / "src"), tmp_path / "out")

    def get(t: int, s: int, name: str) -> torch.Tensor:
        with safe_open(str(res.out_dir / f"model-tp{t:02d}-pp{s:02d}.safetensors"), "pt") as g:
            return g.get_tensor(name)

    last = get(3, 1, "lm_head.weight")
    assert last.shape == (3, 32) and torch.equal(last[0], src["lm_head.weight"][9])
    assert not last[1:].any()
    emb = get(3, 0, "model.embed_tokens.weight")
    assert torch.equal(emb[0], src["model.embed_tokens.weight"][9]) and not emb[1:].any()
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(get(0, 0, k), get(1, 0, k)) and torch.equal(get(2, 0, k), get(3, 0, k))
    assert not torch.equal(get(1, 0, k), get(2, 0, k))
