"""A Redis password in ``state.url``, as userinfo or as ``?password=``, reaches neither ``GET /admin/config`` nor
the log (security sweep, item 2: the query form was shown, and either form was logged at INFO on every
connect)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from tests.conftest import free_port, serve_in_thread
from tests.state.conftest import RedisServer
from tests.waiting import wait_until

pytestmark = pytest.mark.system

PASSWORD = "hunter2-0b5e7c"
OPS_KEY = "sk-ops-4567"


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_a_redis_password_is_neither_shown_nor_logged(tmp_path: Path, form: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    redis = RedisServer(free_port(), tmp_path, password=PASSWORD).start()
    try:
        url = (f"redis://:{PASSWORD}@127.0.0.1:{redis.port}/0" if form == "userinfo"
               else f"redis://127.0.0.1:{redis.port}/0?password={PASSWORD}")
        settings = settings_from_mapping({
            "state": {"url": url, "heartbeat_seconds": 0.1},
            "auth": {"keys": [{"name": "ops", "key_sha256": hashlib.sha256(OPS_KEY.encode()).hexdigest(),
                               "scopes": ["admin"]}]}})
        app = create_app(settings)
        caplog.set_level(logging.INFO, logger="gateway")
        with serve_in_thread(app) as gateway:
            shared = app.gateway.shared
            assert shared is not None
            # (connected with the password: else Redis answers NOAUTH)
            wait_until(lambda: shared.up, "the password-protected Redis reached")
            shown = httpx.get(gateway.url + "/admin/config", headers={"authorization": f"Bearer {OPS_KEY}"})
        assert shown.status_code == 200
        assert PASSWORD not in shown.text and "[redacted]" in shown.json()["state"]["url"]
        connected = [r.getMessage() for r in caplog.records if "reachable at" in r.getMessage()]
        assert connected, "the connect line is logged"
        assert all(PASSWORD not in line and "[redacted]" in line for line in connected), connected
        assert not any(PASSWORD in r.getMessage() for r in caplog.records)
    finally:
        redis.kill()
