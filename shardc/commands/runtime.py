"""`shardc run` and `shardc gate`: execute built shards for real. Parsing and formatting only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from .options import json_option

_TIMEOUT_HELP = "Seconds any collective or pipeline wait may take before it is an error naming the rank."


@dataclass(frozen=True)
class RunOutput:
    """One prompt of ``shardc run``: as given (text, or the ids joined by commas), its ids, the new
    tokens, and their text (None without a tokenizer)."""

    prompt: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None


@dataclass(frozen=True)
class Run:
    """What ``shardc run --json`` prints: the generate result in the command's words."""

    plan: str
    outputs: list[RunOutput]
    seconds: float  # generation, on the rank holding the tokens (after every shard is loaded)
    load_seconds: float  # that rank's shard load
    tokens_per_s: float | None
    wall_seconds: float  # from the command's start to the last token (rank start-up and loads included)
    first_token_seconds: float  # from the start of generation to the first token (prefill)


@click.command("run", epilog="""\b
Examples:
  shardc run --manifest build/demo-tp3pp2-bf16/manifest.json --prompt "The capital of France is"
  shardc run --manifest build/x --prompt-ids 1,2,3 --max-new-tokens 8 --json
  torchrun --nproc-per-node 6 -m shardc.cli run --manifest build/demo-tp3pp2-bf16 --prompt "Hi"
""")
@click.option("--manifest", "manifest_path", required=True,
              help="A build's manifest.json (or the build directory).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="Directory holding the shards [default: the manifest's directory].")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for several; each is a micro-batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="A prompt as comma-separated token ids (for builds without a tokenizer).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path),
              help="tokenizer.json (or its directory) [default: the one shipped with the build].")
@click.option("--device", default="cpu", show_default=True,
              help="cpu (gloo), or cuda (nccl; rank r on cuda:LOCAL_RANK, one GPU per rank).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              help=_TIMEOUT_HELP)
@json_option
def run_cmd(manifest_path: str, directory: Path | None, prompts: tuple[str, ...],
            prompt_ids: tuple[str, ...], max_new_tokens: int, tokenizer: Path | None, device: str,
            timeout_s: float, as_json: bool) -> None:
    """Generate text greedily from a built plan: every rank loads only its own shard file."""
    import time

    t0 = time.perf_counter()
    from ..errors import ManifestError
    from ..runtime.api import generate, load_tokenizer, open_build
    from .output import Stderr, emit

    ref = open_build(manifest_path, directory)
    if not prompts and not prompt_ids:
        raise ManifestError("give --prompt TEXT or --prompt-ids IDS", key="prompt")
    tok = load_tokenizer(ref, tokenizer) if prompts or tokenizer else None
    encoded: list[list[int]] = [tok.encode(p).ids for p in prompts] if tok else []
    for spec in prompt_ids:
        try:
            encoded.append([int(x) for x in spec.split(",") if x.strip()])
        except ValueError:
            raise ManifestError(f"--prompt-ids {spec!r} is not a comma-separated list of integers") from None
    vocab = int(ref.manifest.model["vocab_size"])
    bad = [i for p in encoded for i in p if not 0 <= i < vocab]
    if bad:
        raise ManifestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", key="prompt-ids")
    res = generate(ref, encoded, max_new_tokens, timeout_s=timeout_s, device=device)
    if res is None:  # under torchrun, only the rank that holds the tokens prints
        return
    wall = time.perf_counter() - t0
    first = res.seconds - (res.decode_seconds if res.decode_seconds is not None else res.seconds)
    labels = list(prompts) + [",".join(map(str, p)) for p in encoded[len(prompts):]]
    texts = [tok.decode(t) if tok else None for t in res.tokens]
    n = sum(len(t) for t in res.tokens)
    outputs = [RunOutput(lab, p, list(t), x) for lab, p, t, x in zip(labels, encoded, res.tokens, texts, strict=True)]

    def text() -> list[str]:
        lines: list[str] = []
        for i, (lab, t, x) in enumerate(zip(labels, res.tokens, texts, strict=True)):
            if len(labels) > 1:  # a continuation may span lines: say where each output starts
                lines.append(f"{'' if i == 0 else chr(10)}--- output {i + 1} of {len(labels)} ---")
            lines.append(f"{lab}{x}" if x is not None else f"[{lab}] -> {','.join(map(str, t))}")
        return [*lines, Stderr(
            f"({ref.name}: {n} tokens, {wall:.2f}s from the command's start to the last token: ranks started "
            f"and every shard loaded in {wall - res.seconds:.2f}s (this rank's shard {res.load_seconds:.2f}s), "
            f"the first token {first:.2f}s later, the rest in {res.seconds - first:.2f}s)")]

    emit(Run(ref.name, outputs, res.seconds, res.load_seconds, n / res.seconds if res.seconds else None,
             wall, first), as_json, text)


@click.command("gate", epilog="""\b
Exit codes: 0 pass, 1 fail (a threshold is exceeded, or a rank died), 2 bad input.
Examples:
  shardc gate --baseline build/demo-tp1pp1-bf16 --candidate build/demo-tp3pp2-bf16
  shardc gate --baseline b/manifest.json --candidate c/manifest.json --golden eval.jsonl \\
      --max-tokens 16384 --max-kl 0.01 --min-top1 0.97 --json --report gate.json
  shardc gate --baseline b --candidate c --device cuda --baseline-cache b-pydoc.safetensors
  shardc gate --baseline build/demo-tp1pp1-bf16 --candidate build/demo-tp3pp2-bf16 --reference transformers
""")
@click.option("--baseline", required=True, help="The trusted plan's manifest.json (or build directory).")
@click.option("--candidate", required=True, help="The new plan's manifest.json (or build directory).")
@click.option("--baseline-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Shard directory of the baseline [default: next to its manifest].")
@click.option("--candidate-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Shard directory of the candidate [default: next to its manifest].")
@click.option("--golden", default="pydoc", show_default=True,
              help="pydoc (Python's bundled pydoc_data.topics), a .txt file or a .jsonl file.")
@click.option("--max-tokens", type=click.IntRange(2), default=8192, show_default=True,
              help="Tokens of the golden text to score.")
@click.option("--window", type=click.IntRange(2), default=512, show_default=True,
              help="Tokens per scoring window (each scored independently).")
@click.option("--max-ppl-delta-pct", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Largest allowed |candidate/baseline perplexity - 1| in percent.")
@click.option("--max-kl", type=click.FloatRange(min=0), help="Largest allowed mean KL(baseline||candidate).")
@click.option("--min-top1", type=click.FloatRange(0, 1), help="Smallest allowed top-1 agreement (0..1).")
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path),
              help="tokenizer.json [default: the baseline build's].")
@click.option("--device", default="cpu", show_default=True,
              help="cpu (gloo) or cuda (nccl): baseline, then candidate, on the same GPUs.")
@click.option("--baseline-cache", type=click.Path(dir_okay=False, path_type=Path),
              help="Keep the baseline's logits here; a later gate of the same baseline, golden text and "
                   "windows reads them instead of rescoring. The file carries a digest keyed by the "
                   "baseline manifest (and SHARDC_GATE_CACHE_SECRET if set): another baseline's, an "
                   "edited or a damaged cache is recomputed. Refused inside a build directory.")
@click.option("--reference", type=click.Choice(["shardc", "transformers"]), default="shardc", show_default=True,
              help="What scores the baseline: shardc's sharded runtime, or transformers itself "
                   "(AutoModelForCausalLM, its default attention: SDPA where the model has it, after verify's checks; "
                   "needs a tp=1 baseline) "
                   "so a runtime bug cannot pass both sides. The candidate is always scored by shardc.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              help=_TIMEOUT_HELP)
@json_option
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the JSON report to this file (for CI artifacts).")
@click.pass_context
def gate_cmd(ctx: click.Context, baseline: str, candidate: str, baseline_dir: Path | None,
             candidate_dir: Path | None, golden: str, max_tokens: int, window: int,
             max_ppl_delta_pct: float, max_kl: float | None, min_top1: float | None,
             tokenizer: Path | None, device: str, baseline_cache: Path | None, reference: str,
             timeout_s: float, as_json: bool, report_path: Path | None) -> None:
    """Compare a candidate plan with a baseline plan on a golden text; exit 1 if it drifts."""
    from ..layout.plan import canonical_json
    from ..results import to_json
    from ..runtime.gate import Thresholds, run_gate
    from ..runtime.gate_report import format_report
    from .output import emit, ensure_parent

    for path, flag in ((report_path, "--report"), (baseline_cache, "--baseline-cache")):
        if path is not None:
            ensure_parent(path, flag)
    report = run_gate(
        baseline, candidate, golden=golden, max_tokens=max_tokens, window=window,
        thresholds=Thresholds(max_ppl_delta_pct, max_kl, min_top1), baseline_dir=baseline_dir,
        candidate_dir=candidate_dir, tokenizer=tokenizer, timeout_s=timeout_s, device=device,
        baseline_cache=baseline_cache, note=lambda line: click.echo(line, err=True), reference=reference,
    )
    if report is None:  # under torchrun, only the rank that holds the comparison reports
        return
    if report_path is not None:
        from ..formats.files import write_atomic

        write_atomic(report_path, canonical_json(to_json(report)))
    emit(report, as_json, lambda: [format_report(report)])
    ctx.exit(0 if report.passed else 1)


COMMANDS = [run_cmd, gate_cmd]
