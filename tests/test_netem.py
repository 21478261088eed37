"""Network emulation (experiments/netem): timing model, namespaces, rate limits, delay, and cleanup.

The tests that build networks need root, `ip`, `tc` and /dev/net/tun; without them they are skipped with the
reason. The timing model and input validation are tested everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.netem import EmulatedNetwork, NetemConfigError, missing_prerequisites, parse_rate_limit
from experiments.netem.cleanup import is_alive, list_namespaces, list_root_links
from experiments.netem.config import PREFIX
from experiments.netem.launch import run_gloo, run_mpi
from experiments.netem.network import python_path_env
from experiments.netem.schedule import LinkSchedule

REPO_ROOT = Path(__file__).resolve().parents[1]
UNAVAILABLE = missing_prerequisites(tun=True)
needs_root = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")

ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 7000))
print("ready", flush=True)
connection, _ = server.accept()
while data := connection.recv(65536):
    connection.sendall(data)
"""

ECHO_CLIENT = """
import json, socket, sys, time
connection = socket.create_connection((sys.argv[1], 7000), timeout=10)
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
round_trips, replies = [], []
for index in range(int(sys.argv[2])):
    message = f"ping {index}".encode()
    start = time.perf_counter()
    connection.sendall(message)
    reply = b""
    while len(reply) < len(message):
        reply += connection.recv(len(message) - len(reply))
    round_trips.append(time.perf_counter() - start)
    replies.append(reply.decode())
print(json.dumps({"round_trips": round_trips, "replies": replies}))
"""

OWNER = """
import sys, time
from experiments.netem import EmulatedNetwork
with EmulatedNetwork(hosts=2, rate="100mbit", delay_ms=1.0) as net:
    worker = net.popen(0, ["sleep", "60"])
    print(net.tag, net.forwarder.pid, worker.pid, flush=True)
    time.sleep(60)
"""


def echo_round_trips(net: EmulatedNetwork, count: int) -> dict[str, list]:
    """Run an echo server on host 1 and a client on host 0; return the client's round trips and replies."""
    server = net.popen(1, [sys.executable, "-c", ECHO_SERVER, net.address(1)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    client = net.popen(
        0, [sys.executable, "-c", ECHO_CLIENT, net.address(1), str(count)], stdout=subprocess.PIPE, text=True
    )
    output, _ = client.communicate(timeout=20)
    assert client.returncode == 0
    return json.loads(output)


def leftovers(tag: str) -> list[str]:
    """Namespaces of this network and devices with the package prefix in the root namespace."""
    return [name for name in list_namespaces() if name.startswith(tag)] + list_root_links(PREFIX)


def test_parse_rate_limit_reads_tc_units_in_bits_per_second() -> None:
    assert parse_rate_limit("1gbit") == 1e9
    assert parse_rate_limit("100mbit") == 1e8
    assert parse_rate_limit("500kbit") == 5e5
    assert parse_rate_limit("1mbps") == 8e6  # tc: bps is bytes per second
    assert parse_rate_limit(2e9) == 2e9  # a number is bit/s
    assert parse_rate_limit(None) is None
    assert parse_rate_limit("none") is None
    assert parse_rate_limit("0") is None


def test_parse_rate_limit_rejects_garbage_naming_the_value_and_units() -> None:
    with pytest.raises(NetemConfigError, match=r"rate='fast' is not a rate in tc\(8\) units: write bit/s as '1gbit'"):
        parse_rate_limit("fast")


def test_network_with_one_host_is_refused_at_construction() -> None:
    with pytest.raises(NetemConfigError, match="hosts=1"):
        EmulatedNetwork(hosts=1)


def test_negative_delay_is_refused_at_construction() -> None:
    with pytest.raises(NetemConfigError, match="delay"):
        EmulatedNetwork(hosts=2, delay_ms=-1.0)


def test_schedule_serialises_on_uplink_and_downlink_then_adds_delay() -> None:
    schedule = LinkSchedule(hosts=2, rate_bps=10e6, delay_s=0.005, queue_bytes=10**6)  # 1250 B = 1 ms
    first = schedule.schedule(0, 1, 1250, now=0.0)
    second = schedule.schedule(0, 1, 1250, now=0.0)
    assert first == pytest.approx(0.001 + 0.001 + 0.005)
    assert second - first == pytest.approx(0.001)  # back-to-back packets pipeline at the link rate


def test_schedule_two_senders_share_the_receivers_downlink() -> None:
    schedule = LinkSchedule(hosts=3, rate_bps=10e6, delay_s=0.0, queue_bytes=10**6)
    assert schedule.schedule(0, 2, 1250, now=0.0) == pytest.approx(0.002)
    assert schedule.schedule(1, 2, 1250, now=0.0) == pytest.approx(0.003)


def test_schedule_drops_when_the_downlink_queue_is_full() -> None:
    schedule = LinkSchedule(hosts=5, rate_bps=10e6, delay_s=0.0, queue_bytes=2500)
    accepted = [schedule.schedule(sender, 4, 1250, now=0.0) for sender in range(3)]
    assert None not in accepted  # the third waits behind 2500 bytes: exactly the buffer
    assert schedule.schedule(3, 4, 1250, now=0.0) is None


def test_schedule_without_rate_only_adds_the_delay() -> None:
    schedule = LinkSchedule(hosts=2, rate_bps=None, delay_s=0.002, queue_bytes=65536)
    assert schedule.schedule(0, 1, 65000, now=1.0) == pytest.approx(1.002)


@needs_root
def test_bridge_hosts_reach_each_other_over_tcp() -> None:
    with EmulatedNetwork(hosts=2, rate="100mbit") as net:
        result = echo_round_trips(net, count=3)
    assert result["replies"] == ["ping 0", "ping 1", "ping 2"]


@needs_root
def test_bridge_rate_is_installed_as_htb_on_uplink_and_downlink() -> None:
    with EmulatedNetwork(hosts=2, rate="100mbit") as net:
        uplink = subprocess.run(
            ["tc", "-n", net.namespace(0), "class", "show", "dev", net.device], capture_output=True, text=True
        ).stdout
        qdisc = subprocess.run(
            ["tc", "-n", net.namespace(0), "qdisc", "show", "dev", net.device], capture_output=True, text=True
        ).stdout
        downlink = subprocess.run(
            ["tc", "-n", f"{net.tag}-sw", "class", "show", "dev", "p0"], capture_output=True, text=True
        ).stdout
    assert "qdisc htb 1: root" in qdisc
    assert "rate 100Mbit ceil 100Mbit" in uplink
    assert "rate 100Mbit ceil 100Mbit" in downlink


@needs_root
def test_tun_forwarder_adds_the_configured_delay_to_every_round_trip() -> None:
    delay_ms = 10.0
    with EmulatedNetwork(hosts=2, delay_ms=delay_ms) as net:
        result = echo_round_trips(net, count=5)
    assert result["replies"] == [f"ping {index}" for index in range(5)]
    assert min(result["round_trips"]) >= 2 * delay_ms / 1000.0


@needs_root
def test_tun_forwarder_uses_no_cpu_while_idle() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    with EmulatedNetwork(hosts=2, delay_ms=1.0) as net:
        stat = Path(f"/proc/{net.forwarder.pid}/stat")
        time.sleep(0.3)  # let it finish starting up
        before = sum(int(field) for field in stat.read_text().rsplit(")", 1)[1].split()[11:13])
        time.sleep(1.0)
        after = sum(int(field) for field in stat.read_text().rsplit(")", 1)[1].split()[11:13])
    assert (after - before) / ticks < 0.1  # a busy loop would use ~1.0 s of CPU in this second


@needs_root
def test_gloo_launch_gives_every_rank_its_own_namespace_and_torchrun_env() -> None:
    script = (
        "import os; e = os.environ; print(e['RANK'], e['WORLD_SIZE'], e['LOCAL_RANK'], e['MASTER_ADDR'],"
        " e['GLOO_SOCKET_IFNAME'], os.readlink('/proc/self/ns/net'))"
    )
    lines: list[str] = []
    with EmulatedNetwork(hosts=3) as net:
        code = run_gloo(net, [sys.executable, "-c", script], sink=lines.append, timeout_s=20)
    fields = sorted(line.split() for line in lines)
    assert code == 0
    assert [row[:6] for row in fields] == [[f"[{rank}]", str(rank), "3", "0", "10.77.0.1", "eth0"] for rank in range(3)]
    assert len({row[6] for row in fields}) == 3


@needs_root
def test_gloo_launch_returns_the_largest_exit_code() -> None:
    script = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    with EmulatedNetwork(hosts=2) as net:
        assert run_gloo(net, [sys.executable, "-c", script], sink=lambda line: None, timeout_s=20) == 3


@needs_root
def test_mpi_launch_puts_rank_r_in_host_r_namespace_and_mpi_connects_them(tmp_path: Path) -> None:
    # The ranks report through MPI itself (a gather over the emulated network) into a file: Hydra may drop the
    # stdout of a rank that exits right after printing, so the forwarded output is no evidence either way.
    report = tmp_path / "namespaces.txt"
    script = (
        "import os, sys; from mpi4py import MPI; comm = MPI.COMM_WORLD; "
        "rows = comm.gather(f\"{comm.Get_rank()} {os.readlink('/proc/self/ns/net')}\"); "
        "comm.Get_rank() == 0 and open(sys.argv[1], 'w').write('\\n'.join(rows))"
    )
    lines: list[str] = []
    with EmulatedNetwork(hosts=2) as net:
        expected = {str(host): f"net:[{os.stat(f'/run/netns/{net.namespace(host)}').st_ino}]" for host in range(2)}
        code = run_mpi(net, [sys.executable, "-c", script, str(report)], sink=lines.append, timeout_s=60)
    assert code == 0, "".join(lines)
    seen = dict(row.split() for row in report.read_text().splitlines())
    assert seen == expected


@needs_root
@pytest.mark.parametrize("delay_ms", [0.0, 1.0], ids=["bridge", "tun"])
def test_nothing_remains_after_the_context_exits(delay_ms: float) -> None:
    with EmulatedNetwork(hosts=2, rate="1gbit", delay_ms=delay_ms) as net:
        worker = net.popen(0, ["sleep", "60"])
        forwarder = net.forwarder
        assert len(leftovers(net.tag)) == (2 if delay_ms else 3)
    assert leftovers(net.tag) == []
    assert worker.poll() is not None
    assert forwarder is None or forwarder.poll() is not None


@needs_root
def test_nothing_remains_after_an_exception_inside_the_with_block() -> None:
    with pytest.raises(RuntimeError, match="boom"), EmulatedNetwork(hosts=2, delay_ms=1.0) as net:
        worker = net.popen(1, ["sleep", "60"])
        raise RuntimeError("boom")
    assert leftovers(net.tag) == []
    assert worker.poll() is not None


def _start_owner() -> tuple[subprocess.Popen, str, int, int]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=python_path_env(), cwd=REPO_ROOT
    )
    tag, forwarder_pid, worker_pid = owner.stdout.readline().split()
    return owner, tag, int(forwarder_pid), int(worker_pid)


@needs_root
def test_nothing_remains_after_owner_sigterm() -> None:
    owner, tag, forwarder_pid, worker_pid = _start_owner()
    owner.send_signal(signal.SIGTERM)
    # a bound against a hang, not a speed claim: the cleanup runs a few `ip` commands, which took more than 10 s
    # once on this 2-core machine under load
    assert owner.wait(timeout=30) == 128 + signal.SIGTERM
    assert leftovers(tag) == []
    assert not is_alive(worker_pid)
    assert not is_alive(forwarder_pid)


@needs_root
def test_nothing_remains_after_owner_sigkill_and_the_cleanup_command() -> None:
    owner, tag, forwarder_pid, worker_pid = _start_owner()
    owner.kill()
    owner.wait()
    assert leftovers(tag) != []  # a SIGKILL runs no handler: the namespaces are still there ...
    cleanup = subprocess.run(
        [sys.executable, "-m", "experiments.netem", "cleanup"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=python_path_env(),
    )
    assert cleanup.returncode == 0, cleanup.stderr
    assert tag in cleanup.stdout
    assert leftovers(tag) == []  # ... until the cleanup command removes them
    assert not is_alive(worker_pid)
    assert not is_alive(forwarder_pid)
