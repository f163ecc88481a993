"""Small helpers shared by the cluster tests."""
from __future__ import annotations

import time
import urllib.request
from typing import Any, Callable


def wait_until(cond: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Poll ``cond`` until it returns something truthy (returned), or fail after ``timeout_s``.

    Waits on a condition, never asserts on elapsed time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what or cond}")


def dashboard_base(client: Any) -> str:
    """``http://127.0.0.1:<port>`` of the client's scheduler dashboard."""
    return f"http://127.0.0.1:{client.scheduler_info()['services']['dashboard']}"


def http_get(url: str, timeout_s: float = 30.0) -> tuple[int, str]:
    """(status, body) of a GET."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.status, r.read().decode()
