"""Real HTTP servers on 127.0.0.1 for the remote-scorer tests: uvicorn in a background thread."""
from __future__ import annotations

import contextlib
import threading
import time

from testing.loopback import free_port


@contextlib.contextmanager
def serve(app):
    """Run an ASGI app on a free loopback port; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
