"""Configuration: YAML + environment, and errors that name the field at fault."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

import pytest

from gateway.cli import main
from gateway.config import ConfigError, load_settings
from gateway.config_file import MAX_CONFIG_BYTES, MAX_CONFIG_NODES, read_config_settled

pytestmark = pytest.mark.unit

GOOD = """
server: {host: 0.0.0.0, port: 8080}
backends:
  - {name: llama-a, engine: llamacpp, url: "http://10.0.0.1:8080/", max_concurrency: 2}
  - {name: vllm-a, engine: vllm, url: "http://10.0.0.2:8000", models: [llama-3-8b], api_key_env: VLLM_KEY}
routing: {policy: round-robin}
timeouts: {connect: 2, first_byte: 30, idle: 10, total: 300}
"""


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_good_file_with_environment_overrides(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KEY", "sk-secret")
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "9000")
    monkeypatch.setenv("GATEWAY_TIMEOUTS__IDLE", "5")
    settings = load_settings(write(tmp_path, GOOD))
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", 9000)
    assert settings.timeouts.idle == 5 and settings.timeouts.total == 300
    llama, vllm = settings.backends
    assert llama.url == "http://10.0.0.1:8080" and llama.models is None and llama.max_concurrency == 2
    assert vllm.resolved_api_key() == "sk-secret" and "sk-secret" not in repr(settings)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("backends: [{name: a, engine: vlm, url: 'http://x'}]",
         "backends[0] (a).engine: unknown engine 'vlm'; known: llamacpp, vllm"),
        ("backends: [{name: a, engine: vllm, url: 'x:80'}]", "backends[0] (a).url: must start with http://"),
        ("backends: [{name: a, engine: vllm, url: 'http://x', max_concurrency: 0}]",
         "backends[0] (a).max_concurrency: Input should be greater than 0"),
        ("backends: [{name: a, engine: vllm, url: 'http://x', api_key_env: NOT_SET_ANYWHERE}]",
         "environment variable NOT_SET_ANYWHERE is not set"),
        ("backends: [{name: a, engine: vllm, url: 'http://x'}, {name: a, engine: sglang, url: 'http://y'}]",
         "duplicate backend name 'a'"),
        ("timeouts: {connect: -1}", "timeouts.connect: Input should be greater than 0"),
        ("servr: {port: 1}", "servr: Extra inputs are not permitted"),
        ("backends: {name: a}", "backends: Input should be a valid list"),
        ("- just\n- a list", "the top level must be a mapping"),
        ("backends: [unclosed", "is not valid YAML"),
        # a key's name is what a reload keeps it by: two of one name were merged, the limited key taking the
        # other's admin scope (and one key under two names was either)
        (f"auth: {{keys: [{{name: t, key_sha256: '{'a' * 64}', requests_per_minute: 2}}, "
         f"{{name: t, key_sha256: '{'b' * 64}', scopes: [admin]}}]}}", "auth: keys: two keys are named 't'"),
        (f"auth: {{keys: [{{name: t, key_sha256: '{'a' * 64}'}}, {{name: u, key_sha256: '{'a' * 64}'}}]}}",
         "'t' and 'u' are the same key"),
        # YAML keeps the second of two equal keys silently: the first auth section, and its keys, were gone
        ("auth: {keys: []}\nbackends: []\nauth: {open: true}\n",
         "'auth' is written twice in one mapping (lines 1 and 3)"),
        ("backends:\n  - name: a\n    engine: vllm\n    url: http://x\n    url: http://y\n",
         "'url' is written twice in one mapping (lines 4 and 5)"),
        # a session's header value is kept, published to every replica and may be logged: never a credential
        ("routing: {session_header: Authorization}", "routing.session_header: 'Authorization' carries credentials"),
        # sweep 28: an empty value in the middle (a template's missing variable) read as null, "none": a key's limit
        # lifted, a replica started without the fleet's Redis
        ("auth:\n  keys:\n    - name: a\n      key_sha256: " + "a" * 64 + "\n      max_in_flight:\n      models: [m]\n",
         "'max_in_flight' at line 5 has no value (what a file cut there, or a template's missing variable"),
        ("state:\n  url:\n  on_failure: closed\n", "'url' at line 2 has no value"),
        # sweep 27: other gateways' and proxies' names for theirs passed
        *((f"routing: {{session_header: {name}}}", f"routing.session_header: '{name}' carries credentials")
          for name in ("x-litellm-key", "x-passwd", "x-credential", "x-jwt", "x-bearer", "x-client-cert", "x-pass",
                       "x-pwd", "x-hmac", "x-otp", "x-sig", "x-psk", "x-amzn-oidc-data", "x-ms-client-principal")),
        # sweep 25: a KV-event endpoint without a port passed, and never connected
        ("backends:\n  - name: v\n    engine: vllm\n    url: http://x:8000\n    kv_events: {endpoint: 'tcp://h'}\n",
         "endpoint must be tcp://host:port"),
        # sweep 24: passed, then `gateway serve` stopped with "Invalid IPv6 URL" (redis-py), naming no field
        ("state: {url: 'redis://:Sup3r[Secret@127.0.0.1:6379/0'}", "state.url: not a URL Redis's client can read"),
        # sweep 30: passed check-config, then every worker exited on its first connection, again and again
        ("state: {url: 'redis://127.0.0.1:6379/0?foo=1'}", "state.url: Redis's client does not take this URL: "
                                                         "unexpected keyword argument 'foo'"),
        ("state: {url: 'redis://:s3cret@127.0.0.1:6379/0?socket_timeout=soon'}",
         "state.url: Redis's client does not take this URL: Invalid value for 'socket_timeout'"),
    ],
)
def test_bad_files_name_the_field(tmp_path: pathlib.Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text))
    assert expected in str(err.value) and "Sup3r" not in str(err.value)


def test_check_config_command(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KEY", "k")
    assert main(["check-config", str(write(tmp_path, GOOD))]) == 0
    assert "llama-a (llamacpp), vllm-a (vllm)" in capsys.readouterr().out
    bad = write(tmp_path, "routing: {policy: fastest}")
    assert main(["check-config", str(bad)]) == 2
    assert "routing.policy: unknown policy 'fastest'" in capsys.readouterr().err
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.parametrize("text", ["", "\n  \n", "# gateway.yaml, being written\n   # by a templating tool\n", "---\n"])
def test_an_empty_file_is_refused_not_read_as_every_default(tmp_path: pathlib.Path, text: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An empty file (or one of comments only) is what a file being rewritten reads as at first: no keys, no
    backends. It was a valid configuration; ``{}`` still says "every default" on purpose."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="is empty") as err:
        load_settings(path)
    assert "(for every default, write {})" in str(err.value)  # (it said {{}})
    assert main(["check-config", str(path)]) == 2
    assert "is empty" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["auth: {keys: []}\n", "auth: {}\n", "auth:\n  protect_metrics: true\n"])
def test_an_auth_section_without_keys_must_say_open(tmp_path: pathlib.Path, text: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Sweep 30: a template whose list of secrets was missing left auth: {keys: []}; every reload refused it, but
    check-config called it OK and a start from it served anyone."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="lists no API keys"):
        load_settings(path)
    assert main(["check-config", str(path)]) == 2
    assert "say auth: {open: true}" in capsys.readouterr().err
    assert load_settings(write(tmp_path, "auth: {open: true}\n")).auth.open
    assert not load_settings(write(tmp_path, "{}\n")).auth.keys, "no auth section: no keys, as ever"


@pytest.mark.system
def test_gateway_serve_refuses_an_empty_configuration_file(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "# nothing here yet\n")
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", "0"],
                            capture_output=True, text=True, timeout=30)  # (it served, open, before)
    assert result.returncode == 2 and "is empty" in result.stderr, result.stderr[-2000:]


@pytest.mark.system
def test_console_script_entry_point_runs(tmp_path: pathlib.Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(write(tmp_path, "{}"))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "backends: none" in result.stdout


SECRET = "sk-live-7f3a9c0e5b1d4e2f8a6c"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (f"backends:\n  - name: a\n    api_key: {SECRET}: oops\n", "mapping values are not allowed here at line 3"),
        (f'auth:\n  keys:\n    - {{name: a, key: "{SECRET}}}\n', "(while scanning a quoted scalar at line 3"),
        (f"backends:\n  - name: a\n    api_key: !{SECRET}\n", "the tag '...' at line 3, column 14"),
        (f"backends:\n  - name: a\n    api_key: *{SECRET}\n", "found undefined alias '...' at line 3"),
        (f"backends:\n  - name: a\n    api_key: !!bool {SECRET}\n", "does not fit its explicit !! tag"),
        ("backends: [unclosed", "expected ',' or ']', but got '<stream end>' at line 1, column 20"),
    ],
)
def test_yaml_errors_say_where_but_never_echo_the_document(tmp_path: pathlib.Path, text: str, where: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    message = str(err.value)
    assert f"{path} is not valid YAML: " in message and where in message
    assert SECRET not in message and "name: a" not in message and "sk-" not in message
    assert main(["check-config", str(path)]) == 2
    printed = capsys.readouterr()
    assert "not valid YAML" in printed.err and SECRET not in printed.out + printed.err


def test_a_bare_off_in_yaml_is_off_not_an_error(tmp_path: pathlib.Path) -> None:
    """The docs write `validate_outputs: off`; YAML 1.1 reads a bare off as false, which was refused."""
    path = tmp_path / "gateway.yaml"
    path.write_text("backends: [{name: a, engine: vllm, url: 'http://127.0.0.1:9'}]\n"
                    "structured_output: {validate_outputs: off, models: {m: off, n: mark}}\n")
    settings = load_settings(str(path)).structured_output
    assert settings.validate_outputs == "off" and settings.models == {"m": "off", "n": "mark"}
    path.write_text("backends: [{name: a, engine: vllm, url: 'http://127.0.0.1:9'}]\n"
                    "structured_output: {validate_outputs: on}\n")
    with pytest.raises(ConfigError):
        load_settings(str(path))


def test_check_config_names_a_key_written_twice_and_a_merge_still_overrides(tmp_path: pathlib.Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "routing: {policy: round-robin}\ntimeouts: {connect: 2}\nrouting: {policy: default}\n")
    assert main(["check-config", str(path)]) == 2
    assert "'routing' is written twice in one mapping (lines 1 and 3)" in capsys.readouterr().err
    # a merge key's values are overridden by the keys beside it, on purpose: no duplicate
    merged = write(tmp_path, "timeouts:\n  <<: {connect: 2, idle: 5}\n  connect: 3\n")
    assert load_settings(merged).timeouts.connect == 3


@pytest.mark.timeout(60)
def test_only_a_regular_file_of_bounded_size_is_read(tmp_path: pathlib.Path) -> None:
    """The path swapped for /dev/zero was read until the process held gigabytes; for a FIFO, the read waited
    for a writer forever (every later reload with it)."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero, tmp_path):
        with pytest.raises(ConfigError, match="not a regular file"):
            load_settings(path)
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as file:
        file.truncate(MAX_CONFIG_BYTES + 1)  # (sparse: no disk used)
    with pytest.raises(ConfigError, match="more than the 1048576 bytes"):
        load_settings(huge)
    linked = tmp_path / "linked.yaml"  # a ConfigMap volume's file is a link to a regular file: read as before
    linked.symlink_to(write(tmp_path, "routing: {policy: round-robin}\n"))
    assert load_settings(linked).routing.policy == "round-robin"


def test_an_admin_listener_reachable_from_other_machines_needs_an_admin_key(tmp_path: pathlib.Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Without a key of the admin scope the admin listener asks for none: on 0.0.0.0 it was open to the network
    (drains, reloads, backends added at an address of the caller's choice)."""
    client = f"{{name: c, key_sha256: '{'c' * 64}'}}"
    ops = f"{{name: ops, key_sha256: '{'d' * 64}', scopes: [admin]}}"
    for host in ("0.0.0.0", "10.0.0.7", "::", "gateway.internal"):
        path = write(tmp_path, f"server: {{admin_port: 9001, admin_host: '{host}'}}\nauth: {{keys: [{client}]}}\n")
        assert main(["check-config", str(path)]) == 2
        assert (f"server.admin_host: the admin listener on {host} can be reached from other machines, and no API "
                "key has the 'admin' scope") in capsys.readouterr().err
        path.write_text(f"server: {{admin_port: 9001, admin_host: '{host}'}}\nauth: {{keys: [{client}, {ops}]}}\n")
        assert load_settings(path).server.admin_host == host
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):  # loopback: trusted by address, as before
        assert load_settings(write(tmp_path, f"server: {{admin_port: 9001, admin_host: '{host}'}}\n"))
    assert load_settings(write(tmp_path, "server: {admin_host: 0.0.0.0}\n"))  # (no admin listener)


def largest_realistic(backends: int = 500, keys: int = 2000) -> str:
    """Hundreds of backends and thousands of keys, every field written out, one per line."""
    lines = ["server: {host: 0.0.0.0, port: 8000, admin_port: 9001}", "backends:"]
    for i in range(backends):
        lines += [f"  - name: vllm-{i:04d}", "    engine: vllm", f"    url: http://10.0.{i // 250}.{i % 250}:8000",
                  "    max_concurrency: 64", "    models: [llama-3.1-8b-instruct, llama-3.1-70b-instruct]"]
    lines += ["auth:", "  keys:"]
    for i in range(keys):
        lines += [f"    - name: team-{i:05d}", '      models: ["llama-*", "mistral-*"]',
                  "      requests_per_minute: 600", "      tokens_per_minute: 200000", "      max_in_flight: 32",
                  "      scopes: [inference]",
                  f"      key_sha256: {hashlib.sha256(str(i).encode()).hexdigest()}"]
    return "\n".join(lines) + "\n"


def test_what_reading_a_configuration_may_cost_is_bounded(tmp_path: pathlib.Path) -> None:
    """A 15.5 MB YAML list, within the old 16 MiB cap, took 29 s and 770 MB to parse; reloaded in a serving
    gateway it raised the requests' p50 from 4 to 42 ms. A file is now at most 1 MiB and 100,000 YAML nodes,
    refused at the first node past the bound (before the document is built), and the largest realistic
    configuration is well within both."""
    realistic = largest_realistic()
    assert len(realistic) < MAX_CONFIG_BYTES
    settings = load_settings(write(tmp_path, realistic))
    assert (len(settings.backends), len(settings.auth.keys)) == (500, 2000)
    # 1.4 MB: refused on its size, unread
    with pytest.raises(ConfigError, match=r"bytes, more than the 1048576 bytes a configuration may have"):
        load_settings(write(tmp_path, largest_realistic(1000, 5000)))
    # 300 KB of one flow list: refused at its 100,001st node, whatever the field
    with pytest.raises(ConfigError, match=rf"more than {MAX_CONFIG_NODES} YAML nodes"):
        load_settings(write(tmp_path, "backends: [" + "x, " * 150_000 + "x]\n"))
    with pytest.raises(ConfigError, match=rf"more than {MAX_CONFIG_NODES} YAML nodes"):
        load_settings(write(tmp_path, "a:\n" + "- 1\n" * 150_000))


def test_a_control_character_in_the_file_is_a_yaml_error_naming_where_not_a_crash(tmp_path: pathlib.Path) -> None:
    """PyYAML's reader refuses a control character before parsing, with an error of its own that was not taken
    for invalid YAML: check-config and a reload failed with a traceback."""
    path = write(tmp_path, "routing: {policy: round-robin}\ntimeouts: {connect: 2\x01}\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: a character YAML does not allow \(#x0001\) at "
                                          r"character 53"):
        load_settings(path)
    assert main(["check-config", str(path)]) == 2


def test_a_start_reads_a_file_being_rewritten_once_it_has_held_still(tmp_path: pathlib.Path) -> None:
    """Sweep 27: a file read at start while rewritten in place gave a prefix (cut before auth:, an open gateway). A
    file modified within the settle time is read again until it has held still that long; one that keeps changing
    is refused; one written earlier is read at once."""
    path = tmp_path / "gateway.yaml"
    whole = b"server: {port: 8080}\nauth:\n  keys: []\n"
    clock = [1.7e9]
    writes = [(clock[0] + 1.5, whole)]  # the writer's second half, 1.5 s after its first
    path.write_bytes(whole[:20])
    os.utime(path, (clock[0], clock[0]))
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds
        while writes and writes[0][0] <= clock[0]:
            at, content = writes.pop(0)
            path.write_bytes(content)
            os.utime(path, (at, at))

    assert read_config_settled(path, 2.0, now=lambda: clock[0], sleep=sleep) == whole
    assert sum(slept) >= 3.5, slept  # (2 s after the last write)
    slept.clear()
    assert read_config_settled(path, 2.0, now=lambda: clock[0], sleep=sleep) == whole and slept == []
    # a file that never holds still is refused
    writes.extend((clock[0] + 0.5 * i, b"server: {port: %d}\n" % i) for i in range(1, 200))
    path.write_bytes(b"server: {}\n")
    os.utime(path, (clock[0], clock[0]))
    with pytest.raises(ConfigError, match="kept changing for 30 s"):
        read_config_settled(path, 2.0, 30.0, now=lambda: clock[0], sleep=sleep)
