"""The ``kspipe`` command (and ``python -m kspipe``): :func:`kspipe.cli.command.main`, with
a stop asked for while the command's own modules import (Ctrl-C as soon as it is typed,
SIGTERM) said in one line, as :func:`kspipe.cli.command.main` says a stop that comes
later."""

from __future__ import annotations

from kspipe.process import stopping


def main() -> None:
    stopping.handle_stop_signals()
    try:
        from kspipe.cli.command import main as command
    except KeyboardInterrupt as stop:
        stopping.exit_stopped(stop, " before the job began")
    command()


if __name__ == "__main__":
    main()
