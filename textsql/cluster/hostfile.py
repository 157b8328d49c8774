"""Read and validate DeepSpeed / OpenMPI hostfiles: one `<address> slots=<N>` line per node."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from textsql.errors import TextsqlError

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
        if problem := _entry_problem(line, seen):
            problems.append(f"line {number} ('{line}'): {problem}")
            continue
        address, slots = line.split()
        seen[address.lower()] = number
        hosts.append(Host(address, int(slots.removeprefix("slots="))))
    if not hosts and not problems:
        problems.append(f"no hosts: add one line per node, {FORMAT}")
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        raise HostfileError(f"Hostfile {source} has {count}:\n" + "\n".join(f"  {p}" for p in problems))
    return hosts


def _entry_problem(line: str, seen: dict[str, int]) -> str | None:
    fields = line.split()
    if "#" in line:
        return "a comment after an entry; DeepSpeed only skips lines that start with #"
    if len(fields) != 2 or not fields[1].startswith("slots="):
        return f"expected {FORMAT}"
    address, slots = fields[0], fields[1].removeprefix("slots=")
    if problem := address_problem(address):
        return problem
    # str.isdigit() is True for other scripts' digits too (e.g. '١'), which int() and DeepSpeed's \d accept.
    if not (slots.isascii() and slots.isdigit()):
        return f"slots must be a whole number of GPUs in ASCII digits (at least 1), not '{slots}'"
    if int(slots) < 1:
        return "slots must be at least 1 (a node with no GPU runs no rank); remove the line instead"
    if address.lower() in seen:
        return f"duplicate host {address}, already on line {seen[address.lower()]}; each node appears once"
    return None


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


@dataclass
class HostSelection:
    """Which hosts of a hostfile a launch uses, and its rendezvous port: the DeepSpeed launcher's own flags, with its
    meaning, checked against the hostfile before anything starts (select_hosts)."""

    include: str = field(
        default="",
        metadata={
            "help": "Only these hosts (and GPUs): HOST[:SLOT[,SLOT...]][@HOST...], e.g. 'node1:0,1@node2' (GPUs 0 "
            "and 1 of node1, every GPU of node2), as DeepSpeed's --include. Not with --exclude or --num_nodes."
        },
    )
    exclude: str = field(
        default="",
        metadata={
            "help": "Every host but these (a HOST alone leaves it out, HOST:SLOT leaves out those GPUs), as "
            "DeepSpeed's --exclude, e.g. 'node2' or 'node1:3'. Not with --include or --num_nodes."
        },
    )
    num_nodes: int = field(
        default=-1,
        metadata={"help": "Use the first N hosts of the hostfile (-1: all), as DeepSpeed's --num_nodes."},
    )
    master_port: int | None = field(
        default=None,
        metadata={"help": "The port rank 0 listens on for the others (default: a free port on the first host)."},
    )

    def __post_init__(self):
        if self.include and self.exclude:
            raise HostfileError(
                "--include and --exclude cannot both be given (DeepSpeed's launcher refuses it too): name the hosts "
                "to use with --include, or the ones to leave out with --exclude."
            )
        if self.num_nodes == 0 or self.num_nodes < -1:
            raise HostfileError(f"--num_nodes must be at least 1 (or -1: every host), not {self.num_nodes}.")
        if self.num_nodes != -1 and (self.include or self.exclude):
            raise HostfileError(
                "--num_nodes cannot be combined with --include or --exclude (DeepSpeed's launcher refuses it too): "
                "either take the first N hosts with --num_nodes, or name them with --include / --exclude."
            )
        if self.master_port is not None and not 1024 <= self.master_port <= 65535:
            raise HostfileError(
                f"--master_port must be a port from 1024 to 65535 that is free on the first host, not {self.master_port}."
            )


def select_hosts(hosts: list[Host], selection: HostSelection) -> list[Host]:
    """The hosts a launch uses, in hostfile order (the first is rank 0's), each with the number of slots it runs: what
    DeepSpeed's runner makes of the same flags (its own functions), found before anything starts."""
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    names = ", ".join(h.address for h in hosts)
    try:
        chosen = parse_inclusion_exclusion({h.address: h.slots for h in hosts}, selection.include, selection.exclude)
    except ValueError as error:
        raise HostfileError(
            f"--include/--exclude {selection.include or selection.exclude!r}: {error}. Write HOST[:SLOT[,SLOT...]] "
            f"separated by @ (slots are GPU numbers from 0), with the hosts and slots of the hostfile ({names})."
        ) from None
    if not chosen:
        raise HostfileError(
            f"--exclude {selection.exclude!r} leaves no host of the hostfile ({names}) to train on. Exclude fewer "
            "hosts or slots, or name the ones to use with --include."
        )
    if selection.num_nodes > len(chosen):
        raise HostfileError(
            f"--num_nodes {selection.num_nodes} asks for more hosts than the hostfile has ({len(chosen)}: {names}). "
            f"Pass --num_nodes {len(chosen)} or less, or add the other hosts to the hostfile."
        )
    hosts = [Host(address, len(slots)) for address, slots in chosen.items()]
    return hosts[: selection.num_nodes] if selection.num_nodes > 0 else hosts
