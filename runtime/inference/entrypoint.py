"""The command line shared by the inference processes (server, P/D router): `--config FILE`, whose
typed config (primebuild/contracts/) is parsed and served; a bad config is a located error, exit 2."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from primebuild.contracts.base import Contract, load_contract
from primebuild.errors import UserError

C = TypeVar("C", bound=Contract)


def serve_main(argv: list[str] | None, *, prog: str, description: str, config_class: type[C],
               serve: Callable[[C], None]) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help=f"a {config_class.__name__} as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(load_contract(config_class, args.config))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
