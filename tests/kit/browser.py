"""The text a page shows in a real headless Chromium, read over its DevTools protocol."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def page_text(url: str, wanted: list[str], profile: Path, timeout: float = 120) -> str:
    """The text of ``url`` in headless Chromium once it shows every string of ``wanted``
    (or at ``timeout``), read over the DevTools protocol on a pipe (fds 3 and 4)."""
    commands, replies = os.pipe(), os.pipe()

    def as_fds_3_and_4():
        os.dup2(commands[0], 3)
        os.dup2(replies[1], 4)

    browser = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ],
        pass_fds=(3, 4, commands[0], replies[1]),
        preexec_fn=as_fds_3_and_4,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(commands[0])
    os.close(replies[1])
    received, numbers = b"", iter(range(1, 1 << 30))

    def call(method, session=None, **params):
        nonlocal received
        message = {"id": next(numbers), "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(commands[1], json.dumps(message).encode() + b"\0")
        while True:  # replies and events, each ended by a NUL byte
            while b"\0" not in received:
                chunk = os.read(replies[0], 1 << 16)
                assert chunk, "chromium closed its DevTools pipe"
                received += chunk
            raw, received = received.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == message["id"]:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    script = "document.title + '\\n' + (document.body ? document.body.innerText : '')"
    try:
        target = call("Target.createTarget", url="about:blank")["targetId"]
        session = call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        call("Page.navigate", session, url=url)
        deadline = time.monotonic() + timeout
        while True:
            text = call("Runtime.evaluate", session, expression=script, returnByValue=True)[
                "result"
            ].get("value", "")
            if all(w in text for w in wanted) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)
    finally:
        with contextlib.suppress(OSError, AssertionError):
            call("Browser.close")
        os.close(commands[1])
        os.close(replies[0])
        try:
            browser.wait(timeout=30)
        except subprocess.TimeoutExpired:
            browser.kill()
            browser.wait(timeout=30)
