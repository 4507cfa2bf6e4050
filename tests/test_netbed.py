"""Tests for netbed, the multi-host MPI testbed (studies/netbed.py).

These need root and iproute2 (they create network namespaces); on a machine where that is
impossible they FAIL with the reason, they do not skip. No timing assertions: speed is measured
by ``netbed bench``, not here. Runtime is about 30 s.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from studies import netbed  # the checkout's studies/ (pyproject's pytest pythonpath)
from studies.netbed import Netbed, NetbedError, parse_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one xdist worker runs this module (tests/run_all.sh: --dist loadgroup): its beds and the probe
# namespace below are machine-wide, so two workers' fixtures would collide ("File exists")
pytestmark = pytest.mark.xdist_group("netbed")

N_FLOATS = 1 << 20  # 4 MiB of fp32 per rank

JOB = textwrap.dedent(f"""
    import os, socket, sys
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    fail_rank = int(os.environ.get("NETBED_TEST_FAIL_RANK", "-1"))
    if rank == fail_rank:
        sys.exit(3)
    a = np.arange({N_FLOATS}, dtype=np.float32) % 1000 + rank
    b = np.empty_like(a)
    comm.Allreduce(a, b, op=MPI.SUM)
    expect = (np.arange({N_FLOATS}, dtype=np.float32) % 1000) * size + size * (size - 1) / 2
    ok = bool(np.array_equal(b, expect))
    names = comm.allgather(MPI.Get_processor_name())
    print(f"RESULT rank={{rank}} size={{size}} ok={{ok}} host={{socket.gethostname()}} "
          f"nodes={{len(set(names))}} rate={{os.environ.get('GIFTCOMM_NETBED_RATE')}} END",
          flush=True)
    sys.exit(0 if ok else 1)
""")


@pytest.fixture(scope="module", autouse=True)
def _requirements():
    """Fail (not skip) with a clear message if this machine cannot create a bed."""
    try:
        Netbed.check_requirements()
        name = f"gcnb-{os.getpid()}n0-probe"  # this process's: never another run's
        probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if probe.returncode != 0:
            raise NetbedError(f"`ip netns add` failed: {probe.stderr.strip()}")
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    except NetbedError as e:
        pytest.fail(f"netbed cannot run here: {e}. These tests need root, iproute2 and "
                    "network-namespace support (run CI as root / privileged container).",
                    pytrace=False)


@pytest.fixture()
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return [sys.executable, "-m", "mpi4py", str(path)]


def _gone(nb: Netbed) -> None:
    names = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
                .stdout.split())
    left = [ns for ns in [*nb.host_ns, nb.switch_ns] if ns in names]
    assert not left, f"namespaces left behind: {left}"


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("125mbps") == 10**9
    assert parse_rate("none") is None and parse_rate(None) is None
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_allreduce_over_shaped_links(job):
    """3 hosts at 1gbit: allreduce is right, ranks are separate nodes, bytes crossed the tbfs."""
    out = io.StringIO()
    with Netbed(hosts=3, rate="1gbit", log=None) as nb:
        before = nb.link_stats()
        rc = nb.run(job, stdout=out, stderr=out, timeout=60)
        after = nb.link_stats()
        leftover = [p for ns in nb.host_ns for p in netbed._netns_pids(ns)]
    text = out.getvalue()
    assert rc == 0, text
    # hydra forwards output in chunks, so lines of different ranks may be merged: use a regex
    results = re.findall(r"RESULT rank=(\d+) size=(\d+) ok=(\w+) host=(\S+) nodes=(\d+) "
                         r"rate=(\S+?) END", text)
    assert sorted(int(r[0]) for r in results) == [0, 1, 2], text
    assert all(r[1:3] == ("3", "True") and r[4:] == ("3", "1gbit") for r in results), text
    assert {r[3] for r in results} == set(nb.host_ns), text
    assert not leftover, f"processes left in the bed after the job: {leftover}"
    # Every rank sends at least ~(P-1)/P of its buffer to other hosts; with MPI on shared
    # memory these counters would stay near zero (only hydra's control traffic).
    payload = N_FLOATS * 4
    for i in range(3):
        tx = after[i]["qdisc_tx_bytes"] - before[i]["qdisc_tx_bytes"]
        rx = after[i]["qdisc_rx_bytes"] - before[i]["qdisc_rx_bytes"]
        assert tx >= payload // 2, f"host {i}: only {tx} B through its egress shaper"
        assert rx >= payload // 2, f"host {i}: only {rx} B through its ingress shaper"
        assert after[i]["tx_bytes"] - before[i]["tx_bytes"] >= payload // 2
    _gone(nb)


def test_two_ranks_per_host(job):
    """2 hosts x 2 ranks: MPI sees 2 nodes; inter-host data still crosses the links."""
    out = io.StringIO()
    with Netbed(hosts=2, rate="1gbit", ranks_per_host=2, log=None) as nb:
        before = nb.link_stats()
        rc = nb.run(job, stdout=out, stderr=out, timeout=60)
        after = nb.link_stats()
    text = out.getvalue()
    assert rc == 0, text
    results = re.findall(r"RESULT rank=(\d+) size=4 ok=True host=(\S+) nodes=2 ", text)
    assert sorted(int(r[0]) for r in results) == [0, 1, 2, 3], text
    assert {r[1] for r in results if int(r[0]) < 2} == {nb.host_ns[0]}, text
    for i in range(2):
        assert after[i]["qdisc_tx_bytes"] - before[i]["qdisc_tx_bytes"] >= N_FLOATS * 4 // 2
    _gone(nb)


def test_failing_job_returns_nonzero_and_cleans_up(job):
    out = io.StringIO()
    nb = Netbed(hosts=2, rate="none", log=None)
    with nb:
        rc = nb.run(job, env={**os.environ, "NETBED_TEST_FAIL_RANK": "1"}, stdout=out,
                    stderr=out, timeout=60)
    assert rc != 0, out.getvalue()
    _gone(nb)


def test_exception_inside_with_cleans_up():
    nb = Netbed(hosts=2, rate="2.5gbit", log=None)
    with pytest.raises(RuntimeError, match="boom"):
        with nb:
            names = set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True).stdout.split())
            assert set(nb.host_ns) <= names and nb.switch_ns in names
            raise RuntimeError("boom")
    _gone(nb)


def test_timeout_kills_stray_processes():
    out = io.StringIO()
    with Netbed(hosts=2, rate="none", log=None) as nb:
        t0 = time.monotonic()
        rc = nb.run([sys.executable, "-c", "import time; time.sleep(120)"], stdout=out,
                    stderr=out, timeout=4)
        assert rc == 124
        assert time.monotonic() - t0 < 30
        leftover = [p for ns in nb.host_ns for p in netbed._netns_pids(ns)]
        assert not leftover, f"processes left after a timeout: {leftover}"
    _gone(nb)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_signal_cleans_up(sig):
    """SIGTERM / SIGINT (Ctrl-C) to `perf/netbed run` tears the bed down; exit 128+signal."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "perf", "netbed"), "run",
                          "--hosts", "2", "--rate", "1gbit", "--", sys.executable, "-c",
                          "import time; print('started', flush=True); time.sleep(120)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = p.stdout.readline()  # the job's output arrives once the job runs
        assert "started" in line  # (hydra may merge the ranks' lines)
        bed_id = f"{p.pid}n0"
        assert bed_id in netbed.list_beds()
        p.send_signal(sig)
        rc = p.wait(timeout=30)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                netbed.cleanup(log=io.StringIO())
    assert rc == 128 + sig, err
    assert bed_id not in netbed.list_beds(), err


def test_cleanup_removes_beds_of_dead_owners():
    code = ("import sys, time; sys.path.insert(0, %r); from studies.netbed import Netbed;"
            "nb = Netbed(hosts=2, rate='1gbit', log=None).up(); print(nb.id, flush=True);"
            "time.sleep(120)" % ROOT)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        bed_id = p.stdout.readline().strip()
        assert bed_id in netbed.list_beds()
        netbed.cleanup(log=io.StringIO())  # owner alive: kept
        assert bed_id in netbed.list_beds()
        p.kill()  # SIGKILL: no chance to clean up
        p.wait()
        assert bed_id in netbed.list_beds()
        assert netbed.main(["cleanup"]) == 0
        assert bed_id not in netbed.list_beds()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
