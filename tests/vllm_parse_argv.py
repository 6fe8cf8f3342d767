"""Runs inside the vLLM env: parses `vllm serve` argv lists with vLLM's own CLI parser, the way the
`vllm` command does (serve subparser, model_tag -> model, the serve validation), then builds
`AsyncEngineArgs.from_cli_args` -- constructing the arguments only, starting nothing. For every
`--quantization` value among them it also reports what vLLM's config classes make of it.

stdin: JSON {"name": [argv...], ...}; stdout (last line): JSON {"argv": {"name": null | "error text", ...},
"quantization": {"method": {...}, ...}}.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def parse(argv: list[str]) -> str | None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:2] != ["vllm", "serve"]:
        return f"argv does not start with 'vllm serve': {argv[:2]}"
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv[1:])  # unknown arguments are an error here
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip() and not line.startswith("usage")]
        return " | ".join(lines)[-1500:] or "argparse exit"
    try:
        if args.model_tag is not None:
            args.model = args.model_tag
        command.validate(args)
        AsyncEngineArgs.from_cli_args(args)
    except Exception as err:  # what vLLM would stop on before starting
        return f"{type(err).__name__}: {err}"
    return None


def quantization(method: str) -> dict:
    """An online shorthand: its weight and activation quant keys as [rows, cols, dtype, static]; "fp8":
    whether it takes a checkpoint that is not stored in FP8 (the error vLLM stops on, if not)."""
    from vllm.config.quantization import _ONLINE_SHORTHANDS
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerBlockOnlineLinearMethod

    def shape(key) -> list:
        return [key.scale.group_shape.row, key.scale.group_shape.col, str(key.dtype), key.scale.static]

    if method == "fp8":
        try:
            Fp8Config(is_checkpoint_fp8_serialized=False)
            return {"bf16_checkpoint": None}
        except ValueError as err:
            return {"bf16_checkpoint": str(err)}
    spec = _ONLINE_SHORTHANDS[method]
    out = {"linear": shape(spec.linear.weight), "moe": shape(spec.moe.weight)}
    if method == "fp8_per_block":
        out["activation"] = shape(Fp8PerBlockOnlineLinearMethod.activation_quant_key)
    return out


def main() -> None:
    argvs = json.load(sys.stdin)
    results = {name: parse(argv) for name, argv in argvs.items()}
    methods = {a[a.index("--quantization") + 1] for a in argvs.values() if "--quantization" in a} | {"fp8"}
    print(json.dumps({"argv": results, "quantization": {m: quantization(m) for m in sorted(methods)}}))


if __name__ == "__main__":
    main()
