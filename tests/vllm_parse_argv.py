"""Runs inside the vLLM env: parses `vllm serve` argv lists with vLLM's own CLI parser, the way the
`vllm` command does (serve subparser, model_tag -> model, the serve validation), then builds
`AsyncEngineArgs.from_cli_args` -- constructing the arguments only, starting nothing.

stdin: JSON {"name": [argv...], ...}; stdout (last line): JSON {"name": null | "error text", ...}.
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


def main() -> None:
    argvs = json.load(sys.stdin)
    results = {name: parse(argv) for name, argv in argvs.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
