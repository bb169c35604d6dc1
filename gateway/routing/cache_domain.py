"""Whose cached prompts a request may profit from: its cache domain.

Prefix caches are shared by every request an engine serves, and a cache hit shows (a prefix scorer's value, the
``cached_tokens`` an engine reports, a faster first token): a key that can tell whether its guess of another
key's prompt was cached can read that prompt, a guess at a time. So each API key has a cache domain (its own
name, unless the operator puts several keys in one with ``cache_domain``), and while more than one domain
exists a request profits only from what its own domain put in the caches: the gateway's prefix keys and session
keys are qualified with the domain, and engines that can keep their cache apart per tenant get the domain's
salt (:attr:`CacheDomain.salt`). With no keys, or every key in one domain, there is one domain, :data:`SHARED`,
and nothing is keyed by it (prefix keys as before).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheDomain:
    """``name``: empty for the one domain of a gateway that has only one. ``salt``: the domain's salt for
    engines that isolate by one (vLLM's and SGLang's ``cache_salt``), a keyed hash of the domain that no
    client can choose or guess into another domain's; None exactly when ``name`` is empty."""

    name: str = ""
    salt: str | None = None

    @property
    def isolated(self) -> bool:
        """Several domains exist: this one must not profit from, or learn of, the others' cached prompts."""
        return self.salt is not None

    def seed(self, model: str) -> str:
        """What the gateway's prefix keys are seeded with: the model, and the domain where there are several."""
        return f"{model}\0{self.name}" if self.name else model

    def qualify(self, key: str) -> str:
        """A session key within the domain (unchanged where there is only one)."""
        return f"{self.name}\0{key}" if self.name else key

    def engine_salt(self, client_salt: object) -> str | None:
        """The ``cache_salt`` to send an engine that isolates by one. With one domain, the client's own, as it
        came (None: none). With several, the domain's salt, partitioned further by the client's own salt when
        it sent one (a non-empty string), never replaced by it: the result is a hex digest keyed with the
        domain's salt, 64 characters, within vLLM's 128 and free of the characters it refuses."""
        if self.salt is None:
            return client_salt if isinstance(client_salt, str) and client_salt else None
        if not isinstance(client_salt, str) or not client_salt:
            return self.salt
        return hashlib.blake2b(client_salt.encode("utf-8", "surrogatepass"), key=self.salt.encode()[:64],
                               digest_size=32).hexdigest()


SHARED = CacheDomain()  # the only domain: no keys, or every key in one
