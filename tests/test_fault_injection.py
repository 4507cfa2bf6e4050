"""Fault injection: failures on some ranks, stalled peers, interrupts, communicator lifetime, a
tiny /dev/shm, bad calibration files. Each MPI case runs ``mpiexec -n P python script.py`` as a
subprocess under a deadline, so a hang fails the test instead of hanging the suite; each shows no
hang, the same error on every rank (where a rank can report at all) and nothing leaked.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
from conftest import UNKNOWN_FORMAT

from giftcomm.algorithms.machine import BUILT_IN
from giftcomm.cost import calibration
from giftcomm.cost.calibration import load_calibration
from giftcomm.cost.model import Calibration, Topology, choose
from giftcomm.formats import get_format

# Under pytest-xdist every test of this module runs on one worker: its jobs' cleanup removes the
# MPICH segment files no live process maps, which must not race with another test of this module
# that inspects the segments its own killed job left.
pytestmark = pytest.mark.xdist_group("mpich_segment_files")

MPIEXEC = shutil.which("mpiexec")
assert MPIEXEC is not None, "no mpiexec on PATH: the mpich wheel (a dependency) provides it"

PRELUDE = """
import os, sys, time, signal, threading
import numpy as np
from mpi4py import MPI
import giftcomm as gc
from giftcomm.errors import CommTimeout, CommAborted
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size

def report(label, fn):
    try:
        fn()
        out = "returned"
    except Exception as exc:
        out = f"{type(exc).__name__}: {exc}"
    print(f"RESULT {label} rank={rank} {out}", flush=True)
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "case.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, GIFTCOMM_TIMEOUT="30")
    env.pop("PYTHONUNBUFFERED", None)  # unbuffered, print() writes text and newline apart: ranks' lines mix
    env.update(extra)
    return env


def mpich_segments() -> set[str]:
    """The MPI library's own segment files in /dev/shm (MPICH: mpich_shm_<id>_<n>)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def _mapped_segments() -> set[str]:
    """Segment files some live process maps (a job still running, of this suite or another)."""
    mapped = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped.update(line.rsplit("/", 1)[-1].split()[0] for line in f if "/dev/shm/mpich_shm_" in line)
            except OSError:
                continue
    return mapped


def remove_orphan_segments(before: set[str]) -> set[str]:
    """Remove the segment files that appeared since ``before`` and no live process maps: what the
    killed or os._exit()ed ranks of a finished job left (MPICH unlinks its segment in
    MPI_Finalize, which such ranks never reach). Returns what was removed."""
    orphans = mpich_segments() - before - _mapped_segments()
    for name in orphans:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    return orphans


def run_mpi(tmp_path: Path, p: int, body: str, deadline: float = 40, **env: str) -> subprocess.CompletedProcess:
    """``mpiexec -n p python <body>``; a run past ``deadline`` seconds is a hang: killed, test failed.
    The job's segment files left in /dev/shm by killed ranks are removed once it ended."""
    before = mpich_segments()
    try:
        return _run_mpi(tmp_path, p, body, deadline, **env)
    finally:
        remove_orphan_segments(before)


def _run_mpi(tmp_path: Path, p: int, body: str, deadline: float, **env: str) -> subprocess.CompletedProcess:
    script = _script(tmp_path, body)
    proc = subprocess.Popen([MPIEXEC, "-n", str(p), sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(**env), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"hang: mpiexec -n {p} still running after {deadline} s; output:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def results(out: str, label: str) -> dict[int, str]:
    got = {}
    for line in out.splitlines():
        if line.startswith(f"RESULT {label} rank="):
            head, _, what = line.partition(" ")[2].partition(" ")[2].partition(" ")
            got[int(head.split("=")[1])] = what
    return got


def assert_same_everywhere(out: str, label: str, p: int, kind: str) -> str:
    got = results(out, label)
    assert sorted(got) == list(range(p)), f"ranks that reported {label}: {sorted(got)}\n{out[-3000:]}"
    assert len(set(got.values())) == 1, got
    message = got[0]
    assert message.startswith(kind), message
    return message


def own_shm_files() -> set[str]:
    """giftcomm's own files in /dev/shm (there should never be any left)."""
    try:
        return {n for n in os.listdir("/dev/shm") if "giftcomm" in n}
    except OSError:
        return set()


# --- one rank fails while preparing a call ----------------------------------------------------------
ONE_RANK_FAULTS = """
n = 4096
x = np.ones(n, np.float32)
gc.allreduce(x, comm=comm)  # the transport exists: the faults below happen in the call itself

class BadFingerprint:
    is_identity, size = False, n
    def forward(self, f): return np.asarray(f, np.float32)
    def inverse(self, f): return f
    def fingerprint(self):
        if rank == 1:
            raise ZeroDivisionError("fingerprint on rank 1")
        return 7

class BadArray:
    def __array__(self, dtype=None, copy=None):
        raise KeyError("__array__ on rank 1")

class Good(BadFingerprint):
    def fingerprint(self): return 7

report("fingerprint", lambda: gc.gift_allreduce(x, BadFingerprint(), comm=comm))
report("array", lambda: gc.allreduce(BadArray() if rank == 1 else x, comm=comm))
report("after", lambda: gc.gift_allreduce(x, Good(), comm=comm))
"""


@pytest.mark.parametrize("shared", ["1", "0"])
def test_an_exception_on_one_rank_is_the_same_error_everywhere(tmp_path, shared):
    p = 3
    r = run_mpi(tmp_path, p, ONE_RANK_FAULTS, GIFTCOMM_SHARED_MEMORY=shared)
    assert r.returncode == 0, r.stdout[-3000:]
    msg = assert_same_everywhere(r.stdout, "fingerprint", p, "RuntimeError")
    assert "rank(s) 1" in msg and "ZeroDivisionError" in msg
    msg = assert_same_everywhere(r.stdout, "array", p, "")
    assert "rank(s) 1" in msg and "KeyError" in msg
    assert_same_everywhere(r.stdout, "after", p, "returned")  # the communicator is still usable


def test_not_a_communicator_on_one_rank_ends_the_job_at_the_deadline(tmp_path):
    """comm=<not a communicator> on one rank: that rank raises TypeError before it can join any
    agreement (it has no communicator to agree over), so the others can only learn of it from
    their deadline: the job must end (abort policy) within the timeout, naming the wait."""
    body = """
    x = np.ones(1024, np.float32)
    gc.allreduce(x, comm=comm)
    report("call", lambda: gc.allreduce(x, comm="not a communicator" if rank == 1 else comm))
    """
    t0 = time.monotonic()
    r = run_mpi(tmp_path, 3, body, GIFTCOMM_TIMEOUT="3")
    assert time.monotonic() - t0 < 30
    assert r.returncode != 0
    got = results(r.stdout, "call")
    assert got.get(1, "").startswith("TypeError"), r.stdout[-3000:]
    assert "timed out" in r.stdout and "GIFTCOMM_ON_TIMEOUT=abort" in r.stdout, r.stdout[-3000:]


# --- a stalled peer -----------------------------------------------------------------------------------
STALL = """
x = np.ones(1 << 16, np.float32)
gc.allreduce(x, comm=comm)
alive = comm.Split(int(rank == 1))  # ranks 0 and 2 meet again before exiting: no output is lost
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # stalled: never comes back by itself
t0 = time.monotonic()
report("stalled", lambda: gc.allreduce(x, comm=comm))
print(f"WAITED rank={rank} {time.monotonic() - t0:.2f}", flush=True)
report("again", lambda: gc.allreduce(x, comm=comm))
if os.environ.get("GIFTCOMM_ON_TIMEOUT") == "raise":
    alive.Barrier()
os._exit(0)
"""


def test_a_stalled_peer_aborts_the_job_at_the_deadline(tmp_path):
    t0 = time.monotonic()
    r = run_mpi(tmp_path, 3, STALL, GIFTCOMM_TIMEOUT="2", GIFTCOMM_SHARED_MEMORY="1")
    assert time.monotonic() - t0 < 25
    assert r.returncode != 0
    assert "timed out" in r.stdout and "after 2 s waiting for" in r.stdout, r.stdout[-3000:]
    assert "calling MPI_Abort" in r.stdout


def test_a_stalled_peer_raises_comm_timeout_and_the_transport_stays_unusable(tmp_path):
    r = run_mpi(tmp_path, 3, STALL, GIFTCOMM_TIMEOUT="2", GIFTCOMM_ON_TIMEOUT="raise", GIFTCOMM_SHARED_MEMORY="0")
    got, again = results(r.stdout, "stalled"), results(r.stdout, "again")
    assert sorted(got) == [0, 2], r.stdout[-3000:]
    for q in (0, 2):
        assert got[q].startswith("CommTimeout") and "after 2 s" in got[q], got[q]
        assert again[q].startswith("CommAborted"), again[q]
    waited = {int(line.split("=")[1].split()[0]): float(line.split()[-1]) for line in r.stdout.splitlines()
              if line.startswith("WAITED")}
    assert all(2 <= w < 10 for w in waited.values()), waited


PLAN_STALL = """
x = np.ones(256, np.float32)
plan = gc.plan_allreduce(x, comm=comm)
plan(x)
calls = {"plan": lambda: plan(x), "plain": lambda: gc.allreduce(x, comm=comm)}
first = os.environ["FIRST"]
alive = comm.Split(int(rank == 1))  # ranks 0 and 2 meet again before exiting: no output is lost
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # stalled: never comes back by itself
t0 = time.monotonic()
report("stalled", calls[first])
print(f"WAITED rank={rank} {time.monotonic() - t0:.2f}", flush=True)
t0 = time.monotonic()
report("again", calls["plan"])
report("plain", calls["plain"])
print(f"REFUSED rank={rank} {time.monotonic() - t0:.2f}", flush=True)
alive.Barrier()
os._exit(0)
"""


@pytest.mark.parametrize("policy,first", [("raise", "plan"), ("raise", "plain"), ("abort", "plan")])
def test_a_stalled_peer_times_out_a_plan_on_the_shared_memory_channel(tmp_path, policy, first):
    """A persistent plan's shared-memory channel waits under the same deadline and policy as
    messages: CommTimeout naming the stalled rank, or the end of the job. After a timeout, of a
    plan or of any other wait, the plan and the transport refuse further calls at once."""
    r = run_mpi(tmp_path, 3, PLAN_STALL, GIFTCOMM_TIMEOUT="2", GIFTCOMM_ON_TIMEOUT=policy, GIFTCOMM_SHARED_MEMORY="1",
                FIRST=first)
    if policy == "abort":
        assert r.returncode != 0 and "calling MPI_Abort" in r.stdout, r.stdout[-3000:]
        assert "timed out" in r.stdout and "after 2 s waiting for rank 1" in r.stdout, r.stdout[-3000:]
        return
    got, again, plain = results(r.stdout, "stalled"), results(r.stdout, "again"), results(r.stdout, "plain")
    assert sorted(got) == [0, 2], r.stdout[-3000:]
    for q in (0, 2):
        assert got[q].startswith("CommTimeout") and "after 2 s waiting for" in got[q], got[q]
        assert again[q].startswith("CommAborted") and plain[q].startswith("CommAborted"), (again[q], plain[q])
    for tag, low, high in (("WAITED", 2, 10), ("REFUSED", 0, 1)):
        took = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith(tag)]
        assert len(took) == 2 and all(low <= w < high for w in took), (tag, took)


def test_a_message_wait_names_the_peer(tmp_path):
    body = """
    from giftcomm.transport.mpi import MpiTransport
    t = MpiTransport(comm, timeout=1, on_timeout="raise")
    buf = np.empty(8, np.uint8)
    if rank == 0:
        report("recv", lambda: t.irecv(buf, 1, tag=5).wait())
    comm.Barrier()
    os._exit(0)
    """
    r = run_mpi(tmp_path, 2, body)
    msg = results(r.stdout, "recv")[0]
    assert msg.startswith("CommTimeout") and "receive timed out on rank 0 of 2 after 1 s waiting for rank 1" in msg


def test_waiting_does_not_burn_a_core(tmp_path):
    """A rank whose peer is late sleeps between polls: its CPU time is a small part of the wait."""
    body = """
    x = np.ones(1 << 16, np.float32)
    gc.allreduce(x, comm=comm)
    if rank == 1:
        time.sleep(2)
    c0, w0 = time.process_time(), time.monotonic()
    gc.allreduce(x, comm=comm)
    if rank == 0:
        print(f"CPU {(time.process_time() - c0) / (time.monotonic() - w0):.3f}", flush=True)
    """
    r = run_mpi(tmp_path, 2, body)
    assert r.returncode == 0, r.stdout[-3000:]
    share = float(next(line for line in r.stdout.splitlines() if line.startswith("CPU")).split()[1])
    assert share < 0.3, share  # was ~0.65-0.85 with MPI's blocking waits (2 shared cores)


# --- interrupts ---------------------------------------------------------------------------------------
LOOP = """
plan = os.environ.get("PLAN") == "1"  # a persistent plan's small calls, over the shared-memory channel
x = np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 256 if plan else 1 << 20, np.float32)
out = np.empty_like(x)
call = gc.plan_allreduce(x, comm=comm) if plan else lambda x, out: gc.allreduce(x, comm=comm, out=out)
call(x, out=out)
if rank == 0:
    print("started", flush=True)
while True:
    call(x, out=out)
"""


@pytest.mark.parametrize("sig,plan", [(signal.SIGINT, "0"), (signal.SIGINT, "0"), (signal.SIGTERM, "0"),
                                      (signal.SIGINT, "1")], ids=["int", "int-again", "term", "int-plan"])
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, sig, plan):
    before, segments = own_shm_files(), mpich_segments()
    script = _script(tmp_path, LOOP)
    proc = subprocess.Popen([MPIEXEC, "-n", "3", sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(GIFTCOMM_SHARED_MEMORY="1", PLAN=plan),
                            start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline().strip() == "started"
        time.sleep(0.5)
        proc.send_signal(sig)
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"hang: mpiexec still running 20 s after {sig.name}")
    finally:
        remove_orphan_segments(segments)
    assert proc.returncode != 0
    assert own_shm_files() <= before


# --- communicator lifetime ---------------------------------------------------------------------------
LEAK = """
from giftcomm.errors import CommClosed
from giftcomm.transport import mpi as gmpi
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20
def shm_maps():
    # this process's mappings of /dev/shm files (MPI segments, shared windows): count and MiB
    n = size_ = 0
    for line in open('/proc/self/maps'):
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith('/dev/shm/'):
            lo, hi = (int(v, 16) for v in parts[0].split('-'))
            n += 1; size_ += hi - lo
    return n, size_ >> 20
mode, cycles = sys.argv[1], int(sys.argv[2])
x = np.ones(1 << 16, np.float32)
marks = {}
for i in range(cycles):
    c = comm.Dup() if mode == "dup" else comm.Split(rank % 2 if mode == "split2" else 0, rank)
    if mode == "plan":
        plan = gc.plan_allreduce(x[:256], comm=c)
        y = plan(x[:256])
    else:
        y = gc.allreduce(x, comm=c, algorithm="ring")
    if mode == "release":
        gmpi.release(c)
    c.Free()
    if mode == "plan":
        try:
            plan(x[:256])
            raise SystemExit("a plan of a freed communicator returned")
        except CommClosed:
            pass
    if i in (50, cycles - 1):
        marks["early" if i == 50 else "late"] = (rss(), *shm_maps())
import json
marks["cached"] = len(gmpi._cache)
print(f"LEAK rank={rank} " + json.dumps(marks), flush=True)
"""


@pytest.mark.parametrize("mode,cycles", [("dup", 300), ("split", 1100), ("release", 200), ("plan", 300)])
def test_freed_communicators_release_their_transports(tmp_path, mode, cycles):
    """Dup/Split -> allreduce -> Free loops (Split: past the ~1022 cycles after which leaked
    private communicators ran out of MPI context ids; the 10,000-cycle runs are in
    docs/robustness.md): RSS and this process's /dev/shm mappings stay flat, and no transport
    stays cached."""
    before = own_shm_files()
    t0 = time.monotonic()
    r = run_mpi(tmp_path, 2, LEAK.replace("sys.argv[1], int(sys.argv[2])", f"{mode!r}, {cycles}"), deadline=90,
                GIFTCOMM_SHARED_MEMORY="1")
    assert r.returncode == 0, r.stdout[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("LEAK")]
    assert len(lines) == 2, r.stdout[-3000:]
    for line in lines:
        marks = json.loads(line.split(" ", 2)[2])
        (rss0, maps0, shm0), (rss1, maps1, shm1) = marks["early"], marks["late"]
        assert (maps1, shm1) == (maps0, shm0), line  # the same /dev/shm mappings (count, MiB)
        assert rss1 - rss0 < 12, line  # RSS (MiB)
        assert marks["cached"] == 0, line
    assert own_shm_files() <= before
    print(f"{mode}: {cycles} cycles in {time.monotonic() - t0:.1f} s")


# --- a tiny /dev/shm ----------------------------------------------------------------------------------
TINY = """
import warnings
warnings.simplefilter("always")
job, ready = sys.argv[1], sys.argv[2]
x = np.ones(4 << 20, np.float32)  # bf16 ring over 2 ranks: a 12 MiB window per rank, 24 MiB a job
gc.allreduce(np.ones(8, np.float32), comm=comm)  # the transport (MPI's own segments) first
if rank == 0:
    open(os.path.join(ready, job), "w").close()
    while len(os.listdir(ready)) < 2 and not os.path.exists(os.path.join(ready, "solo")):
        time.sleep(0.001)
comm.Barrier()  # both jobs now make their first large call at the same moment
with warnings.catch_warnings(record=True) as caught:
    y = gc.allreduce(x, comm=comm, algorithm="ring", fmt="bf16")
ok = bool((y == size).all())
fell_back = any("MPI messages from now on" in str(w.message) for w in caught)
from giftcomm.transport.mpi import transport_for
print(f"TINY job={job} rank={rank} ok={ok} window={transport_for(comm).shared_memory} warned={fell_back}", flush=True)
"""


def _tiny_shm_available() -> str | None:
    if shutil.which("unshare") is None or MPIEXEC is None:
        return "unshare or mpiexec not on PATH"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount a private /dev/shm (unshare -m: {probe.stderr.strip()[:100]}): needs root"
    return None


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_tiny_dev_shm_falls_back_to_messages_and_racing_jobs_both_complete(tmp_path, jobs):
    """In a private mount namespace with a 52 MiB /dev/shm (MPI itself takes ~10 MiB a job): one
    job alone gets its window; two jobs whose first large calls start together both pass the
    free-space check, but the two windows' pages do not fit: a job that runs out while backing
    its pages notices (no SIGBUS; before, one job died of it), warns once and sends messages.
    Both complete with the right sums."""
    why = _tiny_shm_available()
    if why:
        pytest.skip(why)
    script = _script(tmp_path, TINY)
    ready = tmp_path / "ready"
    ready.mkdir()
    if jobs == 1:
        (ready / "solo").touch()
    launch = " & ".join(f"{MPIEXEC} -n 2 {sys.executable} {script} job{j} {ready}" for j in range(jobs))
    cmd = f"mount -t tmpfs -o size=52m tmpfs /dev/shm && {launch} & wait"
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=60,
                           env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail("hang: the tiny /dev/shm jobs did not finish in 60 s")
    lines = [line for line in r.stdout.splitlines() if line.startswith("TINY")]
    assert len(lines) == 2 * jobs, r.stdout + r.stderr[-3000:]
    assert all("ok=True" in line for line in lines), lines
    for j in range(jobs):
        mine = [line for line in lines if f"job=job{j} " in line]
        assert len({line.split("window=")[1].split()[0] for line in mine}) == 1, mine  # every rank alike
        warned = [line for line in mine if "warned=True" in line]
        assert all("rank=0" in line for line in warned), mine  # one warning, on rank 0
    if jobs == 1:
        assert all("window=True" in line for line in lines), lines


# --- calibration files -------------------------------------------------------------------------------
GOOD = json.loads(Calibration().to_json())


def _bad_files() -> dict[str, object]:
    """name -> file content (bytes / str / a JSON value to dump) or a special marker."""
    def with_(**kw):
        d = json.loads(json.dumps(GOOD))
        for k, v in kw.items():
            if "." in k:
                a, b = k.split(".")
                d[a][b] = v
            else:
                d[k] = v
        return d

    missing_net = json.loads(json.dumps(GOOD))
    del missing_net["net"]
    return {
        "empty": "",
        "truncated": json.dumps(GOOD)[:40],
        "not json": "alpha = 3\n",
        "binary": b"\x00\xff\xfe" * 100,
        "a list": [1, 2, 3],
        "a number": 42,
        "missing net": missing_net,
        "link not an object": with_(shm=5),
        "alpha a string": with_(**{"shm.alpha": "fast"}),
        "alpha a bool": with_(**{"shm.alpha": True}),
        "NaN": with_(encode_rate=float("nan")),
        "Infinity": with_(**{"net.beta": float("inf")}),
        "negative beta": with_(**{"net.beta": -1e-9}),
        "zero rate": with_(fused_rate=0),
        "huge overhead": with_(call_overhead=1e300),
        "overlap above 1": with_(overlap=3.5),
        "fractional nics": with_(nics_per_node=1.5),
        "deep nesting": "[" * 100000 + "]" * 100000,
        "too large": " " * (calibration.MAX_FILE_BYTES + 10) + "{}",
        "a directory": "<dir>",
        "a fifo": "<fifo>",
    }


def _write(path: Path, content: object) -> None:
    if content == "<dir>":
        path.mkdir()
    elif content == "<fifo>":
        os.mkfifo(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))


@pytest.mark.parametrize("case", list(_bad_files()))
def test_a_bad_calibration_file_warns_once_and_uses_the_built_in_constants(tmp_path, monkeypatch, case):
    path = tmp_path / "calibration.json"
    _write(path, _bad_files()[case])
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(path))
    built_in = BUILT_IN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # planned calls: read once, warned once
            cal = load_calibration()
            assert choose(1 << 20, Topology(4, 1, 4), get_format("e4m3")) in ("ring", "direct", "doubling")
    assert (cal.shm, cal.net, cal.encode_rate, cal.overlap) == (built_in.shm, built_in.net, built_in.encode_rate,
                                                                 built_in.overlap)
    ours = [w for w in caught if "calibration file" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert str(path) in str(ours[0].message)


def test_a_good_calibration_file_is_used_and_a_fixed_one_is_reread(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(path))
    path.write_text("{")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_calibration().source == "built-in defaults"
    good = json.loads(json.dumps(GOOD))
    good["shm"]["alpha"] = 3e-6
    calibration.write_calibration(path, json.dumps(good))
    cal = load_calibration()
    assert cal.shm.alpha == 3e-6 and cal.source == str(path)


def test_the_calibration_path_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("GIFTCOMM_CALIBRATION", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert calibration.calibration_path() == tmp_path / "cache" / "giftcomm" / "calibration.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibration.calibration_path() == tmp_path / "home" / ".cache" / "giftcomm" / "calibration.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert calibration.calibration_path() == tmp_path / "home" / ".cache" / "giftcomm" / "calibration.json"
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(tmp_path / "x.json"))
    assert calibration.calibration_path() == tmp_path / "x.json"


def test_writing_the_calibration_is_atomic(tmp_path, monkeypatch):
    """A reader polling while the file is rewritten 200 times never sees a partial file."""
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(path))
    calibration.write_calibration(path, json.dumps(GOOD))
    stop, seen = threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                seen.append(json.loads(path.read_text())["shm"]["alpha"])
            except Exception as exc:  # noqa: BLE001
                seen.append(exc)

    th = threading.Thread(target=reader)
    th.start()
    for i in range(200):
        doc = json.loads(json.dumps(GOOD))
        doc["shm"]["alpha"] = (i + 1) * 1e-6
        doc["measured"] = {"pad": "x" * 20000}
        calibration.write_calibration(path, json.dumps(doc))
    stop.set()
    th.join()
    assert seen and not [s for s in seen if isinstance(s, Exception)]
    assert sorted(os.listdir(tmp_path)) == ["calibration.json"]  # no temporary files left


def test_a_bad_calibration_file_on_one_rank_does_not_fail_any_call(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"shm": {"alpha": 1e-5, "beta": -1}}')
    body = f"""
    if rank == 1:
        os.environ["GIFTCOMM_CALIBRATION"] = {str(bad)!r}
    x = np.arange(100000, dtype=np.float32)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report("auto", lambda: [gc.allreduce(x, comm=comm) for _ in range(3)])
    n = len([w for w in caught if "calibration file" in str(w.message)])
    print(f"WARNINGS rank={{rank}} {{n}}", flush=True)
    """
    r = run_mpi(tmp_path, 2, body, GIFTCOMM_CALIBRATION=str(tmp_path / "missing.json"))
    assert r.returncode == 0, r.stdout[-3000:]
    assert_same_everywhere(r.stdout, "auto", 2, "returned")
    assert "WARNINGS rank=1 1" in r.stdout and "WARNINGS rank=0 0" in r.stdout, r.stdout


# --- what a communicator owns dies with it; stale plans, concurrency, forks, configuration -------------
STALE = """
from giftcomm.errors import CommClosed
x = np.ones(256, np.float32)
c = comm.Dup()
fast = gc.plan_allreduce(x, comm=c)                           # the channel's C path
slow = gc.plan_allreduce(x.astype(np.float64), comm=c)        # the Python path
direct = gc.plan_allreduce(x, comm=c, algorithm="ring")       # no channel: the agreement's gather
print(f"SUM rank={rank} {float(fast(x)[0])} {float(slow(x.astype(np.float64))[0])} {float(direct(x)[0])}", flush=True)
t_stale = gc.transport.resolve(c)
c.Free()
report("fast", lambda: fast(x))
report("slow", lambda: slow(x.astype(np.float64)))
report("direct", lambda: direct(x))
report("transport", lambda: gc.allreduce(x, comm=t_stale))
# COMM_WORLD: released, then a new plan; one rank calls the stale plan, the other the new one
old = gc.plan_allreduce(x, comm=comm)
old(x)
gc.release(comm)
new = gc.plan_allreduce(x, comm=comm)
t0 = time.monotonic()
report("mixed", lambda: (old if rank == 0 else new)(x))
print(f"TOOK rank={rank} {time.monotonic() - t0:.2f}", flush=True)
report("after", lambda: new(x))
"""


def test_a_plan_of_a_freed_or_released_communicator_raises_comm_closed_on_every_rank(tmp_path):
    """After comm.Free() a plan (channel C path, Python path, gather path) and the stale transport
    raise CommClosed on every rank: no sums through freed state, no raw MPI exception. After
    giftcomm.release(COMM_WORLD) a stale plan on one rank against a new plan on the other raises on
    both at once (CommClosed on the stale rank, "ranks disagree on plan" on the other), not at the
    deadline, and the new plan still works."""
    r = run_mpi(tmp_path, 2, STALE, GIFTCOMM_TIMEOUT="20", GIFTCOMM_ON_TIMEOUT="raise", GIFTCOMM_SHARED_MEMORY="1")
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.count("SUM rank=") == 2 and "2.0 2.0 2.0" in r.stdout, r.stdout[-3000:]
    for label in ("fast", "slow", "direct", "transport"):
        msg = assert_same_everywhere(r.stdout, label, 2, "CommClosed")
        assert "freed" in msg or "released" in msg, msg
    mixed = results(r.stdout, "mixed")
    assert mixed[0].startswith("CommClosed"), mixed
    assert mixed[1].startswith("ValueError") and "ranks disagree on plan" in mixed[1], mixed
    took = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("TOOK")]
    assert len(took) == 2 and max(took) < 5, took
    assert_same_everywhere(r.stdout, "after", 2, "returned")


RELEASE_DURING_CALL = """
from giftcomm.errors import CommClosed
c = comm.Dup()
x = np.ones(1 << 20, np.float32)
plan = gc.plan_allreduce(x[:256], comm=c)
t = gc.transport.resolve(c)
kind = os.environ["KIND"]
got = {}
def work():
    time.sleep(0.6 * rank)  # rank 0 is inside the call (waiting for rank 1) when it releases
    try:
        y = plan(x[:256]) if kind == "plan" else gc.allreduce(x, comm=c, algorithm="ring")
        got["call"] = f"returned {float(y[0])}"
    except Exception as exc:
        got["call"] = f"{type(exc).__name__}: {exc}"
th = threading.Thread(target=work)
th.start()
time.sleep(0.3 + 0.6 * rank)
report("release", lambda: gc.release(c))
th.join()
print(f"RESULT call rank={rank} {got['call']}", flush=True)
report("later", lambda: gc.allreduce(x, comm=t))
report("plan", lambda: plan(x[:256]))
c.Free()
"""


@pytest.mark.parametrize("kind", ["plain", "plan"])
def test_release_waits_for_the_call_in_flight(tmp_path, kind):
    """giftcomm.release(comm) from one thread while another thread is inside a call: the call
    completes (release takes the transport's lock), then everything the transport owned is
    closed: later calls on it, and its plans, raise CommClosed on every rank."""
    r = run_mpi(tmp_path, 2, RELEASE_DURING_CALL, GIFTCOMM_TIMEOUT="20", GIFTCOMM_ON_TIMEOUT="raise",
                GIFTCOMM_SHARED_MEMORY="1", KIND=kind)
    assert r.returncode == 0, r.stdout[-3000:]
    assert_same_everywhere(r.stdout, "call", 2, "returned 2.0")
    assert_same_everywhere(r.stdout, "release", 2, "returned")
    assert_same_everywhere(r.stdout, "later", 2, "CommClosed")
    assert_same_everywhere(r.stdout, "plan", 2, "CommClosed")


MIXED = """
x = np.ones(256, np.float32)
plan = gc.plan_allreduce(x, comm=comm)
plan(x)
how = os.environ["HOW"]
t0 = time.monotonic()
if how == "ranks":  # rank 0 runs the plan, rank 1 a plain call
    report("mixed", lambda: plan(x) if rank == 0 else gc.allreduce(x, comm=comm))
else:  # on each rank, two threads: one runs the plan, the other a plain call; ranks pair them up crosswise
    out = {}
    def run(name, fn):
        try:
            fn(); out[name] = "returned"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    first = (lambda: plan(x)) if rank == 0 else (lambda: gc.allreduce(x, comm=comm))
    th = threading.Thread(target=run, args=("a", first), name="worker")
    th.start(); th.join()
    print(f"RESULT mixed rank={rank} {out['a']}", flush=True)
print(f"TOOK rank={rank} {time.monotonic() - t0:.2f}", flush=True)
report("plan", lambda: plan(x))
report("plain", lambda: gc.allreduce(x, comm=comm))
"""


@pytest.mark.parametrize("how", ["ranks", "threads"])
def test_a_plan_against_a_plain_call_raises_ranks_disagree_at_once(tmp_path, how):
    """A persistent plan on one rank against a plain call on the other (from the same thread, or
    from differently named threads) raises "ranks disagree" on both within seconds (the plain call
    meets the plan in the plan channel), not at the 20 s deadline; both stay usable."""
    r = run_mpi(tmp_path, 2, MIXED, GIFTCOMM_TIMEOUT="20", GIFTCOMM_ON_TIMEOUT="raise", GIFTCOMM_SHARED_MEMORY="1",
                HOW=how)
    assert r.returncode == 0, r.stdout[-3000:]
    got = results(r.stdout, "mixed")
    assert sorted(got) == [0, 1] and all(v.startswith("ValueError") and "ranks disagree" in v for v in got.values()), got
    took = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("TOOK")]
    assert len(took) == 2 and max(took) < 5, took
    assert_same_everywhere(r.stdout, "plan", 2, "returned")
    assert_same_everywhere(r.stdout, "plain", 2, "returned")


FORK = """
x = np.ones(256, np.float32)
plan = gc.plan_allreduce(x, comm=comm)
plan(x)
if rank == 0:
    pid = os.fork()
    if pid == 0:  # the child: everything it inherited refuses at once
        t0 = time.monotonic()
        report("child-plan", lambda: plan(np.full(256, 1000, np.float32)))
        report("child-plain", lambda: gc.allreduce(x, comm=comm))
        print(f"CHILD took {time.monotonic() - t0:.2f}", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
comm.Barrier()
y = plan(x)
print(f"SUM rank={rank} {float(y.min())} {float(y.max())}", flush=True)
"""


def test_a_forked_child_cannot_use_the_parents_plans_or_transports(tmp_path):
    """A plan and a transport used in a fork()ed child raise CommClosed at once in the child and
    post nothing: the parent's next plan call sums 1 + 1, not the child's 1000 + 1."""
    r = run_mpi(tmp_path, 2, FORK, GIFTCOMM_TIMEOUT="20", GIFTCOMM_ON_TIMEOUT="raise", GIFTCOMM_SHARED_MEMORY="1")
    assert r.returncode == 0, r.stdout[-3000:]
    child = results(r.stdout, "child-plan")
    assert child[0].startswith("CommClosed") and "fork" in child[0], child
    assert results(r.stdout, "child-plain")[0].startswith("CommClosed"), r.stdout[-3000:]
    took = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("CHILD")]
    assert took and took[0] < 1, took
    sums = [line for line in r.stdout.splitlines() if line.startswith("SUM")]
    assert len(sums) == 2 and all(line.endswith("2.0 2.0") for line in sums), sums


BAD_ENV = """
if rank == 1:
    os.environ[os.environ["VAR"]] = os.environ["VALUE"]
x = np.ones(256, np.float32)
t0 = time.monotonic()
report("first", lambda: gc.allreduce(x, comm=comm))
print(f"TOOK rank={rank} {time.monotonic() - t0:.2f}", flush=True)
"""


@pytest.mark.parametrize("var,value", [("GIFTCOMM_TIMEOUT", "ten"), ("GIFTCOMM_ON_TIMEOUT", "explode"),
                                       ("GIFTCOMM_NATIVE", "maybe"), ("GIFTCOMM_SHARED_MEMORY", "sometimes")])
def test_a_bad_setting_on_one_rank_is_the_same_error_on_every_rank_at_once(tmp_path, var, value):
    r = run_mpi(tmp_path, 2, BAD_ENV, GIFTCOMM_TIMEOUT="20", GIFTCOMM_ON_TIMEOUT="raise", VAR=var, VALUE=value)
    msg = assert_same_everywhere(r.stdout, "first", 2, "ValueError")
    assert var in msg and "rank(s) 1" in msg, msg
    took = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("TOOK")]
    assert len(took) == 2 and max(took) < 5, took


def test_the_native_isa_variable_is_case_insensitive():
    code = "import giftcomm._codec_native as m; print(m._isa())"
    got = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, GIFTCOMM_NATIVE_ISA="GENERIC"))
    assert got.returncode == 0 and got.stdout.strip() == "generic", got.stderr[-2000:]


LATE = """
from giftcomm.transport.mpi import MpiTransport
step = os.environ["STEP"]
x = np.ones(256, np.float32)
if step == "dup":  # rank 1 comes after rank 0's deadline passed while creating the private communicator
    if rank == 1:
        time.sleep(2.5)
    report("late", lambda: gc.allreduce(x, comm=comm))
else:  # the transport exists; rank 1 comes late to the first plan (the channel's window) or split
    gc.allreduce(x, comm=comm)
    if rank == 1:
        time.sleep(2.5)
    if step == "plan":
        report("late", lambda: gc.plan_allreduce(x, comm=comm))
    else:
        report("late", lambda: gc.allreduce(x, comm=comm, algorithm="hierarchical", local_size=1))
comm.Barrier()
os._exit(0)
"""


@pytest.mark.parametrize("step", ["dup", "plan", "split"])
def test_a_deadline_during_set_up_leaves_no_rank_in_a_blocking_mpi_call(tmp_path, step):
    """A 1 s deadline that passes on rank 0 while it waits for a late rank 1 at a set-up step: both
    ranks raise CommTimeout (rank 1 at its own next wait), none stays in MPI_Comm_dup / a split /
    the window allocation."""
    r = run_mpi(tmp_path, 2, LATE, deadline=30, GIFTCOMM_TIMEOUT="1", GIFTCOMM_ON_TIMEOUT="raise", STEP=step)
    got = results(r.stdout, "late")
    assert sorted(got) == [0, 1] and all(v.startswith("CommTimeout") for v in got.values()), r.stdout[-3000:]


TORCHRUN_NO_GROUP = """
import numpy as np
import torch  # noqa: F401  (torch.distributed imported, no process group)
import giftcomm as gc
rank = int(os.environ["RANK"])
try:
    gc.allreduce(np.ones(64, np.float32))
    out = "returned"
except Exception as exc:
    out = f"{type(exc).__name__}: {exc}"
print(f"RESULT nogroup rank={rank} {out}", flush=True)
"""


def test_torchrun_without_a_process_group_raises_naming_init_process_group(tmp_path):
    """Under torchrun (WORLD_SIZE=2) without init_process_group, comm=None raises on every rank a
    RuntimeError naming init_process_group instead of reducing over this rank alone."""
    script = tmp_path / "nogroup.py"
    script.write_text("import os\n" + textwrap.dedent(TORCHRUN_NO_GROUP))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(script)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(_env(), OMP_NUM_THREADS="1"))
    msg = assert_same_everywhere(got.stdout, "nogroup", 2, "RuntimeError")
    assert "init_process_group" in msg and "WORLD_SIZE=2" in msg, msg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_perf_tool_failing_on_one_rank_ends_every_rank_with_the_error(tmp_path):
    """``python -m giftcomm.perf calibrate`` whose rank 0 cannot write the file (its directory is a
    regular file): the job ends at once, with the error and a non-zero exit, instead of rank 0
    waiting in MPI_Finalize and rank 1 in a barrier for ever."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "giftcomm.perf", "calibrate", "--out", str(blocker / "cal.json"),
           "--small", "8,64", "--large", "256K,512K", "--reps", "5", "--budget", "0.01", "--no-codec",
           "--overlap-bytes", "0"]
    t0, segments = time.monotonic(), mpich_segments()
    try:
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env(), start_new_session=True)
    except subprocess.TimeoutExpired:
        pytest.fail("hang: perf calibrate with an unwritable output still running after 60 s")
    finally:
        remove_orphan_segments(segments)
    assert got.returncode != 0, got.stdout[-2000:] + got.stderr[-2000:]
    assert "rank 0 of 2 failed" in got.stderr, got.stderr[-3000:]
    assert "NotADirectoryError" in got.stderr or "FileExistsError" in got.stderr, got.stderr[-3000:]
    assert time.monotonic() - t0 < 60


def test_killed_ranks_leave_no_segment_files_in_dev_shm(tmp_path):
    """A job whose ranks end without MPI_Finalize (os._exit, as the stalled-peer cases here end)
    leaves MPICH's segment in /dev/shm; run_mpi removes it once the job ended, so the suite leaves
    /dev/shm as it found it (before: ~32 MiB a run)."""
    before = mpich_segments()
    r = _run_mpi(tmp_path, 2, "comm.Barrier()\nos._exit(0)\n", 30)
    assert r.returncode == 0, r.stdout[-2000:]
    left = mpich_segments() - before
    assert left, "this MPI library left no segment behind: the cleanup below is not exercised"
    assert remove_orphan_segments(before) == left - _mapped_segments()
    assert not (mpich_segments() - before) - _mapped_segments()


# --- the documented exception types of every entry point (docs/api.md, "Exception types") ---------------
class _FailingArray:
    def __array__(self, dtype=None, copy=None):
        raise KeyError("conversion fails")


def _entry_points(x, plan):
    """Each entry point called with ``x`` (the plan: made from a good float32 template)."""
    import giftcomm as gc

    return {
        "allreduce": lambda t: gc.allreduce(x, comm=t),
        "gift_allreduce": lambda t: gc.gift_allreduce(x, None, comm=t),
        "reduce_scatter": lambda t: gc.reduce_scatter(x, comm=t),
        "allgather": lambda t: gc.allgather(x, comm=t),
        "plan_allreduce": lambda t: gc.plan_allreduce(x, comm=t),
        "plan call": lambda t: plan[t.rank](x),
    }


@pytest.mark.parametrize("case,exc", [("int32", TypeError), ("masked", TypeError), ("bad fmt", ValueError),
                                      ("not an array", TypeError), ("failing conversion", RuntimeError),
                                      ("one rank int32", TypeError)])
def test_every_entry_point_raises_the_documented_type_on_every_rank(case, exc):
    import numpy as np

    import giftcomm as gc

    p = 2
    inputs = {"int32": np.ones(64, np.int32), "masked": np.ma.masked_array(np.ones(64, np.float32)),
              "bad fmt": np.ones(64, np.float32), "not an array": object(), "one rank int32": None,
              "failing conversion": _FailingArray()}
    names = list(_entry_points(None, None))
    for name in names:
        group = gc.LoopbackGroup(p)
        plans = group.run(lambda t: gc.plan_allreduce(np.ones(64, np.float32), comm=t))

        def body(t, name=name):
            x = inputs[case]
            if case == "one rank int32":
                x = np.ones(64, np.int32) if t.rank == 1 else np.ones(64, np.float32)
            fn = _entry_points(x, plans)[name]
            if case == "bad fmt":
                if name == "plan call":
                    return "skip"
                kw = {"fmt": UNKNOWN_FORMAT}
                fn = {"allreduce": lambda: gc.allreduce(x, comm=t, **kw),
                      "gift_allreduce": lambda: gc.gift_allreduce(x, None, comm=t, **kw),
                      "reduce_scatter": lambda: gc.reduce_scatter(x, comm=t, **kw),
                      "allgather": lambda: gc.allgather(x, comm=t, **kw),
                      "plan_allreduce": lambda: gc.plan_allreduce(x, comm=t, **kw)}[name]
                try:
                    fn()
                except Exception as err:  # noqa: BLE001 - compared below
                    return type(err)
                return None
            try:
                fn(t)
            except Exception as err:  # noqa: BLE001 - compared below
                return type(err)
            return None

        got = group.run(body)
        if got[0] == "skip":
            continue
        assert got == [exc] * p, (case, name, got)


RELEASE_DURING_LOOP = """
c = comm.Dup()
x = np.full(256, float(rank + 1), np.float32)
errors = []
calls = int(os.environ["CALLS"])
def loop():  # one thread calls on c without pause; the main thread releases c in the middle
    try:
        for _ in range(calls):
            y = gc.allreduce(x, comm=c, fmt="fp32")
            assert float(y[0]) == 3.0, y[:4]
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
th = threading.Thread(target=loop)
th.start()
time.sleep(0.2 + 0.05 * rank)  # the ranks release between different calls of the loop
t0 = time.monotonic()
report("release", lambda: gc.release(c))
th.join()
print(f"TOOK rank={rank} {time.monotonic() - t0:.2f}", flush=True)
print(f"RESULT loop rank={rank} {errors[0] if errors else 'returned'}", flush=True)
report("after", lambda: np.testing.assert_array_equal(gc.allreduce(x, comm=c, fmt="fp32"), np.full(256, 3.0, np.float32)))
c.Free()
"""


def test_release_while_another_thread_keeps_calling(tmp_path):
    """giftcomm.release(c) on the main thread while a second thread calls on c in a loop: the
    ranks agree on how many calls run before the release (whatever call each rank's release
    came between), the release returns on every rank, the loop's later calls run on c's new
    transport with correct sums, and c is usable afterwards; no wait near the deadline."""
    r = run_mpi(tmp_path, 2, RELEASE_DURING_LOOP, GIFTCOMM_TIMEOUT="15", GIFTCOMM_ON_TIMEOUT="raise",
                GIFTCOMM_SHARED_MEMORY="1", CALLS="3000")
    assert r.returncode == 0, r.stdout[-3000:]
    assert_same_everywhere(r.stdout, "release", 2, "returned")
    assert_same_everywhere(r.stdout, "loop", 2, "returned")
    assert_same_everywhere(r.stdout, "after", 2, "returned")
    took = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("TOOK")]
    assert len(took) == 2 and max(took) < 10, took
