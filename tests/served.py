"""Helpers for tests that run a Serve application over HTTP."""
import time

import httpx


def wait_ready(url: str, timeout: float = 120) -> None:
    """Until the application at url answers /health with 200 (its replicas loaded), or TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)
