"""The `fedmq` command line (Typer): the app that puts the commands together (cli/commands/, one module per
command or command group) and its entry point. Every user error ends in one line on stderr and exit code 2."""

from __future__ import annotations

import sys

import typer

from fedmq.cli.commands import agent, aggregator, bench, broker
from fedmq.cli.commands.experiment import experiment
from fedmq.cli.commands.report import report
from fedmq.cli.commands.simulate import simulate
from fedmq.cli.commands.status import status
from fedmq.cli.help import HelpCommand, HelpGroup
from fedmq.errors import FedmqError

app = typer.Typer(
    cls=HelpGroup,
    add_completion=True,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="fedmq: asynchronous federated learning over a message broker.",
)
app.add_typer(aggregator.app, name="aggregator")
app.add_typer(agent.app, name="agent")
app.add_typer(broker.app, name="broker")
app.add_typer(bench.app, name="bench")
for command in (simulate, status, report, experiment):
    app.command(cls=HelpCommand)(command)


def main() -> None:
    """Console entry point: user errors become one line on stderr, never a traceback."""
    from fedmq.cli.logs import configure

    configure("warning")  # commands that log (simulate, services) configure their own level and format
    try:
        code = app(standalone_mode=False)  # returns the exit code of typer.Exit instead of raising it
        if isinstance(code, int) and code:
            sys.exit(code)
    except FedmqError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))  # 2: the command line was wrong; 1: a run that broke
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # errors of typer's bundled click (bad flag values, unknown options)
        if type(exc).__name__ == "NoArgsIsHelpError" or not hasattr(exc, "format_message"):
            if hasattr(exc, "show") and hasattr(exc, "exit_code"):
                exc.show()
                sys.exit(exc.exit_code)
            raise
        ctx = getattr(exc, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)  # one line, like fedmq's own errors
        sys.exit(getattr(exc, "exit_code", 2))


if __name__ == "__main__":
    main()
