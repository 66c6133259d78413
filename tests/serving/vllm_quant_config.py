"""Run in vLLM's venv, not by pytest: what vLLM reads of a ModelOpt quantization_config, through its
own parser (``ModelOptNvFp4Config.from_config``, ``is_layer_excluded``) and its KV-cache dtype
resolution (``get_kv_cache_quant_algo_string``, what ``--kv-cache-dtype auto`` becomes).

``python vllm_quant_config.py JOB.json OUT.json``; JOB: {"cases": {NAME: {"config": PATH,
"modules": [...]}}}; OUT: {NAME: {"kv": str|null, "group_size": int, "exclude": [...],
"excluded": [bool per module]}}.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.utils.torch_utils import get_kv_cache_quant_algo_string

    job, out = json.loads(open(sys.argv[1]).read()), {}
    for name, case in job["cases"].items():
        block = json.loads(open(case["config"]).read())["quantization_config"]
        config = ModelOptNvFp4Config.from_config(block)
        out[name] = {"kv": get_kv_cache_quant_algo_string(block), "group_size": config.group_size,
                     "exclude": config.exclude_modules,
                     "excluded": [config.is_layer_excluded(m) for m in case["modules"]]}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
