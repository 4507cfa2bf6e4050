"""netbed: a multi-host MPI testbed on one machine, over real, rate-shaped TCP links.

A bed of N "hosts" is N Linux network namespaces joined by a bridge::

    namespace gcnb-<id>-br            (the "switch"; also runs mpiexec)
      br0 10.213.7.254/24
       |-- p0 ==veth== eth0 10.213.7.1   namespace gcnb-<id>-0   (host 0, hostname gcnb-<id>-0)
       |-- p1 ==veth== eth0 10.213.7.2   namespace gcnb-<id>-1   (host 1)
       ...

Each host's link is shaped with a ``tbf`` qdisc at the configured rate in both directions: on the
host side of the veth (host transmit) and on the switch port (switch -> host, i.e. host receive),
so a host can neither send nor receive faster than its "NIC", like a full-duplex Ethernet link.
Nothing is created in the caller's (root) network namespace.

An MPI job is started with MPICH's hydra in ``-launcher manual`` mode: ``mpiexec`` runs in the
switch namespace and prints one proxy command per host; netbed runs proxy ``i`` inside namespace
``i`` (in a fresh UTS namespace with its own hostname), so every host is a separate MPI node.
Ranks on different hosts would still talk through shared memory (all namespaces share /dev/shm
and UCX believes it is one machine), so netbed forces the network module onto TCP:
``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0`` (``--transport ofi``, the default:
full duplex at link rate) or ``UCX_TLS=tcp,self UCX_NET_DEVICES=eth0`` (``--transport ucx``: works,
but a bidirectional exchange gets only half the link rate each way). Ranks on the same host
(``--ranks-per-host k``) still use MPICH's shared memory, as on a real node.

Cleanup is guaranteed on normal exit, job failure, exceptions, SIGINT/SIGTERM/SIGHUP: all
processes inside the bed's namespaces are killed and the namespaces (with their links) deleted.
After a SIGKILL of netbed itself, ``netbed cleanup`` removes the leftovers.

CLI (``python -m studies.netbed`` or ``perf/netbed``)::

    netbed run --hosts 4 --rate 1gbit [--ranks-per-host 1] [--transport ofi|ucx] -- CMD ...
    netbed probe [--sizes 16MiB,64MiB]          # an mpi4py bandwidth probe, run inside a bed
    netbed bench --hosts 4 --rates 1gbit,10gbit,none --out perf/results/netbed-probe.md
    netbed cleanup [--all]                      # remove beds left by crashed runs
    netbed list

Python API::

    with Netbed(hosts=4, rate="1gbit") as nb:
        rc = nb.run([sys.executable, "-m", "giftcomm.perf", "allreduce"])
        print(nb.link_stats())
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from giftcomm.perf.sizes import parse_size
from giftcomm.perf.timing import time_calls
from studies import subprocess_env

__all__ = [
    "Netbed",
    "NetbedError",
    "NetbedInterrupted",
    "parse_rate",
    "format_rate",
    "payload_ceiling",
    "probe",
    "bench",
    "list_beds",
    "cleanup",
    "main",
]

PREFIX = "gcnb"
DEFAULT_SUBNET = "10.213.7"  # a /24; hosts get .1 .. .N, the switch namespace .254
SWITCH_HOST = 254
MAX_HOSTS = 253
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)n(\d+)-(\d+|br)$")

# Variables of an outer launcher that must not leak into the bed's mpiexec.
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "OMPI_")

TRANSPORTS: dict[str, dict[str, str]] = {
    # UCX netmod (the mpich wheel's default), restricted to its TCP transport on the bed's NIC.
    "ucx": {
        "MPIR_CVAR_CH4_NETMOD": "ucx",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "eth0",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    },
    # OFI netmod with libfabric's tcp provider on the bed's NIC.
    "ofi": {
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "eth0",
    },
}

# Set when the bed runs more ranks than the machine has cores (the usual case: 4 "hosts" on a
# 2-core VM). MPICH's progress loop spins; spinning ranks then take the cores that the kernel
# needs to move the bed's packets and that the other ranks need to compute, and a rank that has
# data to forward waits a scheduler time slice (~ms) per hop. Yielding after every poll removes
# that artefact of the bed (real hosts have their own cores). It applies to every job on the
# bed alike, the MPI_Allreduce baseline included; the caller's own values win.
OVERSUBSCRIBED_ENV: dict[str, str] = {
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
}

_bed_counter = 0
_live_beds: set[Netbed] = set()


class NetbedError(RuntimeError):
    """Setting up, running on, or tearing down a bed failed."""


class NetbedInterrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM/SIGHUP arrives while a bed is up."""

    def __init__(self, signum: int):
        super().__init__(f"netbed interrupted by {signal.Signals(signum).name}")
        self.signum = signum


# --------------------------------------------------------------------------- rates

_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,  # tc's bytes/s spelling
}


def parse_rate(rate: str | int | float | None) -> int | None:
    """Return a link rate in bits per second, or None for an unshaped link.

    Accepts tc's spelling (``"1gbit"``, ``"2.5gbit"``, ``"100mbit"``, ``"125mbps"`` = bytes/s),
    a plain number of bit/s, or ``"none"``/``"unshaped"``/None.
    """
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        s = rate.strip().lower()
        if s in ("none", "unshaped", "off", "0", ""):
            return None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", s)
        if not m or (m.group(2) or "bit") not in _UNITS:
            raise ValueError(f"bad link rate {rate!r}: use e.g. 1gbit, 2.5gbit, 100mbit or none")
        bits = float(m.group(1)) * _UNITS[m.group(2) or "bit"]
    if bits < 8000:
        raise ValueError(f"link rate {rate!r} is below 8 kbit/s")
    return int(round(bits))


def format_rate(bits: int | None) -> str:
    """Human spelling of a rate in bit/s (``2500000000 -> '2.5gbit'``; None -> ``'none'``)."""
    if bits is None:
        return "none"
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= mult:
            return f"{bits / mult:g}{unit}"
    return f"{bits}bit"


def payload_ceiling(bits: int, mtu: int = 1500) -> float:
    """Most TCP payload bytes/s a tbf-shaped link of ``bits`` bit/s can carry at ``mtu``."""
    return bits / 8 * (mtu - 52) / (mtu + 14)


def _fmt_size(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return str(n)


# --------------------------------------------------------------------------- helpers


def _sh(args: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> str:
    """Run a short iproute2 command; return stdout; raise NetbedError with its stderr."""
    try:
        p = subprocess.run(list(args), stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise NetbedError(f"{args[0]} not found: netbed needs iproute2 (ip, tc)") from e
    except subprocess.TimeoutExpired as e:
        raise NetbedError(f"timed out: {shlex.join(args)}") from e
    if check and p.returncode != 0:
        raise NetbedError(f"`{shlex.join(args)}` failed (rc {p.returncode}): {p.stderr.strip()}")
    return p.stdout


def _netns_list() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def _kill_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespaces(names: Sequence[str], grace: float = 2.0) -> list[str]:
    """Kill every process in the namespaces, then delete them. Returns error strings."""
    errors: list[str] = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        pids = [p for ns in names for p in _netns_pids(ns)]
        if not pids:
            break
        _kill_pids(pids, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)
    # hosts first, then the switch (deleting a host ns deletes its veth pair in the switch too)
    for ns in sorted(names, key=lambda n: n.endswith("-br")):
        if ns not in _netns_list():
            continue
        try:
            _sh(["ip", "netns", "del", ns])
        except NetbedError as e:
            errors.append(str(e))
    return errors


def list_beds() -> dict[str, list[str]]:
    """Map bed id -> its namespaces, for every ``gcnb-*`` namespace on the machine."""
    beds: dict[str, list[str]] = {}
    for ns in _netns_list():
        m = _NAME_RE.match(ns)
        if m:
            beds.setdefault(f"{m.group(1)}n{m.group(2)}", []).append(ns)
        elif ns.startswith(PREFIX + "-"):
            beds.setdefault(ns.rsplit("-", 1)[0].removeprefix(PREFIX + "-"), []).append(ns)
    return beds


def _bed_owner(bed_id: str) -> int | None:
    m = re.fullmatch(r"(\d+)n\d+", bed_id)
    return int(m.group(1)) if m else None


def cleanup(all_beds: bool = False, log: IO[str] | None = None) -> int:
    """Remove beds whose owning netbed process is gone (all beds with ``all_beds``).

    Returns the number of namespaces removed.
    """
    log = log or sys.stderr
    removed = 0
    for bed_id, names in sorted(list_beds().items()):
        owner = _bed_owner(bed_id)
        if not all_beds and owner is not None and owner != os.getpid() and _pid_alive(owner):
            print(f"netbed: keeping bed {bed_id} (owner pid {owner} is alive; --all removes it)",
                  file=log)
            continue
        errors = _remove_namespaces(names)
        removed += len(names) - len(errors)
        print(f"netbed: removed bed {bed_id}: {' '.join(sorted(names))}", file=log)
        for e in errors:
            print(f"netbed: {e}", file=log)
    return removed


def _pump(src: IO[str], dst: IO[str] | None, lock: threading.Lock) -> None:
    """Copy lines from a pipe to a stream until EOF (runs in a thread)."""
    try:
        for line in src:
            if dst is not None:
                with lock:
                    dst.write(line)
                    dst.flush()
    except (ValueError, OSError):
        pass


# --------------------------------------------------------------------------- the bed


class Netbed:
    """N network namespaces behind a bridge, with rate-shaped veth links, for MPI jobs.

    Use as a context manager (``with Netbed(hosts=4, rate="1gbit") as nb: nb.run(cmd)``) or call
    :meth:`up` / :meth:`down` yourself (``down`` is idempotent and also runs at interpreter exit).

    Args:
        hosts: number of hosts (namespaces), 1..253.
        rate: link rate per host and direction (``"1gbit"``, ``"10gbit"``, ``"none"`` ...).
        ranks_per_host: MPI ranks per host (they share memory with each other).
        transport: ``"ofi"`` (default) or ``"ucx"``: how MPI traffic is forced onto TCP.
        subnet: first three octets of the private /24 used inside the bed.
        mtu: MTU of every link (1500 like plain Ethernet, 9000 for jumbo frames).
        burst: tbf bucket in bytes (default: 1 ms of traffic at the rate, at least 64 KiB).
        queue_ms: tbf queue length in milliseconds of traffic at the rate.
        hostnames: give each host namespace its own UTS namespace and hostname.
        keep_env: if True, transport variables already set by the caller are not overridden.
        log: stream for netbed's own messages (default stderr); None silences them.
    """

    def __init__(self, hosts: int = 2, rate: str | int | None = "1gbit", *,
                 ranks_per_host: int = 1, transport: str = "ofi", subnet: str = DEFAULT_SUBNET,
                 mtu: int = 1500, burst: int | None = None, queue_ms: float = 50.0,
                 hostnames: bool = True, keep_env: bool = False,
                 log: IO[str] | None = sys.stderr):
        global _bed_counter
        if not 1 <= int(hosts) <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {hosts}")
        if int(ranks_per_host) < 1:
            raise ValueError("ranks_per_host must be >= 1")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}")
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet) or any(
                int(x) > 255 for x in subnet.split(".")):
            raise ValueError(f"subnet must look like 10.213.7, got {subnet!r}")
        self.hosts = int(hosts)
        self.rate_spec = "none" if parse_rate(rate) is None else str(rate)
        self.rate_bits = parse_rate(rate)
        self.ranks_per_host = int(ranks_per_host)
        self.transport = transport
        self.subnet = subnet
        self.mtu = int(mtu)
        self.queue_ms = float(queue_ms)
        if self.rate_bits is not None:
            one_ms = self.rate_bits // 8 // 1000
            self.burst = int(burst) if burst else max(64 * 1024, one_ms)
        else:
            self.burst = 0
        self.hostnames = hostnames and shutil.which("unshare") is not None
        self.keep_env = keep_env
        self.log = log
        self.id = f"{os.getpid()}n{_bed_counter}"
        _bed_counter += 1
        self.switch_ns = f"{PREFIX}-{self.id}-br"
        self.host_ns = [f"{PREFIX}-{self.id}-{i}" for i in range(self.hosts)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(self.hosts)]
        self.switch_addr = f"{subnet}.{SWITCH_HOST}"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._is_up = False
        self._old_handlers: dict[int, object] = {}

    # ----------------------------------------------------------------- lifecycle

    def _say(self, msg: str) -> None:
        if self.log is not None:
            print(f"netbed: {msg}", file=self.log, flush=True)

    @staticmethod
    def check_requirements() -> None:
        """Raise NetbedError with a clear message if this machine cannot host a bed."""
        missing = [t for t in ("ip", "tc", "mpiexec") if shutil.which(t) is None]
        if missing:
            raise NetbedError(f"netbed needs {', '.join(missing)} on PATH "
                              "(iproute2 for ip/tc, MPICH's hydra for mpiexec)")
        if os.geteuid() != 0:
            raise NetbedError("netbed needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) to create "
                              "network namespaces; run it as root or in a privileged container")

    def up(self) -> Netbed:
        """Create namespaces, bridge, links, addresses and shapers. Cleans up if it fails."""
        if self._is_up:
            return self
        self.check_requirements()
        _live_beds.add(self)
        self._is_up = True
        try:
            self._build()
        except BaseException as e:
            self.down()
            if isinstance(e, NetbedError):
                raise NetbedError(f"could not create the bed: {e}") from e
            raise
        self._say(self.describe())
        return self

    def _build(self) -> None:
        sw = self.switch_ns
        for ns in [sw, *self.host_ns]:
            _sh(["ip", "netns", "add", ns])
            self._created.append(ns)
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        _sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu)])
        _sh(["ip", "-n", sw, "addr", "add", f"{self.switch_addr}/24", "dev", "br0"])
        _sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, (ns, addr) in enumerate(zip(self.host_ns, self.addrs)):
            port = f"p{i}"
            _sh(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu)])
            _sh(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _sh(["ip", "-n", sw, "link", "set", port, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if self.rate_bits is not None:
                self._shape(ns, "eth0")   # host -> switch (host transmit)
                self._shape(sw, port)     # switch -> host (host receive)

    def _shape(self, ns: str, dev: str) -> None:
        limit = max(3 * self.burst, int(self.rate_bits / 8 * self.queue_ms / 1000))
        _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", f"{self.rate_bits}bit", "burst", str(self.burst), "limit", str(limit)])

    def down(self) -> None:
        """Kill every process of the bed and delete its namespaces and links. Idempotent.

        Signals are held off (ignored) while this runs so a second Ctrl-C cannot interrupt it.
        """
        if not self._is_up:
            return
        held = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                held[s] = signal.signal(s, signal.SIG_IGN)
        try:
            self._kill_procs()
            names = [ns for ns in [*self.host_ns, self.switch_ns] if ns in _netns_list()]
            errors = _remove_namespaces(names)
            left = [ns for ns in [*self.host_ns, self.switch_ns] if ns in _netns_list()]
            if errors or left:
                self._say(f"cleanup incomplete ({'; '.join(errors)}); "
                          f"left: {' '.join(left)}; run `netbed cleanup`")
            self._is_up = False
            self._created.clear()
            _live_beds.discard(self)
        finally:
            for s, h in held.items():
                signal.signal(s, h)

    def _kill_procs(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self._procs if p.poll() is None]
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 2.0
            for p in alive:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._procs = [p for p in self._procs if p.poll() is None]

    def __enter__(self) -> Netbed:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[s] = signal.signal(s, self._on_signal)
        try:
            return self.up()
        except BaseException:
            self._restore_handlers()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            self._restore_handlers()

    def _restore_handlers(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers.clear()

    @staticmethod
    def _on_signal(signum, frame) -> None:
        raise NetbedInterrupted(signum)

    # ----------------------------------------------------------------- info

    def describe(self) -> str:
        """One paragraph: link rate and topology."""
        shaped = (f"tbf {format_rate(self.rate_bits)} each direction "
                  f"(burst {self.burst} B, queue {self.queue_ms:g} ms)"
                  if self.rate_bits else "unshaped veth")
        env = self.job_env()
        tvars = [k for k in TRANSPORTS[self.transport] if not k.startswith("UCX_WARN")]
        kept = [k for k in tvars if env[k] != TRANSPORTS[self.transport][k]]
        how = (f"MPI via {self.transport} with the caller's {', '.join(kept)} kept: TCP NOT "
               f"guaranteed" if kept else f"MPI over TCP via {self.transport}")
        lines = [f"bed {self.id}: {self.hosts} hosts x {self.ranks_per_host} rank(s), "
                 f"link rate {self.rate_spec} ({shaped}), mtu {self.mtu}, {how} "
                 f"({' '.join(f'{k}={env[k]}' for k in tvars)})"
                 + (f"; {self.hosts * self.ranks_per_host} ranks on {os.cpu_count()} CPUs, so MPI "
                    f"yields while it waits ({' '.join(f'{k}={env[k]}' for k in OVERSUBSCRIBED_ENV)})"
                    if self.oversubscribed else ""),
                 f"  switch {self.switch_ns}: br0 {self.switch_addr}/24 (runs mpiexec)"]
        for i, (ns, a) in enumerate(zip(self.host_ns, self.addrs)):
            r0 = i * self.ranks_per_host
            ranks = (f"rank {r0}" if self.ranks_per_host == 1
                     else f"ranks {r0}-{r0 + self.ranks_per_host - 1}")
            lines.append(f"  host {i} {ns}: eth0 {a} <-> br0 port p{i}; {ranks}")
        return "\n".join(lines)

    def link_stats(self) -> dict[int, dict[str, int]]:
        """Per host: bytes/packets through its link and its shapers.

        Keys: ``tx_bytes``/``rx_bytes`` (host's eth0 counters), ``qdisc_tx_bytes`` (bytes the
        host-side tbf sent), ``qdisc_rx_bytes`` (bytes the switch-port tbf sent to the host),
        ``qdisc_overlimits`` (times a shaper throttled), ``qdisc_drops``. Qdisc keys are 0 when
        the bed is unshaped.
        """
        stats: dict[int, dict[str, int]] = {}
        for i, ns in enumerate(self.host_ns):
            link = json.loads(_sh(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0"]))[0]
            s = {"tx_bytes": link["stats64"]["tx"]["bytes"],
                 "rx_bytes": link["stats64"]["rx"]["bytes"],
                 "qdisc_tx_bytes": 0, "qdisc_rx_bytes": 0, "qdisc_overlimits": 0,
                 "qdisc_drops": 0}
            for key, q_ns, dev in (("qdisc_tx_bytes", ns, "eth0"),
                                   ("qdisc_rx_bytes", self.switch_ns, f"p{i}")):
                for q in json.loads(_sh(["tc", "-n", q_ns, "-s", "-j", "qdisc", "show",
                                         "dev", dev]) or "[]"):
                    if q.get("kind") == "tbf":
                        s[key] += q.get("bytes", 0)
                        s["qdisc_overlimits"] += q.get("overlimits", 0)
                        s["qdisc_drops"] += q.get("drops", 0)
            stats[i] = s
        return stats

    @property
    def oversubscribed(self) -> bool:
        """More ranks on the bed than CPUs on the machine (see OVERSUBSCRIBED_ENV)."""
        return self.hosts * self.ranks_per_host > (os.cpu_count() or 1)

    def job_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a job on this bed gets (mpiexec passes it to every rank)."""
        env = dict(os.environ if base is None else base)
        for k in list(env):
            if k.startswith(_LAUNCHER_ENV_PREFIXES):
                del env[k]
        for k, v in TRANSPORTS[self.transport].items():
            if not (self.keep_env and k in env):
                env[k] = v
        if self.oversubscribed:
            for k, v in OVERSUBSCRIBED_ENV.items():
                env.setdefault(k, v)
        env["GIFTCOMM_NETBED_RATE"] = self.rate_spec
        env["GIFTCOMM_NETBED_HOSTS"] = str(self.hosts)
        env["GIFTCOMM_NETBED_RANKS_PER_HOST"] = str(self.ranks_per_host)
        env["GIFTCOMM_NETBED_TRANSPORT"] = self.transport
        return env

    # ----------------------------------------------------------------- running jobs

    def run(self, cmd: Sequence[str], *, env: dict[str, str] | None = None,
            timeout: float | None = None, stdout: IO[str] | None = None,
            stderr: IO[str] | None = None, launch_timeout: float = 30.0) -> int:
        """Run ``cmd`` as an MPI job with ``hosts * ranks_per_host`` ranks; return its exit code.

        The job's stdout/stderr (forwarded by hydra) stream to ``stdout``/``stderr`` (default:
        this process's). ``env`` replaces the base environment (netbed's variables are added).
        On ``timeout`` (seconds) the job is killed and 124 is returned. Processes left over
        after the job are killed before returning.
        """
        if not self._is_up:
            raise NetbedError("the bed is not up (use `with Netbed(...)` or call up())")
        if not cmd:
            raise ValueError("empty command")
        out = stdout if stdout is not None else sys.stdout
        err = stderr if stderr is not None else sys.stderr
        lock = threading.Lock()
        jenv = self.job_env(env)
        nranks = self.hosts * self.ranks_per_host
        mpiexec = ["ip", "netns", "exec", self.switch_ns, "mpiexec", "-launcher", "manual",
                   "-localhost", self.switch_addr,
                   "-hosts", ",".join(f"{a}:{self.ranks_per_host}" for a in self.addrs),
                   "-n", str(nranks), *cmd]
        self._say(f"job: {shlex.join(cmd)} ({nranks} ranks, GIFTCOMM_NETBED_RATE={self.rate_spec})")
        t0 = time.monotonic()
        mp = subprocess.Popen(mpiexec, env=jenv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, bufsize=1,
                              start_new_session=True)
        self._procs.append(mp)
        threads = [threading.Thread(target=_pump, args=(mp.stderr, err, lock), daemon=True)]
        threads[0].start()
        finished = False
        try:
            launches = self._read_launch_lines(mp, launch_timeout)
            for proxy_id, argv in launches:
                ns = self.host_ns[proxy_id]
                wrapped = ["ip", "netns", "exec", ns]
                if self.hostnames:
                    wrapped += ["unshare", "--uts", "--", "sh", "-c",
                                'echo "$0" > /proc/sys/kernel/hostname && exec "$@"', ns]
                px = subprocess.Popen(wrapped + argv, env=jenv, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      bufsize=1, start_new_session=True)
                self._procs.append(px)
                t = threading.Thread(target=_pump, args=(px.stdout, err, lock), daemon=True)
                t.start()
                threads.append(t)
            t = threading.Thread(target=_pump, args=(mp.stdout, out, lock), daemon=True)
            t.start()
            threads.append(t)
            remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
            try:
                rc = mp.wait(timeout=remaining)
                finished = True
            except subprocess.TimeoutExpired:
                self._say(f"job timed out after {timeout:g} s; killing it")
                rc = 124
        finally:
            # after a normal end the proxies exit right after mpiexec: give them a moment;
            # after a timeout, error or interrupt kill at once. Anything left is a stray.
            deadline = time.monotonic() + (3.0 if finished else 0.0)
            for p in self._procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._kill_procs()
            for ns in self.host_ns:
                _kill_pids(_netns_pids(ns), signal.SIGKILL)
            for t in threads:
                t.join(timeout=2.0)
        self._say(f"job exited with {rc} after {time.monotonic() - t0:.1f} s")
        return rc

    def _read_launch_lines(self, mp: subprocess.Popen, timeout: float) -> list[tuple[int, list[str]]]:
        """Read hydra's ``HYDRA_LAUNCH:`` lines (one per host) up to ``HYDRA_LAUNCH_END``."""
        launches: list[tuple[int, list[str]]] = []
        box: dict[str, object] = {}

        def reader() -> None:
            try:
                for line in mp.stdout:
                    if line.startswith("HYDRA_LAUNCH_END"):
                        box["end"] = True
                        return
                    if line.startswith("HYDRA_LAUNCH:"):
                        argv = shlex.split(line.split(":", 1)[1])
                        pid = int(argv[argv.index("--proxy-id") + 1])
                        launches.append((pid, argv))
                    else:
                        box.setdefault("other", []).append(line)
            except Exception as e:  # noqa: BLE001 - reported below
                box["error"] = e

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout)
        if "end" not in box:
            other = "".join(box.get("other", []))[-2000:]
            why = "timed out" if t.is_alive() else f"mpiexec exited with {mp.poll()}"
            raise NetbedError(f"hydra did not print its launch commands ({why}); output: {other}")
        if sorted(p for p, _ in launches) != list(range(self.hosts)):
            raise NetbedError(f"expected proxies 0..{self.hosts - 1}, got "
                              f"{sorted(p for p, _ in launches)}")
        return launches


@atexit.register
def _down_all() -> None:
    for bed in list(_live_beds):
        bed.down()


# --------------------------------------------------------------------------- probe (MPI job)


def probe(sizes: Sequence[int], iters: int = 3, p2p_size: int = 16 << 20,
          out: IO[str] | None = None) -> int:
    """mpi4py bandwidth probe; run it as an MPI job (e.g. inside a bed). Rank 0 prints.

    Measures (best of ``iters``): one-way stream rank 0 -> rank on the next host; bidirectional
    exchange between those two; a ring shift (every rank sends to the next host's rank and
    receives from the previous one at the same time, like a ring allreduce step); and
    ``MPI_Allreduce`` on fp32 buffers of each size with algbw and busbw = algbw*2(P-1)/P.
    """
    import numpy as np
    from mpi4py import MPI

    out = out or sys.stdout
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rph = int(os.environ.get("GIFTCOMM_NETBED_RANKS_PER_HOST", "1"))
    say = (lambda s: print(s, file=out, flush=True)) if rank == 0 else (lambda s: None)
    results: dict[str, float] = {}
    names = comm.gather(MPI.Get_processor_name(), root=0)
    say(f"# probe: {size} ranks on {len(set(names or []))} nodes {sorted(set(names or []))}; "
        f"link rate {os.environ.get('GIFTCOMM_NETBED_RATE', '?')}; MPI {MPI.Get_library_version().splitlines()[0]}")

    def until_all_done(run):  # a repeat ends when the last rank is done (the second barrier)
        t0 = MPI.Wtime()
        result = run()
        comm.Barrier()
        return MPI.Wtime() - t0, result

    def best(fn) -> float:
        return time_calls(fn, iters, warmup=0, barrier=comm.Barrier, stat="min", clock=until_all_done)[0]

    if size >= 2:
        peer = rph % size if rph < size else 1
        n = p2p_size
        sbuf = np.ones(n, np.uint8)
        rbuf = np.empty(n, np.uint8)

        def one_way():
            if rank == 0:
                comm.Send(sbuf, dest=peer)
            elif rank == peer:
                comm.Recv(rbuf, source=0)

        def both_ways():
            if rank in (0, peer):
                other = peer if rank == 0 else 0
                comm.Sendrecv(sbuf, dest=other, recvbuf=rbuf, source=other)

        step = rph if size > rph else 1

        def ring_shift():
            comm.Sendrecv(sbuf, dest=(rank + step) % size, recvbuf=rbuf,
                          source=(rank - step) % size)

        comm.Sendrecv(sbuf[:1024], dest=(rank + 1) % size, recvbuf=rbuf[:1024],
                      source=(rank - 1) % size)  # warm up connections
        say(f"{'test':<34} {'bytes':>12} {'time_ms':>10} {'MB/s':>10}")
        for label, fn, factor in (
                (f"p2p one-way 0->{peer}", one_way, 1),
                (f"p2p bidirectional 0<->{peer} (each)", both_ways, 1),
                (f"ring shift +{step} (per rank)", ring_shift, 1)):
            t = best(fn)
            say(f"{label:<34} {n:>12} {t * 1e3:>10.1f} {factor * n / t / 1e6:>10.1f}")
            results[label.split()[0] + "_" + label.split()[1]] = n / t / 1e6

    say(f"{'allreduce fp32 sum':<22} {'bytes':>12} {'time_ms':>10} {'algbw MB/s':>11} "
        f"{'busbw MB/s':>11} {'#wrong':>6}")
    for nbytes in sizes:
        count = nbytes // 4
        a = np.full(count, rank + 1, np.float32)
        b = np.empty_like(a)
        comm.Allreduce(a, b)  # warm-up
        t = best(lambda: comm.Allreduce(a, b))
        wrong = int(np.count_nonzero(b != np.float32(size * (size + 1) / 2)))
        wrong = comm.reduce(wrong, op=MPI.SUM, root=0)
        algbw = nbytes / t / 1e6
        busbw = algbw * 2 * (size - 1) / size if size > 1 else 0.0
        if rank == 0:
            say(f"{'':<22} {nbytes:>12} {t * 1e3:>10.1f} {algbw:>11.1f} {busbw:>11.1f} "
                f"{wrong:>6}")
            results[f"allreduce_busbw_{nbytes}"] = busbw
            results[f"allreduce_wrong_{nbytes}"] = wrong
    say("PROBE_JSON " + json.dumps(results))
    return 0


def _abort_on_error(fn, *args, **kwargs) -> int:
    """Call fn inside an MPI job; on an exception print it and MPI_Abort the whole job.

    (A rank that dies with a Python exception would otherwise hang the others in MPI_Finalize.)
    """
    try:
        return fn(*args, **kwargs)
    except BaseException:
        import traceback

        from mpi4py import MPI
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1


# --------------------------------------------------------------------------- bench (probe sweep)


def bench(hosts: int, rates: Sequence[str], sizes: Sequence[int], iters: int,
          transport: str, ranks_per_host: int, out_path: str | None, argv_line: str,
          **bed_kwargs) -> int:
    """Run the probe on a fresh bed per rate; report link counters; optionally write markdown.

    ``bed_kwargs`` go to :class:`Netbed` (mtu, burst, queue_ms, subnet). Returns the first
    non-zero probe exit code, else 0.
    """
    mtu = int(bed_kwargs.get("mtu", 1500))
    report = ["# netbed probe\n", f"```\n{argv_line}\n```\n",
              f"Machine: {os.cpu_count()} CPUs, kernel {os.uname().release}; "
              f"{hosts} hosts x {ranks_per_host} rank(s), transport {transport}.\n"]
    worst = 0
    summary = ["| rate | payload ceiling MB/s | p2p one-way | p2p bidir (each) | ring shift | "
               + " | ".join(f"allreduce {_fmt_size(n)} busbw" for n in sizes)
               + " | bytes sent over links | bytes through shapers |",
               "|---" * (7 + len(sizes)) + "|"]
    for rate in rates:
        buf = io.StringIO()
        cmd = [sys.executable, "-m", "studies.netbed", "probe", "--iters", str(iters),
               "--sizes", ",".join(str(s) for s in sizes)]
        with Netbed(hosts=hosts, rate=rate, transport=transport,
                    ranks_per_host=ranks_per_host, **bed_kwargs) as nb:
            before = nb.link_stats()
            rc = nb.run(cmd, stdout=_Tee(buf, sys.stdout), env=subprocess_env())
            after = nb.link_stats()
            desc = nb.describe()
        worst = worst or rc
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        report.append(f"## rate {rate}\n\nload average after the run: {load}\n\n"
                      f"```\n{desc}\n\n{buf.getvalue().rstrip()}\n```\n")
        rows = ["| host | eth0 tx | eth0 rx | tbf tx (host->switch) | tbf rx (switch->host) "
                "| overlimits | drops |", "|---|---|---|---|---|---|---|"]
        for i in sorted(after):
            d = {k: after[i][k] - before[i][k] for k in after[i]}
            rows.append(f"| {i} | {_fmt_bytes(d['tx_bytes'])} | {_fmt_bytes(d['rx_bytes'])} | "
                        f"{_fmt_bytes(d['qdisc_tx_bytes'])} | {_fmt_bytes(d['qdisc_rx_bytes'])} | "
                        f"{d['qdisc_overlimits']} | {d['qdisc_drops']} |")
        report.append("Link counters during the job:\n\n" + "\n".join(rows) + "\n")
        print("\n".join(rows), file=sys.stderr)
        res = {}
        for line in buf.getvalue().splitlines():
            if line.startswith("PROBE_JSON "):
                res = json.loads(line.split(" ", 1)[1])
        bits = parse_rate(rate)
        ceiling = f"{payload_ceiling(bits, mtu) / 1e6:.1f}" if bits else "-"
        shaped = sum(after[i]["qdisc_tx_bytes"] - before[i]["qdisc_tx_bytes"] for i in after)
        sent = sum(after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in after)
        cells = [rate, ceiling] + [
            f"{res[k]:.1f}" if k in res else "?" for k in
            ("p2p_one-way", "p2p_bidirectional", "ring_shift",
             *(f"allreduce_busbw_{n}" for n in sizes))] + [_fmt_bytes(sent), _fmt_bytes(shaped)]
        summary.append("| " + " | ".join(cells) + " |")
    report.insert(3, "## Summary (MB/s = 10^6 B/s of MPI payload)\n\n" + "\n".join(summary)
                  + "\n\nPayload ceiling: rate/8 x (MTU-52)/(MTU+14) (TCP/IPv4 headers with "
                  "timestamps; tbf counts the 14-byte Ethernet header but not preamble/FCS/gap). "
                  "busbw = algbw x 2(P-1)/P.\n")
    print("\n".join(summary), file=sys.stderr)
    if out_path:
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        with open(out_path, "w") as f:
            f.write("\n".join(report))
        print(f"netbed: wrote {out_path}", file=sys.stderr)
    return worst


class _Tee(io.TextIOBase):
    def __init__(self, *streams: IO[str]):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


# --------------------------------------------------------------------------- CLI


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="netbed",
        description="Multi-host MPI testbed on one machine: network namespaces joined by a "
                    "bridge, links rate-shaped with tc tbf, MPI forced onto TCP. Needs root.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def bed_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
        q.add_argument("--ranks-per-host", type=int, default=1, help="MPI ranks per host")
        q.add_argument("--transport", choices=sorted(TRANSPORTS), default="ofi",
                       help="how MPI is forced onto TCP (default ofi)")
        q.add_argument("--subnet", default=DEFAULT_SUBNET, help="private /24 inside the bed")
        q.add_argument("--mtu", type=int, default=1500)
        q.add_argument("--burst", type=int, default=None, help="tbf bucket bytes")
        q.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue length (ms)")

    r = sub.add_parser("run", help="run an MPI job on a fresh bed (then tear it down)")
    bed_args(r)
    r.add_argument("--rate", default="1gbit",
                   help="link rate per host and direction: 1gbit, 2.5gbit, 10gbit, none ...")
    r.add_argument("--keep-env", action="store_true",
                   help="do not override UCX_*/FI_*/MPIR_CVAR_CH4_NETMOD already set by the caller")
    r.add_argument("--timeout", type=float, default=None, help="kill the job after SECONDS (rc 124)")
    r.add_argument("--stats", action="store_true", help="print per-link byte counters afterwards")
    r.add_argument("job", nargs=argparse.REMAINDER, help="-- command and its arguments")

    pr = sub.add_parser("probe", help="mpi4py bandwidth probe (run inside a bed)")
    pr.add_argument("--sizes", default="16MiB,64MiB", help="allreduce sizes, comma separated")
    pr.add_argument("--p2p-size", type=parse_size, default=16 << 20)
    pr.add_argument("--iters", type=int, default=3)

    b = sub.add_parser("bench", help="run the probe on a fresh bed per rate")
    bed_args(b)
    b.add_argument("--rates", default="1gbit,10gbit,none")
    b.add_argument("--sizes", default="16MiB,64MiB")
    b.add_argument("--iters", type=int, default=3)
    b.add_argument("--out", default=None, help="write a markdown report here")

    c = sub.add_parser("cleanup", help="remove beds left behind by crashed runs")
    c.add_argument("--all", action="store_true", help="also remove beds of live netbed processes")
    sub.add_parser("list", help="list gcnb-* namespaces")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    args = _build_parser().parse_args(argv)
    try:
        if args.cmd == "probe":
            return _abort_on_error(probe, [parse_size(s) for s in args.sizes.split(",") if s],
                                   iters=args.iters, p2p_size=args.p2p_size)
        if args.cmd == "list":
            for bed_id, names in sorted(list_beds().items()):
                owner = _bed_owner(bed_id)
                state = ("owner alive" if owner and _pid_alive(owner) else "stale")
                print(f"{bed_id}\t{state}\t{' '.join(sorted(names))}")
            return 0
        if args.cmd == "cleanup":
            Netbed.check_requirements()
            n = cleanup(all_beds=args.all)
            print(f"netbed: removed {n} namespace(s)", file=sys.stderr)
            return 0
        if args.cmd == "bench":
            line = "perf/netbed " + shlex.join(argv if argv is not None else sys.argv[1:])
            return bench(args.hosts, [r for r in args.rates.split(",") if r],
                         [parse_size(s) for s in args.sizes.split(",") if s], args.iters,
                         args.transport, args.ranks_per_host, args.out, line, mtu=args.mtu,
                         burst=args.burst, queue_ms=args.queue_ms, subnet=args.subnet)
        # run
        job = args.job[1:] if args.job[:1] == ["--"] else args.job
        if not job:
            print("netbed run: give the job after --, e.g. netbed run --hosts 4 -- "
                  "python -m studies.netbed probe", file=sys.stderr)
            return 2
        with Netbed(hosts=args.hosts, rate=args.rate, ranks_per_host=args.ranks_per_host,
                    transport=args.transport, subnet=args.subnet, mtu=args.mtu,
                    burst=args.burst, queue_ms=args.queue_ms, keep_env=args.keep_env) as nb:
            before = nb.link_stats()
            rc = nb.run(job, timeout=args.timeout)
            if args.stats:
                after = nb.link_stats()
                for i in sorted(after):
                    d = {k: after[i][k] - before[i][k] for k in after[i]}
                    print(f"netbed: host {i}: eth0 tx {_fmt_bytes(d['tx_bytes'])} rx "
                          f"{_fmt_bytes(d['rx_bytes'])}; tbf tx {_fmt_bytes(d['qdisc_tx_bytes'])}"
                          f" rx {_fmt_bytes(d['qdisc_rx_bytes'])}, overlimits "
                          f"{d['qdisc_overlimits']}, drops {d['qdisc_drops']}", file=sys.stderr)
            return rc
    except NetbedInterrupted as e:
        print(f"netbed: {e}; cleaned up", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("netbed: interrupted; cleaned up", file=sys.stderr)
        return 130
    except (NetbedError, ValueError) as e:
        print(f"netbed: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
