"""The converted SmolLM2 demo checkpoint is a plain HF Llama checkpoint that shardc and transformers accept."""

from __future__ import annotations

import json

import pytest

from shardc.layout.model import load_model
from shardc.layout.ranks import source_tensors

pytestmark = pytest.mark.heavy


def test_names_shapes_and_dtype_match_layout(demo_model_dir):
    from safetensors import safe_open

    model = load_model(demo_model_dir)
    assert (model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads) == (30, 576, 9, 3)
    assert (model.head_dim, model.intermediate_size, model.vocab_size) == (64, 1536, 49152)
    assert model.tie_word_embeddings and model.rope_theta == 100000.0
    expected = {t.name: t.shape for t in source_tensors(model)}
    with safe_open(str(demo_model_dir / "model.safetensors"), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert found == expected  # tied: no lm_head.weight in the file
    assert dtypes == {"BF16"}
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"


def test_transformers_generates_coherent_text(demo_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    # q/k left in GGUF's interleaved rotary layout would scramble attention: no "Paris".
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
