"""A configuration file read half-written must not open the gateway (security sweep, item 1).

A file rewritten in place is empty, then a growing prefix of itself; most prefixes parse, and with ``auth`` at
the end such a prefix has no keys. The file watch used to apply what it saw mid-write (12 of 24 anonymous
requests got 200 during a 3-second rewrite), and any reload applied an empty or cut file. Here the attack is
run again: the file is rewritten in place in pieces while the watch polls it every 50 ms, and anonymous clients
and a keyed one keep asking throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway import control
from gateway.app import GatewayApp, create_app
from gateway.config import load_settings
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE
from tests.conftest import ServerThread, serve_in_thread
from tests.waiting import until_true, wait_until

CLIENT_KEY, OPS_KEY = "sk-client-0123", "sk-ops-4567"
OPS = {"authorization": f"Bearer {OPS_KEY}"}
ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keyed(fleet: FleetThread, names: list[str], **extra: Any) -> dict[str, Any]:
    """A configuration with API keys, its auth section last (where a cut loses it first), watched every 50 ms
    (a change applied once 40 more reads, server.reload_settle_seconds of 2 s by default, found it unchanged: the
    writer below leaves each piece for a few reads)."""
    servers = {s.spec.name: s for s in fleet.fleet.servers}
    return {"server": {"reload_watch_seconds": 0.05},
            "backends": [{"name": n, "engine": "vllm", "url": servers[n].url} for n in names],
            "scrape": {"interval": 0.1, "timeout": 1.0}, **extra,
            "auth": {"keys": [{"name": "client", "key_sha256": digest(CLIENT_KEY)},
                              {"name": "ops", "key_sha256": digest(OPS_KEY), "scopes": ["admin", "metrics"],
                               "requests_per_minute": 600}],
                     "protect_metrics": True}}


def dump(raw: dict[str, Any]) -> str:
    return yaml.safe_dump(raw, sort_keys=False)


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    with FleetThread([SimSpec(engine="vllm", model="m", name=n, time_scale=TIME_SCALE) for n in ("va", "vb")]) as f:
        yield f


@contextlib.contextmanager
def serving(path: Path) -> Iterator[tuple[ServerThread, GatewayApp]]:
    app = create_app(load_settings(path), config_path=str(path))
    with serve_in_thread(app) as gateway:
        yield gateway, app


def reloads(gateway: ServerThread, result: str) -> float:
    line = f'gateway_config_reloads_total{{result="{result}"}} '
    text = httpx.get(gateway.url + "/metrics", headers=OPS).text
    return next((float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line)), 0.0)


def anonymous_status(url: str) -> int:
    return httpx.post(url + "/v1/chat/completions", json=ASK).status_code


def test_a_file_rewritten_in_place_slowly_never_opens_the_gateway(fleet: FleetThread, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(dump(keyed(fleet, ["va"])))
    text = dump(keyed(fleet, ["va", "vb"])).encode()
    auth = text.index(b"auth:")
    first_key_line = text.index(b"\n", text.index(b"- name: client")) + 1
    # empty, then everything but auth (valid YAML without keys), then a cut inside the first key, then the rest
    pieces = [text[:auth], text[auth:first_key_line], text[first_key_line:]]
    reads: list[None] = []  # one per read of the file by the watch
    read = control.read_settings_file

    def counted(file: str | Path) -> bytes:
        try:
            return read(file)
        finally:
            reads.append(None)

    monkeypatch.setattr(control, "read_settings_file", counted)

    def seen_by_the_watch() -> None:
        """Return once the watch has read the file as it is now, twice (two more reads begun after this)."""
        begun = len(reads) + 1  # (a read under way may have begun before the last write)
        wait_until(lambda: len(reads) >= begun + 2, "the watch reading the file")

    def rewrite_in_place() -> None:
        with path.open("r+b", buffering=0) as file:  # as tee, scp or rsync --inplace write it: same inode
            file.truncate(0)
            for piece in pieces:
                seen_by_the_watch()  # each prefix, the empty one first, is read, though not for long enough
                file.write(piece)
                os.fsync(file.fileno())

    with serving(path) as (gateway, app):

        async def attack() -> tuple[list[int], list[int], list[int]]:
            anonymous: list[int] = []
            stranger: list[int] = []  # the OpenAI SDK with a key the gateway does not know
            client: list[int] = []
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
                sdks = {key: openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0,
                                                http_client=http) for key in ("sk-nobody", CLIENT_KEY)}

                async def sdk_status(key: str) -> int:
                    try:
                        await sdks[key].chat.completions.create(model="m", messages=ASK["messages"], max_tokens=2)
                    except openai.APIStatusError as exc:
                        return exc.status_code
                    return 200

                async def ask() -> None:
                    anonymous.append((await http.post("/v1/chat/completions", json=ASK)).status_code)
                    stranger.append(await sdk_status("sk-nobody"))
                    client.append(await sdk_status(CLIENT_KEY))

                async def asked_until_applied() -> bool:
                    await ask()
                    return writer.done() and {b.name for b in app.gateway.pool} == {"va", "vb"}

                writer = asyncio.create_task(asyncio.to_thread(rewrite_in_place))
                # ask throughout the rewrite and until the new file is in force (vb added), then a little more
                await until_true(asked_until_applied, "the rewritten file applied", within=20)
                for _ in range(5):
                    await ask()
                await writer
            return anonymous, stranger, client

        anonymous, stranger, client = asyncio.run(attack())
        assert anonymous and set(anonymous) == {401}, f"anonymous requests answered: {anonymous}"
        assert set(stranger) == {401}, f"an unknown key's requests answered: {stranger}"
        assert set(client) == {200}, f"the client key's requests answered: {client}"
        effective = httpx.get(gateway.url + "/admin/config", headers=OPS).json()
        assert [k["name"] for k in effective["auth"]["keys"]] == ["client", "ops"]
        assert effective["auth"]["keys"][1]["requests_per_minute"] == 600
        assert reloads(gateway, "applied") == 1.0, "the final content, once, and nothing before it"


def test_an_empty_or_cut_file_is_refused_by_any_reload_and_changes_nothing(fleet: FleetThread,
                                                                            tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    full = dump(keyed(fleet, ["va", "vb"]))
    path.write_text(full)
    cut_before_auth = full[:full.index("auth:")]
    without_backends = dump({k: v for k, v in keyed(fleet, ["va"]).items() if k != "backends"})
    ops_hash = full.index(digest(OPS_KEY))
    cut_inside_ops = full[:full.index("\n", ops_hash) + 1]  # ops keeps its hash, loses its scopes and limit
    cut_before_protection = full[:full.index("  protect_metrics")]
    cases = [("", "is empty"), ("# rewritten by ansible\n\n   \n", "is empty"),
             (cut_before_auth, "auth.keys: the file has no API keys"),
             (without_backends, "backends: the file has no backends section"),
             (cut_inside_ops, "auth.keys (ops).scopes: left out of the file"),
             (cut_before_protection, "auth.protect_metrics: left out of the file")]
    with serving(path) as (gateway, app):
        before = httpx.get(gateway.url + "/admin/config", headers=OPS).json()
        for content, why in cases:
            path.write_text(content)
            reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
            assert reply.status_code == 400, (content, reply.text)
            assert reply.json()["error"]["code"] == "invalid_config" and why in reply.json()["error"]["message"]
            assert httpx.get(gateway.url + "/admin/config", headers=OPS).json() == before
            assert anonymous_status(gateway.url) == 401
        # SIGHUP's path: the same refusal, counted
        path.write_text(cut_before_auth)
        rejected = reloads(gateway, "rejected")
        app.gateway.control.request_reload("SIGHUP")
        wait_until(lambda: reloads(gateway, "rejected") != rejected, "SIGHUP's reload applied or refused")
        assert httpx.get(gateway.url + "/admin/config", headers=OPS).json() == before
        assert anonymous_status(gateway.url) == 401
        assert reloads(gateway, "applied") == 0.0


def test_a_file_that_says_so_removes_every_backend_or_every_key(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(dump(keyed(fleet, ["va"])))
    with serving(path) as (gateway, _app):
        lifted = keyed(fleet, ["va"])
        lifted["auth"]["keys"][1]["requests_per_minute"] = None  # (said: the limit is lifted)
        lifted["auth"]["protect_metrics"] = False
        path.write_text(dump(lifted))
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
        assert reply.status_code == 200 and reply.json()["sections"] == ["auth"], reply.text
        assert httpx.get(gateway.url + "/metrics").status_code == 200
        path.write_text(dump(keyed(fleet, [])))  # (backends: [], said)
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
        assert reply.status_code == 200 and reply.json()["removed"] == ["va"], reply.text
        contradiction = keyed(fleet, ["va"])
        contradiction["auth"]["open"] = True
        path.write_text(dump(contradiction))
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
        assert reply.status_code == 400 and "open: true says" in reply.json()["error"]["message"]
        path.write_text(dump({**keyed(fleet, ["va"]), "auth": {"open": True}}))
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
        assert reply.status_code == 200 and reply.json()["added"] == ["va"], reply.text
        # (once va's first probe passed)
        wait_until(lambda: anonymous_status(gateway.url) == 200, "the open gateway serving an anonymous request")
        assert httpx.get(gateway.url + "/admin/config", headers=OPS).json()["error"]["code"] == "admin_disabled"


def test_a_gateway_that_never_had_keys_reloads_as_before(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    open_config = {k: v for k, v in keyed(fleet, ["va"]).items() if k != "auth"}
    path.write_text(dump(open_config))
    with serving(path) as (gateway, app):
        path.write_text(dump({**open_config, "backends": keyed(fleet, ["va", "vb"])["backends"]}))
        result = gateway.call(app.gateway.control.reload("test"))
        assert result["added"] == ["vb"]


def test_a_key_name_or_a_section_written_twice_is_refused_by_a_reload(fleet: FleetThread, tmp_path: Path) -> None:
    """Two keys of one name were merged by a reload: the limited client key took the other's admin scope and lost
    its limit. A section written twice kept the second silently."""
    path = tmp_path / "gateway.yaml"
    config = keyed(fleet, ["va"])
    config["auth"]["keys"][0]["requests_per_minute"] = 600
    path.write_text(dump(config))
    twin = {"name": "client", "key_sha256": digest("sk-twin-89ab"), "scopes": ["admin", "inference"],
            "requests_per_minute": None}
    twice = {**config, "auth": {**config["auth"], "keys": [*config["auth"]["keys"], twin]}}
    client = {"authorization": f"Bearer {CLIENT_KEY}"}
    with serving(path) as (gateway, _app):
        before = httpx.get(gateway.url + "/admin/config", headers=OPS).json()
        for content, why in ((dump(twice), "auth: keys: two keys are named 'client'"),
                             (dump(config) + "auth: {open: true}\n", "'auth' is written twice in one mapping")):
            path.write_text(content)
            reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
            assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
            assert httpx.get(gateway.url + "/admin/config", headers=OPS).json() == before
            assert httpx.get(gateway.url + "/admin/config", headers=client).status_code == 403
            assert anonymous_status(gateway.url) == 401


@pytest.mark.timeout(60)
def test_a_fifo_in_the_files_place_is_refused_at_once_and_the_watch_goes_on(fleet: FleetThread,
                                                                           tmp_path: Path) -> None:
    """A FIFO swapped in for the file made every later reload (and the watch) wait for a writer forever."""
    path = tmp_path / "gateway.yaml"
    config = keyed(fleet, ["va"])
    config["server"]["reload_settle_seconds"] = 0.2
    path.write_text(dump(config))
    with serving(path) as (gateway, app):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, path)
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS, timeout=20)
        assert reply.status_code == 400 and "not a regular file" in reply.json()["error"]["message"], reply.text
        path.unlink()
        path.write_text(dump({**config, "backends": keyed(fleet, ["va", "vb"])["backends"]}))
        wait_until(lambda: {b.name for b in app.gateway.pool} == {"va", "vb"},  # (the watch, still reading)
                   "the file watch going on past the FIFO", within=20)


def test_a_bad_port_is_refused_and_a_reload_that_fails_still_revokes_keys_and_the_watch_goes_on(
        fleet: FleetThread, tmp_path: Path) -> None:
    """Sweep 8: a backend URL with port 99999 passed validation and raised in the middle of applying the reload:
    the keys revoked in the same file stayed valid, the file watch died, and the key stayed valid after the typo
    was fixed, until a restart."""
    path = tmp_path / "gateway.yaml"
    config = keyed(fleet, ["va"])
    config["server"]["reload_settle_seconds"] = 0.2
    temp_key = "sk-temp-8901"
    config["auth"]["keys"].append({"name": "temp", "key_sha256": digest(temp_key)})
    path.write_text(dump(config))
    client = {"authorization": f"Bearer {CLIENT_KEY}"}
    temp = {"authorization": f"Bearer {temp_key}"}

    def status() -> int:
        return httpx.post(gateway.url + "/v1/chat/completions", json=ASK, headers=client).status_code

    revoked = {**config, "auth": {**config["auth"], "keys": config["auth"]["keys"][1:]}}
    with serving(path) as (gateway, app):
        assert status() == 200
        typo = {**revoked, "backends": [{**revoked["backends"][0], "url": "http://127.0.0.1:99999"}]}
        path.write_text(dump(typo))
        wait_until(lambda: reloads(gateway, "rejected") >= 1, "the file with a bad port refused", within=20)
        assert status() == 200  # (refused whole: the running configuration stays)
        path.write_text(dump(revoked))
        wait_until(lambda: status() == 401, "the fixed file applied (the watch still going)", within=20)

        failing = app.gateway.pool.reconcile

        async def fail_once(*args: Any, **kwargs: Any) -> Any:
            app.gateway.pool.reconcile = failing  # type: ignore[method-assign]
            raise RuntimeError("a fault of the gateway's own")

        app.gateway.pool.reconcile = fail_once  # type: ignore[method-assign]
        assert httpx.post(gateway.url + "/v1/chat/completions", json=ASK, headers=temp).status_code == 200
        path.write_text(dump({**revoked, "auth": {**revoked["auth"], "keys": revoked["auth"]["keys"][:1]}}))
        wait_until(lambda: reloads(gateway, "failed") >= 1, "the failing reload counted", within=20)
        assert httpx.post(gateway.url + "/v1/chat/completions", json=ASK, headers=temp).status_code == 401
        path.write_text(dump({**config, "backends": keyed(fleet, ["va", "vb"])["backends"]}))
        wait_until(lambda: {b.name for b in app.gateway.pool} == {"va", "vb"},
                   "the next change applied after the failure", within=20)
        assert status() == 200
