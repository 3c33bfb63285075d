"""Base URIs (R-URI-*, A-5): normalized as kvsp's Go ``NormalizeBaseURI``
normalizes them, which parses with Go's net/url; this module follows the
same steps, so the two accept, refuse and rewrite the same strings (the
shared vectors hold them to it). And the resource ids derived from them."""

from __future__ import annotations

import base64
import hashlib
import ipaddress

from .errors import invalid

MAX_BASE_URI_LEN = 2048

_ALNUM = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_HOST_OK = _ALNUM | frozenset(b"-_.~!$&'()*+,;=:[]<>\"")  # Go's shouldEscape(c, encodeHost) is false
_PATH_OK = _ALNUM | frozenset(b"-_.~$&+,/:;=@")  # shouldEscape(c, encodePath) is false
_PATH_VALID = _PATH_OK | frozenset(b"!$&'()*+,;=:@[]%")  # validEncoded(s, encodePath)
_UNRESERVED = _ALNUM | frozenset(b"-._~")
_HEX = frozenset(b"0123456789abcdefABCDEF")


class _ParseError(Exception):
    pass


def _unescape(s: bytes, host: bool) -> bytes:
    """Go's unescape in encodePath or encodeHost mode."""
    out = bytearray()
    i = 0
    while i < len(s):
        c = s[i]
        if c == 0x25:  # %
            if i + 2 >= len(s) or s[i + 1] not in _HEX or s[i + 2] not in _HEX:
                raise _ParseError("bad escape")
            v = int(s[i + 1 : i + 3], 16)
            if host and v < 0x80 and s[i : i + 3] != b"%25":
                raise _ParseError("bad host escape")
            out.append(v)
            i += 3
            continue
        if host and c < 0x80 and c not in _HOST_OK:
            raise _ParseError("invalid character in host name")
        out.append(c)
        i += 1
    return bytes(out)


def _escape_path(p: bytes) -> bytes:
    out = bytearray()
    for c in p:
        if c in _PATH_OK:
            out.append(c)
        else:
            out += b"%%%02X" % c
    return bytes(out)


def _valid_port(p: bytes) -> bool:
    return p == b"" or (p[:1] == b":" and all(0x30 <= c <= 0x39 for c in p[1:]))


def _parse_host(scheme: bytes, host: bytes) -> bytes:
    """Go's parseHost: the authority's host[:port], unescaped."""
    ob = host.rfind(b"[")
    if ob > 0:
        raise _ParseError("invalid IP-literal")
    if ob == 0:
        cb = host.rfind(b"]")
        if cb < 0:
            raise _ParseError("missing ']'")
        colon_port = host[cb + 1 :]
        if not _valid_port(colon_port):
            raise _ParseError("invalid port")
        port = _unescape(colon_port, True)
        name = host[1:cb]
        zone = name.find(b"%25")
        if zone >= 0:
            raise _ParseError("zone")  # refused by kvsp whatever Go makes of it
        un = _unescape(name, True)
        try:
            ipaddress.IPv6Address(un.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            raise _ParseError("invalid host") from None
        return b"[" + un + b"]" + port
    i = host.find(b":")
    if i >= 0:
        last = host.rfind(b":")
        if last != i and scheme not in (b"http", b"https"):
            i = last
        if not _valid_port(host[i:]):
            raise _ParseError("invalid port")
    return _unescape(host, True)


def _split_host_port(hp: bytes) -> tuple[bytes, bytes]:
    host, port = hp, b""
    colon = hp.rfind(b":")
    if colon >= 0 and _valid_port(hp[colon:]):
        host, port = hp[:colon], hp[colon + 1 :]
    if host.startswith(b"[") and host.endswith(b"]"):
        host = host[1:-1]
    return host, port


def _normalize_percent(p: bytes) -> bytes:
    if b"%" not in p:
        return p
    out = bytearray()
    i = 0
    while i < len(p):
        if p[i] != 0x25:
            out.append(p[i])
            i += 1
            continue
        if i + 2 >= len(p):
            raise invalid("base URI: truncated percent-encoding")
        if p[i + 1] not in _HEX or p[i + 2] not in _HEX:
            raise invalid("base URI: bad percent-encoding")
        c = int(p[i + 1 : i + 3], 16)
        if c in _UNRESERVED:
            out.append(c)
        else:
            out += b"%%%02X" % c
        i += 3
    return bytes(out)


def _remove_dot_segments(s: bytes) -> bytes:
    """RFC 3986 section 5.2.4; an empty path becomes "/"."""
    if s == b"":
        return b"/"
    out: list[bytes] = []
    while s:
        if s.startswith(b"../"):
            s = s[3:]
        elif s.startswith(b"./") or s.startswith(b"/./"):
            s = s[2:]
        elif s == b"/.":
            s = b"/"
        elif s.startswith(b"/../"):
            s = s[3:]
            if out:
                out.pop()
        elif s == b"/..":
            s = b"/"
            if out:
                out.pop()
        elif s in (b".", b".."):
            s = b""
        else:
            j = s.find(b"/", 1)
            if j < 0:
                out.append(s)
                s = b""
            else:
                out.append(s[:j])
                s = s[j:]
    return b"".join(out) or b"/"


def normalize_base_uri(raw: str) -> str:
    """The normalized form of a base URI: lowercase scheme and host, no
    default port, percent-encoding normalized, dot segments removed, a path
    ending in "/"; refused: anything but https (or moqt), user information,
    a query, a fragment, a non-ASCII host, an IPv6 zone."""
    b = raw.encode("utf-8", "surrogatepass")
    if len(b) > MAX_BASE_URI_LEN:
        raise invalid(f"base URI: longer than {MAX_BASE_URI_LEN} octets")
    try:
        scheme, host, port, path, has_user = _parse(b)
    except _ParseError:
        raise invalid("base URI: not a URI") from None
    if scheme not in (b"https", b"moqt"):
        raise invalid("base URI: scheme must be https")
    if has_user:
        raise invalid("base URI: must not carry user information")
    if host == b"":
        raise invalid("base URI: host required")
    if any(c >= 0x80 for c in host):
        raise invalid("base URI: host must be ASCII (use the A-label form)")
    if b"%" in host:
        raise invalid("base URI: IPv6 zone identifiers are not allowed")
    host = host.lower()
    if b":" in host:
        host = b"[" + host + b"]"
    if port:
        n = int(port)
        if n > 0xFFFF:
            raise invalid("base URI: bad port")
        port = b"%d" % n
    if port == b"443" and scheme == b"https":
        port = b""
    p = _remove_dot_segments(_normalize_percent(path))
    if not p.endswith(b"/"):
        raise invalid('base URI: path must end in "/"')
    out = scheme + b"://" + host + (b":" + port if port else b"") + p
    return out.decode("utf-8", "surrogatepass")


def _parse(b: bytes) -> tuple[bytes, bytes, bytes, bytes, bool]:
    """Go's url.Parse, as far as NormalizeBaseURI reads it: the scheme
    (lowercased), the host and port, the escaped path, whether user
    information was present. Everything NormalizeBaseURI refuses from the
    parse (opaque, query, fragment) raises here too."""
    if b"#" in b:
        raise invalid("base URI: must not have a fragment")
    if any(c < 0x20 or c == 0x7F for c in b):
        raise _ParseError("control character")
    scheme, rest = b"", b
    for i, c in enumerate(b):
        if c in _ALNUM and not 0x30 <= c <= 0x39:
            continue
        if (0x30 <= c <= 0x39 or c in b"+-.") and i > 0:
            continue
        if c == 0x3A and i > 0:
            scheme, rest = b[:i].lower(), b[i + 1 :]
        elif c == 0x3A:
            raise _ParseError("missing protocol scheme")
        break
    if b"?" in rest:
        if scheme in (b"https", b"moqt"):
            raise invalid("base URI: must not have a query")
        raise invalid("base URI: scheme must be https")
    if not rest.startswith(b"/"):
        if scheme:
            if scheme in (b"https", b"moqt"):
                raise invalid("base URI: must be hierarchical")
            raise invalid("base URI: scheme must be https")
        seg = rest.split(b"/", 1)[0]
        if b":" in seg:
            raise _ParseError("first path segment in URL cannot contain colon")
    host = b""
    has_user = False
    if (scheme or not rest.startswith(b"///")) and rest.startswith(b"//"):
        authority, rest = rest[2:], b""
        j = authority.find(b"/")
        if j >= 0:
            authority, rest = authority[:j], authority[j:]
        at = authority.rfind(b"@")
        host = _parse_host(scheme, authority[at + 1 :] if at >= 0 else authority)
        if at >= 0:
            _check_userinfo(authority[:at])
            has_user = True
    path = _unescape(rest, False)
    escaped = rest if all(c in _PATH_VALID for c in rest) else _escape_path(path)
    hostname, port = _split_host_port(host)
    return scheme, hostname, port, escaped, has_user


def _check_userinfo(u: bytes) -> None:
    ok = _ALNUM | frozenset(b"-._:~!$&'()*+,;=%@")
    if not all(c in ok for c in u):
        raise _ParseError("invalid userinfo")
    for part in u.split(b":", 1):
        _unescape(part, False)


def validate_base_uri(name: str, s: str) -> None:
    """s must be an https base URI in normalized form."""
    n = normalize_base_uri_named(name, s)
    if n != s:
        raise invalid(f"{name}: base URI is not in normalised form")
    if not s.startswith("https://"):
        raise invalid(f"{name}: must be an https base URI")


def normalize_base_uri_named(name: str, s: str) -> str:
    try:
        return normalize_base_uri(s)
    except Exception as e:
        raise invalid(f"{name}: {e}".replace("invalid: ", "")) from None


def resource_id(base_uri: str) -> str:
    """{holder-id}, {instance-id}: base64url (no padding) of SHA-256 of the
    base URI's octets."""
    d = hashlib.sha256(base_uri.encode("utf-8", "surrogatepass")).digest()
    return base64.urlsafe_b64encode(d).rstrip(b"=").decode("ascii")
