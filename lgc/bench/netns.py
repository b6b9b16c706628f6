"""A shaped network of Linux network namespaces: the harness behind ``lgc-bench network``.

Layout (``P`` workers, all names carry the run's prefix, pid and a random id)::

    worker ns <prefix>-<pid>-<id>-w0          hub ns <prefix>-<pid>-<id>-hub
      lo, <prefix><id>w0  10.77.0.1/24 ---veth---  <prefix><id>h0 --+
    worker ns ...-w1                                                 +-- bridge <prefix><id>br
      lo, <prefix><id>w1  10.77.0.2/24 ---veth---  <prefix><id>h1 --+
    ...

Every link is shaped in both directions, like a switch port: the queue on the worker-side veth
holds what the worker uploads, the queue on the hub-side veth what it downloads. Each queue is a
token bucket (``tbf``) at ``bandwidth``; with ``delay``, a ``netem`` delay line sits in front of it
(``netem`` as the root qdisc, ``tbf`` as its child: the pattern of the netem documentation). A
packet from one worker to another crosses two links, so it sees ``2 * delay`` one way and
``4 * delay`` round trip, and the tighter of the two token buckets.

Three choices keep the interface counters equal to what a real wire would carry:

* IPv6 is off in every namespace (IPv4 only: no router solicitations, DAD or MLD reports) and the
  bridge does no multicast snooping (which would send an IGMP report for 224.0.0.106): an idle
  network sends nothing at all, and traffic adds only an ARP exchange per pair of peers.
* The worker-side veth has ``gso_max_segs 1``: TCP hands the device one MSS-sized frame at a time,
  each counted with its own Ethernet, IP and TCP headers (66 bytes with timestamps). With TSO a
  64 KiB super-frame would be counted once with one set of headers, undercounting the framing by
  about 1.5 % of the payload. The cost is CPU per frame, noticeable only well above 1 Gbit/s.

Requirements: root, ``ip`` and ``tc`` from iproute2, a kernel with network namespaces, veth,
bridges, ``sch_tbf`` (and ``sch_netem`` for ``delay``). :func:`check_available` says which one
is missing before anything is created.

Example::

    from lgc.bench.netns import ShapedNetwork, check_available, counter_delta

    check_available()
    with ShapedNetwork(workers=2, bandwidth="100mbit", delay="1ms") as net:
        before = net.counters()
        env = {**os.environ, "GLOO_SOCKET_IFNAME": net.interface(1)}
        subprocess.run(net.command(1, [sys.executable, "worker.py", net.address(0)]), env=env)
        print(counter_delta(before, net.counters()))

Why one module: one job, building, shaping, measuring and always tearing down the namespaces
(veth pairs, the hub bridge, the tbf and netem queues, the byte counters), whose cleanup paths
(signals, a crashed worker, a build that fails halfway, stale namespaces) must stay beside the
build; the parsing of rates and delays beside it is what its commands take.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import warnings
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "NetworkSetupError",
    "NetworkUnavailable",
    "ShapedNetwork",
    "check_available",
    "counter_delta",
    "parse_delay",
    "parse_rate",
    "remove_stale",
]

# tc(8) rate units, case-insensitive as tc reads them. Beware: "bps" is *bytes* per second.
_RATE_UNITS: dict[str, int] = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
# tc(8) time units, in microseconds.
_TIME_UNITS: dict[str, float] = {
    "s": 1e6,
    "sec": 1e6,
    "secs": 1e6,
    "ms": 1e3,
    "msec": 1e3,
    "msecs": 1e3,
    "us": 1.0,
    "usec": 1.0,
    "usecs": 1.0,
}
_NUMBER_AND_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*$")

# Interface names hold at most 15 characters (IFNAMSIZ - 1): prefix (<= 6) + id (4) + "w" + rank.
_IFNAME_MAX = 15
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,5}$")
_RUN_ID_HEX = 4
# A full-size Ethernet frame without FCS: 1500 bytes of MTU + 14 bytes of header.
_FRAME_BYTES = 1514
# Smallest frame a token bucket or delay line can hold (a TCP ACK is 66 bytes): sizes netem's limit.
_MIN_FRAME_BYTES = 64
# Where iproute2 may live when PATH lacks the sbin directories (non-login root shells, sudo -E).
_SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_COMMAND_TIMEOUT_S = 30.0


class NetworkUnavailable(RuntimeError):
    """This machine cannot build a :class:`ShapedNetwork`; the message says what is missing."""


class NetworkSetupError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message holds the command and its stderr."""


def parse_rate(bandwidth: str) -> int:
    """Bits per second of a tc rate such as ``"100mbit"``, ``"1gbit"`` or ``"12.5mbps"``.

    The unit is required (tc would read a bare number as bits per second, an easy slip for
    bytes). Units as in tc(8): ``bit kbit mbit gbit tbit`` (powers of 1000), ``kibit mibit gibit
    tibit`` (powers of 1024), and the same with ``bps`` for *bytes* per second.

    Raises:
        ValueError: naming the bad value and the accepted units.
    """
    match = _NUMBER_AND_UNIT.match(bandwidth) if isinstance(bandwidth, str) else None
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS:
        raise ValueError(
            f"bandwidth={bandwidth!r} is not a tc rate: expected a number and one of the units "
            f"{', '.join(_RATE_UNITS)} (e.g. '100mbit', '1gbit')"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[unit])
    if bits <= 0:
        raise ValueError(f"bandwidth={bandwidth!r} must be positive")
    return bits


def parse_delay(delay: str) -> int:
    """Microseconds of a tc time such as ``"1ms"``, ``"250us"`` or ``"0.5s"`` (unit required).

    Raises:
        ValueError: naming the bad value and the accepted units.
    """
    match = _NUMBER_AND_UNIT.match(delay) if isinstance(delay, str) else None
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _TIME_UNITS:
        raise ValueError(
            f"delay={delay!r} is not a tc time: expected a number and one of the units "
            f"{', '.join(_TIME_UNITS)} (e.g. '1ms', '250us')"
        )
    return round(float(match.group(1)) * _TIME_UNITS[unit])


def _find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for directory in _SBIN_DIRS:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run an ``ip``/``tc`` command; raise :class:`NetworkSetupError` with its stderr if it fails."""
    try:
        result = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetworkSetupError(f"`{' '.join(argv)}` could not run: {error}") from error
    if result.returncode != 0:
        raise NetworkSetupError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _probe(argv: list[str], stdin: str | None = None) -> str | None:
    """Run a probe; its stderr (or a reason) if it fails, None if it works."""
    try:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if result.returncode == 0:
        return None
    return "; ".join(result.stderr.split("\n")).strip("; ") or f"exit status {result.returncode}"


def check_available(*, with_delay: bool = False) -> None:
    """Check, creating nothing that outlives the call, that a :class:`ShapedNetwork` can be built.

    Checks root, ``ip`` and ``tc``, then (with ``unshare`` from util-linux, in throwaway anonymous
    namespaces that vanish with the probe) that network namespaces, veth pairs, bridges and the
    ``tbf`` qdisc work, and with ``with_delay`` the ``netem`` qdisc too. Without ``unshare`` the
    kernel probes are skipped; a failure while building still cleans up and raises
    :class:`NetworkSetupError`.

    Args:
        with_delay: also require ``netem`` (a :class:`ShapedNetwork` with ``delay`` needs it).

    Raises:
        NetworkUnavailable: with a message saying what is missing.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "unknown"
        raise NetworkUnavailable(f"a shaped network needs root (network namespaces, veth, tc); running as uid {uid}")
    ip, tc = _find_tool("ip"), _find_tool("tc")
    missing = [name for name, path in (("ip", ip), ("tc", tc)) if path is None]
    if missing:
        raise NetworkUnavailable(
            f"{' and '.join(f'`{m}`' for m in missing)} not found on PATH or in {', '.join(_SBIN_DIRS)} "
            "(install iproute2)"
        )
    unshare = _find_tool("unshare")
    if unshare is None:
        return
    isolated = [unshare, "--net", "--"]
    if (error := _probe([*isolated, "true"])) is not None:
        raise NetworkUnavailable(f"network namespaces are not permitted here: {error}")
    links = "link add name lgcp0 type veth peer name lgcp1\nlink add name lgcpbr type bridge\n"
    if (error := _probe([*isolated, ip, "-batch", "-"], stdin=links)) is not None:
        raise NetworkUnavailable(f"veth pairs or bridges are not available in this kernel: {error}")
    if (error := _probe([*isolated, tc, "qdisc", "add", "dev", "lo", "root", "tbf", *_tbf_args(10**6)])) is not None:
        raise NetworkUnavailable(f"the tbf qdisc (sch_tbf) is not available in this kernel: {error}")
    if with_delay:
        qdiscs = "".join(f"{' '.join(line)}\n" for line in _shaping_commands("lo", 10**6, 1000))
        if (error := _probe([*isolated, tc, "-batch", "-"], stdin=qdiscs)) is not None:
            raise NetworkUnavailable(
                "delay needs the netem qdisc (CONFIG_NET_SCH_NETEM, module sch_netem), "
                f"which this kernel lacks: {error}"
            )


def _tbf_burst_bytes(rate_bits_per_second: int) -> int:
    # tc-tbf(8): the bucket must hold at least rate/HZ bytes or the rate is not reached; 4 ms is
    # rate/HZ for HZ=250, the usual kernel setting (1000 needs less). At least 10 full frames so
    # that slow links still pass a few back-to-back frames. A larger bucket lets more bytes
    # through at veth speed after an idle spell: at most burst/rate (4 ms) of error per transfer.
    return max(math.ceil(rate_bits_per_second / 8 * 0.004), 10 * _FRAME_BYTES)


def _tbf_limit_bytes(rate_bits_per_second: int) -> int:
    # Bytes that may wait for tokens: 100 ms at the rate (at least 64 KiB), the classic buffer of
    # a bottleneck router. Enough that TCP keeps the link busy and that fan-in (several workers
    # sending to one) queues rather than drops, since retransmitted bytes would inflate the
    # counters; at most 100 ms of queueing delay. Capped below tbf's 32-bit limit.
    queue = max(math.ceil(rate_bits_per_second / 8 * 0.1), 64 * 1024)
    return min(_tbf_burst_bytes(rate_bits_per_second) + queue, 2**30)


def _tbf_args(rate_bits_per_second: int) -> list[str]:
    burst, limit = _tbf_burst_bytes(rate_bits_per_second), _tbf_limit_bytes(rate_bits_per_second)
    # Bare numbers are bytes for burst and limit, bits per second for rate (tc(8)).
    return ["rate", f"{rate_bits_per_second}bit", "burst", str(burst), "limit", str(limit)]


def _shaping_commands(device: str, rate_bits_per_second: int, delay_us: int) -> list[list[str]]:
    """``tc`` arguments (without ``tc -n NS``) that shape ``device``'s egress."""
    tbf = _tbf_args(rate_bits_per_second)
    if delay_us <= 0:
        return [["qdisc", "add", "dev", device, "root", "handle", "1:", "tbf", *tbf]]
    # netem keeps every packet for delay_us, then hands it to its child tbf. Its limit is in
    # packets and must cover a full delay line of minimum-size frames plus the tbf queue behind
    # it, or netem itself would drop (its default is 1000 packets).
    in_flight_bytes = rate_bits_per_second / 8 * delay_us / 1e6 + _tbf_limit_bytes(rate_bits_per_second)
    netem_limit = max(1000, math.ceil(in_flight_bytes / _MIN_FRAME_BYTES))
    netem = ["netem", "delay", f"{delay_us}us", "limit", str(netem_limit)]
    return [
        ["qdisc", "add", "dev", device, "root", "handle", "1:", *netem],
        ["qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", "tbf", *tbf],
    ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _list_namespaces(ip: str) -> list[str]:
    listing = _run([ip, "-j", "netns", "list"]).stdout.strip()
    return [entry["name"] for entry in json.loads(listing)] if listing else []


def remove_stale(prefix: str = "lgc") -> list[str]:
    """Delete namespaces left by :class:`ShapedNetwork` runs whose owning process is gone.

    A run that was killed with SIGKILL (or lost power) cannot clean up; its namespaces, and the
    veth pairs and bridge inside them, stay until deleted. Names carry the owner's pid, so this
    deletes exactly those of ``prefix`` whose pid no longer runs. A pid reused by an unrelated
    process keeps its namespaces until that process exits too (harmless: they are idle).

    Args:
        prefix: the ``prefix`` the runs used.

    Returns:
        The namespaces deleted.
    """
    _check_prefix(prefix)
    ip = _find_tool("ip")
    if ip is None:
        raise NetworkUnavailable("`ip` not found (install iproute2)")
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-[0-9a-f]{{{_RUN_ID_HEX}}}-(?:hub|w\d+)$")
    removed = []
    for name in _list_namespaces(ip):
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _run([ip, "netns", "delete", name])
            removed.append(name)
    return removed


def counter_delta(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    """Per-rank difference of two :meth:`ShapedNetwork.counters` snapshots (``after - before``)."""
    return {rank: {key: after[rank][key] - before[rank][key] for key in after[rank]} for rank in after}


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise ValueError(
            f"prefix={prefix!r} must be 1 to 6 lowercase letters or digits starting with a letter "
            "(it starts every namespace and interface name, which hold at most 15 characters)"
        )


class ShapedNetwork:
    """``workers`` network namespaces joined by a bridge, every link shaped by ``tc``.

    A context manager: entering builds the network (after :func:`check_available`), leaving
    deletes every namespace it created, and with them every veth, the bridge and the qdiscs. The
    network is also deleted when a build fails halfway, on an exception inside the ``with``
    block, on SIGINT or SIGTERM while inside it (the handlers clean up, then pass the signal on
    to the handlers that were there before, which are restored on exit), and at interpreter exit
    as a last resort. Only SIGKILL leaves namespaces behind: :func:`remove_stale` deletes those.
    Processes still running inside a namespace keep it alive (unnamed) after it is deleted: end
    them before leaving the block.

    Args:
        workers: number of worker namespaces, one per rank (>= 1).
        bandwidth: rate of every link in each direction, in tc syntax (``"100mbit"``,
            ``"1gbit"``; ``"mbps"`` means megabytes per second). The token bucket holds 4 ms at
            the rate (at least 10 full frames), and up to 100 ms at the rate may queue behind it.
        delay: one-way delay of every link in each direction (``"1ms"``), added with ``netem``;
            worker-to-worker round trips take ``4 * delay``. None (default) adds no delay line.
        subnet: IPv4 subnet of the workers; rank ``r`` gets its ``r + 1``-th host address.
        prefix: first part of every name (1 to 6 lowercase letters or digits), so that
            :func:`remove_stale` and leak checks find this harness's namespaces.

    Raises:
        ValueError: at construction, for a bad value, before anything is created.

    Example::

        with ShapedNetwork(workers=4, bandwidth="1gbit") as net:
            argv = net.command(0, [sys.executable, "-c", "print('inside', flush=True)"])
            subprocess.run(argv, check=True)
    """

    def __init__(
        self,
        workers: int,
        bandwidth: str,
        delay: str | None = None,
        *,
        subnet: str = "10.77.0.0/24",
        prefix: str = "lgc",
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r} must be an integer >= 1")
        _check_prefix(prefix)
        # hyperparameters
        self.workers = workers
        self.bandwidth = bandwidth
        self.delay = delay
        self.rate_bits_per_second = parse_rate(bandwidth)
        self.delay_us = 0 if delay is None else parse_delay(delay)
        try:
            self.subnet = ipaddress.IPv4Network(subnet)
        except ValueError as error:
            raise ValueError(f"subnet={subnet!r} is not an IPv4 network such as '10.77.0.0/24': {error}") from None
        if self.subnet.num_addresses - 2 < workers:
            raise ValueError(
                f"subnet={subnet!r} has {max(self.subnet.num_addresses - 2, 0)} host addresses, "
                f"fewer than workers={workers}"
            )
        # names: the pid tells remove_stale whether the owner still runs; the random id keeps
        # interface names (which cannot hold the pid as well) apart between runs
        self.prefix = prefix
        self._owner_pid = os.getpid()
        self._run_id = secrets.token_hex(_RUN_ID_HEX // 2)
        if len(self.interface(workers - 1)) > _IFNAME_MAX:
            raise ValueError(
                f"workers={workers} with prefix={prefix!r} makes interface names longer than "
                f"{_IFNAME_MAX} characters; use a shorter prefix"
            )
        # internal state
        self._ip = _find_tool("ip") or "ip"  # full paths: PATH may lack /usr/sbin
        self._tc = _find_tool("tc") or "tc"
        self._created_namespaces: list[str] = []  # appended *before* each `ip netns add`
        self._entered = False
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}  # signal number -> handler before ours
        self._busy = False  # building or deleting: a signal then waits until the step is done
        self._deferred_signal: int | None = None

    # ----------------------------------------------------------------------------------- names

    @property
    def run_name(self) -> str:
        """``<prefix>-<pid>-<id>``: the start of every namespace name of this run."""
        return f"{self.prefix}-{self._owner_pid}-{self._run_id}"

    @property
    def interface_tag(self) -> str:
        """``<prefix><id>``: the start of every interface name of this run."""
        return f"{self.prefix}{self._run_id}"

    @property
    def hub_namespace(self) -> str:
        """The namespace holding the bridge and the hub-side veth ends."""
        return f"{self.run_name}-hub"

    @property
    def bridge(self) -> str:
        """The bridge's interface name (in :attr:`hub_namespace`)."""
        return f"{self.interface_tag}br"

    @property
    def tbf_burst_bytes(self) -> int:
        """Size of every link's token bucket: bytes that pass at veth speed after an idle spell."""
        return _tbf_burst_bytes(self.rate_bits_per_second)

    @property
    def tbf_limit_bytes(self) -> int:
        """Bytes that may queue on every link waiting for tokens (beyond them, frames drop)."""
        return _tbf_limit_bytes(self.rate_bits_per_second)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this run, workers first, hub last."""
        return [self.namespace(rank) for rank in range(self.workers)] + [self.hub_namespace]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.workers:
            raise IndexError(f"rank={rank} is not in [0, {self.workers})")

    def namespace(self, rank: int) -> str:
        """Network namespace of worker ``rank``."""
        self._check_rank(rank)
        return f"{self.run_name}-w{rank}"

    def interface(self, rank: int) -> str:
        """Worker ``rank``'s interface (inside its namespace): its ``GLOO_SOCKET_IFNAME``."""
        self._check_rank(rank)
        return f"{self.interface_tag}w{rank}"

    def hub_interface(self, rank: int) -> str:
        """The bridge port toward worker ``rank`` (in :attr:`hub_namespace`); its egress is the download."""
        self._check_rank(rank)
        return f"{self.interface_tag}h{rank}"

    def address(self, rank: int) -> str:
        """IPv4 address of worker ``rank`` (e.g. the ``MASTER_ADDR`` when ``rank`` is 0)."""
        self._check_rank(rank)
        return str(self.subnet.network_address + rank + 1)

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside worker ``rank``'s namespace (``ip netns exec NS argv...``)."""
        return [self._ip, "netns", "exec", self.namespace(rank), *argv]

    # -------------------------------------------------------------------------------- counters

    def counters(self) -> dict[int, dict[str, int]]:
        """Bytes and frames each worker's interface sent and received so far, per rank.

        Keys ``tx_bytes``, ``rx_bytes``, ``tx_packets``, ``rx_packets``. Bytes are whole frames
        without the FCS: payload plus TCP, IP and Ethernet headers, and every retransmission.
        Take a snapshot before and after and subtract them (:func:`counter_delta`).
        """
        counters = {}
        for rank in range(self.workers):
            shown = _run(
                [self._ip, "-n", self.namespace(rank), "-s", "-j", "link", "show", "dev", self.interface(rank)]
            )
            stats = json.loads(shown.stdout)[0]["stats64"]
            counters[rank] = {
                "tx_bytes": int(stats["tx"]["bytes"]),
                "rx_bytes": int(stats["rx"]["bytes"]),
                "tx_packets": int(stats["tx"]["packets"]),
                "rx_packets": int(stats["rx"]["packets"]),
            }
        return counters

    # -------------------------------------------------------------------------------- lifetime

    def __enter__(self) -> ShapedNetwork:
        if self._entered:
            raise RuntimeError("a ShapedNetwork builds its network once; make a new one")
        check_available(with_delay=self.delay_us > 0)
        self._entered = True
        self._install_cleanup()
        try:
            with self._signals_deferred():
                self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this run created and restore the signal handlers (idempotent)."""
        if self._closed or not self._entered or os.getpid() != self._owner_pid:
            return  # a forked child must not delete its parent's network
        with self._signals_deferred():
            self._delete()
            self._closed = True
            self._uninstall_cleanup()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._entered else "not built"
        return (
            f"ShapedNetwork(workers={self.workers}, bandwidth={self.bandwidth!r}, delay={self.delay!r}, "
            f"run_name={self.run_name!r}, {state})"
        )

    def _build(self) -> None:
        hub = self.hub_namespace
        self._add_namespace(hub)
        self._ip_in(hub, "link", "add", "name", self.bridge, "type", "bridge", "mcast_snooping", "0")
        self._ip_in(hub, "link", "set", "dev", self.bridge, "addrgenmode", "none", "up")
        for rank in range(self.workers):
            worker, worker_if, hub_if = self.namespace(rank), self.interface(rank), self.hub_interface(rank)
            self._add_namespace(worker)
            # Both ends are created directly inside their namespaces: nothing appears in the root
            # namespace, and deleting either namespace deletes the pair.
            veth = ["type", "veth", "peer", "name", hub_if, "netns", hub]
            _run([self._ip, "link", "add", "name", worker_if, "netns", worker, *veth])
            self._ip_in(worker, "link", "set", "dev", worker_if, "addrgenmode", "none", "gso_max_segs", "1")
            self._ip_in(worker, "address", "add", f"{self.address(rank)}/{self.subnet.prefixlen}", "dev", worker_if)
            self._shape(worker, worker_if)  # upload
            self._ip_in(worker, "link", "set", "dev", worker_if, "up")
            self._ip_in(hub, "link", "set", "dev", hub_if, "master", self.bridge, "addrgenmode", "none")
            self._shape(hub, hub_if)  # download
            self._ip_in(hub, "link", "set", "dev", hub_if, "up")

    def _add_namespace(self, name: str) -> None:
        self._created_namespaces.append(name)  # before: a failed or interrupted add is deleted too
        _run([self._ip, "netns", "add", name])
        sysctl = _find_tool("sysctl")
        if sysctl is not None:  # best effort (no sysctl, or no IPv6 in the kernel): a few IPv6 frames
            ipv6_off = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
            _probe([self._ip, "netns", "exec", name, sysctl, "-q", "-w", *ipv6_off])
        self._ip_in(name, "link", "set", "dev", "lo", "up")

    def _ip_in(self, namespace: str, *args: str) -> None:
        _run([self._ip, "-n", namespace, *args])

    def _shape(self, namespace: str, device: str) -> None:
        for args in _shaping_commands(device, self.rate_bits_per_second, self.delay_us):
            _run([self._tc, "-n", namespace, *args])

    def _delete(self) -> None:
        # The hub first: its veth ends take their worker-side peers with them.
        for name in sorted(self._created_namespaces, key=lambda n: n != self.hub_namespace):
            try:
                _run([self._ip, "netns", "delete", name])
            except NetworkSetupError as error:
                if os.path.exists(os.path.join("/run/netns", name)):
                    warnings.warn(f"could not delete network namespace {name}: {error}", stacklevel=3)
        self._created_namespaces.clear()

    # --------------------------------------------------------------------- signals and atexit

    def _install_cleanup(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still holds
        for signum in _HANDLED_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _uninstall_cleanup(self) -> None:
        atexit.unregister(self.close)
        for signum, previous in self._previous_handlers.items():
            # Only if still ours: a handler installed after ours (another network) stays.
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    @contextlib.contextmanager
    def _signals_deferred(self) -> Iterator[None]:
        """Hold SIGINT/SIGTERM until a build or delete step ends, then act on them.

        Acting mid-step could race an ``ip netns add`` still running (its namespace would
        appear after the delete) or abandon a delete half done.
        """
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            deferred, self._deferred_signal = self._deferred_signal, None
            if deferred is not None:
                self._on_signal(deferred, None)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._busy and os.getpid() == self._owner_pid:
            self._deferred_signal = signum
            return
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        self.close()
        if callable(previous):
            previous(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
        elif previous != signal.SIG_IGN:
            # SIG_DFL (or a handler set outside Python): die of the signal as if never caught.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            raise SystemExit(128 + signum)
