"""Headless Chromium for dashboard tests: screenshots and live JavaScript state of a page.

Debian's ``chromium`` package (``apt-get install -y chromium``; ``.ci/run`` installs it).
Tests call :func:`chromium_path` and skip with a clear reason when it is absent.

Two ways in:

* :func:`screenshot` / :func:`dump_dom`: the one-shot command line
  (``--screenshot``/``--dump-dom`` with ``--virtual-time-budget``). Enough for static
  pages, but Bokeh *server* pages draw only after their websocket delivers the document,
  which virtual time does not wait for: the shot comes out blank.
* :class:`Browser`: Chromium with a DevTools (CDP) endpoint on loopback, driven over its
  websocket with tornado (already a Dask dependency). It waits in real time for a
  JavaScript condition (e.g. "the Bokeh document has arrived"), evaluates expressions
  (e.g. read a ColumnDataSource's data in the browser) and captures screenshots.

Every run gets a throw-away profile directory; background networking, sync, component
updates and QUIC are off; DevTools listens on 127.0.0.1 only.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
COMMON_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
)


def chromium_path() -> Optional[str]:
    """The Chromium executable (``$CHROMIUM`` first), or None when none is installed."""
    env = os.environ.get("CHROMIUM")
    if env and Path(env).exists():
        return env
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _exe() -> str:
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("no chromium executable found (apt-get install -y chromium)")
    return exe


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="tc-chromium-") as profile:
        cmd = [_exe(), *COMMON_FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)


def screenshot(
    url: str, path: Path, *, width: int = 1400, height: int = 1000,
    virtual_time_budget_ms: int = 8000, timeout_s: float = 90.0,
) -> Path:
    """One-shot PNG of ``url`` (pixels; budget in ms). Blank for Bokeh server pages."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = _run([f"--screenshot={path}", f"--window-size={width},{height}",
                 f"--virtual-time-budget={virtual_time_budget_ms}", url], timeout_s)
    if not path.exists():
        raise RuntimeError(f"chromium wrote no screenshot (rc={proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return path


def dump_dom(url: str, *, virtual_time_budget_ms: int = 8000, timeout_s: float = 90.0) -> str:
    """The light DOM of ``url`` after the budget (ms), serialized as HTML."""
    proc = _run([f"--virtual-time-budget={virtual_time_budget_ms}", "--dump-dom", url], timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom failed (rc={proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return proc.stdout.decode(errors="replace")


def image_stats(path: Path) -> dict[str, int]:
    """``width``, ``height`` (pixels) and ``colors`` (distinct RGB values) of a PNG."""
    from PIL import Image  # bokeh depends on pillow, so it is present with the dashboard

    with Image.open(path) as im:
        rgb = im.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20)
        return {"width": rgb.width, "height": rgb.height, "colors": len(colors) if colors else 1 << 20}


def ink_fraction(path: Path, box: tuple[float, float, float, float], background: tuple[int, int, int] | None = None,
                 tolerance: int = 24) -> float:
    """Share of the pixels of ``box`` (left, top, width, height in CSS px = image px) in the
    PNG at ``path`` that differ from ``background`` (default: the most common colour of the
    box) by more than ``tolerance`` in some channel. 0.0 for a blank region."""
    from PIL import Image

    left, top, width, height = (int(round(v)) for v in box)
    with Image.open(path) as im:
        region = im.convert("RGB").crop((left, top, left + max(width, 1), top + max(height, 1)))
    pixels = list(region.getdata())
    if background is None:
        background = max(region.getcolors(maxcolors=1 << 24) or [(0, (255, 255, 255))])[1]
    differ = sum(1 for px in pixels if max(abs(a - b) for a, b in zip(px, background)) > tolerance)
    return differ / len(pixels)


LAYOUT_JS = """
(() => {
  // Bokeh 3 renders every view inside a shadow root: walk them all.
  const all = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      all.push(el);
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  const box = (el) => { const r = el.getBoundingClientRect();
    return {left: r.left + window.scrollX, top: r.top + window.scrollY, width: r.width, height: r.height}; };
  const cls = (el, c) => el.classList && el.classList.contains(c);
  const canvases = all.filter((el) => cls(el, 'bk-Canvas') && el.getBoundingClientRect().width > 0);
  const cells = all.filter((el) => (cls(el, 'slick-cell') || cls(el, 'slick-header-column'))
                                   && el.getBoundingClientRect().width > 0);
  return {
    page_width: document.documentElement.scrollWidth,
    viewport_width: window.innerWidth,
    plots: canvases.map(box),
    cells: cells.length,
    // a cell is cut off when its text needs more room than it has; a header column's
    // resize handle overhangs it by design, so its title (the name span) is measured
    truncated: cells.filter((el) => {
      if (!cls(el, 'slick-header-column')) { return el.scrollWidth > el.clientWidth + 1; }
      const name = el.querySelector('.slick-column-name');  // an inline span: compare boxes
      return name != null && name.getBoundingClientRect().right > el.getBoundingClientRect().right - 1;
    }).map((el) => ({text: el.textContent, scroll: el.scrollWidth, client: el.clientWidth})),
  };
})()
"""
"""JavaScript for :meth:`Browser.layout`: ``page_width``/``viewport_width`` (px),
``plots`` (the page box of every drawn Bokeh plot canvas), ``cells`` (table cells and
headers drawn) and ``truncated`` (those whose text does not fit: ``scrollWidth >
clientWidth``)."""


class BrowserError(RuntimeError):
    """Chromium did not start, a DevTools call failed, or a wait timed out."""


class Browser:
    """A headless Chromium page driven over the DevTools protocol (synchronous API).

    >>> with Browser(width=1400, height=1000) as b:
    ...     b.navigate(url)
    ...     b.wait_for("window.Bokeh && Bokeh.documents.length > 0", timeout_s=30)
    ...     n = b.evaluate("Bokeh.documents[0].get_model_by_name('x').data.y.length")
    ...     b.screenshot(Path("artifacts/page.png"))
    """

    def __init__(self, *, width: int = 1400, height: int = 1000, start_timeout_s: float = 60.0) -> None:
        self.width, self.height = width, height
        # chromium's helper processes may still flush into the profile as it exits
        self._profile = tempfile.TemporaryDirectory(prefix="tc-chromium-", ignore_cleanup_errors=True)
        self._proc = subprocess.Popen(
            [_exe(), *COMMON_FLAGS, f"--user-data-dir={self._profile.name}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        self._ws: Any = None
        self.errors: list[str] = []  # uncaught JavaScript exceptions and console.error lines
        try:
            port = self._devtools_port(start_timeout_s)
            ws_url = self._page_target(port, start_timeout_s)
            self._ws = self._loop.run_until_complete(self._connect(ws_url))
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call("Emulation.setDeviceMetricsOverride",
                      width=width, height=height, deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    # chromium writes its DevTools port here once it listens
    def _devtools_port(self, timeout_s: float) -> int:
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self._proc.returncode} before DevTools started")
            if port_file.exists():
                text = port_file.read_text().split()
                if text:
                    return int(text[0])
            time.sleep(0.1)
        raise BrowserError(f"chromium DevTools did not start within {timeout_s}s")

    @staticmethod
    def _page_target(port: int, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.load(r)
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise BrowserError("chromium has no page target")

    async def _connect(self, ws_url: str) -> Any:
        from tornado.websocket import websocket_connect

        return await websocket_connect(ws_url, max_message_size=256 << 20)

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self._ws.write_message(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            raw = await self._ws.read_message()
            if raw is None:
                raise BrowserError(f"DevTools connection closed during {method}")
            reply = json.loads(raw)
            if reply.get("id") != msg_id:
                self._note_event(reply)  # otherwise we poll state instead of following events
                continue
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error']}")
            return reply.get("result", {})

    def _note_event(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "?"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))

    def call(self, method: str, timeout_s: float = 60.0, **params: Any) -> dict[str, Any]:
        """One DevTools method call; its ``result``."""
        return self._loop.run_until_complete(asyncio.wait_for(self._call(method, params), timeout_s))

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """Evaluate JavaScript in the page; the value (JSON-able), or raise on a JS error."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            details = res["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"JavaScript error: {text}")
        return res.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0, poll_s: float = 0.2) -> Any:
        """Poll ``expression`` until truthy (JS errors count as not yet); its value."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expression)
            except BrowserError as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(poll_s)
        raise BrowserError(f"timed out after {timeout_s}s waiting for {expression!r} (last: {last!r})")

    def resize(self, width: int, height: int) -> None:
        """Set the viewport to ``width`` x ``height`` CSS pixels (the page re-lays itself out)."""
        self.width, self.height = width, height
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def page_height(self) -> int:
        """The document's full height (px)."""
        return int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))

    def full_page_screenshot(self, path: Path, settle_s: float = 1.0) -> Path:
        """A PNG of the whole page at the current width: the viewport is made as tall as
        the document for the shot (``settle_s`` lets Bokeh repaint), then restored."""
        width, height = self.width, self.height
        self.resize(width, max(height, self.page_height()))
        time.sleep(settle_s)  # repaint after the resize; only the picture depends on it
        self.resize(width, max(height, self.page_height()))  # a re-layout may have grown it
        time.sleep(settle_s)
        try:
            return self.screenshot(path)
        finally:
            self.resize(width, height)

    def layout(self) -> dict[str, Any]:
        """Where Bokeh drew things, looked up through every shadow root (:data:`LAYOUT_JS`)."""
        return self.evaluate(LAYOUT_JS)

    def screenshot(self, path: Path) -> Path:
        """Write a PNG of the viewport to ``path``."""
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self._ws is not None:
                try:  # a clean shutdown stops chromium's helper processes too
                    self.call("Browser.close", timeout_s=10)
                except Exception:
                    pass
                self._loop.run_until_complete(_close(self._ws))  # tornado's close needs its loop current
        finally:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
            self._loop.close()
            self._profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _close(ws: Any) -> None:
    """Close a tornado websocket inside its event loop (under pytest-xdist the main
    thread has no default loop to fall back on)."""
    ws.close()
