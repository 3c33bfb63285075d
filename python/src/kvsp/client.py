"""Clients of the KVSP roles over mutual TLS, as kvsp's Go client does it:
TLS 1.3 only (R-HTTP-4), the client's certificate and key and the CA from
files, and the server's identity checked by its certificate's URI SAN
(A-5), not only by the host name. HTTP/1.1 over the standard library: a
block body is read into one buffer per layer (``readinto``) and hashed
through views, never copied per read.

Every role: the holder (GET whole or by layer range, verified in one pass
against Repr-Digest and the record's layer digests; PUT with
If-None-Match: *; leases), the Index Service (publish, withdraw, lookup),
the Placement Controller (place, instance status, checkpoints, maps), the
instance (generate as an iterator of labelled tokens, prefetch directives
and their status, its state, resume, reshard), and :meth:`Client.run_session`,
the exactly-once front end that follows a session across migrations.
Records sent are validated first, as the receiver validates them; errors
are problem details decoded into the KVSP exception classes
(:mod:`kvsp.errors`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import ssl
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import urlsplit

from . import _calls
from ._calls import generate_body, join, place_body
from .container import Digests, Geometry, Layer, Reader
from .digests import parse_repr_digest, repr_digest
from .errors import (
    DigestMismatchError,
    InvalidError,
    InvalidStateError,
    KVSPError,
    TooManyRequestsError,
    UnavailableError,
    parse_problem,
    problem_error,
)
from .ids import BlockKey, CompatID, ScopeID
from .records import (
    GeneratedToken,
    LeaseResponse,
    LookupResponse,
    PlaceResponse,
    PrefetchStatus,
    ShardMap,
)

_T = TypeVar("_T")
MEDIA_BLOCK = "application/kvsp-block"
MEDIA_JSON = "application/kvsp+json"
MEDIA_PROBLEM = "application/problem+json"
MAX_ERROR_BODY = 64 << 10
MAX_JSON_BODY = 64 << 20


class IdentityError(KVSPError):
    """The server's certificate does not carry the expected identity."""


@dataclass(frozen=True)
class BlockRef:
    """A block resource: blocks/{compat}/{scope}/{block_key}."""

    compat: CompatID
    scope: ScopeID
    key: BlockKey

    def path(self) -> str:
        return f"blocks/{self.compat.hex()}/{self.scope.hex()}/{self.key.hex()}"


def tls_context(cert: str, key: str, ca: str, server_identity: str | None) -> ssl.SSLContext:
    """TLS 1.3 only (R-HTTP-4), the client's certificate and key, the CA;
    the host name checked only when no server identity is expected."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.check_hostname = server_identity is None
    return ctx


def check_identity(cert: dict[str, Any] | None, identity: str | None) -> None:
    """The server's certificate must name ``identity`` as a URI SAN (A-5)."""
    if identity is None:
        return
    sans = [str(pair[1]) for pair in (cert or {}).get("subjectAltName", ()) if pair[0] == "URI"]
    if identity not in sans:
        raise IdentityError("client: the server's certificate does not name the expected identity")


@dataclass(frozen=True)
class SessionResult:
    """How a session ran: its id, why its output ended (A-39: "stop" at the
    model's end-of-generation token, "length" at max_tokens), and how its
    first instance served the prompt (cached tokens, computed tokens)."""

    session: bytes
    finish: str
    prefill: tuple[int, int] | None


class SessionCursor:
    """What a front end has delivered of a session (R-SES-5, R-SES-9): the
    next index, the highest epoch seen. :meth:`take` says whether a token
    line is delivered; :meth:`moved` whether a place answer names where the
    session continues. Shared by the sync and asyncio ``run_session``."""

    def __init__(self) -> None:
        self.next = 0
        self.epoch = 0
        self.finish = ""  # from the done line
        self.prefill: tuple[int, int] | None = None  # the first line's: cached, computed

    def done(self, t: GeneratedToken) -> None:
        """The stream's done line: why the output ended."""
        self.finish = t.finish

    def take(self, t: GeneratedToken) -> bool:
        """True when t is the next index: deliver it. Tokens of an epoch
        lower than one seen (a fenced instance) and indices already
        delivered are dropped; a gap is the server's error."""
        if t.prefill is not None and self.prefill is None:
            self.prefill = t.prefill  # how the first instance served the prompt
        if t.epoch < self.epoch:  # R-SES-9
            return False
        self.epoch = t.epoch
        if t.index < self.next:  # a duplicate (R-SES-5)
            return False
        if t.index > self.next:
            raise InvalidError(f"invalid: token {t.index} arrived before {self.next}")
        self.next += 1
        return True

    @staticmethod
    def moved(at: PlaceResponse, now: PlaceResponse) -> bool:
        """The PC placed the session elsewhere, or at a new epoch."""
        return now.epoch > at.epoch or now.instance != at.instance


class Client:
    """One identity's connection settings. ``server_identity``, when set, is
    the URI SAN every server must present (then the host name is not
    checked); otherwise the host name is, against the certificate."""

    def __init__(
        self, *, cert: str, key: str, ca: str, server_identity: str | None = None, timeout: float = 30.0
    ) -> None:
        self._ctx, self._identity, self._timeout = tls_context(cert, key, ca, server_identity), server_identity, timeout
        self._idle: dict[tuple[str, int], list[http.client.HTTPSConnection]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()

    def _release(self, conn: http.client.HTTPSConnection, resp: http.client.HTTPResponse) -> None:
        """Keep conn for the next request to its host, once its response was
        read to the end and the server keeps it open; else close it."""
        if not resp.isclosed() or resp.will_close or conn.sock is None:
            conn.close()
            return
        with self._lock:
            conns = self._idle.setdefault((conn.host, conn.port), [])
            if len(conns) < 8:
                conns.append(conn)
                return
        conn.close()

    def holder(self, base: str) -> Holder:
        return Holder(self, base)

    def index(self, base: str) -> IndexService:
        return IndexService(self, base)

    def controller(self, base: str) -> Controller:
        return Controller(self, base)

    def instance(self, base: str) -> Instance:
        return Instance(self, base)

    def run_session(
        self,
        pc: str,
        scope: ScopeID,
        compat: CompatID,
        tokens: Sequence[int],
        max_tokens: int,
        deliver: Callable[[int, int], None],
        *,
        method: str = "greedy",
        p: float | None = None,
        seed: int = 0,
        session: bytes | None = None,
        retry: float = 0.2,
        deadline: float = 120.0,
    ) -> SessionResult:
        """Place a request with the PC at ``pc`` and run it, delivering each
        output index exactly once, in order (R-SES-5, R-SES-8, R-SES-9,
        R-SES-14, R-SES-16), as Go's client.RunSession does: tokens of an
        epoch lower than one already seen are discarded, and so are indices
        already delivered. When the token stream ends before its end (the
        instance failed), it asks the PC where the session continues (place
        with the session: the PC migrates it once it detects the failure) and
        resumes the stream from the first index it lacks. ``session`` names
        the session (16 octets; a new one by default). Returns the
        :class:`SessionResult`; raises when ``deadline`` seconds pass, and
        InvalidStateError when the PC says the session finished (A-39)."""
        end = time.monotonic() + deadline
        ctl = self.controller(pc)
        kw: dict[str, Any] = {"method": method, "p": p, "seed": seed}
        at = _retrying(lambda: ctl.place(scope, compat, tokens, max_tokens, session=session, **kw), retry, end)
        assert at.session is not None
        cur = SessionCursor()
        while True:
            stream = self.instance(at.instance).generate(
                at, scope, compat, tokens, max_tokens, from_=cur.next, on_done=cur.done, **kw
            )
            with contextlib.closing(stream):
                while True:
                    try:
                        t = next(stream)
                    except StopIteration:
                        return SessionResult(at.session, cur.finish, cur.prefill)
                    except InvalidError:
                        raise
                    except (KVSPError, OSError, http.client.HTTPException):
                        break  # the stream ended early: where does the session continue?
                    if cur.take(t):
                        deliver(t.index, t.token)  # its errors are the caller's
            while True:
                if time.monotonic() > end:
                    raise UnavailableError("client: the session did not finish before its deadline")
                time.sleep(retry)
                try:
                    now = ctl.place(scope, compat, tokens, max_tokens, session=at.session, **kw)
                except InvalidStateError:
                    raise  # finished: nothing continues it
                except (KVSPError, OSError, http.client.HTTPException):
                    continue
                if cur.moved(at, now):
                    at = now
                    break

    def _connect(self, url: str) -> tuple[http.client.HTTPSConnection, str]:
        u = urlsplit(url)
        if u.scheme != "https" or not u.hostname:
            raise InvalidError("invalid: client: an https URL is required")
        path = u.path + ("?" + u.query if u.query else "")
        with self._lock:
            idle = self._idle.get((u.hostname, u.port or 443))
            if idle:
                return idle.pop(), path  # its server's identity was checked when it connected
        conn = http.client.HTTPSConnection(u.hostname, u.port or 443, context=self._ctx, timeout=self._timeout)
        conn.connect()
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            check_identity(sock.getpeercert(), self._identity)
        except IdentityError:
            conn.close()
            raise
        return conn, path

    def _call(self, c: _calls.Call[_T]) -> _T:
        """Carry one JSON request of :mod:`kvsp._calls`."""
        status, out, hdr = self._exchange(c.method, c.url, c.body)
        return c.parse(status, out, {k.lower(): v for k, v in hdr.items()})

    def _exchange(self, method: str, url: str, body: Any = None) -> tuple[int, Any, http.client.HTTPMessage]:
        """One JSON request: the status, the decoded body (None when empty)
        and the headers; a status of 300 or more raises its problem."""
        conn, path = self._connect(url)
        try:
            data = None if body is None else json.dumps(body, separators=(",", ":")).encode("utf-8")
            headers = {"Accept": f"{MEDIA_JSON}, {MEDIA_PROBLEM}"}
            if data is not None:
                headers["Content-Type"] = MEDIA_JSON
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(MAX_JSON_BODY + 1)
        except BaseException:
            conn.close()
            raise
        if len(raw) > MAX_JSON_BODY:
            conn.close()
            raise InvalidError("invalid: client: a response body past 64 MiB")
        self._release(conn, resp)
        if resp.status >= 300:
            raise _problem(resp.status, raw)
        if not raw:
            return resp.status, None, resp.headers
        from . import _json

        return resp.status, _json.loads(raw), resp.headers


def _problem(status: int, body: bytes) -> KVSPError:
    try:
        return problem_error(parse_problem(body[:MAX_ERROR_BODY], status))
    except KVSPError:
        from .errors import Problem

        return problem_error(Problem("about:blank", status))


class BlockStream:
    """A verified GET's layers, in order: iterate it (each layer once its
    octets arrived and its digests matched), then ``digests``. Use it as a
    context manager, or call :meth:`close`."""

    def __init__(
        self, client: Client, conn: http.client.HTTPSConnection, resp: http.client.HTTPResponse, reader: Reader
    ) -> None:
        self._client, self._conn, self.response, self._reader = client, conn, resp, reader
        self._done = False

    def __iter__(self) -> Iterator[Layer]:
        yield from self._reader
        self._done = True  # read to the end and verified: the connection can serve another request

    @property
    def digests(self) -> Digests:
        return self._reader.digests

    def close(self) -> None:
        if self._done:
            self._client._release(self._conn, self.response)
        else:
            self._conn.close()

    def __enter__(self) -> BlockStream:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Holder:
    """A holder's block and lease resources."""

    def __init__(self, client: Client, base: str) -> None:
        self._c, self.base = client, base

    def get_block(
        self,
        ref: BlockRef,
        g: Geometry,
        *,
        layers: tuple[int, int] | None = None,
        layer_digests: Sequence[bytes] | None = None,
    ) -> BlockStream:
        """GET a block, whole or layers [first, last] (inclusive), verified in
        one pass: the container digest against Repr-Digest (required,
        R-BLK-6) and each layer against ``layer_digests`` (indexed by model
        layer, as a replica record's), when given."""
        url = join(self.base, ref.path())
        if layers is not None:
            url += f"?layers={layers[0]}-{layers[1]}"
        conn, path = self._c._connect(url)
        try:
            conn.request(
                "GET", path, headers={"Accept": f"{MEDIA_BLOCK}, {MEDIA_PROBLEM}", "Accept-Encoding": "identity"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise _problem(resp.status, resp.read(MAX_ERROR_BODY))
            ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip()
            if ctype != MEDIA_BLOCK:
                raise InvalidError("invalid: client: a block answered with another Content-Type")
            try:
                whole = parse_repr_digest(resp.getheader("Repr-Digest") or "")
            except InvalidError as e:
                raise DigestMismatchError(f"client: {e}") from None
            return BlockStream(
                self._c, conn, resp, Reader(resp, g, layer_digests=layer_digests, container_digest=whole)
            )
        except BaseException:
            conn.close()
            raise

    def put_block(self, ref: BlockRef, data: bytes | memoryview, digest: bytes) -> bool:
        """PUT a container with If-None-Match: * and its Repr-Digest
        (R-BLK-12, A-4). False when the holder already had the block and
        kept it (412, R-BLK-14)."""
        conn, path = self._c._connect(join(self.base, ref.path()))
        try:
            # A holder that refuses the PUT (403) answers before it reads the
            # body and may reset the connection as the body arrives: the
            # answer waiting in the socket is read below all the same.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(
                    "PUT",
                    path,
                    body=bytes(data),
                    headers={"Content-Type": MEDIA_BLOCK, "If-None-Match": "*", "Repr-Digest": repr_digest(digest)},
                )
            resp = conn.getresponse()
            body = resp.read(MAX_ERROR_BODY)
        except BaseException:
            conn.close()
            raise
        self._c._release(conn, resp)
        if resp.status == 412:
            return False
        if not 200 <= resp.status < 300:
            raise _problem(resp.status, body)
        return True

    def lease(self, scope: ScopeID, compat: CompatID, keys: Sequence[BlockKey], ttl_ms: int) -> LeaseResponse:
        """POST leases (A-2): the blocks held for ttl_ms."""
        return self._c._call(_calls.lease(self.base, scope, compat, keys, ttl_ms))

    def release_lease(self, lease_id: str) -> None:
        """DELETE leases/{lease}."""
        self._c._call(_calls.release_lease(self.base, lease_id))


class IndexService:
    """The Index Service: publish, withdraw and look up replicas."""

    def __init__(self, client: Client, base: str) -> None:
        self._c, self.base = client, base

    def publish(self, record: dict[str, Any]) -> None:
        """PUT replicas/{holder-id}/{block_key}: the record is validated
        first, as the IS will validate it."""
        self._c._call(_calls.publish(self.base, record))

    def withdraw(self, holder: str, key: BlockKey) -> None:
        """DELETE replicas/{holder-id}/{block_key}."""
        self._c._call(_calls.withdraw(self.base, holder, key))

    def lookup(
        self, scope: ScopeID, compat: CompatID, keys: Sequence[BlockKey], targets: Sequence[str] = ()
    ) -> LookupResponse:
        """POST lookup: the longest prefix of keys with replicas (R-IS-11)."""
        return self._c._call(_calls.lookup(self.base, scope, compat, keys, targets))


def transient(e: BaseException) -> bool:
    """An error worth the same request again a moment later: no answer, or
    429, 502, 503, 504 (Go's client.transient)."""
    if isinstance(e, KVSPError):
        return isinstance(e, (TooManyRequestsError, UnavailableError)) or e.status in (429, 502, 503, 504)
    return isinstance(e, (OSError, http.client.HTTPException))


def _retrying(f: Callable[[], _T], retry: float, end: float) -> _T:
    """f(), again after retry seconds while it fails for a moment."""
    while True:
        try:
            return f()
        except Exception as e:
            if not transient(e) or time.monotonic() > end:
                raise
        time.sleep(retry)


class Controller:
    """The Placement Controller: place, instance status, checkpoints, maps."""

    def __init__(self, client: Client, base: str) -> None:
        self._c, self.base = client, base

    def place(
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
        """Where a request runs: its session, the instance and its epoch, the
        blocks matched, the prefetch directive sent, the placement grant.
        With ``session``: where that session continues."""
        return self._c._call(
            _calls.place(self.base, place_body(scope, compat, tokens, max_tokens, method, p, seed, session))
        )

    def put_status(self, record: dict[str, Any]) -> str:
        """PUT instances/{instance-id}/status: an Instance Status Record
        (validated first, as the PC validates it); returns the state the PC
        assigns (R-ST-9, A-19)."""
        return self._c._call(_calls.put_status(self.base, record))

    def put_checkpoint(self, record: dict[str, Any]) -> int:
        """PUT sessions/{session}/checkpoint: a Session Checkpoint (validated
        first); returns the output offset the PC acknowledged (A-24)."""
        return self._c._call(_calls.put_checkpoint(self.base, record))

    def update_map(self, update: dict[str, Any]) -> tuple[ShardMap, dict[str, int]]:
        """PUT maps/{map}: move a sequence-sharded context to its next map
        (validated first); returns once the members committed: the new map
        and the octets each member fetched."""
        return self._c._call(_calls.update_map(self.base, update))


class Instance:
    """An instance agent: generate, prefetch directives, its lifecycle
    state, session resumption and resharding."""

    def __init__(self, client: Client, base: str) -> None:
        self._c, self.base = client, base

    def prefetch(self, directive: dict[str, Any]) -> str:
        """POST prefetch: a Prefetch Directive (validated first); returns the
        Location of its status resource (R-PF-2). Not retried: the directive
        id makes a manual retry idempotent (A-17)."""
        return self._c._call(_calls.prefetch(self.base, directive))

    def prefetch_status(self, directive: bytes) -> PrefetchStatus:
        """GET prefetch/{id}: a directive's state (A-17)."""
        return self._c._call(_calls.prefetch_status(self.base, directive))

    def set_state(self, state: str) -> str:
        """PUT state: the instance's lifecycle state (A-19); returns it."""
        return self._c._call(_calls.set_state(self.base, state))

    def resume(self, epoch: int, checkpoint: dict[str, Any]) -> None:
        """POST sessions/{session}/resume: resume a session from its
        checkpoint at a new epoch (A-23)."""
        self._c._call(_calls.resume(self.base, epoch, checkpoint))

    def reshard(self, message: dict[str, Any]) -> tuple[str, int, int]:
        """POST reshard: a plan, commit or abort (A-26), validated first; a
        plan returns once the instance loaded its fetch ranges. Returns the
        acknowledgement: map, version, octets fetched."""
        return self._c._call(_calls.reshard(self.base, message))

    def generate(
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
    ) -> Generator[GeneratedToken, None, None]:
        """Run a placed request: its token lines as they come, each labelled
        with its index and the instance's epoch, the first with what the
        prefill reused and computed. A stream that ends before its done line
        raises UnavailableError."""
        body = generate_body(placed, scope, compat, tokens, max_tokens, method, p, seed, from_)
        conn, path = self._c._connect(join(self.base, "generate"))
        try:
            conn.request(
                "POST",
                path,
                body=json.dumps(body).encode("utf-8"),
                headers={"Content-Type": MEDIA_JSON, "Accept": "application/x-ndjson, " + MEDIA_PROBLEM},
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise _problem(resp.status, resp.read(MAX_ERROR_BODY))
            while True:
                line = resp.readline(MAX_ERROR_BODY)
                if not line:
                    raise UnavailableError("client: the token stream ended before its end")
                t = GeneratedToken.decode(line)
                if t.done:
                    if on_done is not None:
                        on_done(t)  # why the output ended
                    break
                yield t
            resp.read()
        except BaseException:
            conn.close()
            raise
        self._c._release(conn, resp)
