"""``cluster.launcher=relay``: kspipe's plan, each process started through a relay."""

import os
import sys

from kspipe import hookimpl
from kspipe.errors import ConfigError
from kspipe.launchers.processes import ProcessLauncher

RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py")
MOST = 4


class RelayLauncher(ProcessLauncher):
    name = "relay"

    def check(self, cfg, processes):
        if processes > MOST:
            raise ConfigError(
                f"cluster.launcher=relay starts at most {MOST} processes; this job has {processes}"
            )

    def command(self, planned, command):
        return [sys.executable, RELAY, f"{planned.role}.{planned.index}", *command]


@hookimpl
def kspipe_process_launchers():
    return [RelayLauncher()]
