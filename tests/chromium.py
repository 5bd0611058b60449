"""A headless Chromium driven over the DevTools protocol on a pipe, with the standard library
only (test helper for the HTML reports).

Chromium started with `--remote-debugging-pipe` reads protocol commands from its fd 3 and
writes responses and events to its fd 4, each message JSON followed by a NUL byte. One page
is opened and every command goes to it through a flat session.
"""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find() -> str | None:
    return next((path for b in BINARIES if (path := shutil.which(b))), None)


class ChromiumError(RuntimeError):
    pass


class Page:
    """`with Page() as page: page.open(url); page.evaluate("1 + 1")`."""

    def __init__(self, binary: str | None = None, width: int = 1366, height: int = 900,
                 timeout: float = 60.0):
        self.binary = binary or find()
        if self.binary is None:
            raise ChromiumError(f"no Chromium found (looked for {', '.join(BINARIES)})")
        self.width, self.height, self.timeout = width, height, timeout
        self.events: list[dict] = []
        self._next_id = 0
        self._buffer = b""

    def __enter__(self) -> "Page":
        self._profile = tempfile.TemporaryDirectory(prefix="glm5-chromium-")
        to_child, self._send_fd = os.pipe()
        self._recv_fd, from_child = os.pipe()

        def as_fds_3_and_4():  # runs in the child before exec; pass_fds keeps 3 and 4 open
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        self._proc = subprocess.Popen(
            [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(3, 4), preexec_fn=as_fds_3_and_4)
        os.close(to_child)
        os.close(from_child)
        try:
            target = self._command("Target.createTarget", {"url": "about:blank"})["targetId"]
            self._session = self._command("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Network"):
                self.send(f"{domain}.enable")
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._proc.poll() is None:
                self._command("Browser.close", {}, timeout=10)
        except (ChromiumError, OSError):
            pass
        finally:
            for fd in (self._send_fd, self._recv_fd):
                os.close(fd)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stderr.close()
            self._profile.cleanup()

    # -- the protocol ------------------------------------------------------------------------
    def send(self, method: str, params: dict | None = None) -> dict:
        """A command to the page; its result."""
        return self._command(method, params or {}, session=True)

    def _command(self, method: str, params: dict, *, session: bool = False, timeout: float | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise ChromiumError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChromiumError("no reply from Chromium in time")
            ready, _, _ = select.select([self._recv_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._recv_fd, 1 << 20)
            if not chunk:
                raise ChromiumError("Chromium exited: " + self._proc.stderr.read().decode(errors="replace")[-2000:])
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    # -- what tests use ----------------------------------------------------------------------
    def open(self, url: str, ready: str = "document.readyState === 'complete'") -> None:
        """Navigates to `url` and waits until the JavaScript expression `ready` is true."""
        seen = len(self.events)
        navigation = self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + self.timeout
        if "loaderId" in navigation:   # a new document (not a jump within this one): wait for it
            while not any(e["method"] == "Page.loadEventFired" for e in self.events[seen:]):
                message = self._read(deadline)
                if "method" in message:
                    self.events.append(message)
        while not self.evaluate(f"Boolean({ready})"):
            if time.monotonic() > deadline:
                raise ChromiumError(f"{url}: {ready} did not become true")
            time.sleep(0.05)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise ChromiumError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the whole page (beyond the viewport), written to `path`."""
        data = base64.b64decode(self.send("Page.captureScreenshot",
                                          {"format": "png", "captureBeyondViewport": True})["data"])
        Path(path).write_bytes(data)
        return data

    def errors(self) -> list[str]:
        """Uncaught exceptions and console errors the page produced so far."""
        out = []
        for e in self.events:
            if e["method"] == "Runtime.exceptionThrown":
                out.append(e["params"]["exceptionDetails"].get("text", "exception"))
            elif e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error":
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"]))
        return out

    def requests(self) -> list[str]:
        """URLs the page requested."""
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]
