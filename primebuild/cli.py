"""The `primebuild` command line.

Each command lives in `primebuild/commands/<name>.py` and is imported only when it runs, so that
`primebuild validate` and `primebuild plan` start in milliseconds and never import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback

import click

from primebuild.errors import UserError

# command name -> module under primebuild.commands exposing a click command called `command`
COMMANDS = {
    "validate": "validate",
    "plan": "plan",
    "schema": "schema",
    "lock": "lock",
    "build": "build",
    "store": "store",
    "run": "run",
    "render": "render",
    "worker": "worker",
    "status": "status",
    "logs": "logs",
    "stop": "stop",
    "scale": "scale",
    "replay": "replay",
    "diff": "diff",
    "verify": "verify",
    "export": "export",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that subcommand is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n, m in COMMANDS.items() if _module_exists(m))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is None or not _module_exists(module):
            return None
        return importlib.import_module(f"primebuild.commands.{module}").command


def _module_exists(module: str) -> bool:
    return importlib.util.find_spec(f"primebuild.commands.{module}") is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for every error.")
@click.version_option(package_name="primebuild")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Declarative, reproducible asynchronous RL for LLMs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        result = cli.main(args=argv, prog_name="primebuild", standalone_mode=False)
        # click returns (not raises) the code of a `click.exceptions.Exit` without standalone mode
        return result if isinstance(result, int) else 0
    except UserError as err:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {err.render()}", err=True)
        return 2
    except click.exceptions.Exit as ex:
        return ex.exit_code
    except click.ClickException as err:  # bad flags, missing files: the user's to fix
        err.show()
        return 2
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    except Exception as err:  # our bug
        if debug:
            traceback.print_exc()
        else:
            click.echo(f"internal error: {type(err).__name__}: {err}\n(re-run with --debug for a traceback)", err=True)
        return 1


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
