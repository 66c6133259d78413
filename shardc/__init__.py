"""shardc: compile a Hugging Face checkpoint into per-rank TP x PP shard files, verify and ship them."""

__version__ = "0.1.0"
