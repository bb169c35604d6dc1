"""Stored responses as two tenants see them, through the gateway with the official OpenAI SDK: each API key
continues its own conversations only (another key's id is answered exactly as an unknown id), and one key
storing as fast as it can does not push another key's conversations out."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import openai
import pytest

from gateway.app import create_app
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread

KEYS = {"alice": "sk-alice", "mallory": "sk-mallory"}


@pytest.fixture(scope="module")
def tenants() -> Iterator[Running]:
    with FleetThread([SimSpec(engine="vllm", model="m", name="sim", time_scale=TIME_SCALE)]) as fleet:
        keys = [{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest()} for name, key in KEYS.items()]
        app = create_app(gateway_settings(fleet.fleet.servers, auth={"keys": keys}, responses={
            "store_entries": 8, "store_entries_per_key": 5}))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


def client(running: Running, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key=KEYS[name], max_retries=0)


def test_another_keys_response_is_answered_exactly_as_an_unknown_id(tenants: Running) -> None:
    alice, mallory = client(tenants, "alice"), client(tenants, "mallory")
    first = alice.responses.create(model="m", input="My password is hunter2.", max_output_tokens=8)
    assert alice.responses.create(model="m", input="And?", previous_response_id=first.id, max_output_tokens=8)
    made_up = "resp_" + "0" * 48
    answers = []
    for asked in (first.id, made_up):
        with pytest.raises(openai.NotFoundError) as refused:
            mallory.responses.create(model="m", input="What was the password?", previous_response_id=asked,
                                     max_output_tokens=8)
        answers.append(refused.value.response)
    theirs, unknown = answers
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json() == json.loads(unknown.text.replace(made_up, first.id))
    assert theirs.json()["error"]["code"] == "previous_response_not_found"
    sent = [r.body for r in list(tenants.server("sim").received) if r.path == "/v1/chat/completions"]
    assert not any("hunter2" in json.dumps(body) and "What was the password?" in json.dumps(body) for body in sent)


def test_one_key_storing_as_fast_as_it_can_does_not_push_out_another_keys_conversation(tenants: Running) -> None:
    """The store keeps 8 responses, at most 5 of one key: the busy key loses its own oldest."""
    alice, mallory = client(tenants, "alice"), client(tenants, "mallory")
    kept = alice.responses.create(model="m", input="Remember this.", max_output_tokens=8)
    flood = [mallory.responses.create(model="m", input=f"Note {i}.", max_output_tokens=8).id for i in range(12)]
    assert alice.responses.create(model="m", input="What was it?", previous_response_id=kept.id,
                                  max_output_tokens=8).output_text
    for old in flood[:7]:
        with pytest.raises(openai.NotFoundError):
            mallory.responses.create(model="m", input="More.", previous_response_id=old, max_output_tokens=8)
    assert mallory.responses.create(model="m", input="More.", previous_response_id=flood[-1],
                                    max_output_tokens=8).output_text
