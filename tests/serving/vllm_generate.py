"""Run in vLLM's venv, not by pytest: greedy tokens from vLLM's engine on a build served with
``--load-format shardc``, then from a second engine that loads the source checkpoint with vLLM's
default loader, for the same prompts, one engine after the other in this process. Same engine
code, same kernels, same batch: the tokens must be equal, not close.

(vLLM's in-place ``reload_weights`` would need one engine only, but on the CPU backend it changed
the tokens of a model reloaded with its own weights; two starts it is.)

``python vllm_generate.py JOB.json OUT.json``; JOB: {"build": DIR, "source": DIR, "tp": N,
"prompts": [[ids...], ...], "max_tokens": N, "text": false}; OUT: {"shardc": [[ids...]], "source":
[[ids...]]}, with "text": the detokenized completions instead (the source's tokenizer), and with no
"build", the source's engine only.
"""

from __future__ import annotations

import gc
import json
import sys


def _tokens(model: str, job: dict, **load: str) -> list:
    from vllm import LLM, SamplingParams

    text = job.get("text", False)
    llm = LLM(model=model, tensor_parallel_size=job["tp"], dtype="bfloat16", skip_tokenizer_init=not text,
              enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0, **load)
    greedy = SamplingParams(max_tokens=job.get("max_tokens", 12), temperature=0.0)
    out = [o.outputs[0].text if text else list(o.outputs[0].token_ids) for o in
           llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], greedy, use_tqdm=False)]
    llm.llm_engine.engine_core.shutdown()  # its workers go before the next engine takes the cores
    del llm
    gc.collect()
    return out


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    out = {"shardc": _tokens(job["build"], job, load_format="shardc")} if job.get("build") else {}
    out["source"] = _tokens(job["source"], job)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":  # vLLM spawns its engine: the LLM call must not run on import
    main()
