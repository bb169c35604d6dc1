"""Secrets out of the URLs the gateway shows and logs: userinfo and secret query parameters."""

from __future__ import annotations

import pytest

from gateway.redaction import redact_url

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@redis:6379/0", "redis://[redacted]@redis:6379/0"),
        ("redis://redis:6379/0?password=hunter2", "redis://redis:6379/0?password=[redacted]"),
        ("rediss://redis:6380/0?db=1&password=hunter2&ssl_cert_reqs=none",
         "rediss://redis:6380/0?db=1&password=[redacted]&ssl_cert_reqs=none"),
        ("unix:///run/redis.sock?db=0&password=hunter2", "unix:///run/redis.sock?db=0&password=[redacted]"),
        ("https://proxy.example/v1?token=t0k3n&access_token=a&key=k&api_key=b&auth=c&secret=d",
         "https://proxy.example/v1?token=[redacted]&access_token=[redacted]&key=[redacted]&api_key=[redacted]"
         "&auth=[redacted]&secret=[redacted]"),
        ("https://h/x?apiKey=1&X-Amz-Signature=2&X-Amz-Credential=3&client_secret=4&sig=5&passwd=6&pwd=7",
         "https://h/x?apiKey=[redacted]&X-Amz-Signature=[redacted]&X-Amz-Credential=[redacted]"
         "&client_secret=[redacted]&sig=[redacted]&passwd=[redacted]&pwd=[redacted]"),
        ("redis://u:p@h/0?password=x", "redis://[redacted]@h/0?password=[redacted]"),
        ("https://h/x?token=t0k3n#part", "https://h/x?token=[redacted]#part"),
        ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
        ("redis://h/0?db=2&health_check_interval=10&password=", "redis://h/0?db=2&health_check_interval=10&password="),
    ],
)
def test_a_urls_credentials_and_secret_parameters_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_path_of_the_operators_own_in_a_backend_url_is_taken_out_where_it_is_echoed_alone() -> None:
    """Sweep 20: a token in a backend URL's path (a reverse proxy routing by it) reached clients in every error
    an engine or proxy wrote naming the path it was asked ("Cannot POST /t/<token>/v1/chat/completions"): the URL
    was taken out whole, its host and port alone, never its path alone. A path naming an API only stays."""
    from gateway.errors import Redactor

    secret = Redactor("e", "http://127.0.0.1:28842/t/TOKSECRETPATH123")
    for echoed in ("Cannot POST /t/TOKSECRETPATH123/v1/chat/completions", "upstream /t%2FTOKSECRETPATH123 failed"):
        assert "TOKSECRETPATH123" not in secret.scrub(echoed), secret.scrub(echoed)
    plain = Redactor("v", "http://10.0.0.7:8000/v1")
    assert plain.scrub("Cannot POST /v1/chat/completions") == "Cannot POST /v1/chat/completions"
