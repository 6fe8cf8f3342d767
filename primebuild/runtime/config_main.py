"""The command line of every process the plan starts with a typed config (trainer, orchestrator,
inference server, P/D routers): `--config FILE`, parsed into its contract (primebuild/contracts/) and
run; a bad config or any other user error is one located message and exit 2, no traceback."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from primebuild.contracts.base import Contract, load_contract
from primebuild.errors import UserError
from primebuild.gc_tuning import freeze_startup

C = TypeVar("C", bound=Contract)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def config_main(argv: list[str] | None, *, prog: str, config_class: type[C], run: Callable[[C], object],
                description: str | None = None, log_format: str | None = LOG_FORMAT,
                failures: tuple[type[Exception], ...] = ()) -> int:
    """Parse `--config`, run, and map the outcome to an exit code: 0 done, 2 user error, 1 for one of
    `failures` (a run that went wrong, e.g. a non-finite step), reported without a traceback too.
    `log_format` None: `run` configures logging itself."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help=f"a {config_class.__name__} as JSON")
    args = parser.parse_args(argv)
    if log_format is not None:
        logging.basicConfig(level=logging.INFO, format=log_format)
    try:
        config = load_contract(config_class, args.config)
        freeze_startup()  # the modules imported so far live as long as the process
        run(config)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except failures as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if err.errno not in DISK_ERRNOS:
            raise
        # a full or read-only disk: the same writes would fail again, so this is an error of its own (the
        # supervisor restarts no process that printed one)
        where = f" writing {err.filename}" if err.filename else ""
        print(f"error: {err.strerror}{where}: free space where the run writes (its runs folder: retention, "
              "checkpoint_every), or move it with --runs-dir, then `primebuild run --resume`", file=sys.stderr)
        return 1
    return 0


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
