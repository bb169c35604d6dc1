"""The gateway's own error for a failed upstream exchange (the transport maps its client's errors to it)."""

from __future__ import annotations

from gateway.errors import Redactor


class UpstreamError(Exception):
    """The upstream failed. ``connect`` is true when no request reached it (safe to try another backend);
    ``auth`` when it refused the gateway's own credentials for it (401/403): a configuration fault of the
    gateway's, never the client's."""

    def __init__(self, message: str, *, connect: bool = False, timeout: bool = False, auth: bool = False,
                 answered: bool = False) -> None:
        super().__init__(message)
        self.connect = connect
        self.timeout = timeout
        self.auth = auth
        # it answered, with an error in a 200 body: counted against it as a 5xx is, where another key's request
        # met one there too (Breaker.corroborated; one key's requests must not eject an engine for everyone)
        self.answered = answered

    @property
    def code(self) -> str:
        """The error code a client sees, and the request's outcome."""
        if self.auth:
            return "upstream_auth_failed"
        return "upstream_timeout" if self.timeout else "upstream_failed"

    @property
    def reason(self) -> str:
        """Why another backend is tried (the retries metric's label)."""
        if self.auth:
            return "upstream_auth"
        if self.timeout:
            return "timeout"
        return "connect_failed" if self.connect else "upstream_failed"

    def redacted(self, redactor: Redactor) -> UpstreamError:
        return UpstreamError(redactor.scrub(str(self)), connect=self.connect, timeout=self.timeout, auth=self.auth,
                             answered=self.answered)


class ResponseTooLarge(UpstreamError):
    """The backend's non-streamed answer is larger than the gateway holds (``server.max_response_bytes``): found
    from its ``Content-Length`` or as it arrives, and the connection closed, so no more of it is read. The
    backend did nothing wrong, and another would answer the same request as largely: not worth a retry, and no
    failure of the backend's."""

    def __init__(self, limit: int, values: bool = False) -> None:
        what = (f"has more than {limit} JSON values, weighted by their cost to parse (server.max_response_values)"
                if values else f"is larger than {limit} bytes (server.max_response_bytes)")
        super().__init__(f"the backend's answer {what}: ask for less in one request (fewer inputs, choices or "
                         f"logprobs, a streamed answer), or have the operator raise it")
        self.limit = limit

    @property
    def code(self) -> str:
        return "upstream_response_too_large"

    def redacted(self, redactor: Redactor) -> UpstreamError:
        return self


class Stopped(UpstreamError):
    """The gateway stopped the attempt (gateway.proxy.stall_guard: the engine's loop stalled while it ran there). Not
    the backend's failure, and not tried on another: the client is told why, and may retry."""

    @property
    def code(self) -> str:
        return "engine_stalled"

    def redacted(self, redactor: Redactor) -> UpstreamError:
        return self
