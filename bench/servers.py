"""Servers in their own processes for the HTTP benchmarks.

`inherent_server` runs `inherent serve` on the embedded default (SQLite and the embedded index
in a data directory of its own, the bundled model); `vllm_server` runs the vLLM CPU peer's
OpenAI server (bench/peers/vllm_cpu.sh). Both listen on a free port of 127.0.0.1 and are stopped
with SIGINT, so a graceful shutdown (pending receipt writes) runs before the process ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PEER_SCRIPT = REPO / "bench" / "peers" / "vllm_cpu.sh"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "inherent-peers"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def running(command: list[str], env: dict[str, str], ready_path: str, log_path: Path,
            port: int, timeout_s: float = 900) -> Iterator[Server]:
    """Start `command`, wait until GET `ready_path` answers 200, stop it on the way out."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        server = Server(f"http://127.0.0.1:{port}", process, log_path)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{command[:3]} did not come up:\n"
                                     f"{log_path.read_text(errors='replace')[-3000:]}")
                try:
                    if httpx.get(server.base_url + ready_path, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield server
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


INHERENT_CLI = [sys.executable, "-c", "from gateway.cli import run; run()"]


def inherent_env(data_dir: Path, api_key: str | None = None,
                 extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an `inherent` command on the embedded default in `data_dir`."""
    return {
        **os.environ,
        "INHERENT_DATA_DIR": str(data_dir),
        "INHERENT_DATABASE_URL": "",
        "INHERENT_QDRANT_URL": "",
        "INHERENT_REDIS_URL": "",
        "PYTHONPATH": str(REPO),
        **({"INHERENT_API_KEY": api_key} if api_key else {}),
        **(extra_env or {}),
    }


@contextmanager
def inherent_server(data_dir: Path, api_key: str | None = None,
                    extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    port = free_port()
    command = [*INHERENT_CLI, "serve", "--port", str(port)]
    with running(command, inherent_env(data_dir, api_key, extra_env), "/readyz",
                 data_dir / "server.log", port) as server:
        yield server


def vllm_peer_ready() -> bool:
    """Whether `bench/peers/vllm_cpu.sh setup` has run (its virtualenv and converted model)."""
    return ((PEERS_DIR / "vllm" / "bin" / "python").exists()
            and (PEERS_DIR / "models" / "smollm2-135m-instruct").is_dir())


@contextmanager
def vllm_server(log_path: Path, extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    port = free_port()
    with running(["bash", str(PEER_SCRIPT), "serve", str(port)],
                 {**os.environ, **(extra_env or {})}, "/health", log_path, port) as server:
        yield server
