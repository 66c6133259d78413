"""The compiler: source checkpoint -> per-rank shard files (+ quantization)."""
