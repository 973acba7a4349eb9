"""A private PostgreSQL and a private Redis that a test may stop, restart and kill.

Fault tests never touch the shared servers the rest of the suite uses: each starts its own
from the system binaries (``initdb``/``pg_ctl`` under /usr/lib/postgresql/*/bin, and
``redis-server``) on a free port, and skips with the reason when they are missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from glob import glob
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    found = [Path(p).parent for p in glob("/usr/lib/postgresql/*/bin/initdb")]
    on_path = shutil.which("initdb")
    if on_path:
        found.append(Path(on_path).parent)
    usable = [d for d in found if (d / "pg_ctl").exists()]
    return max(usable, key=lambda d: d.parent.name) if usable else None


class PrivatePostgres:
    """A throwaway cluster in a temporary directory: trust auth, TCP on 127.0.0.1 only."""

    def __init__(self) -> None:
        bindir = postgres_bin()
        if bindir is None:
            pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) for the fault tests")
        self.bindir = bindir
        # initdb refuses to run as root: then the cluster belongs to the postgres OS user.
        self.as_user: list[str] = []
        owner = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no postgres OS user to run initdb as")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        # Not under pytest's tmp_path: its parents are private to the user running the tests.
        self.root = Path(tempfile.mkdtemp(prefix="inherent-pg-"))
        if owner is not None:
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        command = [*self.as_user, str(self.bindir / tool), *args]
        # Output to a file, not a pipe: a server that pg_ctl starts inherits it and keeps it open.
        output = self.root / f"{tool}.out"
        with output.open("w") as out:
            returncode = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=120, check=False
            ).returncode
        if returncode != 0:
            raise RuntimeError(f"{tool} failed: {output.read_text()}\n{self.server_log()}")

    def server_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root}"
            " -c fsync=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def create_database(self, name: str) -> str:
        from sqlalchemy import create_engine, text

        admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis:
    """``redis-server --save '' --appendonly no`` on a free port: a restart loses every key."""

    def __init__(self, log: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("no redis-server binary for the fault tests")
        self.port = free_port()
        self.log = log
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no",
        ]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, as an operator's restart does; waits for the process to exit."""
        if self.process is None:
            return
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"SHUTDOWN NOSAVE\r\n")
        except OSError:
            self.process.terminate()
        self.process.wait(30)
        self.process = None

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
