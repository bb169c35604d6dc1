"""DNS discovery: replicas follow the name's answers; gateway replicas agree on the names and the routing."""

from __future__ import annotations

import pytest

from gateway.config import settings_from_mapping
from gateway.pool.pool import Pool
from gateway.routing.policies import build_pipeline
from gateway.routing.request import RouteRequest
from gateway.sim import Fleet, SimSpec
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit


class StubResolver:
    """A resolver whose answers the test changes; a lookup can also fail."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.fail = False
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.fail:
            raise OSError("Temporary failure in name resolution")
        return list(self.answers)


def test_dns_entries_need_a_port_and_exclude_a_url() -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="dns needs a port"):
        settings_from_mapping({"backends": [{"name": "v", "engine": "vllm", "dns": "v.svc"}]})
    with pytest.raises(ConfigError, match="set either url or dns"):
        settings_from_mapping({"backends": [{"name": "v", "engine": "vllm", "dns": "v.svc", "port": 1,
                                             "url": "http://x"}]})


@pytest.mark.integration
@pytest.mark.anyio
async def test_replicas_follow_a_changing_set_of_addresses() -> None:
    # three emulated vLLM servers on 127.0.0.1-3, same port: what a headless Service's pods look like
    port = free_port_block(1)
    fleet = Fleet([SimSpec(engine="vllm", model="m", name=f"pod{i}", host=f"127.0.0.{i}", port=port)
                   for i in (1, 2, 3)])
    await fleet.start()
    try:
        resolver = StubResolver(["127.0.0.1", "127.0.0.2"])
        settings = settings_from_mapping({"backends": [{"name": "vllm", "engine": "vllm", "dns": "vllm.svc",
                                                        "port": port}], "scrape": {"interval": 60}})
        pool = Pool(settings.backends, settings.scrape, discovery=settings.discovery, resolver=resolver)
        await pool.start()
        try:
            assert sorted(b.name for b in pool.backends) == ["vllm-127.0.0.1", "vllm-127.0.0.2"]
            assert all(b.routable and b.models == {"m"} for b in pool.backends)
            assert pool.get("vllm-127.0.0.2").url == f"http://127.0.0.2:{port}"
            assert resolver.asked == [("vllm.svc", port)]

            resolver.answers = ["127.0.0.2", "127.0.0.3"]  # a pod went away, another came
            await pool.discover()
            assert sorted(b.name for b in pool.backends) == ["vllm-127.0.0.2", "vllm-127.0.0.3"]
            assert pool.get("vllm-127.0.0.3").routable, "a new replica is probed at once"

            resolver.fail = True  # a DNS hiccup keeps what we have
            await pool.discover()
            assert len(pool.backends) == 2
            resolver.fail, resolver.answers = False, []
            await pool.discover()
            assert pool.backends == [] and pool.models() == []
        finally:
            await pool.stop()
    finally:
        await fleet.stop()


@pytest.mark.anyio
async def test_two_gateway_replicas_discover_the_same_names_and_route_a_prefix_alike() -> None:
    from gateway.pool.state import Health, Probe

    settings = settings_from_mapping({"backends": [{"name": "v", "engine": "vllm", "dns": "v.svc", "port": 8000,
                                                    "models": ["m"]}],
                                      "routing": {"policy": "consistent-prefix"}})
    pools = [Pool(settings.backends, settings.scrape, resolver=StubResolver(answers))
             for answers in (["10.0.0.3", "10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3", "10.0.0.1"])]
    for pool in pools:
        await pool.discover()  # (not started: no probes are sent to these addresses)
        for backend in pool.backends:
            backend.record_probe(Probe(Health.READY))
    pipelines = [build_pipeline(settings.routing) for _ in pools]
    for g in range(20):
        body = {"messages": [{"role": "system", "content": f"group {g} " * 80}, {"role": "user", "content": "q"}]}
        picks = {p.route(RouteRequest("chat", "m", False, None, body), pool.backends).ranked[0].name
                 for p, pool in zip(pipelines, pools, strict=True)}
        assert len(picks) == 1


@pytest.mark.anyio
async def test_a_name_resolving_to_thousands_of_addresses_stands_for_the_first_256() -> None:
    """Sweep 24: 2,000 addresses (a selector's slip, a stale wildcard record), each a backend scraped every second,
    took 58% of a core and got the one live replica marked down. One entry stands for 256 at most, the same on
    every gateway replica (the first by address)."""
    from gateway.pool.discovery import MAX_DNS_REPLICAS

    settings = settings_from_mapping({"backends": [{"name": "v", "engine": "vllm", "dns": "v.svc", "port": 8000,
                                                    "models": ["m"]}]})
    answers = [f"10.0.{i // 250}.{i % 250}" for i in range(2000)]
    pool = Pool(settings.backends, settings.scrape, resolver=StubResolver(answers))
    await pool.discover()  # (not started: nothing is probed)
    assert len(pool.backends) == MAX_DNS_REPLICAS == 256
    assert {b.name for b in pool.backends} == {f"v-{a}" for a in sorted(answers)[:256]}
