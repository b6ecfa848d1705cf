"""What follows a broker URI's port, read as Metaq 1.4's Java client reads it.

A client builds a ``Broker`` from a node's ``meta://host:port...`` with
``Broker(int, String)`` (metamorphosis-commons ``cluster/Broker.java``): a
``java.net.URI``, then ``Broker.slaveIdByUri`` over ``URIUtils.parseParameters``
(``utils/URIUtils.java``).  :func:`slave_id_of_uri_tail` does the same to the path,
query and fragment after the port and returns the slave number, or raises
:class:`NodeDataError` where Java throws.  ``decode_broker_uri`` (``_codecs``) is
its one user.
"""

from __future__ import annotations

import unicodedata
from urllib.parse import unquote_plus

from zk_layout._errors import NodeDataError
from zk_layout._names import INT32_MAX

__all__ = ["slave_id_of_uri_tail"]

# What java.net.URI lets through after the authority (RFC 2396 as Java reads it): in a
# path the unreserved and escaped characters, ";:@&=+$," and "/"; in a query or fragment
# also "?" and "[]"; in all three Java's "other" characters (non-ASCII, neither ISO control
# nor a space separator), see _uri_char_ok.
_PATH_ASCII = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                        "-_.!~*'()" ";:@&=+$," "/")
_QUERY_ASCII = _PATH_ASCII | frozenset("?[]")
_HEX = frozenset("0123456789abcdefABCDEF")
#: Java's Character.isWhitespace beyond the space separators (StringUtils.isBlank uses it)
_JAVA_WS_CONTROLS = frozenset("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f")
_JAVA_NOT_WS = frozenset("\u00a0\u2007\u202f")


def _uri_char_ok(ch: str, ascii_ok: frozenset[str]) -> bool:
    """java.net.URI's test for one character of a path, query or fragment (escapes apart)."""
    if ch < "\x80":
        return ch in ascii_ok
    # Java's "other" characters: not ISO control (U+0080..U+009F), not a space separator
    return ch > "\x9f" and unicodedata.category(ch) not in ("Zs", "Zl", "Zp")


def _check_uri_part(part: str, start: int, what: str, ascii_ok: frozenset[str],
                    path: str, data: object) -> None:
    """Raise NodeDataError where java.net.URI throws URISyntaxException for ``part``."""
    i = 0
    while i < len(part):
        ch = part[i]
        if ch == "%":
            if len(part) < i + 3 or part[i + 1] not in _HEX or part[i + 2] not in _HEX:
                raise NodeDataError(path, data, f"malformed %-escape in the URI's {what} "
                                                f"at index {start + i}")
            i += 3
            continue
        if not _uri_char_ok(ch, ascii_ok):
            raise NodeDataError(path, data, f"illegal character {ch!r} in the URI's {what} "
                                            f"at index {start + i}")
        i += 1


def _java_blank(s: str) -> bool:
    """commons-lang ``StringUtils.isBlank``: empty or only ``Character.isWhitespace``."""
    return all(ch in _JAVA_WS_CONTROLS or (
        ch not in _JAVA_NOT_WS and unicodedata.category(ch) in ("Zs", "Zl", "Zp")) for ch in s)


def slave_id_of_uri_tail(rest: str, start: int, path: str, data: object) -> int | None:
    """The slave number in what follows the port (``/...?...#...``), as Java reads it.

    Java (``Broker.slaveIdByUri``, ``URIUtils.parseParameters``): the raw query split at
    each ``&`` (empty pieces skipped), each piece split at ``=`` dropping trailing empty
    strings (``String.split``), more than two parts or none an error, name and value
    ``URLDecoder.decode``d as UTF-8 (``+`` is a space), the last ``slaveId`` kept.  A
    value that is absent or blank gives -1; else ``Integer.parseInt``, and a negative
    number is a master too (``Broker.isSlave`` is ``slaveId >= 0``).
    """
    rest, hash_, fragment = rest.partition("#")
    before, qmark, query = rest.partition("?")
    _check_uri_part(before, start, "path", _PATH_ASCII, path, data)
    if qmark:
        _check_uri_part(query, start + len(before) + 1, "query", _QUERY_ASCII, path, data)
    if hash_:
        _check_uri_part(fragment, start + len(rest) + 1, "fragment", _QUERY_ASCII, path, data)
    value: str | None = None
    for piece in query.split("&"):
        if not piece:
            continue
        parts = piece.split("=")
        while parts and not parts[-1]:
            parts.pop()
        if not 1 <= len(parts) <= 2:
            raise NodeDataError(path, data, f"bad parameter {piece!r} in the URI's query "
                                            "(Metaq's URIUtils allows one '=')")
        if unquote_plus(parts[0], encoding="utf-8", errors="replace") == "slaveId":
            value = None if len(parts) == 1 else unquote_plus(parts[1], encoding="utf-8",
                                                              errors="replace")
    if value is None or _java_blank(value):
        return None
    digits = value[1:] if value[:1] in ("+", "-") else value
    if not digits or not all(unicodedata.decimal(ch, -1) >= 0 for ch in digits):
        raise NodeDataError(path, data, f"slaveId {value!r} is not a whole number")
    number = int(value)  # Python's int() takes the same Unicode digits as Java's parseInt
    if not -(2**31) <= number <= INT32_MAX:
        raise NodeDataError(path, data, f"slaveId {value!r} is out of Java's int range")
    return None if number < 0 else number
