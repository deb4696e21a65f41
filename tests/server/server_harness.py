"""The live server the tests drive: its address, its engine and /metrics helpers.

A plain module (not conftest) so test files can import it by a name no other
test directory uses.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.engine import LLMEngine
from kvserve.server.app import DEFAULT_MODEL_NAME

KV_MEMORY = 256 << 20
MODEL = DEFAULT_MODEL_NAME


@dataclass
class LiveServer:
    base_url: str
    engine: LLMEngine

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=60).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Poll /metrics until nothing runs or waits and no KV page is held; return it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            used = sum(v for (name, _), v in m.items() if name == "kvserve_kv_used_bytes")
            running = m[("kvserve_num_requests_running", ())]
            waiting = m[("kvserve_num_requests_waiting", ())]
            if running == waiting == used == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.2)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """An ASGI app served by uvicorn in a thread on a free loopback port; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()
