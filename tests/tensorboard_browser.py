"""A real TensorBoard server and a headless Chromium driven over the DevTools protocol, for the end-to-end tests and
``docs/make_screenshot.py``.

* :class:`TensorBoardServer` runs ``tensorboard --logdir DIR --host 127.0.0.1 --port PORT`` as a subprocess, waits for
  its HTTP API and always stops it (terminate, wait, kill) when the ``with`` block ends.
* :class:`HeadlessChromium` runs Debian's ``chromium --headless`` with ``--remote-debugging-pipe``: DevTools commands
  go as JSON over two pipes (file descriptors 3 and 4 of the browser), no extra package needed. TensorBoard's
  dashboards live in shadow DOM, which ``--dump-dom`` does not show, so the page's text is read by a script that walks
  the shadow roots.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tensorboard_command() -> list[str]:
    """The ``tensorboard`` script of this Python environment, or ``python -m tensorboard.main``."""
    script = Path(sys.executable).parent / "tensorboard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tensorboard.main"]


class TensorBoardServer:
    """``tensorboard --logdir logdir`` on a free port of 127.0.0.1, for the duration of a ``with`` block."""

    def __init__(self, logdir: Path, startup_timeout: float = 60.0) -> None:
        self.logdir = logdir
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (TensorBoard's output; closed by stop())

    def __enter__(self) -> TensorBoardServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for _attempt in range(3):  # another process may take the free port before TensorBoard binds it
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            command = [*tensorboard_command(), "--logdir", str(self.logdir), "--host", "127.0.0.1", "--port", str(port)]
            # load_fast=false: the Python loader, in this one process (the Rust data server would be a child process)
            command.append("--load_fast=false")
            self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                with contextlib.suppress(OSError, ValueError):  # not listening yet (URLError is an OSError)
                    self.get_json("/data/runs")
                    return
                time.sleep(0.2)
            if self.process.poll() is None:
                raise TimeoutError(f"TensorBoard did not answer within {self.startup_timeout:.0f} s:\n{self.output()}")
        raise RuntimeError(f"TensorBoard exited with status {self.process.returncode}:\n{self.output()}")

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def wait_for(self, path: str, ready: Callable[[Any], bool], timeout: float = 60.0) -> Any:
        """Poll ``path`` until ``ready(its JSON)``; TensorBoard loads event files in the background."""
        deadline = time.monotonic() + timeout
        while True:
            data = self.get_json(path)
            if ready(data):
                return data
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not become ready within {timeout:.0f} s; last answer: {data}")
            time.sleep(0.2)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        process, self.process = self.process, None
        _terminate(process)
        self._log.close()


def _terminate(process: subprocess.Popen[bytes] | None) -> None:
    """Stop a child process that may still run: terminate, then kill if it does not exit within 10 s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


# Text of the page, shadow roots included, without style and script contents, whitespace collapsed
_PAGE_TEXT_JS = """
(() => {
  const parts = [];
  const walk = (node) => {
    if (node.shadowRoot) walk(node.shadowRoot);
    if (node.nodeType === Node.TEXT_NODE) parts.push(node.textContent);
    if (node.nodeName === 'STYLE' || node.nodeName === 'SCRIPT') return;
    for (const child of node.childNodes) walk(child);
  };
  walk(document.documentElement);
  return parts.join(' ').replace(/\\s+/g, ' ');
})()
"""


class HeadlessChromium:
    """A headless Chromium with one page, driven over ``--remote-debugging-pipe``; closed when the block ends."""

    def __init__(self, binary: str, width: int = 1400, height: int = 900) -> None:
        self.binary = binary
        self.width = width
        self.height = height
        self.process: subprocess.Popen[bytes] | None = None
        self._profile = tempfile.TemporaryDirectory()
        self._buffer = b""
        self._next_id = 0
        self._session = ""
        self._to_browser = self._from_browser = -1

    def __enter__(self) -> HeadlessChromium:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        browser_reads, self._to_browser = os.pipe()
        self._from_browser, browser_writes = os.pipe()

        def wire_pipes() -> None:  # in the child: the DevTools pipe is fds 3 (commands in) and 4 (answers out)
            high_read = fcntl.fcntl(browser_reads, fcntl.F_DUPFD, 10)
            high_write = fcntl.fcntl(browser_writes, fcntl.F_DUPFD, 10)
            os.dup2(high_read, 3)
            os.dup2(high_write, 4)

        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={self._profile.name}",
            f"--window-size={self.width},{self.height}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        try:
            self.process = subprocess.Popen(
                [self.binary, *flags],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=wire_pipes,  # only fd juggling between fork and exec
                close_fds=False,
                start_new_session=True,  # its helper processes too can then be stopped as one group
            )
        finally:
            os.close(browser_reads)
            os.close(browser_writes)
        pages = [t for t in self.command("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        attached = self.command("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)
        self._session = attached["sessionId"]
        # --window-size counts the window's frame; the page itself gets exactly width x height this way
        self.command(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def command(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        """Send one DevTools command (to the page once attached) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self._session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer from Chromium to {method} within {timeout:.0f} s")
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe (exit status {self.process_status()})")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return dict(answer["result"])

    def process_status(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def open(self, url: str) -> None:
        self.command("Page.navigate", url=url)

    def text(self) -> str:
        """Everything the page shows as text, shadow DOM included."""
        result = self.command("Runtime.evaluate", expression=_PAGE_TEXT_JS, returnByValue=True)
        return str(result["result"].get("value", ""))

    def wait_for_text(self, needles: Iterable[str], timeout: float = 60.0) -> str:
        """Poll the page's text until it contains every needle; returns it. Raises ``TimeoutError`` naming the
        missing ones."""
        needles = list(needles)
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            missing = [needle for needle in needles if needle not in text]
            if not missing:
                return text
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page does not show {missing} after {timeout:.0f} s; it shows: {text[:2000]}")
            time.sleep(0.5)

    def screenshot(self, path: Path) -> None:
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        process, self.process = self.process, None
        for fd in (self._to_browser, self._from_browser):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._to_browser = self._from_browser = -1
        _terminate(process)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # helpers (renderer, crash handler) that outlived the browser
        _remove_profile(self._profile)


def _remove_profile(profile: tempfile.TemporaryDirectory[str]) -> None:
    """Delete Chromium's profile directory; a helper process still exiting may write into it for a moment, so a
    removal that finds new files is tried again for up to 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            profile.cleanup()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header."""
    header = path.read_bytes()[:24]
    if not header.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"{path} is not a PNG")
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
