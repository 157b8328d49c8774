"""Read, write and validate DeepSpeed / OpenMPI hostfiles: one `<address> slots=<N>` line per node."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from textsql.errors import TextsqlError

_ADDRESS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._:-]*[A-Za-z0-9])?$")
FORMAT = "'<address> slots=<N>', e.g. '10.0.0.11 slots=1'"


class HostfileError(TextsqlError):
    """A hostfile that DeepSpeed would misread or reject; the message lists every bad line."""


@dataclass(frozen=True)
class Host:
    """One node: its address (IP or name) and how many ranks (GPUs) it runs."""

    address: str
    slots: int = 1

    def line(self) -> str:
        return f"{self.address} slots={self.slots}"


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile text; all problems are collected and raised together as one HostfileError."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    problems = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"line {number} ('{line}')"
        fields = line.split()
        if "#" in line:
            problems.append(f"{where}: a comment after an entry; DeepSpeed only skips lines that start with #")
            continue
        if len(fields) != 2 or not fields[1].startswith("slots="):
            problems.append(f"{where}: expected {FORMAT}")
            continue
        address, slots_text = fields[0], fields[1].removeprefix("slots=")
        if not _ADDRESS.match(address):
            problems.append(f"{where}: '{address}' is not a host name or IP address")
            continue
        if not slots_text.isdigit():
            problems.append(f"{where}: slots must be a whole number of GPUs (at least 1), not '{slots_text}'")
            continue
        if int(slots_text) < 1:
            problems.append(f"{where}: slots must be at least 1 (a node with no GPU runs no rank); remove the line instead")
            continue
        if address in seen:
            problems.append(f"{where}: duplicate host {address}, already on line {seen[address]}; each node appears once")
            continue
        seen[address] = number
        hosts.append(Host(address, int(slots_text)))
    if not hosts and not problems:
        problems.append(f"no hosts: add one line per node, {FORMAT}")
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        raise HostfileError(f"Hostfile {source} has {count}:\n" + "\n".join(f"  {p}" for p in problems))
    return hosts


def read_hostfile(path) -> list[Host]:
    path = Path(path)
    if not path.is_file():
        raise HostfileError(f"Hostfile {path} does not exist. Write one line per node, {FORMAT} (see hostfile.example).")
    return parse_hostfile(path.read_text(), str(path))


def format_hostfile(hosts: list[Host]) -> str:
    text = "".join(h.line() + "\n" for h in hosts)
    parse_hostfile(text)  # never write what we would refuse to read
    return text


def write_hostfile(path, hosts: list[Host]) -> Path:
    """Write the hostfile atomically (node 0 first: DeepSpeed makes the first host rank 0)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(format_hostfile(hosts))
    os.replace(tmp, path)
    return path


def rank_layout(hosts: list[Host]) -> dict[int, tuple[str, int]]:
    """Global rank -> (host, local rank), in the order the DeepSpeed launcher assigns them (hostfile order)."""
    layout, rank = {}, 0
    for host in hosts:
        for local in range(host.slots):
            layout[rank] = (host.address, local)
            rank += 1
    return layout
