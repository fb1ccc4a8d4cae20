"""A real `tessera serve` process on a free port, for tests that go through the CLI, the
process boundary and the official clients; `running_server` stops it and keeps its log."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
import httpx

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, log_path: Path, *extra: str, model: str = MODEL) -> None:
        """`model`: the MODEL argument(s) of `tessera serve`, space-separated."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tessera", "serve", *model.split(), "--port", str(self.port),
             "--kv-cache-memory", "512MiB", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not healthy after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/stats", timeout=5).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            s = stats["scheduler"]
            if (s["num_running"], s["num_waiting"], s["num_swapped"], stats["server"]["active_requests"]) \
                    == (0, 0, 0, 0) and s["kv_cache_usage"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.1)


@contextmanager
def running_server(log_path: Path, *extra: str, model: str = MODEL) -> Iterator[ServerProcess]:
    """A healthy `tessera serve` for the duration of the block."""
    proc = ServerProcess(log_path, *extra, model=model)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()
