"""DNS discovery: a backend entry naming a DNS name (a Kubernetes headless Service) stands for every address
it resolves to. Re-resolved periodically; replicas come and go with the answers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from gateway.config import BackendSettings

Resolver = Callable[[str, int], Awaitable[list[str]]]
# the replicas one DNS entry stands for at most (the first, by address: every gateway replica takes the same)
MAX_DNS_REPLICAS = 256


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def replica_settings(group: BackendSettings, address: str) -> BackendSettings:
    """The settings of one replica: the group's, at ``scheme://address:port``, named ``<name>-<address>``
    (stable across gateway replicas, which the consistent-hash picker relies on)."""
    host = f"[{address}]" if ":" in address else address
    name = f"{group.name}-{address.replace(':', '.')}"
    return group.model_copy(update={"name": name, "url": f"{group.scheme}://{host}:{group.port}", "dns": None})
