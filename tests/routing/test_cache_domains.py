"""Cache domains in routing: a request profits only from what its own domain put in the caches, and with one
domain nothing changes."""

from __future__ import annotations

import pytest

from gateway.config import settings_from_mapping
from gateway.routing.cache_domain import SHARED, CacheDomain
from gateway.routing.policies import build_pipeline
from gateway.routing.prompt import block_hashes
from gateway.routing.request import RouteRequest
from tests.routing.helpers import backend, chat

pytestmark = pytest.mark.unit

SYSTEM = "You are the assistant of tenant A; the secret word is gondola. " * 40
A, B = CacheDomain("a", "salt-a"), CacheDomain("b", "salt-b")


def routing(policy: str) -> object:
    return settings_from_mapping({"routing": {"policy": policy}}).routing


def in_domain(request: RouteRequest, domain: CacheDomain) -> RouteRequest:
    request.cache_domain = domain
    return request


def test_one_domain_keeps_the_prefix_keys_and_several_keep_them_apart() -> None:
    shared = chat(SYSTEM, "q")
    assert shared.cache_domain is SHARED
    assert shared.blocks == block_hashes("m", shared.prompt)  # (replicas of an earlier release agree)
    a, also_a, b = (in_domain(chat(SYSTEM, "q"), d) for d in (A, A, B))
    assert a.blocks == also_a.blocks
    assert not set(a.blocks) & set(b.blocks) and not set(a.blocks) & set(shared.blocks)


def test_a_prefix_another_domain_cached_earns_no_credit() -> None:
    pipeline = build_pipeline(routing("prefix"))  # type: ignore[arg-type]
    backends = [backend(n, slots=8) for n in "wxyz"]
    home = backends[2]
    pipeline.routed(in_domain(chat(SYSTEM, "first"), A), home)
    same = pipeline.route(in_domain(chat(SYSTEM, "second"), A), backends)
    assert same.ranked[0] is home and same.reason == "prefix"
    other = pipeline.route(in_domain(chat(SYSTEM, "second"), B), backends)
    assert other.reason != "prefix" and "prefix=0.00" in other.detail


def test_sessions_are_kept_per_domain() -> None:
    pipeline = build_pipeline(routing("session"))  # type: ignore[arg-type]
    backends = [backend(n) for n in "abc"]
    pipeline.routed(in_domain(chat("s", "hi", session="s1"), A), backends[1])
    assert pipeline.route(in_domain(chat("s", "more", session="s1"), A), backends).reason == "session"
    decision = pipeline.route(in_domain(chat("s", "more", session="s1"), B), backends)
    assert decision.reason != "session" and "session=0.00" in decision.detail


def test_the_engine_salt_is_the_domains_and_a_clients_own_only_partitions_it() -> None:
    assert SHARED.engine_salt(None) is None and SHARED.engine_salt("mine") == "mine"  # one domain: as it came
    assert A.engine_salt(None) == "salt-a" and A.engine_salt("") == "salt-a"
    mine, other = A.engine_salt("x"), A.engine_salt("y")
    assert mine not in (None, "salt-a", other, B.engine_salt("x"), "x")
    assert A.engine_salt("salt-b") != "salt-b", "a client cannot name another domain's salt"
