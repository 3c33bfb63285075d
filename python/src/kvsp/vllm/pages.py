"""vLLM's paged KV tensors to and from kvsp-layout-1, one layer at a time,
by vectorized copies (never a Python loop over tokens or heads).

kvsp-layout-1 holds a block's K (then V) section as
``[block_tokens, kv_heads, head_dim]``, token slowest. vLLM keeps one
tensor per layer, its pages of ``page`` tokens, in the layout of its
attention backend; a kvsp block is ``block_tokens`` consecutive tokens of
one page (``block_tokens`` divides ``page``), at a token offset in it:

- ``hnd``, vLLM's CPU backend: ``[pages, kv_heads, page, 2 * head_dim]``,
  K in the first half of the last dimension, V in the second: per head, so
  a token's K rows are ``kv_heads`` strided pieces.
- ``nhd``, FlashAttention's (CUDA): ``[2, pages, page, kv_heads, head_dim]``.
"""

from __future__ import annotations

from typing import Any

import torch

LAYOUTS = ("hnd", "nhd")


def detect_layout(t: torch.Tensor, kv_heads: int, head_dim: int) -> str:
    """The layout of one layer's tensor, or ValueError naming its shape."""
    s = tuple(t.shape)
    if len(s) == 4 and s[1] == kv_heads and s[3] == 2 * head_dim:
        return "hnd"
    if len(s) == 5 and s[0] == 2 and s[3] == kv_heads and s[4] == head_dim:
        return "nhd"
    raise ValueError(
        f"kvsp connector: a KV cache tensor of shape {list(s)}: neither [pages, {kv_heads}, page, {2 * head_dim}]"
        f" (CPU) nor [2, pages, page, {kv_heads}, {head_dim}] (FlashAttention)"
    )


def page_tokens(t: torch.Tensor) -> int:
    """Tokens per page: dimension 2 in both layouts."""
    return int(t.shape[2])


def gather(t: torch.Tensor, layout: str, pages: torch.Tensor, subs: torch.Tensor, bt: int) -> tuple[Any, Any]:
    """K and V of n blocks of one layer, each ``[n, bt, kv_heads, head_dim]``
    contiguous on the host: block i is tokens ``subs[i]*bt ..`` of page
    ``pages[i]``."""
    if layout == "hnd":
        n_pages, heads, page, d2 = t.shape
        sel = t.view(n_pages, heads, page // bt, bt, d2)[pages, :, subs]  # [n, heads, bt, 2D]
        sel = sel.permute(0, 2, 1, 3)  # [n, bt, heads, 2D]
        d = d2 // 2
        k, v = sel[..., :d], sel[..., d:]
    else:
        _, n_pages, page, heads, d = t.shape
        sel = t.view(2, n_pages, page // bt, bt, heads, d)[:, pages, subs]  # [2, n, bt, heads, D]
        k, v = sel[0], sel[1]
    return k.contiguous().cpu(), v.contiguous().cpu()


def scatter(t: torch.Tensor, layout: str, page: int, off: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write one block's K and V (``[bt, kv_heads, head_dim]``, host) of one
    layer into tokens ``off ..`` of a page."""
    bt = k.shape[0]
    if layout == "hnd":
        d = k.shape[2]
        t[page, :, off : off + bt, :d].copy_(k.permute(1, 0, 2))
        t[page, :, off : off + bt, d:].copy_(v.permute(1, 0, 2))
    else:
        t[0, page, off : off + bt].copy_(k)
        t[1, page, off : off + bt].copy_(v)


def as_bytes(x: torch.Tensor) -> memoryview:
    """A contiguous host tensor's octets (little-endian elements, as the layout wants)."""
    return memoryview(x.view(torch.uint8).numpy()).cast("B")


def from_bytes(b: memoryview, dtype: torch.dtype, bt: int, heads: int, d: int) -> torch.Tensor:
    return torch.frombuffer(b, dtype=torch.uint8).view(dtype).view(bt, heads, d)
