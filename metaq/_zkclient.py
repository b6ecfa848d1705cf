"""One place that builds kazoo clients: credentials, ACLs and TLS for every component.

:class:`ZkSecurity` says how a broker, producer, consumer or tool talks to
ZooKeeper:

- ``auth``: ``"user:password"`` for ZooKeeper's ``digest`` scheme (sent on
  every (re)connect);
- ``acl``: what nodes this client creates allow others:

  * ``"open"`` (default, what Metaq does): anyone may read and change them;
  * ``"creator-read"``: the credential's user has all rights, everyone else
    may only read (the inspector and ``group describe`` keep working);
  * ``"creator"``: only the credential's user may even read them.

- TLS: ``tls=True`` with optional ``ca_file``, ``cert_file``, ``key_file``,
  passed through to kazoo (ZooKeeper's ``secureClientPort``).

Nodes created by Metaq's Java clients keep their own ACLs; this only governs
what we create.
"""

from __future__ import annotations

from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.retry import KazooRetry
from kazoo.security import ACL, OPEN_ACL_UNSAFE, READ_ACL_UNSAFE, make_acl, make_digest_acl

from metaq._errors import ConfigError

__all__ = ["ZkSecurity", "make_client"]

ACL_MODES = ("open", "creator-read", "creator")


@dataclass(frozen=True, kw_only=True)
class ZkSecurity:
    """Credentials, ACL mode and TLS for a ZooKeeper connection (see the module doc)."""

    #: ``user:password`` for the digest scheme, or None for no credential.
    auth: str | None = None
    #: ``open``, ``creator-read`` or ``creator`` (the last two need ``auth``).
    acl: str = "open"
    #: Connect with TLS.
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify_certs: bool = True

    def __post_init__(self) -> None:
        if self.auth is not None and (not isinstance(self.auth, str) or ":" not in self.auth
                                      or self.auth.startswith(":")):
            raise ConfigError("zk auth must be 'user:password'")
        if self.acl not in ACL_MODES:
            raise ConfigError(f"zk acl must be one of {ACL_MODES}, got {self.acl!r}")
        if self.acl != "open" and self.auth is None:
            raise ConfigError(f"zk acl {self.acl!r} needs a credential (auth='user:password')")
        if not self.tls and (self.ca_file or self.cert_file or self.key_file):
            raise ConfigError("zk TLS files given but tls is off")

    def acl_list(self) -> list[ACL]:
        if self.acl == "open" or self.auth is None:
            return list(OPEN_ACL_UNSAFE)
        user, password = self.auth.split(":", 1)
        mine = make_digest_acl(user, password, all=True)
        return [mine] if self.acl == "creator" else [mine, *READ_ACL_UNSAFE]

    def shared_acl(self) -> list[ACL]:
        """ACL for directories shared with other credentials (``topics-sub/<t>``,
        ``brokers/ids``, ``consumers``): anyone may read and add children, only
        this credential may delete them or change the directory.  ZooKeeper checks
        a delete against the parent's ACL, so this is what protects the children."""
        if self.acl == "open" or self.auth is None:
            return list(OPEN_ACL_UNSAFE)
        user, password = self.auth.split(":", 1)
        everyone = make_acl("world", "anyone", read=True, create=True)
        return [make_digest_acl(user, password, all=True), everyone]

    def client_kwargs(self) -> dict[str, object]:
        kw: dict[str, object] = {}
        if self.auth is not None:
            kw["auth_data"] = [("digest", self.auth)]
        if self.acl != "open":
            kw["default_acl"] = self.acl_list()
        if self.tls:
            kw.update(use_ssl=True, verify_certs=self.verify_certs)
            if self.ca_file:
                kw["ca"] = self.ca_file
            if self.cert_file:
                kw["certfile"] = self.cert_file
            if self.key_file:
                kw["keyfile"] = self.key_file
        return kw


#: Longest pause between attempts to reach ZooKeeper again, seconds.  kazoo's default
#: doubles up to an hour: after a 20 s outage the next attempt could come 13 s after the
#: servers were back, and members resumed late; capped, they return within about this.
RECONNECT_MAX_DELAY = 1.0


def make_client(hosts: str, *, timeout: float = 30.0,
                security: ZkSecurity | None = None) -> KazooClient:
    """A (not yet started) kazoo client for ``hosts`` with ``security`` applied, which
    reconnects after an outage with a bounded backoff (:data:`RECONNECT_MAX_DELAY`)."""
    kw = (security or ZkSecurity()).client_kwargs()
    retry = KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_jitter=0.4,
                       max_delay=RECONNECT_MAX_DELAY)
    return KazooClient(hosts=hosts, timeout=timeout, connection_retry=retry, **kw)
