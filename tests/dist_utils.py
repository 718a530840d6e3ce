"""Run a test script on several ranks under torchrun (gloo) and fail with its output.

Scripts live in ``tests/dist_scripts/``; each asserts what it checks and exits non-zero
on failure. A free port is chosen per launch so tests can run back to back.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "dist_scripts"


def free_port() -> int:
    """A port torchrun's store can listen on, drawn below Linux's ephemeral range (32768-60999 by default).

    Why: a port from ``bind(0)`` is an ephemeral one; released, it can be handed to another process's outgoing
    connection before torchrun listens on it (CI, 2026-12-07: EADDRINUSE on 37269, other ranks connecting).
    Below that range the OS gives out no port by itself, so only another test's draw could take it."""
    draw = random.Random()  # seeded from os.urandom: xdist workers draw apart
    for _ in range(200):
        port = draw.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every draw taken: whatever the OS gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 600.0) -> str:
    """Launch ``tests/dist_scripts/<script>`` on ``nproc`` ranks; return its combined output."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(SCRIPTS / script), *args,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out
