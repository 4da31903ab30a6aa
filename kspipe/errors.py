"""The errors kspipe reports to a user as one line, without a traceback."""


class KspipeError(Exception):
    """A problem the user can fix: bad configuration, bad data, a failed cluster.

    The command line prints ``kspipe: error: <message>`` and exits non-zero.
    """

    exit_code = 2


class ConfigError(KspipeError):
    """A configuration value is missing, out of range or names nothing known."""


class DataError(KspipeError):
    """A data folder or file is missing, empty, unreadable or too small for the task."""


class ClusterError(KspipeError):
    """A process of a distributed job failed, or the cluster could not be started."""

    exit_code = 3
