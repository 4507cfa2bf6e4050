"""tests/_launch.py keeps its deadline when a launcher's worker sits in a session of its own and
holds the output pipes (what torch's elastic agent does), and leaves no process behind."""
from __future__ import annotations

import os
import sys
import time

import _launch  # tests/_launch.py
import pytest

# a "launcher" that starts a "worker" in a new session (inheriting stdout/stderr), prints the
# worker's pid, and then both wait forever
LAUNCHER = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(w.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_worker_in_its_own_session_is_killed_and_the_deadline_holds():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="did not end within 3 s") as err:
        _launch.run([sys.executable, "-c", LAUNCHER], 3)
    assert time.monotonic() - t0 < 3 + _launch.READ_AFTER_KILL_S
    worker = int(str(err.value).split("killed):\n", 1)[1].split()[0])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"the worker {worker} outlived the kill"


def test_a_command_that_ends_returns_its_output():
    proc = _launch.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
