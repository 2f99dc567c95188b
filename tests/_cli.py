"""The `headgraph` entry point run in this process, for tests that check exit codes and what reaches stderr."""

from headgraph.cli import main


def run_cli(args, capsys):
    """(exit code, stdout, stderr) of `headgraph ARGS`."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
