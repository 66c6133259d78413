"""Which families vLLM's CPU build runs from a shardc build (README: "Serving a build with vLLM").

For each family of tests/serving/vllm_models.py (tiny, seeded, made by transformers): a tp=1 build,
one vLLM engine per family started with ``--load-format shardc`` that generates 4 greedy tokens,
and transformers' greedy tokens on the source for the same prompt. An engine start is 35-110 s
here, so this is a script (about 20 minutes), not a test; the tests prove every family's
parameters equal to vLLM's default loader's (tests/serving/test_vllm_families.py).

    .venv/bin/python scripts/vllm_cpu_families.py [--vllm-python .venv-vllm/bin/python] [--source-too] [FAMILY ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 33]
ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], load_format=sys.argv[2], dtype="bfloat16", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=256, max_num_seqs=2)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)))
""".replace("PROMPT", json.dumps(PROMPT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--source-too", action="store_true",
                    help="also start vLLM on the source with its own loader (one more engine per family): the "
                         "build's tokens against vLLM's own load of the source")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "serving")]
    import torch
    import transformers
    from plan_helpers import plan
    from vllm_models import FAMILIES, save

    from shardc.compiler.compile import build

    names = args.families or [n for n in FAMILIES if n != "gpt_oss"]  # gpt-oss: refused by the load format
    with tempfile.TemporaryDirectory(prefix="vllm-families-") as tmp:
        script = Path(tmp) / "engine.py"
        script.write_text(ENGINE)
        for name in names:
            src = save(Path(tmp) / "src", name)
            out = build(plan(1, name=f"{name}-tp1", source=src), Path(tmp) / name).out_dir
            model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
            ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0, 4:].tolist()
            run = subprocess.run([args.vllm_python, str(script), str(out), "shardc"], capture_output=True,
                                 text=True, timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
            got = [json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
            if got:
                verdict = "equal" if got[0] == ref else "DIFFERENT"
                own = ""
                if args.source_too:
                    base = subprocess.run([args.vllm_python, str(script), str(src), "auto"], capture_output=True,
                                          text=True, timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
                    theirs = [json.loads(ln[7:]) for ln in base.stdout.splitlines() if ln.startswith("TOKENS ")]
                    own = (f", vLLM's own load of the source {theirs[0]}: "
                           f"{'equal' if theirs[0] == got[0] else 'DIFFERENT'}" if theirs else
                           ", vLLM's own load of the source did not run")
                print(f"{name}: vLLM CPU {got[0]}, transformers {ref}: {verdict}{own}", flush=True)
            else:
                text = (run.stdout + run.stderr).splitlines()
                # a failed assertion in a worker is the root cause the engine's last error line hides
                lines = ([ln for ln in text if ln.split("]")[-1].strip().startswith("assert ")]
                         or [ln for ln in text if "Error" in ln and "File " not in ln])
                print(f"{name}: vLLM CPU does not run it: {(lines or ['(no error line)'])[-1][-240:]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
