"""The engine attach protocol (docs/engine-attach.md), the engine's side:
an inference engine on the node hands the kvsp holder its paged KV pool
over a Unix socket and says which pages hold which blocks; the holder
then serves those blocks straight out of the engine's memory.

A pool is a ``memfd`` (for engines without a GPU, and for tests: the
descriptor rides with the hello frame, ``socket.send_fds``) or a
``cuda-ipc`` allocation (its ``cuIpcGetMemHandle`` handle, taken through
ctypes over the CUDA driver: no torch needed; a torch tensor is accepted
for its pointer). Frames are a 4-octet big-endian length and a JSON
object of at most 4 MiB; each request is answered by one frame, in order.

The same session speaks to an instance agent's socket (an engine
``connected`` to it): :meth:`Session.lend` gives it free pages to load
prefetched blocks into, :meth:`Session.claim` takes the loaded blocks
back, :meth:`Session.report` sends the engine's load."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from . import _json
from .errors import InvalidError, KVSPError
from .ids import BlockKey, CompatID, ScopeID

VERSION = 1
MAX_FRAME = 4 << 20
MAX_PAGE_TOKENS = 1 << 16
MAX_PAGES = 1 << 24
MEMORY_CUDA = "cuda-ipc"
MEMORY_MEMFD = "memfd"
_I64 = (1 << 63) - 1


class AttachError(KVSPError):
    """The other side refused a request (its reason), or broke the protocol."""


@dataclass(frozen=True)
class Pool:
    """An engine's paged KV pool: one region of ``size`` octets in which the
    K rows of (layer l, page p) start at ``l*layer_stride + p*page_stride``
    and its V rows ``v_offset`` octets later: ``page_tokens`` rows of
    kv_heads x head_dim elements, token after token. ``offset`` is where
    the region starts in the memfd or the CUDA allocation."""

    memory: str
    size: int
    pages: int
    page_tokens: int
    layer_stride: int
    v_offset: int
    page_stride: int
    device: int = 0
    handle: bytes | None = None
    offset: int = 0

    @classmethod
    def layer_major(cls, memory: str, layers: int, pages: int, page_tokens: int, row_bytes: int, **kw: Any) -> Pool:
        """vLLM's per-layer ``[2, pages, page_tokens, kv_heads, head_dim]``
        tensors allocated as one region, layer after layer."""
        page = page_tokens * row_bytes
        return cls(memory, layers * 2 * pages * page, pages, page_tokens, 2 * pages * page, pages * page, page, **kw)

    def section(self, layer: int, page: int) -> tuple[int, int]:
        """The offsets in the pool of the K and V rows of (layer, page)."""
        k = layer * self.layer_stride + page * self.page_stride
        return k, k + self.v_offset

    def check(self, layers: int, row_bytes: int) -> None:
        """The checks the holder makes of a pool against the model's geometry
        (rows of row_bytes octets), with its words: sections inside the pool,
        K and V apart, layers apart."""
        if not (
            0 < self.page_tokens <= MAX_PAGE_TOKENS
            and 0 < self.pages <= MAX_PAGES
            and 0 < layers <= 1 << 16
            and 0 < row_bytes <= 1 << 24
        ):
            raise InvalidError(
                f"attach: pool: pages (at most {MAX_PAGES}) of page_tokens (at most {MAX_PAGE_TOKENS}) "
                f"for {layers} layers of {row_bytes}-octet rows"
            )
        section = self.page_tokens * row_bytes
        if self.memory not in (MEMORY_CUDA, MEMORY_MEMFD):
            raise InvalidError(f"attach: pool memory {self.memory!r}: want {MEMORY_CUDA} or {MEMORY_MEMFD}")
        if self.memory == MEMORY_CUDA and (self.handle is None or len(self.handle) != 64):
            raise InvalidError(f"attach: a {MEMORY_CUDA} pool needs its 64-octet handle")
        if self.size <= 0 or self.layer_stride < 0 or self.page_stride < section or self.v_offset < section:
            raise InvalidError(
                "attach: pool: pages, size and strides must describe sections that do not overlap "
                "(v_offset and page_stride at least a section)"
            )
        if self.size > _I64 or self.offset < 0 or self.offset > _I64 - self.size:
            raise InvalidError("attach: pool: offset must be at least 0, and offset + size fit in 63 bits")
        end = (layers - 1) * self.layer_stride + (self.pages - 1) * self.page_stride + self.v_offset + section
        if end > self.size:
            raise InvalidError(f"attach: pool: its sections reach past the pool's {self.size} octets")
        extent = (self.pages - 1) * self.page_stride + self.v_offset + section
        if layers > 1 and (extent > _I64 or self.layer_stride < extent):
            raise InvalidError("attach: pool: layer_stride is shorter than a layer's pages: layers would overlap")

    def wire(self) -> dict[str, Any]:
        o: dict[str, Any] = {
            "memory": self.memory,
            "device": self.device,
            "size": self.size,
            "pages": self.pages,
            "page_tokens": self.page_tokens,
            "layer_stride": self.layer_stride,
            "v_offset": self.v_offset,
            "page_stride": self.page_stride,
        }
        if self.handle is not None:
            import base64

            o["handle"] = base64.b64encode(self.handle).decode("ascii")
        if self.offset:
            o["offset"] = self.offset
        return o


@dataclass(frozen=True)
class Placement:
    """Where a block's tokens are: ``page`` when pages are blocks; otherwise
    its ``pages`` from the one holding its first token, whose row there is
    ``offset``."""

    block_key: BlockKey
    page: int = 0
    pages: tuple[int, ...] | None = None
    offset: int = 0

    def wire(self) -> dict[str, Any]:
        o: dict[str, Any] = {"block_key": self.block_key.hex(), "page": self.page}
        if self.pages is not None:
            o["pages"] = list(self.pages)
        if self.offset:
            o["offset"] = self.offset
        return o

    @classmethod
    def decode(cls, o: Any) -> Placement:
        if not isinstance(o, dict):
            raise AttachError("attach: a block must be an object")
        try:
            pages = o.get("pages")
            return cls(
                BlockKey.parse(o["block_key"]),
                _int(o.get("page", 0), "page"),
                None if pages is None else tuple(_int(p, "pages") for p in pages),
                _int(o.get("offset", 0), "offset"),
            )
        except KeyError:
            raise AttachError("attach: a block: block_key: required") from None
        except (InvalidError, TypeError) as e:
            raise AttachError(f"attach: a block: {e}") from None


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise AttachError(f"attach: {what}: must be a non-negative integer")
    return v


@dataclass(frozen=True)
class Stats:
    """An engine's load, which the instance agent's status records carry."""

    running: int = 0
    queued: int = 0
    batch_size: int = 0
    kv_utilization: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


class MemfdPool:
    """A pool's memory in a memfd of ``size`` octets (from ``offset`` in
    it), mapped shared: what the engine writes, the holder reads."""

    def __init__(self, size: int, *, offset: int = 0, name: str = "kvsp-engine-pool") -> None:
        if size <= 0 or offset < 0:
            raise InvalidError("attach: a memfd pool of at least one octet, at an offset of at least 0")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, offset + size)
            self._map = mmap.mmap(self.fd, offset + size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.offset, self.size = offset, size
        self.buf = memoryview(self._map)[offset : offset + size]

    def close(self) -> None:
        self.buf.release()
        self._map.close()
        os.close(self.fd)

    def __enter__(self) -> MemfdPool:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


@dataclass
class _Conn:
    sock: socket.socket
    rest: bytearray = field(default_factory=bytearray)

    def write(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
        body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
        if len(body) > MAX_FRAME:
            raise InvalidError(f"attach: a frame of {len(body)} octets (at most {MAX_FRAME})")
        frame = struct.pack(">I", len(body)) + body
        n = socket.send_fds(self.sock, [frame], list(fds)) if fds else self.sock.send(frame)
        if n < len(frame):
            self.sock.sendall(frame[n:])

    def read(self) -> dict[str, Any]:
        hdr = self._exactly(4)
        (size,) = struct.unpack(">I", hdr)
        if size > MAX_FRAME:
            raise AttachError(f"attach: a frame of {size} octets (at most {MAX_FRAME})")
        try:
            m = _json.loads(self._exactly(size))
        except KVSPError as e:
            raise AttachError(f"attach: frame: {e}") from None
        if not isinstance(m, dict) or not isinstance(m.get("type"), str):
            raise AttachError("attach: a frame must be an object with a type")
        return m

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            b = self.sock.recv(n - len(out))
            if not b:
                raise AttachError("attach: the other side closed the connection")
            out += b
        return bytes(out)


class Session:
    """An engine's attach session (a connector's): hello with the pool, then
    publish, unpublish, and at an agent's socket lend, claim and report.
    Closing it (or leaving its ``with``) ends the session: the holder stops
    serving what it published, after the reads in flight."""

    def __init__(
        self, path: str, compat: CompatID, pool: Pool, *, fd: int | None = None, engine: str = "kvsp-python"
    ) -> None:
        if (pool.memory == MEMORY_MEMFD) != (fd is not None):
            raise InvalidError("attach: a memfd pool is sent with its descriptor, a cuda-ipc pool without one")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            self._c = _Conn(s)
            hello = {"type": "hello", "version": VERSION, "engine": engine, "compat_id": compat.hex()}
            hello["pool"] = pool.wire()
            self._c.write(hello, [fd] if fd is not None else [])
            self._answer("welcome")
        except BaseException:
            s.close()
            raise

    def _answer(self, want: str) -> dict[str, Any]:
        m = self._c.read()
        if m["type"] == "error":
            raise AttachError(f"attach: refused: {m.get('error', '')}")
        if m["type"] != want:
            raise AttachError(f"attach: {m['type']!r} where {want!r} was due")
        return m

    def _call(self, msg: dict[str, Any], want: str = "ok") -> dict[str, Any]:
        self._c.write(msg)
        return self._answer(want)

    def publish(self, scope: ScopeID, blocks: Iterable[Placement]) -> None:
        """Declare pages that hold blocks of scope; when it returns, the
        holder serves them (it read each once, for its digests). The engine
        must not write a published page until it unpublished it."""
        self._call({"type": "publish", "scope_id": scope.hex(), "blocks": [b.wire() for b in blocks]})

    def unpublish(self, keys: Iterable[BlockKey]) -> None:
        """Withdraw blocks: when it returns no read of their pages is in
        flight and none will start; the engine may reuse them."""
        self._call({"type": "unpublish", "block_keys": [k.hex() for k in keys]})

    def lend(self, pages: Iterable[int]) -> None:
        """Give an instance agent free pages to load blocks into."""
        self._call({"type": "lend", "pages": list(pages)})

    def claim(self) -> list[Placement]:
        """The blocks the agent loaded since the last claim: their pages are
        the engine's again, holding them."""
        m = self._call({"type": "claim"}, "claimed")
        blocks = m.get("blocks") or []
        if not isinstance(blocks, list):
            raise AttachError("attach: claimed: blocks must be an array")
        return [Placement.decode(b) for b in blocks]

    def report(self, stats: Stats) -> None:
        """Send the engine's load to the agent."""
        self._call({"type": "stats", "stats": dataclasses.asdict(stats)})

    def close(self) -> None:
        self._c.sock.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def cuda_ipc_pool(memory: Any, size: int | None = None, *, device: int | None = None, **layout: Any) -> Pool:
    """A ``cuda-ipc`` pool of device memory: ``memory`` is a device pointer
    (an int) or a torch tensor (its ``data_ptr()``, size and device).
    The handle names the whole allocation the pointer lies in (a caching
    allocator's segment); ``offset`` is the pointer's place in it.
    ``layout`` is the rest of :class:`Pool` (pages, page_tokens, strides).
    Through the CUDA driver (libcuda.so.1, ctypes): no torch needed."""
    if hasattr(memory, "data_ptr"):
        ptr = int(memory.data_ptr())
        size = size if size is not None else int(memory.numel()) * int(memory.element_size())
        device = device if device is not None else int(memory.device.index or 0)
    else:
        ptr = int(memory)
    if size is None or size <= 0:
        raise InvalidError("attach: a cuda-ipc pool needs its size")
    dev = device or 0
    base, alloc, handle = _cuda_ipc_handle(ptr, dev)
    if ptr - base + size > alloc:
        raise InvalidError(f"attach: the pool's {size} octets reach past its allocation's {alloc}")
    return Pool(MEMORY_CUDA, size, device=dev, handle=handle, offset=ptr - base, **layout)


def _cuda_ipc_handle(ptr: int, device: int) -> tuple[int, int, bytes]:
    """(allocation base, allocation size, 64-octet IPC handle) of a device
    pointer, with the device's primary context current if none is."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise InvalidError(f"attach: no CUDA driver here: {e}") from None

    def check(r: int, what: str) -> None:
        if r != 0:
            raise InvalidError(f"attach: {what}: CUDA error {r}")

    check(cu.cuInit(0), "cuInit")
    ctx = ctypes.c_void_p()
    check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        check(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    base, alloc = ctypes.c_uint64(), ctypes.c_size_t()
    check(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(alloc), ctypes.c_uint64(ptr)), "address range")
    handle = (ctypes.c_char * 64)()
    check(cu.cuIpcGetMemHandle(handle, ctypes.c_uint64(base.value)), "cuIpcGetMemHandle")
    return base.value, alloc.value, bytes(handle)
