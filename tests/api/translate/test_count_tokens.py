"""count_tokens on an engine that only tokenizes: the request it gets, and its answer in Anthropic's shape."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.translate.count_tokens import countable, encode_request, input_tokens
from gateway.api.translate.messages import count_tokens_chat

pytestmark = pytest.mark.unit

TOOL = {"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}}


def test_tools_are_appended_to_the_system_message_or_make_one() -> None:
    chat = count_tokens_chat({"model": "m", "system": "Be brief.", "tools": [TOOL],
                              "messages": [{"role": "user", "content": "Hi"}]})
    sent = encode_request(chat)
    listed = orjson.dumps(chat["tools"][0]).decode()
    assert sent["text"][0] == {"role": "system", "content": "Be brief.\n" + listed}
    assert sent["text"][1:] == chat["messages"][1:] and sent["add_bos_token"] is True
    bare = encode_request(count_tokens_chat({"model": "m", "tools": [TOOL, TOOL],
                                             "messages": [{"role": "user", "content": "Hi"}]}))
    assert bare["text"][0] == {"role": "system", "content": listed + "\n" + listed}


def test_text_parts_are_one_string_and_an_image_is_not_countable() -> None:
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert countable(chat) and encode_request(chat)["text"] == [{"role": "user", "content": "ab"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert not countable({"messages": [{"role": "user", "content": [image]}]})


def test_the_engines_count_is_answered_as_input_tokens_and_anything_else_is_no_count() -> None:
    assert orjson.loads(input_tokens(b'{"tokens": [1, 2, 3], "length": 3}')) == {"input_tokens": 3}
    assert orjson.loads(input_tokens(b'{"tokens": [1, 2]}')) == {"input_tokens": 2}
    for bad in (b"[]", b"nope", b'{"length": -1}', b'{"length": true}', b'{"detail": "x"}',
                b'{"length": 18446744073709551615}'):  # (the final sweep: 2^64 - 1 reached the client)
        with pytest.raises(ValueError):
            input_tokens(bad)
