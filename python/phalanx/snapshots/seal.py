"""The job's seal on its snapshots: an HMAC-SHA256, under a key derived from the job
token, over each manifest's body. A manifest that does not open under this job's key
was not written by this job (another job's, one from before a token change, or a
forgery) and nothing it names is read.

The key is derived, never the token itself, so that a manifest reveals nothing a
listener would take; its `tag` (a MAC of a constant) tells this job's manifests and
folders from another job's without revealing the key.

>>> key = SnapshotKey.of("t0k3n")
>>> mac = key.seal(b"body")
>>> key.opens(b"body", mac), key.opens(b"bodY", mac), SnapshotKey.of("other").opens(b"body", mac)
(True, False, False)
>>> key.tag == SnapshotKey.of("t0k3n").tag != SnapshotKey.of("other").tag
True
>>> len(key.tag), "t0k3n" in repr(key)
(16, False)
"""

from __future__ import annotations

import hashlib
import hmac

#: What the job token is stretched into a snapshot key with (a new purpose, a new key).
_PURPOSE = b"phalanx snapshot manifest key/1"


class SnapshotKey:
    """The key a job seals and opens its snapshot manifests with."""

    __slots__ = ("_secret", "authenticated", "tag")

    def __init__(self, secret: bytes, authenticated: bool) -> None:
        self._secret = secret
        #: Derived from a real token (False: the job has none, and neither its
        #: listeners nor its snapshots are closed to anyone).
        self.authenticated = authenticated
        #: Names this job's manifests and folders: 16 hex digits.
        self.tag = hmac.new(secret, b"tag", hashlib.sha256).hexdigest()[:16]

    @classmethod
    def of(cls, token: str | None) -> SnapshotKey:
        """The key of the job whose token is `token` (None: a job without one)."""
        secret = hmac.new((token or "").encode(), _PURPOSE, hashlib.sha256).digest()
        return cls(secret, authenticated=bool(token))

    def seal(self, body: bytes) -> str:
        """The MAC of `body`, in hex."""
        return hmac.new(self._secret, body, hashlib.sha256).hexdigest()

    def opens(self, body: bytes, mac: str) -> bool:
        """Whether `mac` is this key's seal of `body` (in constant time)."""
        return hmac.compare_digest(self.seal(body), mac)

    def __repr__(self) -> str:
        return f"SnapshotKey(tag={self.tag!r})"
