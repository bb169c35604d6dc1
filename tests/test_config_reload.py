"""The file watch's settling: a file being rewritten is handed on only once it held still, and only as read."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import gateway.control
from gateway.app import Gateway
from gateway.auth import KeyStore
from gateway.config import AuthSettings, ConfigError, Settings, parse_settings
from gateway.config_reload import KnownKeys, check_reload, stable_contents
from gateway.control import ControlPlane
from gateway.errors import GatewayError
from gateway.pool.pool import Pool
from gateway.proxy.admission import Admission

pytestmark = pytest.mark.unit

OLD, FULL = b"auth: {keys: [...]}\nbackends: [...]\n", b"auth: {keys: [...]}\nbackends: [..., ...]\n"


class Exhausted(Exception):
    pass


def contents_handed_on(reads: list[bytes | None], every: float = 0.1, settle: float = 0.3,
                       in_force: bytes | None = None) -> list[bytes]:
    """What the watch hands on when successive reads of the file give ``reads`` (the first: the content in
    force); time is the sleeps' count, so no test waits."""
    script = iter(reads)
    slept: list[float] = []

    async def read() -> bytes | None:
        try:
            return next(script)
        except StopIteration:
            raise Exhausted from None

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def run() -> list[bytes]:
        out: list[bytes] = []
        try:
            async for content in stable_contents(read, every, settle, in_force=in_force, sleep=sleep):
                out.append(content)
        except Exhausted:
            pass
        assert set(slept) == {every}
        return out

    return asyncio.run(run())


def test_a_file_written_in_pieces_is_handed_on_once_whole() -> None:
    # read every 0.1 s, settle 0.3 s: a content must be read four times in a row (three agreeing reads after the
    # first, 0.3 s apart at least) before it is handed on
    empty, part, more = b"", FULL[:12], FULL[:30]
    reads = [OLD, empty, empty, empty, part, part, more, more, more, FULL, FULL, FULL]
    assert contents_handed_on(reads) == [], "FULL has held still for 0.2 s only"
    assert contents_handed_on([*reads, FULL]) == [FULL]
    assert contents_handed_on([*reads, FULL, FULL, FULL, FULL]) == [FULL], "handed on once, not at every read"


def test_a_content_that_goes_back_or_cannot_be_read_is_no_change() -> None:
    assert contents_handed_on([OLD, b"", b"", OLD, OLD, OLD, OLD, OLD]) == []
    assert contents_handed_on([OLD, FULL, FULL, None, FULL, FULL, FULL]) == [], "an unreadable moment restarts"
    assert contents_handed_on([OLD, FULL, FULL, None, FULL, FULL, FULL, FULL]) == [FULL]
    assert contents_handed_on([OLD, FULL, FULL, FULL, FULL, OLD, OLD, OLD, OLD]) == [FULL, OLD]


def test_the_watch_compares_the_file_with_the_content_in_force_not_with_its_first_read() -> None:
    """A worker started again (or a file changed between the start's read and the watch's) took the file as it
    found it for the content in force, and never applied it."""
    assert contents_handed_on([FULL, FULL, FULL, FULL, FULL], in_force=OLD) == [FULL]
    assert contents_handed_on([OLD, OLD, OLD, OLD, OLD], in_force=OLD) == []


def test_a_settle_shorter_than_the_poll_still_needs_two_reads() -> None:
    assert contents_handed_on([OLD, FULL], every=1.0, settle=0.1) == []
    assert contents_handed_on([OLD, FULL, FULL], every=1.0, settle=0.1) == [FULL]


# -- a file read half-written: every byte prefix of it, applied as a reload ----------------------------------------
H = [hashlib.sha256(f"sk-{n}".encode()).hexdigest() for n in ("ops", "batch", "team", "lim", "new")]
# block style, each key's hash before its restrictions (the order a cut hurts most), negative priorities (a cut
# of -100 is -10), lists in both styles, a band and the default priority of the operator's own
KEYED = f"""\
server: {{port: 8000, admin_port: 9001}}
backends:
  - {{name: v1, engine: vllm, url: "http://127.0.0.1:48101", models: [m1], max_concurrency: 4}}
admission:
  default_priority: bulk
  bands:
    critical: {{priority: 100}}
    standard: {{priority: 0}}
    bulk: {{priority: -100, max_saturation: 0.5}}
limits: {{max_tokens: 64}}
auth:
  protect_metrics: true
  protect_health: true
  reserve_tokens: 8000
  keys:
    - name: ops
      key_sha256: {H[0]}
      scopes: [admin, metrics]
    - name: batch
      key_sha256: {H[1]}
      tokens_per_minute: 20000
      priority: -100
      max_priority: -100
      weight: 0.15
      max_in_flight: 12
    - name: team
      key_sha256: {H[2]}
      models:
        - llama-3-8b-instruct
        - m1
      scopes:
        - inference
      requests_per_minute: 600
      priority: standard
    - name: lim
      key_sha256: {H[3]}
      requests_per_minute: 30
      max_in_flight: 2
"""
NEW_KEY = f"""\
    - name: new
      key_sha256: {H[4]}
      models: [m1]
      requests_per_minute: 5
"""


def reload_of(running: Settings, content: bytes) -> Settings | None:
    """The settings a reload of ``content`` would apply over ``running``, or None when it is refused."""
    try:
        new = parse_settings(content, "gateway.yaml")
        check_reload(running, new)
    except ConfigError:
        return None
    return new


def at_a_line_end(full: str, n: int) -> bool:
    """Whether a cut of ``full`` after ``n`` characters falls between lines' contents: at a line's start (or in
    its indentation), or after its last value (at most blanks and a comment left of it)."""
    rest_of_line = full[n:].split("\n", 1)[0].strip()
    return not full[:n].rsplit("\n", 1)[-1].strip() or not rest_of_line or rest_of_line.startswith("#")


def restrictions(settings: Settings) -> dict[str, tuple[Any, ...]]:
    """Per key, what it may do: models, scopes, limits, effective priority and ceiling, weight."""
    out = {}
    for key in settings.auth.keys:
        admission = settings.admission
        own = admission.priority_of(key.priority if key.priority is not None else admission.default_priority)
        ceiling = admission.priority_of(key.max_priority) if key.max_priority is not None else own
        out[key.name] = (set(key.models), set(key.scopes), key.requests_per_minute, key.tokens_per_minute,
                         key.max_in_flight, own, ceiling, key.weight)
    return out


def no_wider(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    models, scopes, *limits, own, ceiling, weight = before
    new_models, new_scopes, *new_limits, new_own, new_ceiling, new_weight = after
    return (new_models <= models and new_scopes <= scopes and new_own <= own and new_ceiling <= ceiling
            and new_weight <= weight and all(old is None or (new is not None and new <= old)
                                             for old, new in zip(limits, new_limits, strict=True)))


def test_no_prefix_of_a_keyed_file_widens_a_key_or_opens_the_gateway() -> None:
    """The sweep cut the file at every byte and applied each prefix as the watch would: a cut right after
    ``requests_per_minute:`` (YAML reads the empty value at the end as null) lifted the limit, a cut inside
    ``priority: -100`` raised it to -10 or -1, and a cut before ``priority``, ``max_priority`` or ``weight``
    set them back to their defaults. Now no prefix a reload takes lifts a limit, allows a model, adds a scope,
    raises a priority or share, turns a protection off or opens the gateway."""
    running = parse_settings(KEYED.encode(), "gateway.yaml")
    before = restrictions(running)
    taken = 0
    for n in range(len(KEYED)):
        new = reload_of(running, KEYED[:n].encode())
        if new is None:
            continue
        taken += 1
        assert at_a_line_end(KEYED, n), f"a cut inside a line was taken for a file: {KEYED[n - 40:n]!r}"
        assert new.auth.keys and not new.auth.open and new.auth.protect_metrics and new.auth.protect_health
        assert new.auth.reserve_tokens == running.auth.reserve_tokens
        assert new.limits == running.limits and new.admission == running.admission
        after = restrictions(new)
        assert after.keys() <= before.keys()
        for name, what in after.items():
            assert no_wider(before[name], what), (name, before[name], what, KEYED[n - 60:n])
    assert taken > 0  # (cuts inside the key list, at a line's end, narrow: they are taken)
    assert reload_of(running, KEYED.encode()) is not None


def test_a_cut_that_ends_on_an_empty_value_or_inside_one_is_refused_naming_it() -> None:
    running = parse_settings(KEYED.encode(), "gateway.yaml")
    lim = KEYED.index("requests_per_minute: 30")
    with pytest.raises(ConfigError, match=r"'requests_per_minute' at line \d+ has no value.*write null"):
        parse_settings(KEYED[:lim + len("requests_per_minute:")].encode(), "gateway.yaml")
    batch_priority = KEYED.index("      priority: -100")
    with pytest.raises(ConfigError, match=r"ends inside a value .* end the file with a line break"):
        parse_settings(KEYED[:batch_priority + len("      priority: -10")].encode(), "gateway.yaml")
    # written on purpose, null is null: the limit is lifted
    lifted = reload_of(running, KEYED.replace("requests_per_minute: 30", "requests_per_minute: null").encode())
    assert lifted is not None and restrictions(lifted)["lim"][2] is None
    # and an empty value inside the file (not at its end) is refused as well: read as YAML's null it lifted the
    # limit, what a template's missing variable does (sweep 28)
    inside = KEYED.replace("      requests_per_minute: 30\n", "      requests_per_minute:\n")
    with pytest.raises(ConfigError, match=r"'requests_per_minute' at line \d+ has no value"):
        parse_settings(inside.encode(), "gateway.yaml")


@pytest.mark.parametrize("field", ["priority", "max_priority", "weight"])
def test_a_kept_keys_priority_ceiling_and_share_are_not_reset_by_leaving_them_out(field: str) -> None:
    running = parse_settings(KEYED.encode(), "gateway.yaml")
    lines = [line for line in KEYED.splitlines(keepends=True) if not line.startswith(f"      {field}: ")
             or ("-100" not in line and "0.15" not in line)]
    with pytest.raises(ConfigError, match=rf"auth.keys \(batch\).{field}: left out of the file"):
        check_reload(running, parse_settings("".join(lines).encode(), "gateway.yaml"))


def test_the_limits_and_admission_in_force_are_not_reset_by_leaving_them_out() -> None:
    """A file cut before its last sections set limits.max_tokens 64 back to 131072, max_n 1 to 128 and the
    queue's size 8 to 1024."""
    running = parse_settings(KEYED.encode(), "gateway.yaml")
    without = KEYED.replace("limits: {max_tokens: 64}\n", "")
    with pytest.raises(ConfigError, match=r"limits.max_tokens: left out of the file, which would set it back to "
                                          r"its default 131072"):
        check_reload(running, parse_settings(without.encode(), "gateway.yaml"))
    reset = KEYED.replace("limits: {max_tokens: 64}", "limits: {max_tokens: 131072}")  # (said: it is reset)
    assert reload_of(running, reset.encode()) is not None


def test_the_default_priority_and_bands_are_not_reset_by_leaving_them_out() -> None:
    running = parse_settings(KEYED.encode(), "gateway.yaml")
    bands = KEYED[KEYED.index("  bands:\n"):KEYED.index("auth:\n")]
    for text, field in ((KEYED.replace("  default_priority: bulk\n", ""), "default_priority"),
                        (KEYED.replace(bands, "").replace("default_priority: bulk", "default_priority: standard"),
                         "bands")):
        with pytest.raises(ConfigError, match=rf"admission.{field}: left out of the file"):
            check_reload(running, parse_settings(text.encode(), "gateway.yaml"))


def test_a_new_key_cut_inside_its_entry_is_refused_unless_the_cut_falls_at_a_line_end() -> None:
    """What stays undetectable (docs/operating.md): a new key cut at a line's end after its hash has the
    defaults for what it lost (every model, no limit) but never a scope it was not written with."""
    running = parse_settings(KEYED.encode(), "gateway.yaml")
    full = KEYED + NEW_KEY
    added = []
    for n in range(len(KEYED), len(full) + 1):
        new = reload_of(running, full[:n].encode())
        if new is None or "new" not in {k.name for k in new.auth.keys}:
            continue
        added.append(n)
        assert at_a_line_end(full, n), f"a cut inside a line added the key: {full[n - 40:n]!r}"
        key = next(k for k in new.auth.keys if k.name == "new")
        assert key.scopes == ["inference"]
    assert added and added[-1] == len(full)


def test_a_reload_keeps_an_admin_key_while_the_admin_listener_is_on_the_network() -> None:
    on_network = KEYED.replace("admin_port: 9001}", "admin_port: 9001, admin_host: 0.0.0.0}")
    running = parse_settings(on_network.encode(), "gateway.yaml")
    no_admin = on_network.replace("scopes: [admin, metrics]", "scopes: [metrics]")
    with pytest.raises(ConfigError, match=r"the admin listener on 0\.0\.0\.0 can be reached from other machines"):
        parse_settings(no_admin.encode(), "gateway.yaml")
    # the server section is restart-only: a file moving the listener home does not move the one that runs
    moved = no_admin.replace("admin_host: 0.0.0.0", "admin_host: 127.0.0.1")
    with pytest.raises(ConfigError, match=r"the admin listener on 0\.0\.0\.0 can be reached from other machines"):
        check_reload(running, parse_settings(moved.encode(), "gateway.yaml"))
    check_reload(running, parse_settings(on_network.encode(), "gateway.yaml"))


# -- changes one at a time, in the order asked ------------------------------------------------------------------
class Turns(asyncio.Lock):
    """The control plane's lock for changes, saying when one has had to wait for its turn."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    async def acquire(self) -> bool:
        if self.locked():
            self.waiting.set()
        return await super().acquire()


class Applier:
    """The composition root's ``reconfigure`` as the control plane sees it: what it applies becomes the settings
    in force; ``hold``: the next change waits for it (a slow one: a new backend probed)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.applied: list[Settings] = []
        self.landed = asyncio.Event()
        self.holding = asyncio.Event()
        self.hold: asyncio.Event | None = None

    async def __call__(self, new: Settings) -> dict[str, Any]:
        hold, self.hold = self.hold, None
        if hold is not None:
            self.holding.set()
            await hold.wait()
        self.settings = new
        self.applied.append(new)
        self.landed.set()
        return {"added": [], "removed": [], "changed": [], "sections": [], "restart_needed": []}


def control_plane(path: Path, applier: Applier) -> tuple[ControlPlane, Turns]:
    settings = applier.settings
    control = ControlPlane(lambda: applier.settings, Pool([], settings.scrape), Admission(settings.admission), None,
                           CollectorRegistry(), apply=applier, config_path=str(path),
                           config_content=path.read_bytes())
    turns = control._changing = Turns()  # (the test waits for the event it needs: a change waiting its turn)
    return control, turns


async def first_of(*waits: Awaitable[Any]) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()


def names(settings: Settings) -> set[str]:
    return {key.name for key in settings.auth.keys}


def test_a_slow_reload_asked_first_never_lands_after_a_newer_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload parsing a large file (or reading a slow disk) took longer than one asked after it, which read the
    file with key ``lim`` revoked and applied it; the slow one landed last and brought ``lim`` back. Now the
    second reads the file when the first is done, and what is in force at the end is the file as last written."""
    path = tmp_path / "gateway.yaml"
    path.write_text(KEYED)
    revoked = KEYED[:KEYED.index("    - name: lim\n")]
    parsing, release = threading.Event(), threading.Event()

    def slow_parse(content: bytes, source: str) -> Settings:
        if b"name: lim" in content:  # (the first reading: held until the second has landed or waits its turn)
            parsing.set()
            release.wait(10.0)
        return parse_settings(content, source)

    monkeypatch.setattr(gateway.control, "parse_settings", slow_parse)

    async def run() -> Applier:
        applier = Applier(parse_settings(KEYED.encode(), "gateway.yaml"))
        control, turns = control_plane(path, applier)
        first = asyncio.create_task(control.reload("the admin API (first)"))
        await asyncio.to_thread(parsing.wait, 10.0)
        path.write_text(revoked)
        applier.landed.clear()
        second = asyncio.create_task(control.reload("the admin API (second)"))
        await first_of(applier.landed.wait(), turns.waiting.wait())
        release.set()
        await asyncio.gather(first, second)
        return applier

    applier = asyncio.run(run())
    assert [names(s) for s in applier.applied] == [{"ops", "batch", "team", "lim"}, {"ops", "batch", "team"}]
    assert "lim" not in names(applier.settings)


def test_admin_changes_made_together_apply_one_after_the_other(tmp_path: Path) -> None:
    """A backend added (its probe takes a while) and the routing policy changed meanwhile: each was worked out
    from the configuration before either, so the one applied last took the other's change back. Now both hold."""
    path = tmp_path / "gateway.yaml"
    path.write_text(KEYED)

    async def run() -> Settings:
        applier = Applier(parse_settings(KEYED.encode(), "gateway.yaml"))
        control, turns = control_plane(path, applier)
        probing = applier.hold = asyncio.Event()
        added = asyncio.create_task(control.add_backend(
            {"name": "v2", "engine": "vllm", "url": "http://127.0.0.1:48102", "models": ["m1"]}, "ops", tell=False))
        await applier.holding.wait()
        routed = asyncio.create_task(control.set_routing({"policy": "round-robin"}, "ops", tell=False))
        await first_of(applier.landed.wait(), turns.waiting.wait())
        probing.set()
        await asyncio.gather(added, routed)
        return applier.settings

    settings = asyncio.run(run())
    assert [b.name for b in settings.backends] == ["v1", "v2"]
    assert settings.routing.policy == "round-robin"


def test_sighups_meanwhile_read_the_file_once_more_and_an_older_reading_is_not_applied(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(KEYED)
    revoked = KEYED[:KEYED.index("    - name: lim\n")]

    async def run() -> Applier:
        applier = Applier(parse_settings(KEYED.encode(), "gateway.yaml"))
        control, turns = control_plane(path, applier)
        await control.start()
        try:
            held = applier.hold = asyncio.Event()
            first = asyncio.create_task(control.reload("the admin API"))
            await applier.holding.wait()
            for _ in range(10):
                control.request_reload("SIGHUP")
            await first_of(applier.landed.wait(), turns.waiting.wait())
            held.set()
            await first
            # (a change asked now runs after the SIGHUPs' reload: the lock is fair; that reload may be reading the
            # file already, so it is replaced whole, not rewritten in place under it)
            (tmp_path / "next.yaml").write_text(revoked)
            (tmp_path / "next.yaml").replace(path)
            watched_before = time.monotonic()
            await control.reload("the admin API (again)")
            await control.reload("file watch", content=KEYED.encode(), read_at=watched_before)
        finally:
            await control.stop()
        return applier

    applier = asyncio.run(run())
    assert len(applier.applied) == 3  # the first, one for ten SIGHUPs, the second; not the watch's older reading
    assert "lim" not in names(applier.settings)


# -- a key removed by a cut file, then brought back by a later reading of it --------------------------------------
def test_a_key_a_cut_file_removed_comes_back_only_as_it_was_and_with_its_budget_spent(tmp_path: Path) -> None:
    """The file read half-written twice: first cut before key ``lim`` (valid, ``lim`` just removed), then cut
    right after ``lim``'s ``key_sha256`` line. The second reading re-added ``lim`` as a new key, with no limit
    and a full bucket. Now a key that comes back is held to what it had when it was in force, by name or by
    hash, and takes back its buckets (a debt with them); what the operator writes (``null``) still applies."""
    path = tmp_path / "gateway.yaml"
    path.write_text(KEYED)
    without = KEYED[:KEYED.index("    - name: lim\n")]
    bare = KEYED[:KEYED.index("      requests_per_minute: 30\n")]
    assert bare.endswith(f"key_sha256: {H[3]}\n")
    lim = {"authorization": b"Bearer sk-lim"}

    async def run() -> None:
        gw = Gateway(parse_settings(KEYED.encode(), "gateway.yaml"), config_path=str(path),
                     config_content=KEYED.encode())
        client = gw.keys.authenticate(lim["authorization"], None)
        assert client is not None
        for _ in range(30):  # (its 30 requests a minute, spent)
            gw.keys.admit(client, "m1")
        with pytest.raises(GatewayError, match="Rate limit reached"):
            gw.keys.admit(client, "m1")

        path.write_text(without)
        await gw.control.reload("file watch")
        assert "lim" not in names(gw.settings)
        with pytest.raises(GatewayError, match="Incorrect API key"):
            gw.keys.authenticate(lim["authorization"], None)

        path.write_text(bare)
        with pytest.raises(GatewayError, match=r"auth.keys \(lim\).requests_per_minute: left out of the file, which "
                                               r"would change it from 30 \(as it had when 'lim' was in force before\)"):
            await gw.control.reload("file watch")
        renamed = bare.replace("name: lim", "name: lim2")  # (its hash, under another name)
        path.write_text(renamed)
        with pytest.raises(GatewayError, match=r"auth.keys \(lim2\).requests_per_minute: left out"):
            await gw.control.reload("file watch")
        assert "lim" not in names(gw.settings) and "lim2" not in names(gw.settings)

        path.write_text(KEYED)  # (the whole file: back as it was, its budget still spent)
        await gw.control.reload("file watch")
        back = gw.keys.authenticate(lim["authorization"], None)
        assert back is not None and back.settings.requests_per_minute == 30
        with pytest.raises(GatewayError, match="Rate limit reached"):
            gw.keys.admit(back, "m1")

        path.write_text(without)
        await gw.control.reload("file watch")
        lifted = bare + "      requests_per_minute: null\n      max_in_flight: null\n"
        path.write_text(lifted)  # (written on purpose: the limits are lifted)
        await gw.control.reload("file watch")
        free = gw.keys.authenticate(lim["authorization"], None)
        assert free is not None and free.settings.requests_per_minute is None
        gw.keys.admit(free, "m1")
        await gw.control.stop()

    asyncio.run(run())


def test_the_keys_remembered_are_bounded() -> None:
    keys = [parse_settings(f"auth: {{keys: [{{name: k{n}, key_sha256: {hashlib.sha256(str(n).encode()).hexdigest()}, "
                           f"requests_per_minute: 5}}]}}\n".encode(), "gateway.yaml").auth.keys[0] for n in range(4)]
    known = KnownKeys(keys[:1], removed=2)
    for key in keys[1:]:
        known.saw([key])
    assert [known.last(k) is not None for k in keys] == [False, True, True, True]
    store = KeyStore(AuthSettings(keys=keys[:1]), removed=2)
    for key in keys[1:]:
        store.update(AuthSettings(keys=[key]))
    assert len(store._gone) == 2
