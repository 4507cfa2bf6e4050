"""Run a launcher (torchrun, ``accelerate launch``, mpiexec, a plain script) from a test, with a
deadline that holds.

On a timeout every process the launcher started is killed and the test fails with what they printed.
Killing the launcher's process group is not enough: torch's elastic agent (torchrun, accelerate)
starts each worker in a session of its own, so a worker stuck at exit outlives the group kill and
keeps the output pipes open, and a plain ``communicate()`` after the kill then waits forever. Here
the launcher's descendants are found through /proc (parent links) while it is still alive, all of
them are killed, and the output is read with a deadline of its own.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

READ_AFTER_KILL_S = 30.0
"""Seconds to wait for the output pipes to close once everything was killed."""


def _children() -> dict[int, list[int]]:
    """{parent pid: [child pids]} of every process visible in /proc now."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), whatever session it is in."""
    kids, found, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (found first: once the parent dies they are orphans
    of init and no longer below it)."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(cmd: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """``cmd``'s completed process (text stdout/stderr captured); AssertionError naming the command
    and its last output when it did not end within ``timeout`` seconds (every process it started
    killed). ``popen``: cwd, env, ... for :class:`subprocess.Popen`."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **popen) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(child.pid)
            try:
                stdout, stderr = child.communicate(timeout=READ_AFTER_KILL_S)
            except subprocess.TimeoutExpired:
                stdout, stderr = "", f"(the output pipes stayed open {READ_AFTER_KILL_S:.0f} s after the kill)"
            raise AssertionError(f"{' '.join(map(str, cmd))} did not end within {timeout} s (it and every process "
                                 f"it started were killed):\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
