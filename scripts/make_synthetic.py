#!/usr/bin/env python3
"""Write a seeded synthetic Llama checkpoint.

Examples:
  python scripts/make_synthetic.py /tmp/tiny --layers 2 --hidden 64 --heads 4 --kv-heads 2
  python scripts/make_synthetic.py /tmp/l70-2 --llama3-70b-shapes --layers 2   # real 70B tensor shapes
"""

from __future__ import annotations

import argparse

from shardc.compiler.synthetic import LLAMA3_70B_SHAPES, llama_config, write_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama3-70b-shapes", action="store_true", help="real Llama-3-70B tensor shapes")
    a = ap.parse_args()
    if a.llama3_70b_shapes:
        cfg = llama_config(num_layers=a.layers, torch_dtype=a.dtype, **LLAMA3_70B_SHAPES)
    else:
        cfg = llama_config(
            hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
            num_heads=a.heads, num_kv_heads=a.kv_heads, vocab_size=a.vocab,
            tie_word_embeddings=a.tied, torch_dtype=a.dtype,
        )
    print(write_checkpoint(a.out, cfg, num_files=a.files, seed=a.seed))


if __name__ == "__main__":
    main()
