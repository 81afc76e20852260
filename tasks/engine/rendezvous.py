"""The torchrun command line for one machine of a training run, and the addresses it advertises.

With several machines torchrun's defaults look this machine up by its hostname: it hosts the
c10d rendezvous store only if the endpoint matches the hostname's addresses, rank 0 advertises
``getfqdn()`` to the workers, and gloo binds to whatever the hostname resolves to (or loopback).
On a machine whose hostname maps to 127.0.1.1 or to another network, the other machines cannot
reach any of those. Here every address is instead the one this machine uses to reach the
rendezvous endpoint, which the other machines must be able to reach anyway.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import sys
from pathlib import Path

from cpuforge.tasks.config.settings import TrainConfig
from cpuforge.tasks.records.errors import ConfigError

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"train.rdzv_endpoint={endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """The source address this machine's routing picks to reach host (no packet is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"train.rdzv_endpoint: cannot reach {host}:{port} from this machine ({exc})") from None


def interface_of(address: str) -> str | None:
    """The network interface holding this IPv4 address (None for IPv6 or if none does)."""
    if ipaddress.ip_address(address).version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def torchrun_command(t: TrainConfig, spec_path: Path, rdzv_id: str) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start this machine's share of the run's worker group."""
    # Workers get a fresh store from rank 0 in every rendezvous round. The store torchrun shares with
    # them by default outlives a restart, and a restarted worker read the dead one's gloo address
    # from it ("Connection refused"), failing once more and using up another restart.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    restarts = f"--max-restarts={t.max_restarts}"
    entry = ["-m", "cpuforge.tasks.engine.distributed", str(spec_path)]
    if t.nnodes == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", restarts,
                f"--nproc_per_node={t.nproc_per_node}", *entry], env
    host, port = split_endpoint(t.rdzv_endpoint)
    local = local_address_towards(host, port)
    # The endpoint's own machine hosts the store; routing to a local address picks that address.
    is_host = local in {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={t.nnodes}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint={t.rdzv_endpoint}", f"--rdzv_id={rdzv_id}",
           f"--rdzv_conf=is_host={str(is_host).lower()}", f"--local_addr={local}", restarts,
           f"--nproc_per_node={t.nproc_per_node}", *entry]
    interface = interface_of(local)
    return cmd, {**env, "GLOO_SOCKET_IFNAME": interface} if interface else env
