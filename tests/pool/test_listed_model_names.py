"""What an engine lists as its models reaches clients (``/v1/models``), metrics labels, logs and the
``x-gateway-model`` header: a name holding the backend's own credentials (an engine echoing the Authorization
header it was sent) or a line break is not served. Sweep 8 found the first listed to every key, in 48 metric
lines and the access log; the second broke every answer naming it (an empty reply, "Invalid HTTP header value")."""

from __future__ import annotations

import httpx
import orjson

from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over
from tests.waiting import wait_until

KEY = "sk-BACKENDSECRETaaaa1111"


def test_model_names_echoing_credentials_or_breaking_headers_are_not_served() -> None:
    with ScriptedUpstream(mode="complete", model="good") as upstream:
        listed = ["good", f"m-{KEY}", f"auth=Bearer {KEY}", "evil\r\nset-cookie: pwn=1", "tab\there"]
        upstream.get_answers["/v1/models"] = (200, orjson.dumps(
            {"object": "list", "data": [{"id": name, "object": "model"} for name in listed]}))
        _, server = gateway_over(upstream, backend={"engine": "vllm", "api_key": KEY})
        with server as gw:
            def ids() -> list[str]:
                return [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]]

            wait_until(ids, "models discovered")
            assert ids() == ["good"]
            metrics = httpx.get(gw.url + "/metrics").text
            assert KEY not in metrics and "set-cookie" not in metrics
            answer = httpx.post(gw.url + "/v1/chat/completions", json={
                "model": "evil\r\nset-cookie: pwn=1", "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 404 and "set-cookie" not in answer.headers
