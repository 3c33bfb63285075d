"""The clients of :mod:`kvsp.client` for asyncio: the same requests, checks
and errors (TLS 1.3, a client certificate, the server's identity by URI
SAN; blocks verified layer by layer as they arrive; problem details into
the KVSP exception classes), over asyncio streams and HTTP/1.1 (one
connection per request)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from . import _calls
from ._calls import generate_body, join, place_body
from .client import (
    MAX_ERROR_BODY,
    MAX_JSON_BODY,
    MEDIA_BLOCK,
    MEDIA_JSON,
    MEDIA_PROBLEM,
    BlockRef,
    SessionCursor,
    SessionResult,
    _problem,
    check_identity,
    tls_context,
    transient,
)
from .container import (
    FIXED_HEADER_LEN,
    LAYER_ENTRY_LEN,
    Digests,
    Geometry,
    Header,
    Layer,
    MalformedError,
    TruncatedError,
    _parse_fixed,
    _parse_lengths,
)
from .digests import parse_repr_digest, repr_digest
from .errors import (
    DigestMismatchError,
    InvalidError,
    InvalidStateError,
    KVSPError,
    UnavailableError,
)
from .ids import BlockKey, CompatID, ScopeID
from .records import GeneratedToken, LeaseResponse, LookupResponse, PlaceResponse, PrefetchStatus, ShardMap

_MAX_HEADER = 64 << 10
_T = TypeVar("_T")


class _Response:
    def __init__(
        self, status: int, headers: dict[str, str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.status, self.headers, self._r, self._w = status, headers, reader, writer
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        cl = headers.get("content-length")
        self._left = int(cl) if cl is not None and cl.isdigit() else None
        self._chunk = 0  # octets left in the current chunk
        self._eof = False

    async def read(self, n: int) -> bytes:
        """Up to n octets of the body; b"" at its end."""
        if self._eof:
            return b""
        if self._chunked:
            if self._chunk == 0:
                line = await self._r.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await self._r.readline()  # the empty trailer
                    self._eof = True
                    return b""
                self._chunk = size
            b = await self._r.read(min(n, self._chunk))
            if not b:
                raise UnavailableError("client: the response ended inside a chunk")
            self._chunk -= len(b)
            if self._chunk == 0:
                await self._r.readexactly(2)  # CRLF
            return b
        if self._left is not None:
            if self._left == 0:
                self._eof = True
                return b""
            b = await self._r.read(min(n, self._left))
            if not b:
                raise UnavailableError("client: the response ended before its length")
            self._left -= len(b)
            return b
        b = await self._r.read(n)
        self._eof = not b
        return b

    async def readexactly(self, n: int, where: str) -> bytes:
        out = bytearray()
        while len(out) < n:
            b = await self.read(n - len(out))
            if not b:
                raise TruncatedError(f"container: malformed: truncated in {where}")
            out += b
        return bytes(out)

    async def read_all(self, limit: int) -> bytes:
        out = bytearray()
        while True:
            b = await self.read(1 << 16)
            if not b:
                return bytes(out)
            out += b
            if len(out) > limit:
                raise InvalidError("invalid: client: a response body past its limit")

    async def readline(self, limit: int) -> bytes:
        out = bytearray()
        while not out.endswith(b"\n"):
            b = await self.read(1) if self._chunked or self._left is not None else await self._r.readline()
            if not b:
                break
            out += b
            if len(out) > limit:
                raise InvalidError("invalid: client: a line past its limit")
        return bytes(out)

    async def close(self) -> None:
        self._w.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self._w.wait_closed()


class AsyncClient:
    """One identity's asyncio client (see :class:`kvsp.client.Client`)."""

    def __init__(
        self, *, cert: str, key: str, ca: str, server_identity: str | None = None, timeout: float = 30.0
    ) -> None:
        self._ctx, self._identity, self._timeout = tls_context(cert, key, ca, server_identity), server_identity, timeout

    def holder(self, base: str) -> AsyncHolder:
        return AsyncHolder(self, base)

    async def run_session(
        self,
        pc: str,
        scope: ScopeID,
        compat: CompatID,
        tokens: Sequence[int],
        max_tokens: int,
        deliver: Callable[[int, int], Awaitable[None] | None],
        *,
        method: str = "greedy",
        p: float | None = None,
        seed: int = 0,
        session: bytes | None = None,
        retry: float = 0.2,
        deadline: float = 120.0,
    ) -> SessionResult:
        """:meth:`kvsp.client.Client.run_session` for asyncio: each output
        index delivered exactly once, in order, across the instance's
        failure; ``deliver`` may be a coroutine function."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        ctl = self.controller(pc)
        kw: dict[str, Any] = {"method": method, "p": p, "seed": seed}
        while True:
            try:
                at = await ctl.place(scope, compat, tokens, max_tokens, session=session, **kw)
                break
            except Exception as e:
                if not transient(e) or loop.time() > end:
                    raise
            await asyncio.sleep(retry)
        assert at.session is not None
        cur = SessionCursor()
        while True:
            stream = self.instance(at.instance).generate(
                at, scope, compat, tokens, max_tokens, from_=cur.next, on_done=cur.done, **kw
            )
            try:
                while True:
                    try:
                        t = await anext(stream)
                    except StopAsyncIteration:
                        return SessionResult(at.session, cur.finish, cur.prefill)
                    except InvalidError:
                        raise
                    except (KVSPError, OSError, asyncio.IncompleteReadError):
                        break  # the stream ended early: where does the session continue?
                    if cur.take(t):
                        r = deliver(t.index, t.token)  # its errors are the caller's
                        if r is not None:
                            await r
            finally:
                await stream.aclose()
            while True:
                if loop.time() > end:
                    raise UnavailableError("client: the session did not finish before its deadline")
                await asyncio.sleep(retry)
                try:
                    now = await ctl.place(scope, compat, tokens, max_tokens, session=at.session, **kw)
                except InvalidStateError:
                    raise  # finished: nothing continues it
                except (KVSPError, OSError):
                    continue
                if cur.moved(at, now):
                    at = now
                    break

    def index(self, base: str) -> AsyncIndexService:
        return AsyncIndexService(self, base)

    def controller(self, base: str) -> AsyncController:
        return AsyncController(self, base)

    def instance(self, base: str) -> AsyncInstance:
        return AsyncInstance(self, base)

    async def _request(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> _Response:
        u = urlsplit(url)
        if u.scheme != "https" or not u.hostname:
            raise InvalidError("invalid: client: an https URL is required")
        host, port = u.hostname, u.port or 443
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host, port, ssl=self._ctx, server_hostname=host if self._identity is None else None
            ),
            self._timeout,
        )
        try:
            sslobj = writer.get_extra_info("ssl_object")
            check_identity(sslobj.getpeercert() if sslobj is not None else None, self._identity)
            path = (u.path or "/") + ("?" + u.query if u.query else "")
            lines = [f"{method} {path} HTTP/1.1", f"Host: {u.netloc}", "Connection: close"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            if body is not None:
                lines.append(f"Content-Length: {len(body)}")
            if not body:
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                status, hdrs = await self._head(reader)
                return _Response(status, hdrs, reader, writer)
            # A body is sent once the server asks for it (100 Continue, or
            # a second's silence, RFC 9110 10.1.1): a server that refuses
            # the request first (a 403 PUT) answers without reading it, and
            # the answer is not lost to a reset of the connection.
            lines.append("Expect: 100-continue")
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            try:
                status, hdrs = await self._head(reader, min(1.0, self._timeout))
                if status != 100:
                    return _Response(status, hdrs, reader, writer)  # the body was not sent
            except TimeoutError:
                pass
            writer.write(body)
            status, hdrs = await self._head(reader)
            return _Response(status, hdrs, reader, writer)
        except BaseException:
            writer.close()
            raise

    async def _head(self, reader: asyncio.StreamReader, timeout: float | None = None) -> tuple[int, dict[str, str]]:
        """A response's status and headers (names in lowercase)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout or self._timeout)
        except asyncio.IncompleteReadError:
            raise UnavailableError("client: the connection closed before a response") from None
        except asyncio.LimitOverrunError:
            raise InvalidError("invalid: client: response headers past 64 KiB") from None
        if len(head) > _MAX_HEADER:
            raise InvalidError("invalid: client: response headers past 64 KiB")
        status_line, *fields = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise InvalidError("invalid: client: not an HTTP/1.1 response")
        hdrs: dict[str, str] = {}
        for f in fields:
            if ":" in f:
                k, v = f.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        return int(parts[1]), hdrs

    async def _call(self, c: _calls.Call[_T]) -> _T:
        """Carry one JSON request of :mod:`kvsp._calls`."""
        data = None if c.body is None else json.dumps(c.body, separators=(",", ":")).encode("utf-8")
        headers = {"Accept": f"{MEDIA_JSON}, {MEDIA_PROBLEM}"}
        if data is not None:
            headers["Content-Type"] = MEDIA_JSON
        resp = await self._request(c.method, c.url, headers, data)
        try:
            raw = await resp.read_all(MAX_JSON_BODY)
        finally:
            await resp.close()
        if resp.status >= 300:
            raise _problem(resp.status, raw[:MAX_ERROR_BODY])
        from . import _json

        return c.parse(resp.status, _json.loads(raw) if raw else None, resp.headers)


class AsyncHolder:
    def __init__(self, client: AsyncClient, base: str) -> None:
        self._c, self.base = client, base

    async def get_block(
        self,
        ref: BlockRef,
        g: Geometry,
        *,
        layers: tuple[int, int] | None = None,
        layer_digests: Sequence[bytes] | None = None,
        digests: Digests | None = None,
    ) -> AsyncIterator[Layer]:
        """The block's layers as they arrive, each verified (its digest
        against ``layer_digests`` by model layer, when given), the container
        against Repr-Digest at the end; ``digests``, when given, receives
        what was computed."""
        url = join(self.base, ref.path()) + (f"?layers={layers[0]}-{layers[1]}" if layers is not None else "")
        resp = await self._c._request(
            "GET", url, {"Accept": f"{MEDIA_BLOCK}, {MEDIA_PROBLEM}", "Accept-Encoding": "identity"}
        )
        try:
            if resp.status != 200:
                raise _problem(resp.status, await resp.read_all(MAX_ERROR_BODY))
            if resp.headers.get("content-type", "").split(";")[0].strip() != MEDIA_BLOCK:
                raise InvalidError("invalid: client: a block answered with another Content-Type")
            try:
                expect_c = parse_repr_digest(resp.headers.get("repr-digest", ""))
            except InvalidError as e:
                raise DigestMismatchError(f"client: {e}") from None
            g.validate()
            whole = hashlib.sha256()
            fixed = await resp.readexactly(FIXED_HEADER_LEN, "header")
            whole.update(fixed)
            codec, first, count, tokens = _parse_fixed(fixed, g)
            lens = await resp.readexactly(LAYER_ENTRY_LEN * count, "header")
            whole.update(lens)
            h = Header(codec, first, tokens, _parse_lengths(memoryview(lens), codec, first, g))
            k_len, _ = h.layers[0]
            out = digests if digests is not None else Digests([])
            for i in range(count):
                idx = first + i
                buf = await resp.readexactly(sum(h.layers[i]), f"layer {idx}")
                whole.update(buf)
                d = hashlib.sha256(buf).digest()
                if layer_digests is not None and (idx >= len(layer_digests) or layer_digests[idx] != d):
                    raise DigestMismatchError(f"container: digest mismatch: layer {idx}")
                out.layers.append(d)
                mv = memoryview(buf)
                yield Layer(idx, mv[:k_len], mv[k_len:], d)
            if await resp.read(1):
                raise MalformedError("container: malformed: octets after the last layer")
            if whole.digest() != expect_c:
                raise DigestMismatchError("container: digest mismatch: container")
            out.container = expect_c
        finally:
            await resp.close()

    async def put_block(self, ref: BlockRef, data: bytes | memoryview, digest: bytes) -> bool:
        """See :meth:`kvsp.client.Holder.put_block`: False when the holder
        already had the block and kept it (412, R-BLK-14)."""
        headers = {"Content-Type": MEDIA_BLOCK, "If-None-Match": "*", "Repr-Digest": repr_digest(digest)}
        resp = await self._c._request("PUT", join(self.base, ref.path()), headers, bytes(data))
        try:
            body = await resp.read_all(MAX_ERROR_BODY)
        finally:
            await resp.close()
        if resp.status == 412:
            return False
        if not 200 <= resp.status < 300:
            raise _problem(resp.status, body)
        return True

    async def lease(self, scope: ScopeID, compat: CompatID, keys: Sequence[BlockKey], ttl_ms: int) -> LeaseResponse:
        return await self._c._call(_calls.lease(self.base, scope, compat, keys, ttl_ms))

    async def release_lease(self, lease_id: str) -> None:
        await self._c._call(_calls.release_lease(self.base, lease_id))


class AsyncIndexService:
    """:class:`kvsp.client.IndexService` for asyncio."""

    def __init__(self, client: AsyncClient, base: str) -> None:
        self._c, self.base = client, base

    async def publish(self, record: dict[str, Any]) -> None:
        await self._c._call(_calls.publish(self.base, record))

    async def withdraw(self, holder: str, key: BlockKey) -> None:
        await self._c._call(_calls.withdraw(self.base, holder, key))

    async def lookup(
        self, scope: ScopeID, compat: CompatID, keys: Sequence[BlockKey], targets: Sequence[str] = ()
    ) -> LookupResponse:
        return await self._c._call(_calls.lookup(self.base, scope, compat, keys, targets))


class AsyncController:
    """:class:`kvsp.client.Controller` for asyncio."""

    def __init__(self, client: AsyncClient, base: str) -> None:
        self._c, self.base = client, base

    async def place(
        self,
        scope: ScopeID,
        compat: CompatID,
        tokens: Sequence[int],
        max_tokens: int,
        *,
        method: str = "greedy",
        p: float | None = None,
        seed: int = 0,
        session: bytes | None = None,
    ) -> PlaceResponse:
        """See :meth:`kvsp.client.Controller.place`."""
        body = place_body(scope, compat, tokens, max_tokens, method, p, seed, session)
        return await self._c._call(_calls.place(self.base, body))

    async def put_status(self, record: dict[str, Any]) -> str:
        return await self._c._call(_calls.put_status(self.base, record))

    async def put_checkpoint(self, record: dict[str, Any]) -> int:
        return await self._c._call(_calls.put_checkpoint(self.base, record))

    async def update_map(self, update: dict[str, Any]) -> tuple[ShardMap, dict[str, int]]:
        return await self._c._call(_calls.update_map(self.base, update))


class AsyncInstance:
    """:class:`kvsp.client.Instance` for asyncio."""

    def __init__(self, client: AsyncClient, base: str) -> None:
        self._c, self.base = client, base

    async def prefetch(self, directive: dict[str, Any]) -> str:
        return await self._c._call(_calls.prefetch(self.base, directive))

    async def prefetch_status(self, directive: bytes) -> PrefetchStatus:
        return await self._c._call(_calls.prefetch_status(self.base, directive))

    async def set_state(self, state: str) -> str:
        return await self._c._call(_calls.set_state(self.base, state))

    async def resume(self, epoch: int, checkpoint: dict[str, Any]) -> None:
        await self._c._call(_calls.resume(self.base, epoch, checkpoint))

    async def reshard(self, message: dict[str, Any]) -> tuple[str, int, int]:
        return await self._c._call(_calls.reshard(self.base, message))

    async def generate(
        self,
        placed: PlaceResponse,
        scope: ScopeID,
        compat: CompatID,
        tokens: Sequence[int],
        max_tokens: int,
        *,
        method: str = "greedy",
        p: float | None = None,
        seed: int = 0,
        from_: int | None = None,
        on_done: Callable[[GeneratedToken], None] | None = None,
    ) -> AsyncGenerator[GeneratedToken, None]:
        body = generate_body(placed, scope, compat, tokens, max_tokens, method, p, seed, from_)
        resp = await self._c._request(
            "POST",
            join(self.base, "generate"),
            {"Content-Type": MEDIA_JSON, "Accept": "application/x-ndjson, " + MEDIA_PROBLEM},
            json.dumps(body).encode("utf-8"),
        )
        try:
            if resp.status != 200:
                raise _problem(resp.status, await resp.read_all(MAX_ERROR_BODY))
            while True:
                line = await resp.readline(MAX_ERROR_BODY)
                if not line:
                    raise UnavailableError("client: the token stream ended before its end")
                t = GeneratedToken.decode(line)
                if t.done:
                    if on_done is not None:
                        on_done(t)  # why the output ended
                    return
                yield t
        finally:
            await resp.close()
