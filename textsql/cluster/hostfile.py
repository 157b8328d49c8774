"""Read, write and validate DeepSpeed / OpenMPI hostfiles: one `<address> slots=<N>` line per node."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.sharedfiles import replace_file

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_DOTTED = re.compile(r"^[0-9]+(\.[0-9]+){3}$")
FORMAT = "'<address> slots=<N>', e.g. '10.0.0.11 slots=1'"


class HostfileError(TextsqlError):
    """A hostfile that DeepSpeed would misread or reject; the message lists every bad line."""


@dataclass(frozen=True)
class Host:
    """One node: its address (IPv4 address or host name) and how many ranks (GPUs) it runs."""

    address: str
    slots: int = 1

    def line(self) -> str:
        return f"{self.address} slots={self.slots}"


def address_problem(address: str) -> str | None:
    """Why `address` cannot name a node in a DeepSpeed launch, or None. IPv6 is refused: the launcher's
    `--include host:slots` syntax and pdsh's host lists split on ':'; a dotted quad with a leading zero is refused:
    inet_aton reads 010 as octal 8, Python's ipaddress refuses it, so two tools would disagree on the machine."""
    if not address.isascii():
        return f"'{address}' has non-ASCII characters; write the host name in ASCII (punycode) or use its IPv4 address"
    if ":" in address:
        try:
            ipaddress.IPv6Address(address.strip("[]"))
            return f"'{address}' is an IPv6 address; the DeepSpeed launcher (host:slot lists) and pdsh cannot name one: use an IPv4 address or a host name"
        except ValueError:
            return f"'{address}' is not a host name or IPv4 address"
    if _DOTTED.match(address):
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            if any(len(part) > 1 and part.startswith("0") for part in address.split(".")):
                return f"'{address}' has a part with a leading zero, which some tools read as octal; write it without (e.g. 10.0.0.1)"
            return f"'{address}' is not a valid IPv4 address"
        return None
    if not _NAME.match(address):
        return f"'{address}' is not a host name or IPv4 address"
    return None


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
        if problem := address_problem(address):
            problems.append(f"{where}: {problem}")
            continue
        # str.isdigit() is True for other scripts' digits too (e.g. '١'), which int() and DeepSpeed's \d accept.
        if not (slots_text.isascii() and slots_text.isdigit()):
            problems.append(
                f"{where}: slots must be a whole number of GPUs in ASCII digits (at least 1), not '{slots_text}'"
            )
            continue
        if int(slots_text) < 1:
            problems.append(
                f"{where}: slots must be at least 1 (a node with no GPU runs no rank); remove the line instead"
            )
            continue
        if address.lower() in seen:
            problems.append(
                f"{where}: duplicate host {address}, already on line {seen[address.lower()]}; each node appears once"
            )
            continue
        seen[address.lower()] = number
        hosts.append(Host(address, int(slots_text)))
    if not hosts and not problems:
        problems.append(f"no hosts: add one line per node, {FORMAT}")
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        raise HostfileError(f"Hostfile {source} has {count}:\n" + "\n".join(f"  {p}" for p in problems))
    return hosts


def resolve(address: str) -> set[str]:
    """The IPv4 addresses a name resolves to on this machine (empty when it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(address, None, socket.AF_INET, socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return set()


def check_addresses(hosts: list[Host], resolver=resolve) -> None:
    """Refuse hosts that do not resolve, and two entries that are one machine (`localhost` and `127.0.0.1`): DeepSpeed
    would start two node launchers there, both taking GPU 0. `resolver` maps a name to its IPv4 addresses."""
    problems, owner = [], {}
    for host in hosts:
        addresses = resolver(host.address)
        if not addresses:
            problems.append(
                f"{host.address} does not resolve to an IPv4 address here; fix the name (or /etc/hosts, DNS) or use its IP address"
            )
            continue
        for ip in sorted(addresses):
            if ip in owner and owner[ip] != host.address:
                problems.append(f"{owner[ip]} and {host.address} are the same machine ({ip}); list each node once")
                break
            owner[ip] = host.address
    if problems:
        raise HostfileError("The hosts cannot be used:\n" + "\n".join(f"  {p}" for p in problems))


def read_hostfile(path) -> list[Host]:
    path = Path(path)
    if not path.is_file():
        raise HostfileError(
            f"Hostfile {path} does not exist. Write one line per node, {FORMAT} (see hostfile.example)."
        )
    return parse_hostfile(path.read_text(encoding="utf-8", errors="replace"), str(path))


def format_hostfile(hosts: list[Host]) -> str:
    text = "".join(h.line() + "\n" for h in hosts)
    parse_hostfile(text)  # never write what we would refuse to read
    return text


def write_hostfile(path, hosts: list[Host]) -> Path:
    """Write the hostfile atomically (node 0 first: DeepSpeed makes the first host rank 0)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return replace_file(path, format_hostfile(hosts))  # through a new file of a random name: never a planted link


def rank_layout(hosts: list[Host]) -> dict[int, tuple[str, int]]:
    """Global rank -> (host, local rank), in the order the DeepSpeed launcher assigns them (hostfile order)."""
    layout, rank = {}, 0
    for host in hosts:
        for local in range(host.slots):
            layout[rank] = (host.address, local)
            rank += 1
    return layout


def ranks_of(hosts: list[Host], address: str) -> list[int]:
    return [rank for rank, (host, _) in rank_layout(hosts).items() if host == address]
