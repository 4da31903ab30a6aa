"""PaddleRec's online layout: ``<root>/<YYYYMMDD>/<HHMM>/`` folders of log files.

A day has ``1440 / split_interval`` HHMM folders (``0000``, then every ``split_interval``
minutes); a pass is ``split_per_pass`` consecutive folders.  A pass's files are those of
its folders (hidden files and the donefile left out).  Given ``ctr.stream.donefile``, a
pass waits for it in each of its folders (a look every ``data_sleep_second``) and gives
up after ``data_timeout_s`` in one line; without it the folders are taken as complete.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

from kspipe.errors import ConfigError, DataError
from kspipe.files import user_path

DAY_FORMAT = "%Y%m%d"


@dataclass(frozen=True)
class Pass:
    """One pass of a day: its day, its number in the day (from 0), its HHMM folders."""

    day: str
    index: int
    folders: tuple

    @property
    def span(self) -> str:
        return f"{self.day} {self.folders[0]}-{self.folders[-1]}"


def parse_day(text, key: str) -> datetime.date:
    try:
        return datetime.datetime.strptime(str(text), DAY_FORMAT).date()
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a day written YYYYMMDD") from None


def check(s) -> None:
    """One line for a stream config that cannot run, before anything starts."""
    root = user_path(s.root)
    if not os.path.isdir(root):
        raise DataError(f"ctr.stream.root={s.root}: no such folder")
    if s.split_interval < 1 or 1440 % s.split_interval:
        raise ConfigError(
            f"ctr.stream.split_interval={s.split_interval} must divide a day's 1440 minutes"
        )
    folders = 1440 // s.split_interval
    if s.split_per_pass < 1 or folders % s.split_per_pass:
        raise ConfigError(
            f"ctr.stream.split_per_pass={s.split_per_pass} must divide a day's {folders} "
            f"folders of {s.split_interval} minutes"
        )
    for key in ("data_sleep_second", "data_timeout_s"):
        if s[key] <= 0:
            raise ConfigError(f"ctr.stream.{key}={s[key]} must be above 0")
    if s.save_delta_frequency < 1:
        raise ConfigError(
            f"ctr.stream.save_delta_frequency={s.save_delta_frequency} must be at least 1"
        )
    found = days(s)
    if s.donefile is None:  # offline: every day is there now
        for day in found:
            if not os.path.isdir(os.path.join(root, day)):
                raise DataError(
                    f"ctr.stream: day folder {os.path.join(root, day)} is missing (days "
                    f"{found[0]} to {found[-1]}; set ctr.stream.end_day, or "
                    f"ctr.stream.donefile to wait for days still to come)"
                )


def days(s) -> list[str]:
    """The stream's days, ``YYYYMMDD``, from ``start_day`` to ``end_day`` included."""
    root = user_path(s.root)
    start = s.start_day
    if start is None:
        present = sorted(d for d in os.listdir(root) if len(d) == 8 and d.isdigit())
        if not present:
            raise DataError(f"ctr.stream.root={s.root} holds no YYYYMMDD day folder")
        start = present[0]
    first = parse_day(start, "ctr.stream.start_day")
    last = parse_day(s.end_day, "ctr.stream.end_day") if s.end_day is not None else first
    if last < first:
        raise ConfigError(f"ctr.stream.end_day={s.end_day} is before start_day={start}")
    return [
        (first + datetime.timedelta(days=k)).strftime(DAY_FORMAT)
        for k in range((last - first).days + 1)
    ]


def passes(s, day: str) -> list[Pass]:
    """The passes of ``day``, in order."""
    names = [f"{m // 60:02d}{m % 60:02d}" for m in range(0, 1440, s.split_interval)]
    per = s.split_per_pass
    return [Pass(day, k, tuple(names[k * per : (k + 1) * per])) for k in range(len(names) // per)]


def present(s, p: Pass) -> bool:
    """Whether any folder of ``p`` exists now (a pass whose folders are all absent, in a
    day that has ended, is not waited for)."""
    root = user_path(s.root)
    return any(os.path.isdir(os.path.join(root, p.day, name)) for name in p.folders)


def files(s, p: Pass, clock=time.monotonic, sleep=time.sleep) -> list[str]:
    """The files of pass ``p``, sorted; waits for each folder's donefile if one is named."""
    root = user_path(s.root)
    if s.donefile is not None:
        wait_for_done(s, p, root, clock, sleep)
    found = []
    for name in p.folders:
        folder = os.path.join(root, p.day, name)
        if not os.path.isdir(folder):
            continue
        found += sorted(
            os.path.join(folder, f)
            for f in os.listdir(folder)
            if not f.startswith(".") and f != s.donefile and os.path.isfile(os.path.join(folder, f))
        )
    return found


def wait_for_done(s, p: Pass, root: str, clock, sleep) -> None:
    started = clock()
    for name in p.folders:
        done = os.path.join(root, p.day, name, s.donefile)
        while not os.path.isfile(done):
            if clock() - started >= s.data_timeout_s:
                raise DataError(
                    f"ctr.stream: {done} did not come within {s.data_timeout_s:g} s "
                    f"(ctr.stream.data_timeout_s); the stream's saves are kept: resume= "
                    f"goes on from the last one"
                )
            sleep(s.data_sleep_second)
