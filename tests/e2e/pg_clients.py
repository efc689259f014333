"""Which local process holds each PostgreSQL connection (pg_stat_activity's client_port
matched to a socket in /proc): for the connection-budget test and its docs."""

from __future__ import annotations

import os
from pathlib import Path


def _inodes_by_port() -> dict[int, int]:
    """Local TCP port -> socket inode, for the sockets of this machine (IPv4 and IPv6)."""
    found: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            found[port] = int(fields[9])
    return found


def owners(ports: list[int], pids: list[int]) -> dict[int, int | None]:
    """For each client port, the pid among ``pids`` whose socket it is (None: none)."""
    inodes = _inodes_by_port()
    wanted = {inodes[p]: p for p in ports if p in inodes}
    found: dict[int, int | None] = {port: None for port in ports}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in wanted:
                    found[wanted[inode]] = pid
    return found


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
