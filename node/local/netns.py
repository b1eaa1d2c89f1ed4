"""Several machines on one: a test bed of Linux network namespaces for `swarmrl up --netns`.

    hub namespace: bridge br0 (no address); every "machine" hangs off it by a veth pair
      main      10.213.0.2   bootstrap + trainer (+ the `up` driver itself, which submits and watches)
      validator 10.213.0.3
      worker_a  10.213.0.4   on a slow, lossy link: netem (80 ms, 1% loss, each way) where the
                             kernel has it, else a user-space wire (node/local/netwire.py) between its
                             veth and the bridge, run inside the hub namespace
      nat       10.213.0.5 / 10.213.1.1   forwards and masquerades (nftables) for 10.213.1.0/24;
                             inbound only for established connections
      worker_b  10.213.1.2   behind the NAT: default route via 10.213.1.1 and no other; nothing
                             on the bridge can dial it (a DHT client-mode worker)
      trainerN  10.213.0.1N  with `remote_trainers` (N = 1..): a job's other trainers, each in its
                             own "data centre" behind a WAN link of its own (default 100 ms one
                             way, 20 Mbit/s each direction, no loss): whatever reaches it, its
                             cotrainer on main and the workers included, crosses that link

The namespaces are joined only to one another, never to the host's interfaces; the addresses
(10.213.0.0/16) exist only inside them. `NetBed.down` (and leaving its `with` block) removes them
all. Needs root, `ip`, `nft` and `ethtool` (`missing()` says what is not there).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.node.local.processes import LocalSwarm
from swarmrl.node.runtime.lifecycle import StartupError

CLONE_NEWNET = 0x40000000
SUBNET = "10.213.0"
NAT_SUBNET = "10.213.1"
DELAY_MS, LOSS = 80, 0.01
WAN_DELAY_MS, WAN_RATE_MBIT = 100.0, 20.0   # a remote trainer's link (issue 26's bed)
MAX_REMOTE_TRAINERS = 8


@dataclass(frozen=True)
class Host:
    """One "machine" of the bed: its namespace and the address its peers reach it at."""

    name: str
    netns: str
    address: str
    behind_nat: bool = False


TOOL_PACKAGES = {"ip": "iproute2", "nft": "nftables", "ethtool": "ethtool"}
"""The commands a bed runs -> the Debian package that installs each."""


def missing(path: str | None = None) -> str | None:
    """Why a bed can't be made here (not root, a tool missing from `path`, default $PATH), or
    None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in TOOL_PACKAGES.items():
        if shutil.which(tool, path=path) is None:
            return f"`{tool}` is not installed (apt-get install -y {package})"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _ok(*args: str) -> bool:
    return subprocess.run(args, check=False, capture_output=True).returncode == 0


@dataclass
class NetBed:
    """The namespaces of one bed (see the module docstring); `prefix` keeps concurrent beds apart."""

    prefix: str = field(default_factory=lambda: "swr" + secrets.token_hex(2))
    delay_ms: float = DELAY_MS
    loss: float = LOSS
    log_dir: Path | None = None
    netem: bool = False            # whether the slow links are kernel netem (else user-space wires)
    remote_trainers: int = 0       # trainer1..N, each behind its own WAN link
    wan_delay_ms: float = WAN_DELAY_MS
    wan_rate_mbit: float = WAN_RATE_MBIT
    wires: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def roles(self) -> list[str]:
        """Every namespace role of the bed, the hub first."""
        return ["hub", "main", "validator", "worker_a", "nat", "worker_b",
                *(f"trainer{i}" for i in range(1, self.remote_trainers + 1))]

    def ns(self, role: str) -> str:
        """The namespace name of `role` (hub, main, validator, worker_a, nat, worker_b)."""
        return f"{self.prefix}-{role}"

    @property
    def hosts(self) -> dict[str, Host]:
        """The machines, by name."""
        return {
            "main": Host("main", self.ns("main"), f"{SUBNET}.2"),
            "validator": Host("validator", self.ns("validator"), f"{SUBNET}.3"),
            "worker_a": Host("worker_a", self.ns("worker_a"), f"{SUBNET}.4"),
            "worker_b": Host("worker_b", self.ns("worker_b"), f"{NAT_SUBNET}.2", behind_nat=True),
            **{f"trainer{i}": Host(f"trainer{i}", self.ns(f"trainer{i}"), f"{SUBNET}.{10 + i}")
               for i in range(1, self.remote_trainers + 1)},
        }

    def up(self) -> NetBed:
        """Make the namespaces, links, NAT and the slow links. Raises CalledProcessError (after
        removing what was made) if a step fails, ValueError for more than MAX_REMOTE_TRAINERS."""
        if not 0 <= self.remote_trainers <= MAX_REMOTE_TRAINERS:
            raise ValueError(f"remote_trainers must be in [0, {MAX_REMOTE_TRAINERS}], got {self.remote_trainers}")
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        hub = self.ns("hub")
        for role in self.roles():
            _run("ip", "netns", "add", self.ns(role))
            _run("ip", "-n", self.ns(role), "link", "set", "lo", "up")
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        self._attach("main", f"{SUBNET}.2", "p-main")
        self._attach("validator", f"{SUBNET}.3", "p-val")
        self._attach("nat", f"{SUBNET}.5", "p-nat")
        self._slow_link("worker_a", f"{SUBNET}.4", "p-wa", self.delay_ms, self.loss, 0.0)
        for i in range(1, self.remote_trainers + 1):
            self._slow_link(f"trainer{i}", f"{SUBNET}.{10 + i}", f"p-t{i}", self.wan_delay_ms, 0.0, self.wan_rate_mbit)
        self._nat()

    def _attach(self, role: str, address: str, hub_end: str, bridge: bool = True) -> None:
        """A veth pair: `eth0` in the role's namespace (with `address`), `hub_end` in the hub."""
        hub, ns = self.ns("hub"), self.ns(role)
        _run("ip", "-n", hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        if bridge:
            _run("ip", "-n", hub, "link", "set", hub_end, "master", "br0")
        _run("ip", "-n", hub, "link", "set", hub_end, "up")

    def _slow_link(self, role: str, address: str, end: str, delay_ms: float, loss: float, rate_mbit: float) -> None:
        """`role`'s link to the bridge: netem on both ends when the kernel has it, else a
        user-space wire between its veth and the bridge (`rate_mbit` 0: no rate limit)."""
        hub, ns = self.ns("hub"), self.ns(role)
        netem = ["root", "netem", "delay", f"{delay_ms:g}ms", "loss", f"{loss * 100:g}%",
                 *(["rate", f"{rate_mbit:g}mbit"] if rate_mbit else [])]
        self._attach(role, address, end, bridge=False)
        if _ok("ip", "netns", "exec", hub, "tc", "qdisc", "add", "dev", end, *netem):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *netem)
            _run("ip", "-n", hub, "link", "set", end, "master", "br0")
            self.netem = True
            return
        _run("ip", "-n", hub, "link", "add", f"{end}-in", "type", "veth", "peer", "name", f"{end}-br")
        _run("ip", "-n", hub, "link", "set", f"{end}-br", "master", "br0")
        for dev in (f"{end}-in", f"{end}-br"):
            _run("ip", "-n", hub, "link", "set", dev, "up")
        for dev in (end, f"{end}-in"):
            _run("ip", "-n", hub, "link", "set", dev, "promisc", "on")
        # the wire copies whole frames: no segmentation offloads and no partial checksums anywhere
        # a frame can come from or go to
        for where, dev in [(hub, end), (hub, f"{end}-in"), (hub, f"{end}-br"), (ns, "eth0"),
                           *((self.ns(r), "eth0") for r in self.roles() if r not in ("hub", role, "worker_b"))]:
            _ok("ip", "netns", "exec", where, "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx", "off")
        log = open(self.log_dir / f"netwire-{role}.log", "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        self.wires.append(subprocess.Popen(
            ["ip", "netns", "exec", hub, sys.executable, "-m", "swarmrl.node.local.netwire", end, f"{end}-in",
             "--delay-ms", f"{delay_ms:g}", "--loss", f"{loss:g}", "--rate-mbit", f"{rate_mbit:g}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _nat(self) -> None:
        """nat's second leg to worker_b, forwarding, and masquerade out of eth0 (inbound: replies only)."""
        nat, wb = self.ns("nat"), self.ns("worker_b")
        _run("ip", "-n", nat, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", wb)
        _run("ip", "-n", nat, "addr", "add", f"{NAT_SUBNET}.1/24", "dev", "eth1")
        _run("ip", "-n", nat, "link", "set", "eth1", "up")
        _run("ip", "-n", wb, "addr", "add", f"{NAT_SUBNET}.2/24", "dev", "eth0")
        _run("ip", "-n", wb, "link", "set", "eth0", "up")
        _run("ip", "-n", wb, "route", "add", "default", "via", f"{NAT_SUBNET}.1")
        _run("ip", "netns", "exec", nat, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        rules = ("table ip swarmrl_nat {\n"
                 " chain nat_out { type nat hook postrouting priority 100; oifname \"eth0\" masquerade; }\n"
                 " chain only_replies { type filter hook forward priority 0; policy drop;\n"
                 "  iifname \"eth1\" oifname \"eth0\" accept; ct state established,related accept; }\n"
                 "}\n")
        subprocess.run(["ip", "netns", "exec", nat, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True)

    def reachable(self, src: str, dst: str, port: int = 47999, timeout_s: float = 3.0) -> bool:
        """Whether host `src` can open a TCP connection to host `dst` (a throwaway listener on `port`)."""
        listen = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                  f"s.bind(('{self.hosts[dst].address}', {port})); s.listen(); s.settimeout({timeout_s + 2}); "
                  "print('up', flush=True); s.accept()")
        dial = f"import socket; socket.create_connection(('{self.hosts[dst].address}', {port}), timeout={timeout_s})"
        server = subprocess.Popen(["ip", "netns", "exec", self.hosts[dst].netns, sys.executable, "-c", listen],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert server.stdout is not None
            server.stdout.readline()
            return _ok("ip", "netns", "exec", self.hosts[src].netns, sys.executable, "-c", dial)
        finally:
            server.kill()
            server.wait()

    def down(self) -> None:
        """Stop the wires and remove every namespace of the bed (their links go with them)."""
        for wire in self.wires:
            if wire.poll() is None:
                os.killpg(wire.pid, signal.SIGTERM)
                try:
                    wire.wait(5)
                except subprocess.TimeoutExpired:
                    os.killpg(wire.pid, signal.SIGKILL)
                    wire.wait()
        for role in reversed(self.roles()):
            _ok("ip", "netns", "del", self.ns(role))

    def existing(self) -> list[str]:
        """The bed's namespaces that exist now (empty after `down`)."""
        out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(self.prefix + "-")]


def enter(netns: str) -> int:
    """Move the calling thread (and the threads it starts later) into namespace `netns`; returns
    a descriptor of the namespace it was in, for `leave`. Call it before any thread that opens
    sockets is started."""
    libc = ctypes.CDLL(None, use_errno=True)
    old = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    finally:
        os.close(fd)
    return old


def leave(old: int) -> None:
    """Back into the namespace `enter` left (and close its descriptor)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        libc.setns(old, CLONE_NEWNET)
    finally:
        os.close(old)


@contextmanager
def bed_for_up(log_dir: Path, remote_trainers: int = 0) -> Iterator[NetBed]:
    """A bed for `swarmrl up --netns` (with `remote_trainers` behind WAN links), with this
    process inside its main namespace while the block runs; everything is removed at the end."""
    reason = missing()
    if reason is not None:
        raise StartupError(f"--netns: {reason}")
    bed = NetBed(log_dir=log_dir, remote_trainers=remote_trainers).up()
    try:
        old = enter(bed.hosts["main"].netns)
        try:
            yield bed
        finally:
            leave(old)
    finally:
        bed.down()


class PlacedSwarm(LocalSwarm):
    """A local swarm whose roles run on the bed's machines (or, with no bed, on loopback), with
    TLS on the trainers' gRPC when `tls`: bootstrap and trainers on main, the validator on its
    own, workers alternately on worker_a (slow link) and worker_b (behind the NAT, client mode),
    red-team workers on worker_a; trainer1, trainer2, ... on their own hosts behind WAN links
    where the bed has them (`remote_trainers`)."""

    def __init__(self, work: Path, bed: NetBed | None = None, *, tls: bool = False) -> None:
        super().__init__(work)
        self.bed, self.tls = bed, tls

    def host_of(self, name: str, role: str) -> Host | None:
        """The bed's machine that runs role process `name` (None without a bed)."""
        if self.bed is None:
            return None
        hosts = self.bed.hosts
        if role == "trainer" and name in hosts:   # trainer1.. each in its own data centre, when the bed has it
            return hosts[name]
        if role in ("bootstrap", "trainer"):
            return hosts["main"]
        if role == "validator":
            return hosts["validator"]
        index = int(name.removeprefix("worker")) if name.removeprefix("worker").isdigit() else 0
        return hosts["worker_b"] if index % 2 else hosts["worker_a"]

    def place(self, name: str, role: str) -> tuple[list[str], list[str]]:
        """`ip netns exec` into the role's machine, listening on its address (client mode behind
        the NAT); TLS for trainers when asked."""
        extra = ["tls=true"] if self.tls and role == "trainer" else []
        host = self.host_of(name, role)
        if host is None:
            return [], extra
        extra.append(f"net.host={host.address}")
        if role == "trainer":
            extra.append(f"grpc_host={host.address}")
        if host.behind_nat:
            extra.append("net.client_mode=true")
        return ["ip", "netns", "exec", host.netns], extra


@contextmanager
def swarm_for_up(work: Path, *, netns: bool, tls: bool, trainers: int = 1) -> Iterator[PlacedSwarm]:
    """The swarm `swarmrl up` drives: on a fresh bed with this process in its main namespace
    (`netns`; the first of `trainers` on main, the others each behind a WAN link), else on loopback."""
    if not netns:
        yield PlacedSwarm(work, tls=tls)
        return
    (work / "logs").mkdir(parents=True, exist_ok=True)
    with bed_for_up(work / "logs", remote_trainers=min(max(0, trainers - 1), MAX_REMOTE_TRAINERS)) as bed:
        yield PlacedSwarm(work, bed, tls=tls)
