"""A kspipe process caps glibc's malloc arenas at its cores (kspipe/memory.py): threads that
allocate then share arenas instead of each keeping one's freed memory."""

import os
import subprocess
import sys

import pytest

#: Starts 16 threads that each allocate and wait for the others (a thread gets an arena of
#: its own while glibc's cap allows, and gives it back when it ends), then prints glibc's
#: malloc_info: one <heap> per arena.
ARENAS = """
import ctypes, sys, threading
if sys.argv[1] == "kspipe":
    import kspipe.cli  # what a kspipe command imports first
elif sys.argv[1] == "worker":
    import kspipe.worker
together = threading.Barrier(16)
def allocate():
    for _ in range(20):
        ctypes.create_string_buffer(64 * 1024)
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
out = libc.fdopen(1, b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fflush(ctypes.c_void_p(out))
"""


def arenas(how: str, env: dict | None = None) -> int:
    result = subprocess.run([sys.executable, "-c", ARENAS, how], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.count("<heap nr=")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_kspipe_process_has_as_many_arenas_as_cores():
    cores = max(2, len(os.sched_getaffinity(0)))
    plain = arenas("plain")
    assert plain > cores  # the threads would each take one (so the check below can fail)
    assert arenas("kspipe") <= cores
    assert arenas("worker") <= cores
    assert arenas("kspipe", {"MALLOC_ARENA_MAX": "5"}) == 5  # the user's own cap is kept
