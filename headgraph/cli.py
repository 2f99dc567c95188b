"""The `headgraph` command line: one click group, each command a thin layer over the library."""

import sys

import click

from headgraph import __version__
from headgraph.errors import HeadgraphError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(__version__, prog_name="headgraph")
@click.pass_context
def cli(ctx, debug):
    """Map attention heads' subspace affinities (Projection Kernel) and roles as a queryable graph."""
    ctx.obj = {"debug": debug}


def main(argv=None):
    """Console entry point: user-facing errors become one line on stderr and a non-zero exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        cli.main(args=args, prog_name="headgraph", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except HeadgraphError as e:
        if "--debug" in args:
            raise
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - last line of defence for the CLI
        if "--debug" in args:
            raise
        click.echo(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", err=True)
        sys.exit(1)
