"""Peer servers held still while another target is measured.

A peer (`benchmarks/serving.py --peer NAME=URL`) is a server someone else started; it stays up for
the whole run. Idle, it is not free: its processes wake (timers, pollers, thread pools), and on a
small machine every wake-up is taken from the target being measured, while tandem's own servers
are stopped between their rounds. So each peer's process group gets SIGSTOP while any other
target runs and SIGCONT for its own rounds, and every group is continued when the run ends, also
on an error or Ctrl-C. The group is that of the process listening on the peer's port (start the
peer with `setsid` so that its workers share it); one this user may not signal is left running,
with a warning.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

LISTEN = "0A"  # the TCP state in /proc/net/tcp


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """Socket inodes listening on `port` where a loopback client reaches them (a loopback or a
    wildcard address), from /proc/net/tcp and tcp6. Peers are local; a socket on the same port
    of another address (a Ray worker on the node's IP, say) is someone else's."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                address, _, port_hex = local.rpartition(":")
                if state == LISTEN and int(port_hex, 16) == port and _reached_locally(address):
                    inodes.add(inode)
    return inodes


def _reached_locally(address: str) -> bool:
    """`address` as /proc/net/tcp(6) writes it (hex, each 32-bit word in host order, which is
    little-endian here) is a loopback or a wildcard address."""
    raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def listening_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process that holds a socket listening on `port`, if this user can see it."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    if not wanted:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        return int(entry.name)
    return None


class QuietPeers:
    """`with QuietPeers(peers) as quiet: quiet.only(name)` before each target's session (None
    for tandem's own targets)."""

    def __init__(self, peers: dict[str, str], enabled: bool = True) -> None:
        self.groups: dict[str, int] = {}
        if not enabled:
            return
        for name, url in peers.items():
            pid = listening_pid(urlsplit(url).port or 80)
            if pid is None:
                print(f"warning: no process of this user listens for peer {name}: it is "
                      "left running beside the other targets", file=sys.stderr)  # fmt: skip
                continue
            group = os.getpgid(pid)
            if group == os.getpgrp():  # stopping it would stop this benchmark too
                print(f"warning: peer {name} shares this benchmark's process group (start it "
                      "with setsid): it is left running", file=sys.stderr)  # fmt: skip
                continue
            self.groups[name] = group

    def only(self, name: str | None) -> None:
        """Continues `name`'s group and stops every other peer's."""
        for peer, group in self.groups.items():
            if peer == name:
                self._signal(peer, group, signal.SIGCONT)
            else:
                self._signal(peer, group, signal.SIGSTOP)

    def resume_all(self) -> None:
        for peer, group in self.groups.items():
            self._signal(peer, group, signal.SIGCONT)

    def _signal(self, peer: str, group: int, sig: signal.Signals) -> None:
        try:
            os.killpg(group, sig)
        except OSError as err:
            print(f"warning: peer {peer}: {sig.name} failed: {err}", file=sys.stderr)

    def __enter__(self) -> QuietPeers:
        # A plain SIGTERM would end this process with the peers still stopped.
        self._on_term = signal.signal(signal.SIGTERM, _exit_on_term)
        return self

    def __exit__(self, *exc: object) -> None:
        self.resume_all()
        signal.signal(signal.SIGTERM, self._on_term)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
