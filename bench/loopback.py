"""Loopback servers the remote-tier benchmarks start and stop themselves (bench/remote.py, bench/fleet.py)."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import time
from importlib.metadata import version
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(300):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def stack_meta(machine_note: str = "") -> dict[str, str]:
    """When, where and on which stack a fleet bench ran: the header both fleet benches write."""
    load = os.getloadavg()
    note = f"{machine_note} " if machine_note else ""
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no GPU; {note}load average {load[0]:.1f} at the end",
        flashinfer=version("flashinfer-python"), dsl=version("nvidia-cutlass-dsl"), redis_py=version("redis"), s3fs=version("s3fs"),
        moto=version("moto"), redis_server=subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2],
    )
