"""kvsp.attach against the real Go holder (the nogpu build, whose device
is the stand-in in host memory and takes memfd pools): an engine's pool
in a memfd, published by Python by page, is served over HTTPS; the
block fetched by the Go client (kvsp fetch) and by the Python client has
equal octets, the container of the engine's pages; unpublish waits for
the GET reading the pages; then the block is gone and withdrawn."""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from serving import ROOT, SERVER_ID, Proc, Served, binary, certs, free_ports

import kvsp
from kvsp.attach import AttachError, MemfdPool, Placement, Pool, Session
from kvsp.client import BlockRef

# A block of 256 tokens, 32 MiB: far more than a loopback socket buffers,
# so a GET whose reader pauses keeps the holder reading the pages.
DESCRIPTOR = (
    '{"model": "example-model", "model_digest": '
    '"sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda", "tokenizer_digest": '
    '"sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c", "layers": 32, "kv_heads": 8, '
    '"head_dim": 128, "kv_dtype": "bf16", "positional": "rope", "block_tokens": 256, "layout": "kvsp-layout-1"}'
)
PAGES = 3


@pytest.fixture(scope="module")
def attached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """kvsp serve of the nogpu build: its device tier is the stand-in."""
    yield from _attached(tmp_path_factory, nogpu=True)


@pytest.fixture(scope="module")
def attached_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """kvsp serve of the GPU build (bin/kvsp): its device tier is GPU 0.
    Without a GPU the test is skipped, or fails under KVSP_REQUIRE_GPU=1
    (make test-gpu's bundle sets it)."""
    if _cuda() is None:
        if os.environ.get("KVSP_REQUIRE_GPU") == "1":
            pytest.fail("KVSP_REQUIRE_GPU=1 and no CUDA device")
        pytest.skip("no CUDA device here: make test-gpu's bundle runs it on a GPU machine")
    yield from _attached(tmp_path_factory, nogpu=False)


def _cuda() -> ctypes.CDLL | None:
    """The CUDA driver, when it finds a device."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    n = ctypes.c_int()
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        return None
    return cu


def _attached(tmp_path_factory: pytest.TempPathFactory, nogpu: bool) -> Iterator[Served]:
    """The development deployment with a device tier and an attach socket."""
    d = tmp_path_factory.mktemp("attach")
    port, metrics = free_ports(2)
    conf = (ROOT / "examples" / "dev" / "kvsp.yaml").read_text()
    tiers = (
        "tiers: [{name: host, capacity: 1GiB, read_mbit_per_s: 400000}, "
        "{name: local-storage, capacity: 10GiB, path: h1-store}]"
    )
    assert tiers in conf
    conf = conf.replace(
        tiers,
        "tiers: [{name: device, capacity: 1GiB, device: 0}, {name: host, capacity: 1GiB, read_mbit_per_s: 400000}]\n"
        "    attach_socket: attach.sock",
    )
    (d / "kvsp.yaml").write_text(conf.replace("8443", str(port)).replace("9090", str(metrics)))
    (d / "descriptor.json").write_text(DESCRIPTOR)
    certs(d / "kvsp.yaml")
    proc = Proc(d / "kvsp.yaml", port, nogpu=nogpu).start()
    try:
        yield Served(d, f"https://127.0.0.1:{port}/")
    finally:
        proc.stop()


def _container(pool: Pool, mem: memoryview, page: int, g: kvsp.Geometry, first: int, count: int) -> bytes:
    """The container a PUT of the page's KV would store."""
    out = io.BytesIO()
    w = kvsp.Writer(out, kvsp.new_header(kvsp.CODEC_RAW, first, count, g))
    n = g.raw_section_len()
    for layer in range(first, first + count):
        k, v = pool.section(layer, page)
        w.write_layer(mem[k : k + n], mem[v : v + n])
    w.close()
    return out.getvalue()


def test_attached_pool_served_to_go_and_python(attached: Served) -> None:
    d = attached.dir
    desc = kvsp.parse_descriptor(DESCRIPTOR.encode())
    compat, g = desc.compat_id(), kvsp.Geometry.of(desc)
    key = kvsp.ScopeKey.from_hex((d / "scope-a.key").read_text())
    row = desc.kv_heads * desc.head_dim * 2
    pool = Pool.layer_major("memfd", desc.layers, PAGES, desc.block_tokens, row, offset=12345)
    pool.check(desc.layers, row)
    tokens = [random.Random(1).randrange(50000) for _ in range(2 * desc.block_tokens)]
    keys = kvsp.block_keys(key, compat, desc.block_tokens, tokens)

    with MemfdPool(pool.size, offset=pool.offset) as mem:
        mem.buf[:] = random.Random(2).randbytes(pool.size)  # the engine's KV
        want = {0: _container(pool, mem.buf, 0, g, 0, desc.layers), 2: _container(pool, mem.buf, 2, g, 0, desc.layers)}
        with Session(str(d / "attach.sock"), compat, pool, fd=mem.fd, engine="pytest") as s:
            s.publish(key.scope_id(), [Placement(keys[0], 0), Placement(keys[1], 2)])
            with pytest.raises(AttachError, match="outside the pool"):
                s.publish(key.scope_id(), [Placement(kvsp.BlockKey(bytes(32)), PAGES)])

            tool = attached.client()
            found = None
            for _ in range(200):  # published at the IS on the device tier
                found = tool.index(attached.base + "is/").lookup(key.scope_id(), compat, keys)
                if found.matched == 2:
                    break
                time.sleep(0.02)
            assert found is not None and found.matched == 2
            rec = found.replicas[0][0]
            assert rec.residency is not None and rec.residency[0].tier == "device"
            ref = BlockRef(compat, key.scope_id(), keys[0])
            url = attached.base + "h1/" + ref.path()

            # The Go client (kvsp fetch) and the Python client: the same octets.
            go = _go_fetch(attached, url)
            py = _py_fetch(attached, ref, g, None, rec.layer_digests)
            assert go == py == want[0]
            assert _go_fetch(attached, url, "5-9") == _py_fetch(attached, ref, g, (5, 9), None)
            assert _py_fetch(attached, ref, g, (5, 9), None) == _container(pool, mem.buf, 0, g, 5, 5)

            # Unpublish waits for the GET reading the pages: a reader that
            # took one layer and paused holds the holder mid-body.
            ref2 = BlockRef(compat, key.scope_id(), keys[1])
            stream = tool.holder(attached.base + "h1/").get_block(ref2, g)
            it = iter(stream)
            first = next(it)
            assert first.index == 0
            done = threading.Event()

            def unpublish() -> None:
                s.unpublish([keys[1]])
                done.set()

            t = threading.Thread(target=unpublish)
            t.start()
            assert not done.wait(0.5), "unpublish returned while a GET read the pages"
            rest = [layer.index for layer in it]
            stream.close()
            assert rest == list(range(1, desc.layers))  # every layer verified
            t.join(10)
            assert done.is_set()
            with pytest.raises(kvsp.NotFoundError):
                _py_fetch(attached, ref2, g, None, None)

        # The session ended: everything it published is gone, and withdrawn.
        for _ in range(250):
            if tool.index(attached.base + "is/").lookup(key.scope_id(), compat, keys).matched == 0:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the replicas were not withdrawn")
        with pytest.raises(kvsp.NotFoundError):
            _py_fetch(attached, ref, g, None, None)


def test_hello_refused(attached: Served) -> None:
    """A pool whose sections leave the memfd, or a compat_id the holder
    does not serve: the hello is refused with the holder's reason."""
    desc = kvsp.parse_descriptor(DESCRIPTOR.encode())
    row = desc.kv_heads * desc.head_dim * 2
    pool = Pool.layer_major("memfd", desc.layers, PAGES, desc.block_tokens, row)
    sock = str(attached.dir / "attach.sock")
    with MemfdPool(pool.size) as mem:
        with pytest.raises(AttachError, match="refused"):
            Session(sock, kvsp.CompatID(bytes(32)), pool, fd=mem.fd)
        with pytest.raises(kvsp.InvalidError, match="reach past the pool's"):
            dataclasses.replace(pool, size=pool.size - 1).check(desc.layers, row)
        larger = Pool.layer_major("memfd", desc.layers, PAGES + 1, desc.block_tokens, row)
        larger.check(desc.layers, row)
        with pytest.raises(AttachError, match="refused"):
            Session(sock, desc.compat_id(), larger, fd=mem.fd)  # the memfd is a page short
        with Session(sock, desc.compat_id(), pool, fd=mem.fd):
            pass  # the holder serves others after refusals


def _go_fetch(served: Served, url: str, layers: str | None = None) -> bytes:
    d = served.dir
    args = [str(binary()), "fetch", "--cert", str(d / "client.pem"), "--key", str(d / "client.key")]
    args += ["--ca", str(d / "ca.pem"), "--descriptor", str(d / "descriptor.json"), "--server-identity", SERVER_ID]
    if layers:
        args += ["--layers", layers]
    r = subprocess.run([*args, url], capture_output=True, check=False, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout


def _py_fetch(
    served: Served,
    ref: BlockRef,
    g: kvsp.Geometry,
    layers: tuple[int, int] | None,
    layer_digests: Sequence[bytes] | None,
) -> bytes:
    """The verified container the Python client receives (written back from
    its layers, as kvsp fetch writes it)."""
    first, last = layers or (0, g.layers - 1)
    out = io.BytesIO()
    w = kvsp.Writer(out, kvsp.new_header(kvsp.CODEC_RAW, first, last - first + 1, g))
    with served.client().holder(served.base + "h1/").get_block(ref, g, layers=layers, layer_digests=layer_digests) as s:
        for layer in s:
            w.write_layer(layer.k, layer.v)
    w.close()
    return out.getvalue()


@pytest.mark.gpu
def test_cuda_ipc_pool(attached_gpu: Served) -> None:
    """A cuda-ipc pool (device memory from cuMemAlloc, through ctypes: no
    torch), 4 KiB into its allocation as a caching allocator's tensor lies:
    the holder opens the handle on GPU 0 and serves the page's block, the
    container of what was copied there. Runs in make test-gpu's bundle."""
    from kvsp.attach import cuda_ipc_pool

    cu = _cuda()
    assert cu is not None
    d, served = attached_gpu.dir, attached_gpu
    desc = kvsp.parse_descriptor(DESCRIPTOR.encode())
    compat, g = desc.compat_id(), kvsp.Geometry.of(desc)
    key = kvsp.ScopeKey.from_hex((d / "scope-a.key").read_text())
    row = desc.kv_heads * desc.head_dim * 2
    layout = Pool.layer_major("memfd", desc.layers, PAGES, desc.block_tokens, row)
    host = random.Random(3).randbytes(layout.size)
    dev, ctx, base = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
    assert cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(layout.size + 4096)) == 0
    try:
        ptr = base.value + 4096
        assert cu.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), host, ctypes.c_size_t(layout.size)) == 0
        pool = cuda_ipc_pool(
            ptr, layout.size, device=0, pages=PAGES, page_tokens=desc.block_tokens,
            layer_stride=layout.layer_stride, v_offset=layout.v_offset, page_stride=layout.page_stride,
        )  # fmt: skip
        assert pool.offset == 4096 and pool.handle is not None and len(pool.handle) == 64
        keys = kvsp.block_keys(key, compat, desc.block_tokens, list(range(desc.block_tokens)))
        with Session(str(d / "attach.sock"), compat, pool, engine="pytest-cuda") as s:
            s.publish(key.scope_id(), [Placement(keys[0], 1)])
            ref = BlockRef(compat, key.scope_id(), keys[0])
            want = _container(layout, memoryview(host), 1, g, 0, desc.layers)
            assert _py_fetch(served, ref, g, None, None) == want
            assert _py_fetch(served, ref, g, (3, 4), None) == _container(layout, memoryview(host), 1, g, 3, 2)
    finally:
        cu.cuMemFree_v2(base)
