"""The SSE relay: byte-for-byte pass-through, usage capture and removal, engine quirks, any chunking."""

from __future__ import annotations

import itertools
import json
import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.sse import InvalidStream, SSERelay

pytestmark = pytest.mark.unit


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"


USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 8}}
USAGE_CHUNK = b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [],
                                        "usage": USAGE}) + b"\n\n"
DONE = b"data: [DONE]\n\n"
VLLM_STREAM = chunk("Hel") + chunk("lo") + chunk(None, "stop") + USAGE_CHUNK + DONE


def relay_all(stream: bytes, keep_usage: bool, cuts: list[int]) -> tuple[bytes, SSERelay]:
    relay = SSERelay(keep_usage)
    out, start = [], 0
    for cut in [*cuts, len(stream)]:
        out.append(relay.feed(stream[start:cut]))
        start = cut
    out.append(relay.flush())
    return b"".join(out), relay


def test_events_pass_through_unchanged_when_client_asked_for_usage() -> None:
    out, relay = relay_all(VLLM_STREAM, keep_usage=True, cuts=[])
    assert out == VLLM_STREAM
    assert relay.usage == USAGE and relay.done


def test_usage_chunk_is_removed_when_client_did_not_ask_but_still_recorded() -> None:
    out, relay = relay_all(VLLM_STREAM, keep_usage=False, cuts=[])
    assert out == chunk("Hel") + chunk("lo") + chunk(None, "stop") + DONE
    assert relay.usage == USAGE


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_upstream_bytes_gives_the_same_output(seed: int) -> None:
    rng = random.Random(seed)
    stream = VLLM_STREAM.replace(b"\n", b"\r\n") if seed % 2 else VLLM_STREAM
    cuts = sorted(rng.sample(range(1, len(stream)), k=rng.randint(1, 12)))
    for keep in (True, False):
        out, relay = relay_all(stream, keep, cuts)
        assert out == relay_all(VLLM_STREAM, keep, [])[0]
        assert relay.usage == USAGE


def test_tabbyapi_crlf_pings_and_usage_chunk_with_choices_are_normalised() -> None:
    tabby_usage = orjson.dumps({"id": "t", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": USAGE})
    stream = (b": ping\r\n\r\n" + chunk("Hi").replace(b"\n", b"\r\n") + b"data: " + tabby_usage + b"\r\n\r\n"
              + DONE.replace(b"\n", b"\r\n"))
    out, _ = relay_all(stream, keep_usage=True, cuts=[5, 40])
    events = [e for e in out.split(b"\n\n") if e]
    assert b"\r" not in out
    assert events[0] == b": ping"
    content, usage = orjson.loads(events[2][6:]), orjson.loads(events[3][6:])
    assert "usage" not in content and content["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"] == USAGE
    assert events[4] == b"data: [DONE]"

    out, _ = relay_all(stream, keep_usage=False, cuts=[])
    assert b'"usage"' not in out and b'"finish_reason":"stop"' in out


def test_llamacpp_timings_and_cached_tokens_are_recorded() -> None:
    final = b"data: " + orjson.dumps({"choices": [], "usage": USAGE, "timings": {
        "cache_n": 8, "prompt_n": 3, "prompt_ms": 12.5, "predicted_n": 3}}) + b"\n\n"
    _, relay = relay_all(chunk("x") + final + DONE, keep_usage=False, cuts=[])
    assert relay.timings is not None and relay.timings["cache_n"] == 8


def test_error_event_mid_stream_is_forwarded_and_noted() -> None:
    error = b'data: {"error": {"message": "out of memory", "type": "InternalServerError", "code": 500}}\n\n'
    out, relay = relay_all(chunk("x") + error, keep_usage=False, cuts=[])
    assert out == chunk("x") + error
    assert relay.error == "out of memory" and not relay.done


def test_content_mentioning_usage_in_text_is_not_mistaken_for_usage() -> None:
    text = chunk('the word "usage" and "error"')
    out, relay = relay_all(text + DONE, keep_usage=False, cuts=[])
    assert out == text + DONE and relay.usage is None and relay.error is None


def test_unterminated_last_event_is_completed_on_flush() -> None:
    out, relay = relay_all(chunk("x") + b"data: [DONE]", keep_usage=False, cuts=[])
    assert out.endswith(b"data: [DONE]\n\n") and relay.done


@pytest.mark.parametrize("garbage", [
    b"<html>502 Bad Gateway</html>\n\n",
    b'data: ["a list"]\n\n',
    b"data: [1,2]\n\n",
    b'data: "x"\n\n',
    b"data: 42\n\n",
    b"data:\n\n",
    b"hello world\n\n",
    b"event: message\n\n",  # no data
    b"data: {\"choices\":[{\"delta\"\n\n",  # a JSON line cut short
    b'data: {"id":"x","choices":[{"delta":{"content":"hel\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":1,}}\n\n',  # an event that matters is parsed in full
    b'data: {"error": {"message": "boom"}\n\n',
])
def test_malformed_events_are_refused_not_relayed(garbage: bytes) -> None:
    from gateway.proxy.sse import InvalidStream

    for cut in (False, True):  # arriving alone, and in one read with the event before it
        relay = SSERelay(keep_usage=False)
        with pytest.raises(InvalidStream):
            if cut:
                relay.feed(chunk("ok") + garbage)
            else:
                assert relay.feed(chunk("ok")) == chunk("ok")
                relay.feed(garbage)


def test_an_object_shaped_event_is_relayed_without_being_parsed() -> None:
    """Only the framing of ordinary chunks is checked (data that starts with ``{`` and ends with ``}``): one
    that is not JSON inside is relayed as it came, not refused. Parsing every event cost more than the rest of
    the relay; the events the gateway acts on (usage, timings, errors) are still parsed in full."""
    odd = b"data: {not json}\n\n"
    relay = SSERelay(keep_usage=False)
    assert relay.feed(chunk("ok") + odd) == chunk("ok") + odd
    assert relay.feed(odd) == odd
    assert relay.events == 3 and relay.usage is None


def test_only_the_events_that_matter_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    loads = orjson.loads

    def counting(data: bytes) -> object:
        parsed.append(data)
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counting)
    sglang_chunk = chunk("x").replace(b"]}\n\n", b'],"usage":null}\n\n')  # SGLang says usage: null every time
    events = [chunk("Hel"), sglang_chunk, chunk(None, "stop"), USAGE_CHUNK, DONE]
    stream = b"".join(events)
    by_event = list(itertools.accumulate(len(e) for e in events))[:-1]
    for cuts in ([], by_event, [len(chunk("Hel")) + 1]):  # in one read, an event a read, cut mid-event
        parsed.clear()
        out, relay = relay_all(stream, keep_usage=True, cuts=cuts)
        assert out == stream
        assert parsed == [USAGE_CHUNK[6:-2]] and relay.usage == USAGE


@pytest.mark.parametrize("event", [
    b'data: {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}\n\n',
    b'data: {"choices":[],"usage" :\t{"prompt_tokens":11,"completion_tokens":3}}\n\n',
    b'data:{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":3}}  \n\n',
    b'event: chunk\ndata: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":3}}\n\n',
])
def test_usage_is_found_however_the_event_is_written(event: bytes) -> None:
    for keep in (True, False):
        out, relay = relay_all(chunk("x") + event + DONE, keep_usage=keep, cuts=[])
        assert relay.usage == {"prompt_tokens": 11, "completion_tokens": 3}
        assert out == (chunk("x") + event + DONE if keep else chunk("x") + DONE)


def test_multi_line_events_and_comments_pass_unchanged() -> None:
    stream = b": ping\n\nevent: message\nid: 7\ndata: {\"choices\":[]}\n\nretry: 5\ndata: [DONE]\n\n"
    out, relay = relay_all(stream, keep_usage=False, cuts=[])
    assert out == stream and relay.done and relay.events == 2


@pytest.mark.parametrize("cut", [b'data: {"choices":[{"del', b'data: {"choices":[{"delta":{}}',
                                 b"data: {not json}"])
def test_a_json_line_cut_at_the_end_of_the_stream_is_refused_on_flush(cut: bytes) -> None:
    """An event the upstream left without its closing blank line is where a cut connection shows: it is
    parsed in full, even when it happens to end with ``}``."""
    from gateway.proxy.sse import InvalidStream

    relay = SSERelay(keep_usage=False)
    relay.feed(chunk("ok") + cut)
    with pytest.raises(InvalidStream):
        relay.flush()


def test_a_stream_without_event_boundaries_is_cut_off() -> None:
    from gateway.proxy.sse import MAX_PENDING_BYTES, InvalidStream

    relay = SSERelay(keep_usage=False)
    with pytest.raises(InvalidStream):
        for _ in range(MAX_PENDING_BYTES // 4096 + 2):
            relay.feed(b"x" * 4096)


@pytest.mark.parametrize(("event", "counted"), [
    (chunk("Hel"), 1),
    (b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n', 1),  # spaces
    (b'data: {"choices":[{"delta":{"content" :  "x"}}]}\n\n', 1),
    (b'data: {"choices":[{"delta":{"reasoning_content": "think"}}]}\n\n', 1),
    (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments": "{\\"a\\""}}]}}]}\n\n', 1),
    (b'data: {"choices":[{"text": "once"}]}\n\n', 1),
    (chunk(None, "stop"), 0),
    (b'data: {"choices":[{"delta":{"role": "assistant", "content": ""}}]}\n\n', 0),
    (b'data: {"choices":[{"delta":{"content": null}}]}\n\n', 0),
    (b'data: {"choices":[{"delta":{"content": "say \\"content\\": \\"x\\""}}]}\n\n', 1),  # a key inside text
    (USAGE_CHUNK, 0),
])
def test_generated_output_is_found_however_the_json_is_spaced(event: bytes, counted: int) -> None:
    """Time to first token is taken at the first event carrying generated output: servers written in Python
    put spaces after colons, and reasoning and tool-call deltas are generated tokens too."""
    from gateway.proxy.sse import text_events_in

    assert text_events_in(event) == counted


SGLANG_CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}\n\n'
TEXT_EVENTS = [chunk("Hel"), chunk(None, "stop"), chunk(""), SGLANG_CHUNK,
               b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n',
               b'data: {"choices":[{"delta":{"reasoning_content": "think"}}]}\n\n',
               b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments": "{"}}]}}]}\n\n',
               b'data: {"choices":[{"text":"once"},{"text":"twice"}]}\n\n',
               b'data: {"choices":[{"delta":{"content": "say \\"usage\\": 1, \\"error\\""}}]}\n\n']


@pytest.mark.parametrize("event", TEXT_EVENTS)
def test_a_single_event_passed_unchanged_is_counted_on_the_way_as_text_events_in_counts(event: bytes) -> None:
    """The relay scans for what matters and for generated output at once; what it counts, for one event or a
    block of them, is what text_events_in would count on its output, and an event that matters is left to be
    counted."""
    from gateway.proxy.sse import text_events_in

    relay = SSERelay(keep_usage=True)
    out = relay.feed(event)
    assert out == event
    assert relay.texts == text_events_in(event)
    relay.feed(USAGE_CHUNK)  # (matters: parsed, and not counted on the way)
    assert relay.texts is None and relay.usage == USAGE
    block = event + chunk("a") + DONE  # several events: counted on the way too
    assert relay.feed(block) == block and relay.texts == text_events_in(block)
    relay.feed(chunk("a") + USAGE_CHUNK)  # (one of them matters: left to be counted)
    assert relay.texts is None
    relay.feed(b": ping\n\n" + chunk("a"))  # (a comment: left to be counted)
    assert relay.texts is None


@pytest.mark.parametrize("key", ["content", "text", "reasoning_content", "reasoning", "arguments"])
def test_every_generated_output_key_is_counted_past_the_scans_first_letter_check(key: str) -> None:
    """The scans look ahead at a key's first letter before trying the keys one by one; no key is skipped."""
    from gateway.proxy.sse import text_events_in

    event = b'data: {"choices":[{"delta":{"%s": "x"}}]}\n\n' % key.encode()
    assert text_events_in(event) == 1
    relay = SSERelay(keep_usage=True)
    assert relay.feed(event) == event and relay.texts == 1


@pytest.mark.parametrize(("event", "seen"), [
    (b'data: {"choices":[],"usage": {"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}\n\n', "usage"),
    (b'data: {"choices":[],"timings": {"prompt_n":1,"cache_n":0}}\n\n', "timings"),
    (b'data: {"error": {"message":"boom","type":"server_error"}}\n\n', "error"),
])
def test_every_event_the_relay_acts_on_is_found_past_the_scans_first_letter_check(event: bytes, seen: str) -> None:
    for relay_input in (event, event + event):  # (the one-event fast path, and the general one)
        relay = SSERelay(keep_usage=True)
        relay.feed(relay_input)
        assert {"usage": relay.usage, "timings": relay.timings, "error": relay.error}[seen] is not None


# -- the one-event scan that skips the head a stream repeats (SSERelay._scan) -----------------------------------

_KEYS = ["content", "text", "reasoning_content", "reasoning", "arguments"]
# what an engine may write inside or around a chunk: quotes, escapes, keys' names inside text, spacing
_TEXT = st.lists(st.sampled_from([*'ab "\\:{}nu', "content", "usage", "error", '\\"']), max_size=8).map("".join)


@st.composite
def _engine_chunk(draw: st.DrawFn, head: dict[str, object], key: str, colon: str | None) -> bytes:
    """One engine chunk: the stream's fixed head (id, model, ...), then a delta whose text varies (its key and
    spacing, now and then), then maybe a usage, timings or error key. ``colon`` None: compact (orjson); else
    as Python's json writes it, with that colon."""
    if draw(st.integers(0, 5)) == 0:
        key, colon = draw(st.sampled_from(_KEYS)), draw(st.sampled_from([None, ": ", " : ", ":"]))
    delta: dict[str, object] = {key: draw(st.one_of(st.none(), st.just(""), _TEXT))}
    doc: dict[str, object] = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    tail = draw(st.sampled_from(["", "", "", "usage-null", "usage", "timings", "error"]))
    if tail == "usage-null":
        doc["usage"] = None
    elif tail == "usage":
        doc["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    elif tail == "timings":
        doc["timings"] = {"cache_n": 0}
    elif tail == "error":
        doc["error"] = {"message": "x"}
    body = orjson.dumps(doc) if colon is None else json.dumps(doc, separators=(", ", colon)).encode()
    return b"data: " + body + b"\n\n"


@st.composite
def _streams(draw: st.DrawFn) -> list[bytes]:
    head: dict[str, object] = draw(st.sampled_from([
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"},  # vLLM, SGLang
        {},  # llama.cpp puts choices first
        {"id": draw(_TEXT), "model": draw(_TEXT)},
    ]))
    key, colon = draw(st.sampled_from(_KEYS)), draw(st.sampled_from([None, ": ", " : ", ":"]))
    chunks = draw(st.lists(_engine_chunk(head, key, colon), min_size=1, max_size=10))
    out = []
    for c in chunks:  # and now and then a byte changed (not the closing "}\n\n"), anywhere in the chunk
        if draw(st.integers(0, 3)) == 0:
            i = draw(st.integers(6, len(c) - 4))
            c = c[:i] + draw(st.sampled_from([b'"', b" ", b":", b"x", b"\\", b"n"])) + c[i + 1 :]
        out.append(c)
    return out


@settings(max_examples=200, deadline=None)
@given(_streams())
def test_the_scan_that_skips_a_repeated_head_finds_what_a_whole_scan_finds(stream: list[bytes]) -> None:
    """Chunk after chunk, the relay's scan (which skips the head its stream's last chunk had) gives exactly the
    matches of a scan of the whole chunk, whatever changed between chunks; and what the relay counts and acts on
    is what a fresh relay does with the same chunk."""
    from gateway.proxy.sse import _SCAN, text_events_in

    relay = SSERelay(keep_usage=True)
    for c in stream:
        assert relay._scan(c) == _SCAN.findall(c)
    relay = SSERelay(keep_usage=True)
    outs: list[bytes | type[Exception]] = []
    for c in stream:
        fresh = SSERelay(keep_usage=True)
        try:
            expected: bytes | type[Exception] = fresh.feed(c)
        except InvalidStream:
            expected = InvalidStream
        try:
            out: bytes | type[Exception] = relay.feed(c)
        except InvalidStream:
            out, relay = InvalidStream, SSERelay(keep_usage=True)
        assert out == expected
        assert relay.texts == fresh.texts
        if relay.texts is not None:
            assert relay.texts == text_events_in(c)
        outs.append(out)
    # the whole stream at once, as an upstream read carrying every chunk gives it: the same bytes out, and what it
    # counts on the way is what text_events_in counts on them
    if InvalidStream not in outs:
        block = SSERelay(keep_usage=True)
        whole = block.feed(b"".join(stream))
        assert whole == b"".join(o for o in outs if isinstance(o, bytes))
        if block.texts is not None:
            assert block.texts == text_events_in(whole)


def test_the_head_is_skipped_only_where_the_chunk_repeats_it() -> None:
    """A chunk whose text is empty right after the kept head, or whose head changed, is scanned whole."""
    from gateway.proxy.sse import _SCAN

    relay = SSERelay(keep_usage=False)
    first = chunk("Hel")
    assert relay._scan(first) == [b"content"]
    assert relay._head == first[: first.index(b'"Hel"') + 1]
    for c in (chunk(""), chunk(None, "stop"), chunk('"'), chunk("lo"), USAGE_CHUNK,
              chunk("x").replace(b'"id":"c"', b'"id":"d"')):
        assert relay._scan(c) == _SCAN.findall(c)


LLAMACPP_HIDDEN = (("usage", "prompt_tokens_details", "cached_tokens"), ("timings", "cache_n"),
                   ("timings", "prompt_n"), ("timings", "prompt_ms"))


@pytest.mark.parametrize("keep_usage", [True, False])
def test_hidden_cache_figures_leave_the_events_that_carry_them_and_nothing_else(keep_usage: bool) -> None:
    """Only the events carrying the hidden fields are re-encoded, without them; every other event passes as the
    very bytes that came; the relay itself keeps the engine's figures (for the gateway's own accounting)."""
    timings = {"cache_n": 8, "prompt_n": 3, "prompt_ms": 12.5, "predicted_n": 3, "predicted_ms": 30.0}
    final = b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": USAGE, "timings": timings}) + b"\n\n"
    text = chunk("Hel") + chunk("lo") + chunk(None, "stop")
    relay = SSERelay(keep_usage, hidden=LLAMACPP_HIDDEN)
    assert relay.feed(text) == text
    out = relay.feed(final) + relay.feed(DONE)
    if keep_usage:
        event = orjson.loads(out.split(b"\n\n")[0][6:])
        assert event["usage"] == {**USAGE, "prompt_tokens_details": {}}
        assert event["timings"] == {"predicted_n": 3, "predicted_ms": 30.0}
    else:
        assert out == DONE
    assert relay.usage == USAGE and relay.timings == timings
    # a finish chunk carrying timings (llama.cpp without include_usage) loses them as well
    last = b"data: " + orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                     "timings": timings}) + b"\n\n"
    shown = orjson.loads(SSERelay(keep_usage, hidden=LLAMACPP_HIDDEN).feed(last)[6:])
    assert shown["timings"] == {"predicted_n": 3, "predicted_ms": 30.0} and shown["choices"][0]["finish_reason"]
    # nothing hidden: the same event passes unchanged
    assert SSERelay(keep_usage=True, hidden=LLAMACPP_HIDDEN).feed(USAGE_CHUNK.replace(b"cached", b"audio")) == \
        USAGE_CHUNK.replace(b"cached", b"audio")


def test_comments_are_pings_and_other_fields_are_scrubbed_of_the_backends_credentials() -> None:
    """Sweep 8: an engine echoing the key it was sent in a comment, an ``id:`` or an ``event:`` line had it
    relayed to the client unread."""
    from gateway.errors import Redactor

    key = "sk-BACKENDSECRETaaaa1111"
    relay = SSERelay(keep_usage=True, secrets=Redactor("b", "http://engine-b.internal:8000", [key]))
    chunk = b'data: {"choices":[{"delta":{"content":"hi"}}]}'
    out = relay.feed(b": Bearer " + key.encode() + b"\n\n" + b"id: " + key.encode() + b"\nevent: " + key.encode()
                     + b"\n: and " + key.encode() + b"\n" + chunk + b"\n\n: ping\n\n")
    assert key.encode() not in out
    assert out == b": ping\n\nid: [redacted]\nevent: [redacted]\n" + chunk + b"\n\n: ping\n\n"


def test_a_flood_of_comments_or_blank_lines_between_events_ends_the_stream() -> None:
    """~30 ms of the event loop per MiB, bounded before only by the stream's idle timeout."""
    relay = SSERelay(keep_usage=True)
    chunk = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    relay.feed(chunk + b": p\n\n" * 100_000 + chunk)  # (under the bound, and a data event resets it)
    relay.feed(b"\n" * 500_000)
    with pytest.raises(InvalidStream, match="comments, blank lines and events without text"):
        for _ in range(200):
            relay.feed(b": p\n\n" * 1000)


@pytest.mark.parametrize("empty", [b"data: {}\n\n", b'data: {"choices":[]}\n\n',
                                   b'data: {"choices":[{"delta":{"content":""}}]}\n\n',
                                   b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'])
@pytest.mark.parametrize("per_read", [1, 500])
def test_a_flood_of_events_without_text_ends_the_stream_as_comments_do(empty: bytes, per_read: int) -> None:
    """Sweep 27: `data: {}` (or usage alone, which the relay parses and the client never sees) unpaced from one
    backend held every other key's requests 2-6 s on the replica: a data event reset the bound on comments. An
    event without text counts toward it now; one with text resets it."""
    relay = SSERelay(keep_usage=False)
    text = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    relay.feed(empty * 1000 + text)  # (a few are what engines send: the role's chunk, the usage)
    with pytest.raises(InvalidStream, match="events without text"):
        for _ in range(2 * (1 << 20) // (len(empty) * per_read) + 1):
            relay.feed(empty * per_read)


def test_noise_is_bounded_in_the_whole_stream_whatever_text_comes_between() -> None:
    """Sweep 28: just under 1 MiB of comments, then one text event, over and over, reset the bound between two text
    events forever (another key's p50 from 3.6 ms to 5.2 s); events of another form (`event:` lines) reset it
    whatever they carried. Comments, blank lines and events without text count in the whole stream too."""
    text = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    relay = SSERelay(keep_usage=False)
    with pytest.raises(InvalidStream, match="in the stream"):
        for _ in range(8):
            relay.feed(b": ping\n\n" * 100_000 + text)  # (~0.8 MiB, then text)
    other = SSERelay(keep_usage=False)
    with pytest.raises(InvalidStream, match="events without text"):
        for _ in range(200_000):
            other.feed(b"event: x\ndata: {}\n\n" * 10)
    # an agent API's own stream, text in its events (a Responses delta, a Messages text), passes however long
    native = SSERelay(keep_usage=False)
    for _ in range(30_000):
        native.feed(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"word '
                    b'and more words to make it long"}\n\n'
                    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta",'
                    b'"text":"more text"}}\n\n')


def test_nothing_after_the_end_of_a_stream_is_relayed() -> None:
    """Sweep 28: after `data: [DONE]` the relay went on: 62 MB reached the client after its stream had ended."""
    relay = SSERelay(keep_usage=False)
    assert relay.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n')
    assert relay.done and relay.feed(b'data: {"choices":[{"delta":{"content":"y"}}]}\n\n') == b""
    with pytest.raises(InvalidStream):
        for _ in range(100):
            relay.feed(b"x" * 65536)


@pytest.mark.parametrize("crlf", [False, True])
def test_an_event_in_many_small_reads_is_relayed_whole(crlf: bool) -> None:
    """Sweep 28: a partial event was joined and searched whole at every read (one 1 MB event in 256-byte reads took
    1.5 s of the event loop): now grown in place and searched where it grew, its end found across reads."""
    event = b'data: {"choices":[{"delta":{"content":"' + b"a" * 300_000 + b'"}}]}\n\n'
    if crlf:
        event = event.replace(b"\n", b"\r\n")
    relay = SSERelay(keep_usage=False)
    out = b"".join(relay.feed(event[i:i + 256]) for i in range(0, len(event), 256))
    assert out.replace(b"\r\n", b"\n") == event.replace(b"\r\n", b"\n")


def test_a_stream_of_more_events_than_the_request_may_generate_is_cut() -> None:
    """Sweep 27: a request of max_tokens 5 was relayed 146 MB of one-character events (every other key's p50 from
    8 ms to 1.2 s while it lasted). One event a token, and a few besides, is all an engine sends."""
    text = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    relay = SSERelay(keep_usage=True, max_events=5 + 256)
    relay.feed(text * 261)
    with pytest.raises(InvalidStream, match="more than 261 events"):
        relay.feed(text)
    relay = SSERelay(keep_usage=True, max_events=5 + 256)
    with pytest.raises(InvalidStream, match="more than 261 events"):
        relay.feed(text * 262)  # (many in one read)


def test_a_credential_split_across_data_lines_is_scrubbed_from_the_error_that_shows_it() -> None:
    from gateway.errors import Redactor

    key = "sk-BACKENDSECRETaaaa1111"
    relay = SSERelay(keep_usage=True, secrets=Redactor("b", "http://engine-b.internal:8000", [key]))
    with pytest.raises(InvalidStream) as bad:
        relay.feed(b'data: {"error": "' + key[:12].encode() + b'\ndata: ' + key[12:].encode() + b'"\n\n')
    shown = bad.value.described(Redactor("b", "http://engine-b.internal:8000", [key]))
    assert key[:12] not in shown and key[12:] not in shown and "[redacted]" in shown


def test_large_events_the_relay_parses_are_bounded_per_stream() -> None:
    """Sweep 9: a stream of back-to-back 1 MiB usage events, each parsed on the event loop, starved it (limited
    keys on other models got 503 when Redis calls missed their timeout)."""
    relay = SSERelay(keep_usage=True)
    big = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"x":"' + b"a" * 300_000 + b'"}}\n\n'
    text = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'  # (so the bound on idle bytes is not what trips)
    relay.feed(big + text)
    relay.feed(big + text)
    relay.feed(big + text)
    with pytest.raises(InvalidStream, match="usage, timings or an error"):
        relay.feed(big)
    small = SSERelay(keep_usage=True)
    for _ in range(2_000):  # (usage in every chunk, as vLLM's continuous usage stats: small, never bounded)
        small.feed(b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n')
