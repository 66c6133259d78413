"""Test helper: put a build's shards back together from the manifest alone, independently of
shardc's Layout code, and compare with the source checkpoint byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def load_source(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():  # noqa: SIM118
                out[k] = s.get_tensor(k)
    return out


def _fused(name: str, parts: list) -> torch.Tensor:
    """A FUSED tensor (Phi-3's qkv_proj, Qwen3-Next's conv1d) from its ranks' pieces: each rank's
    rows are its pieces' source row ranges, in order; overlaps (a replicated KV head) must agree."""
    full_len = max(b for rec, _ in parts for _, b in rec["pieces"])
    t0 = parts[0][1]
    full = torch.zeros([full_len, *t0.shape[1:]], dtype=t0.dtype)
    covered = torch.zeros(full_len, dtype=torch.bool)
    for rec, t in parts:
        at = 0
        for a, b in rec["pieces"]:
            piece = t[at : at + b - a]
            if covered[a:b].all():
                assert torch.equal(full[a:b].view(torch.uint8), piece.contiguous().view(torch.uint8)), name
            full[a:b], covered[a:b] = piece, True
            at += b - a
    assert covered.all(), f"{name}: pieces do not cover the tensor"
    return full


def reassemble(build_dir: Path) -> dict[str, torch.Tensor]:
    """shard tensor name -> tensor rebuilt from every rank's pieces (checks overlaps agree).

    Quantized weights come back quantized, with their ``X.weight_scale`` rebuilt alongside (int8
    as pack-quantized ``X.weight_packed``; ``X.weight_shape`` is each rank's own, unpacked shape)."""
    m = json.loads((build_dir / "manifest.json").read_text())
    pieces: dict[str, list] = {}
    for file, shard in m["shards"].items():  # format_version 2: keyed by file name
        with safe_open(build_dir / file, "pt") as f:
            for name, rec in shard["tensors"].items():
                pieces.setdefault((name, rec["source"]), []).append((rec, f.get_tensor(name)))
    out = {}
    for (name, _source), parts in pieces.items():
        rec0, t0 = parts[0]
        if rec0.get("dim") is None:
            for _, t in parts:
                assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8)), f"replicas of {name} differ"
            out[name] = t0
            continue
        dim = rec0["dim"]
        if rec0.get("pieces"):  # a fused tensor's parts, each cut by its own kind (dim 0), end to end
            out[name] = _fused(name, parts)
            continue
        pack = (rec0.get("pack") or 1) if dim == 1 else 1
        full_len = max(r["stop"] for r, _ in parts) // pack
        shape = list(t0.shape)
        shape[dim] = full_len
        full = torch.zeros(shape, dtype=t0.dtype)
        covered = torch.zeros(full_len, dtype=torch.bool)
        for rec, t in parts:
            n = rec["stop"] - rec["start"]
            if rec.get("pad_rows"):
                pad = t[n:]
                assert not pad.view(torch.uint8).any(), f"{name}: padding rows are not zero"
                t = t[:n]
            idx = slice(rec["start"], rec["stop"])
            if rec.get("pack") and dim == 1:  # packed: start/stop count source columns
                idx = slice(rec["start"] // rec["pack"], rec["stop"] // rec["pack"])
            region = full[idx] if dim == 0 else full[:, idx]
            if covered[idx].all():  # a replicated KV head: must equal what is there
                assert torch.equal(region.view(torch.uint8), t.contiguous().view(torch.uint8)), name
            if dim == 0:
                full[idx] = t
            else:
                full[:, idx] = t
            covered[idx] = True
        assert covered.all(), f"{name}: slices do not cover the tensor"
        out[name] = full
    for name in [n for n in out if n.endswith(".weight_packed")]:
        # int8 pack-quantized: unpacked by compressed-tensors itself (the oracle, not shardc)
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed = out[name]
        base = name.removesuffix("_packed")
        out[base] = unpack_from_int32(packed, 8, torch.Size([packed.shape[0], packed.shape[1] * 4]))
    return out
