"""Real ``kvsp serve`` processes for the tests: ports, configurations,
certificates (``kvsp certs``), start, wait until listening, stop or
SIGKILL."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from kvsp.client import Client

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_ID = "spiffe://kvsp.local/node/127.0.0.1"


def binary(nogpu: bool = False) -> pathlib.Path:
    """bin/kvsp, or with nogpu the build whose device is the stand-in in
    host memory (go build -tags nogpu): its device tier takes memfd pools."""
    var, name = ("KVSP_NOGPU_BIN", "kvsp-nogpu") if nogpu else ("KVSP_BIN", "kvsp")
    b = pathlib.Path(os.environ.get(var, ROOT / "bin" / name)).resolve()
    if not b.exists():
        pytest.fail(f"{b} is missing: make test-python builds it")
    return b


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all bound at once, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def certs(config: pathlib.Path) -> None:
    """The CA, the certificates and the policy a configuration names."""
    subprocess.run([str(binary()), "certs", "--config", str(config)], check=True, capture_output=True)


@dataclass
class Proc:
    """A ``kvsp serve`` process and its log."""

    config: pathlib.Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    nogpu: bool = False
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.config.with_suffix(".log"), "ab")  # noqa: SIM115 (the child holds it)
        with log:
            self.popen = subprocess.Popen(
                [str(binary(self.nogpu)), "serve", "--config", str(self.config)],
                cwd=self.config.parent,
                stdout=log,
                stderr=log,
                env={**os.environ, **self.env},
            )
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.popen.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"kvsp serve did not start: {self.log()[-2000:]}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.config.with_suffix(".log").read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: nothing flushed, nothing withdrawn."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Served:
    """A running deployment: its directory (certificates, scope keys) and
    the base URI of its first process."""

    dir: pathlib.Path
    base: str

    def client(self, who: str = "client", identity: str | None = SERVER_ID) -> Client:
        d = self.dir
        return Client(
            cert=str(d / f"{who}.pem"), key=str(d / f"{who}.key"), ca=str(d / "ca.pem"), server_identity=identity
        )
