"""Where Redis is: REDIS_URL's forms, parsed in one place for the workers and the producer.

    redis://[[user]:password@]host[:port][/db]      one server (rediss:// with TLS, unix://)
    sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db]
                                                    the master that Redis Sentinel names

A `sentinel://` URL lists the sentinels (port 26379 unless said), comma-separated, then the
name of the monitored master and the database (0 unless said). The user and password are the
master's (and its replicas'); the sentinels are asked without a password. Every client built
from it asks the sentinels for the master and asks again when a connection fails or the server
it reaches answers READONLY (it was demoted by a failover). kombu's own form for the same
(`sentinel://h1:26379;sentinel://h2:26379` and a `master_name` transport option) is made from
it here (`kombu_url`), so the user writes one URL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SENTINEL_SCHEME = "sentinel"
REDIS_SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
SENTINEL_PORT = 26379
SENTINEL_FORM = "sentinel://[:password@]host[:port][,host[:port]...]/master[/db]"
# a host is a name, an IPv4 address or a bracketed IPv6 one; the port optional
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>.*))?$")
_MASTER = re.compile(r"^[A-Za-z0-9_.-]+$")


class RedisUrlError(ValueError):
    """REDIS_URL is not a form this module reads: the message is one line, naming what."""


@dataclass(frozen=True)
class SentinelUrl:
    """A `sentinel://` URL, parsed: the sentinels to ask, the master they name, its db and
    credentials."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    def kombu_url(self) -> str:
        """kombu's Sentinel broker URL: one `sentinel://` URL a sentinel, joined by `;`, each
        with the credentials and db (kombu's failover may start from any of them)."""
        auth = ""
        if self.password is not None or self.username:
            user = quote(self.username or "", safe="")
            secret = "" if self.password is None else ":" + quote(self.password, safe="")
            auth = f"{user}{secret}@"
        return ";".join(
            f"{SENTINEL_SCHEME}://{auth}{_netloc(host, port)}/{self.db}"
            for host, port in self.sentinels
        )

    def redacted(self) -> str:
        """The URL without its password: what messages and pages show."""
        auth = ""
        if self.password is not None:
            auth = f"{self.username or ''}:***@"
        elif self.username:
            auth = f"{self.username}@"
        hosts = ",".join(_netloc(h, p) for h, p in self.sentinels)
        return f"{SENTINEL_SCHEME}://{auth}{hosts}/{self.master_name}/{self.db}"


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_sentinel(url: str) -> bool:
    return url.partition("://")[0].lower() == SENTINEL_SCHEME


def parse_sentinel_url(url: str) -> SentinelUrl:
    """A `sentinel://` URL as a SentinelUrl; a RedisUrlError saying what is wrong (the URL is
    never in the message: it may hold a password)."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != SENTINEL_SCHEME or not sep:
        raise RedisUrlError(f"not a {SENTINEL_SCHEME}:// URL (expected {SENTINEL_FORM})")
    if ";" in rest:
        raise RedisUrlError(
            "sentinels are listed comma-separated in one URL, not as ;-joined URLs "
            f"(expected {SENTINEL_FORM})"
        )
    if "?" in rest or "#" in rest:
        raise RedisUrlError(f"a {SENTINEL_SCHEME}:// URL takes no query or fragment")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_sentinel(part) for part in hosts.split(","))
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise RedisUrlError(f"no master name after the sentinels (expected {SENTINEL_FORM})")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1]):
        raise RedisUrlError(f"too many path parts: expected /master[/db] ({SENTINEL_FORM})")
    master = unquote(parts[0])
    if not _MASTER.match(master):
        raise RedisUrlError(f"master name {master!r} is not a Sentinel master name")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise RedisUrlError(f"database {parts[1]!r} is not a number")
        db = int(parts[1])
    return SentinelUrl(sentinels, master, db, username, password)


def _sentinel(part: str) -> tuple[str, int]:
    if not part:
        raise RedisUrlError(f"an empty sentinel address (expected {SENTINEL_FORM})")
    found = _HOST.match(part)
    if found is None:
        raise RedisUrlError(f"sentinel address {part!r} is not host[:port]")
    host = found["v6"] or found["name"]
    port = found["port"]
    if port is None:
        return host, SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisUrlError(f"sentinel {host}: port {port!r} is not a port number")
    return host, int(port)


def check_redis_url(url: str) -> SentinelUrl | None:
    """A RedisUrlError (one line) unless `url` is of a scheme REDIS_SCHEMES names and, for
    `sentinel://`, well formed; the parsed SentinelUrl when it is one."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        accepted = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        raise RedisUrlError(f"not a Redis URL (accepted schemes: {accepted})")
    return parse_sentinel_url(url) if scheme == SENTINEL_SCHEME else None


def redacted(url: str) -> str:
    """A Redis URL without its password (a sentinel:// one as parsed, when it parses)."""
    if is_sentinel(url):
        try:
            return parse_sentinel_url(url).redacted()
        except RedisUrlError:
            return re.sub(r"//[^@/]*@", "//***@", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    where = parts.netloc.rpartition("@")[2]  # host:port as written (a bad port is shown)
    return parts._replace(netloc=f"{parts.username or ''}:***@{where}").geturl()


def kombu_broker(url: str) -> tuple[str, dict[str, str | float]]:
    """The broker URL kombu reads for REDIS_URL, and the transport options it needs with it
    (a Sentinel's master name; its timeouts are every connection's, schemas/redis_links.py);
    a RedisUrlError for a malformed sentinel:// URL."""
    if not is_sentinel(url):
        return url, {}
    sentinel = parse_sentinel_url(url)
    return sentinel.kombu_url(), {"master_name": sentinel.master_name}
