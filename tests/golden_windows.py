"""The golden text as token windows, for the tests that run the demo model (runtime, clients):
``golden_windows(tokenizer_json, n, t)`` is n windows of t tokens of real English. Import by name
(tests/ is on the path); a test module never imports another test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def golden_windows(tokenizer_json: Path, n: int, t: int) -> Any:
    """The first n * t tokens of the gate's pydoc golden text as an (n, t) tensor."""
    import torch
    from tokenizers import Tokenizer

    from shardc.runtime.gate import golden_text

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(golden_text("pydoc")[0][:40000]).ids
    return torch.tensor(ids[: n * t]).view(n, t)
