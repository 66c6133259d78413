"""Sizes as people type them: the one parser every command's size flag uses.

One unit rule: a size names its unit, decimal (KB, MB, GB, TB, PB: powers of 1,000, as transformers'
``max_shard_size`` and disk vendors read them) or binary (KiB ... PiB; Ki ... Pi: powers of 1,024, as
CUDA and the planner report memory), or B for bytes. A bare number other than 0
is refused: "80" could be bytes (transformers), GiB (a plan's ``kv_cache_cap_gb``) or GB (a data
sheet), and each reading gives another answer without a word.
"""

from __future__ import annotations

import re

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "ki": 1 << 10, "mib": 1 << 20, "mi": 1 << 20, "gib": 1 << 30, "gi": 1 << 30,
         "tib": 1 << 40, "ti": 1 << 40, "pb": 10**15, "pib": 1 << 50, "pi": 1 << 50}
MAX_SIZE = 1 << 50  # no GPU, cache, budget or shard is a PiB: a larger figure is a slip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
EXAMPLES = "20GiB, 5.63GiB, 512MiB, 80GB or 1000B"


def parse_size(text: str, *, allow_zero: bool = False) -> int:
    """Bytes in ``text`` ('20GiB', '5.63 GiB', '5GB', '1000B'), or ValueError saying what would
    parse: the caller names its field or flag. 0 needs no unit, and only where ``allow_zero``."""
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"must be a size such as {EXAMPLES}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if number == 0 and not allow_zero:
        raise ValueError(f"must be positive, such as {EXAMPLES}")
    if number == 0 and not unit:
        return 0
    if not unit:
        raise ValueError(f"needs a unit ({EXAMPLES}): a bare number could be bytes, GiB or GB")
    if unit not in UNITS:
        raise ValueError(f"has no unit {m.group(2)!r}: use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB")
    size = number * UNITS[unit]
    if size > MAX_SIZE:
        raise ValueError("must be at most 1 PiB")
    return int(size)
