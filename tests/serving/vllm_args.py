"""Run in vLLM's venv: the argument vectors of `vllm serve` lines (a JSON list of argv lists, each
starting with "vllm", "serve") through vLLM's own `vllm serve` parser (the subcommand its CLI builds,
vllm/entrypoints/cli/main.py) and ``EngineArgs.from_cli_args``; with ``"config": true`` also through
``create_engine_config`` (vLLM's engine-config validation: the model directory must exist here).
Writes, per argv, the parsed engine arguments that matter or the error vLLM raised."""

from __future__ import annotations

import json
import sys


def check(argv: list[str], config: bool) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    assert argv[0] == "vllm"
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as exc:  # argparse's own refusal (printed on stderr)
        return {"error": f"argparse exit {exc.code}"}
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    cmd.validate(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    out = {k: getattr(engine, k) for k in ("model", "load_format", "tensor_parallel_size", "pipeline_parallel_size",
                                           "data_parallel_size", "enable_expert_parallel", "quantization", "dtype",
                                           "max_model_len", "max_num_seqs", "block_size", "kv_cache_dtype",
                                           "gpu_memory_utilization", "served_model_name")}
    out = {k: v if isinstance(v, (str, int, float, bool, type(None), list)) else str(v) for k, v in out.items()}
    if config:
        try:
            vc = engine.create_engine_config()
            out["engine_config"] = {"tp": vc.parallel_config.tensor_parallel_size,
                                    "max_model_len": vc.model_config.max_model_len,
                                    "load_format": str(vc.load_config.load_format)}
        except Exception as exc:  # noqa: BLE001 - the validation's verdict is the result
            out["engine_config_error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # "shardc" is a load format only once the entry point has run, as in `vllm serve`
    with open(sys.argv[2], "w") as f:
        json.dump([check(c["argv"], c.get("config", False)) for c in cases], f)
