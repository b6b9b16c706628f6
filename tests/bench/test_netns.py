"""The shaped-network harness of ``lgc-bench network``: real namespaces, real tc, real TCP.

Skipped as a whole where :func:`check_available` fails (not root, no iproute2, no netns). Each
test uses a unique name prefix, so leak checks see only its own namespaces and interfaces.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lgc.bench.netns import (
    NetworkSetupError,
    NetworkUnavailable,
    ShapedNetwork,
    check_available,
    counter_delta,
    remove_stale,
)

try:
    check_available()
except NetworkUnavailable as error:
    pytest.skip(f"no shaped network on this machine: {error}", allow_module_level=True)

NETNS_PY = Path(__file__).resolve().parents[2] / "lgc" / "bench" / "netns.py"
# Subprocesses load netns.py as a file: importing the lgc package would import torch (seconds).
LOAD_NETNS = textwrap.dedent(f"""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("netns", {str(NETNS_PY)!r})
    netns = importlib.util.module_from_spec(spec)
    sys.modules["netns"] = netns
    spec.loader.exec_module(netns)
""")
RATE = "20mbit"
RATE_BITS = 20_000_000


def _namespaces() -> list[str]:
    listing = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [entry["name"] for entry in json.loads(listing)] if listing.strip() else []


def _root_interfaces() -> list[str]:
    listing = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [entry["ifname"] for entry in json.loads(listing)]


def _leftovers(run_name: str, interface_tag: str) -> list[str]:
    """Namespaces of the run, and interfaces with its tag in the root namespace."""
    return [n for n in _namespaces() if n.startswith(run_name)] + [
        i for i in _root_interfaces() if i.startswith(interface_tag)
    ]


def _prefix(tag: str) -> str:
    """A prefix of this test and process, so parallel runs never see each other's networks."""
    return f"t{tag}{os.getpid() % 1000}"


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"workers": 0, "bandwidth": "1gbit"}, "workers=0"),
        ({"workers": 2, "bandwidth": "fast"}, "bandwidth='fast'"),
        ({"workers": 2, "bandwidth": "100"}, "bandwidth='100'"),
        ({"workers": 2, "bandwidth": "0mbit"}, "bandwidth='0mbit'"),
        ({"workers": 2, "bandwidth": "1gbit", "delay": "soon"}, "delay='soon'"),
        ({"workers": 3, "bandwidth": "1gbit", "subnet": "10.77.0.0/30"}, "subnet='10.77.0.0/30'"),
        ({"workers": 2, "bandwidth": "1gbit", "subnet": "10.77.0.1/24"}, "subnet='10.77.0.1/24'"),
        ({"workers": 2, "bandwidth": "1gbit", "prefix": "Way-Too-Long"}, "prefix='Way-Too-Long'"),
    ],
)
def test_bad_values_raise_before_anything_is_created(kwargs, named):
    before = (_namespaces(), _root_interfaces())
    with pytest.raises(ValueError, match=re.escape(named)):
        ShapedNetwork(**kwargs)
    assert (_namespaces(), _root_interfaces()) == before


def test_rates_are_read_as_tc_reads_them():
    assert ShapedNetwork(1, "20mbit").rate_bits_per_second == 20_000_000
    assert ShapedNetwork(1, "1GBit").rate_bits_per_second == 10**9
    assert ShapedNetwork(1, "2.5mbps").rate_bits_per_second == 20_000_000  # bytes per second
    assert ShapedNetwork(1, "1mibit").rate_bits_per_second == 2**20
    assert ShapedNetwork(1, "1gbit", delay="0.5ms").delay_us == 500


# ------------------------------------------------------------------------- layout and cleanup


def test_layout_names_addresses_and_qdiscs():
    with ShapedNetwork(workers=3, bandwidth=RATE, prefix=_prefix("l")) as net:
        assert set(net.namespaces) <= set(_namespaces())
        assert [net.address(r) for r in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        assert all(len(net.interface(r)) <= 15 and len(net.hub_interface(r)) <= 15 for r in range(3))
        # Inside its namespace, rank 2 sees lo and its own interface with its address, nothing else.
        shown = subprocess.run(net.command(2, ["ip", "-j", "address", "show"]), capture_output=True, text=True)
        links = {entry["ifname"]: entry for entry in json.loads(shown.stdout)}
        assert set(links) == {"lo", net.interface(2)}
        assert [a["local"] for a in links[net.interface(2)]["addr_info"]] == ["10.77.0.3"]
        # Both directions of every link are shaped at the rate.
        for namespace, device in [(net.namespace(1), net.interface(1)), (net.hub_namespace, net.hub_interface(1))]:
            qdiscs = subprocess.run(["tc", "-n", namespace, "-j", "qdisc", "show", "dev", device], capture_output=True)
            (tbf,) = json.loads(qdiscs.stdout)
            assert tbf["kind"] == "tbf" and tbf["options"]["rate"] == RATE_BITS // 8  # tc shows bytes/s
        # Nothing of the run lives in the root namespace, and an idle network sends nothing
        # (IPv6 off, no multicast snooping reports from the bridge).
        assert not [i for i in _root_interfaces() if i.startswith(net.interface_tag)]
        time.sleep(1.5)  # the bridge's IGMP report, if any, would go out within a second
        idle = {"tx_bytes": 0, "rx_bytes": 0, "tx_packets": 0, "rx_packets": 0}
        assert net.counters() == {0: idle, 1: idle, 2: idle}
    assert _leftovers(net.run_name, net.interface_tag) == []


def test_cleanup_after_an_exception_inside_the_block():
    previous_sigint = signal.getsignal(signal.SIGINT)
    with pytest.raises(ZeroDivisionError):
        with ShapedNetwork(workers=2, bandwidth=RATE, prefix=_prefix("e")) as net:
            assert signal.getsignal(signal.SIGINT) != previous_sigint  # ours while inside
            assert net.namespace(0) in _namespaces()
            1 / 0  # noqa: B018
    assert _leftovers(net.run_name, net.interface_tag) == []
    assert signal.getsignal(signal.SIGINT) == previous_sigint


def test_a_build_that_fails_halfway_deletes_what_it_made(monkeypatch):
    import lgc.bench.netns as netns

    real_run = netns._run
    net = ShapedNetwork(workers=3, bandwidth=RATE, prefix=_prefix("f"))

    def fail_on_rank_1_download(argv, stdin=None):  # after the hub and two workers exist
        if "qdisc" in argv and net.hub_interface(1) in argv:
            raise NetworkSetupError("injected failure")
        return real_run(argv, stdin)

    monkeypatch.setattr(netns, "_run", fail_on_rank_1_download)
    with pytest.raises(NetworkSetupError, match="injected"):
        with net:
            pytest.fail("the block must not run")
    assert _leftovers(net.run_name, net.interface_tag) == []


@pytest.fixture
def python_sigint():
    """Python's SIGINT handler for the test (a background job starts with SIGINT ignored), then the one before."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_signal_during_the_build_waits_for_the_build_then_cleans_up(monkeypatch, python_sigint):
    import lgc.bench.netns as netns

    real_run = netns._run
    net = ShapedNetwork(workers=2, bandwidth=RATE, prefix=_prefix("i"))
    ran = []

    def interrupt_at_rank_1(argv, stdin=None):
        ran.append(argv[1:])
        if argv[1:] == ["netns", "add", net.namespace(1)]:
            os.kill(os.getpid(), signal.SIGINT)  # Python's handler runs before kill() returns
        return real_run(argv, stdin)

    monkeypatch.setattr(netns, "_run", interrupt_at_rank_1)
    previous_sigint = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with net:
            pytest.fail("the block must not run")
    # The build went on to its last step (rank 1's download link up), then deleted everything.
    last_step = ["-n", net.hub_namespace, "link", "set", "dev", net.hub_interface(1), "up"]
    deletes = [argv for argv in ran if argv[:2] == ["netns", "delete"]]
    assert ran.index(last_step) < ran.index(deletes[0])
    assert sorted(argv[2] for argv in deletes) == sorted(net.namespaces)
    assert _leftovers(net.run_name, net.interface_tag) == []
    assert signal.getsignal(signal.SIGINT) == previous_sigint


HOLD_A_NETWORK = LOAD_NETNS + textwrap.dedent("""
    import json, signal, time
    # Python's own SIGINT handler even when the test runs in a background job, which starts with
    # SIGINT ignored (and the holder inherits that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    net = netns.ShapedNetwork(workers=2, bandwidth="20mbit", prefix=sys.argv[1])
    net.__enter__()  # no `with`: only the signal handlers and atexit can clean up
    print(json.dumps([net.run_name, net.interface_tag]), flush=True)
    if sys.argv[2] == "exit":
        sys.stdin.readline()  # the test has seen the network
        sys.exit(3)
    time.sleep(60)
""")


def _start_holder(prefix: str, how: str = "sleep") -> tuple[subprocess.Popen, str, str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_NETWORK, prefix, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_name, interface_tag = json.loads(holder.stdout.readline())
    assert len([n for n in _namespaces() if n.startswith(run_name)]) == 3
    return holder, run_name, interface_tag


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cleanup_on_a_signal(signum):
    holder, run_name, interface_tag = _start_holder(_prefix("s"))
    holder.send_signal(signum)
    _, stderr = holder.communicate(timeout=20)
    assert _leftovers(run_name, interface_tag) == []
    # Then the previous handler had the signal: KeyboardInterrupt (an uncaught one ends Python
    # by SIGINT), or the default action of SIGTERM.
    assert holder.returncode == -signum
    assert ("KeyboardInterrupt" in stderr) == (signum == signal.SIGINT)


def test_cleanup_at_interpreter_exit_as_a_last_resort():
    holder, run_name, interface_tag = _start_holder(_prefix("x"), how="exit")
    holder.communicate("go\n", timeout=20)
    assert holder.returncode == 3
    assert _leftovers(run_name, interface_tag) == []


def test_remove_stale_deletes_networks_of_dead_processes_only():
    prefix = _prefix("k")
    with ShapedNetwork(workers=1, bandwidth=RATE, prefix=prefix) as alive:
        holder, run_name, interface_tag = _start_holder(prefix)
        holder.kill()  # SIGKILL: no chance to clean up
        holder.communicate(timeout=20)
        assert len([n for n in _namespaces() if n.startswith(run_name)]) == 3
        assert sorted(remove_stale(prefix)) == [f"{run_name}-hub", f"{run_name}-w0", f"{run_name}-w1"]
        assert _leftovers(run_name, interface_tag) == []
        assert set(alive.namespaces) <= set(_namespaces())  # its owner (this process) still runs
    assert remove_stale(prefix) == []


# ---------------------------------------------------------------------------- shaping, in use

RECEIVE = textwrap.dedent("""
    import socket, sys, time
    server = socket.create_server((sys.argv[1], 5001))
    print("ready", flush=True)
    connection, _ = server.accept()
    received, first = 0, None
    while chunk := connection.recv(1 << 20):
        first = first or time.perf_counter()
        received += len(chunk)
    print(received, time.perf_counter() - first, flush=True)
""")
SEND = "import socket, sys; socket.create_connection((sys.argv[1], 5001)).sendall(bytes(int(sys.argv[2])))"


def test_a_tcp_transfer_takes_the_shaped_time():
    payload = 2_500_000  # one second at 20 Mbit/s
    with ShapedNetwork(workers=2, bandwidth=RATE, prefix=_prefix("t")) as net:
        before = net.counters()
        receiver = subprocess.Popen(
            net.command(1, [sys.executable, "-c", RECEIVE, net.address(1)]), stdout=subprocess.PIPE, text=True
        )
        assert receiver.stdout.readline().strip() == "ready"
        subprocess.run(net.command(0, [sys.executable, "-c", SEND, net.address(1), str(payload)]), check=True)
        received, seconds = receiver.communicate(timeout=30)[0].split()
        traffic = counter_delta(before, net.counters())
    assert int(received) == payload
    # At least the payload's time at the rate, less what the full token bucket lets through at
    # once; frame headers add 4.6 % on top. Measured: 1.04 s (payload at 96 % of the rate).
    assert (payload - net.tbf_burst_bytes) * 8 / RATE_BITS <= float(seconds) <= 2 * payload * 8 / RATE_BITS
    # Every frame rank 0 sends crosses the bridge to rank 1 and back the same way: the counters
    # of both ends agree to the byte. Data frames carry 1448 payload bytes in 1514 (Ethernet 14 +
    # IP 20 + TCP with timestamps 32): measured tx = payload * 1.0457.
    assert traffic[0]["tx_bytes"] == traffic[1]["rx_bytes"]
    assert traffic[1]["tx_bytes"] == traffic[0]["rx_bytes"]
    assert 1.04 * payload <= traffic[0]["tx_bytes"] <= 1.06 * payload
    assert traffic[1]["tx_bytes"] < 0.05 * payload  # ACKs only


ALLREDUCE = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world_size, master, numel = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=rank, world_size=world_size)
    tensor = torch.full((numel,), float(rank + 1))
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    seconds = time.perf_counter() - start
    assert torch.all(tensor == world_size * (world_size + 1) / 2)
    dist.destroy_process_group()
    print(seconds, flush=True)
""")


@pytest.mark.multiprocess
def test_a_gloo_allreduce_sends_the_ring_volume_at_the_shaped_rate():
    workers, numel = 2, 1_000_000
    tensor_bytes = 4 * numel
    with ShapedNetwork(workers=workers, bandwidth=RATE, prefix=_prefix("g")) as net:
        before = net.counters()
        processes = [
            subprocess.Popen(
                net.command(r, [sys.executable, "-c", ALLREDUCE, str(r), str(workers), net.address(0), str(numel)]),
                env={**os.environ, "GLOO_SOCKET_IFNAME": net.interface(r), "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(workers)
        ]
        outputs = [p.communicate(timeout=120) for p in processes]
        assert [p.returncode for p in processes] == [0, 0], outputs
        seconds = [float(stdout) for stdout, _ in outputs]
        traffic = counter_delta(before, net.counters())
    # Ring allreduce: every rank sends 2 (P - 1) / P of the tensor (here: all of it once).
    ring_bytes = 2 * (workers - 1) / workers * tensor_bytes
    # Measured: tx = 1.052 x ring_bytes on both ranks. Frame headers are 4.6 % (66 bytes per
    # 1448 of payload); ACKs mostly ride on the data flowing the other way, and the TCPStore
    # rendezvous, gloo's handshakes and the barrier add a few KB.
    for rank in range(workers):
        assert ring_bytes <= traffic[rank]["tx_bytes"] <= 1.10 * ring_bytes
    # Both directions of each link carry the ring volume at once: the shaped time of those bytes.
    # Measured: 1.70 s for 1.60 s of payload at the rate (1.06 x: the frame headers).
    shaped_seconds = ring_bytes * 8 / RATE_BITS
    assert all(0.97 * shaped_seconds <= s <= 2 * shaped_seconds for s in seconds)


def test_delay_adds_four_one_way_delays_to_a_round_trip():
    try:
        check_available(with_delay=True)
    except NetworkUnavailable as error:
        pytest.skip(str(error))
    delay_ms = 20
    with ShapedNetwork(workers=2, bandwidth="100mbit", delay=f"{delay_ms}ms", prefix=_prefix("d")) as net:
        qdiscs = subprocess.run(
            ["tc", "-n", net.namespace(0), "-j", "qdisc", "show", "dev", net.interface(0)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert sorted(q["kind"] for q in json.loads(qdiscs.stdout)) == ["netem", "tbf"]  # tbf under netem
        receiver = subprocess.Popen(
            net.command(1, [sys.executable, "-c", RECEIVE, net.address(1)]), stdout=subprocess.PIPE, text=True
        )
        assert receiver.stdout.readline().strip() == "ready"
        connect = (
            "import socket, sys, time; start = time.perf_counter(); "
            "s = socket.create_connection((sys.argv[1], 5001)); print(time.perf_counter() - start); "
            "s.sendall(b'x'); s.close()"
        )
        shown = subprocess.run(
            net.command(0, [sys.executable, "-c", connect, net.address(1)]), capture_output=True, text=True, check=True
        )
        receiver.communicate(timeout=30)
    # connect() returns after SYN and SYN-ACK: one round trip, two links each way.
    assert 4 * delay_ms / 1000 <= float(shown.stdout) <= 4 * delay_ms / 1000 + 0.5
