"""Reading keys and values back from vLLM's paged KV cache, whatever the attention backend's layout: the KV
connector saves a chunk's last position from it, and the served attention rebuilds a request's state from the
blocks vLLM's prefix cache found for it."""

from __future__ import annotations

from typing import Any

import torch


class CacheReader:
    """Reads one slot's keys and values back from an attention layer's paged cache, whatever the backend's
    layout: it writes numbered probes into a one-block scratch copy with the backend's own cache-update op and
    records where each element lands (the CPU backend's blocks come first; a layout this does not recover is
    refused, not guessed)."""

    def __init__(self, layer: Any, cache: torch.Tensor, block_size: int) -> None:
        heads, dim = int(layer.num_kv_heads), int(layer.head_size)
        n = block_size * heads * dim
        if not cache.is_floating_point() or cache.element_size() < 2 or n > 255 * 256:
            raise RuntimeError(f"lcx's KV connector reads float caches of up to {255 * 256} elements a block; this one "
                               f"is {cache.dtype} with {n}")
        where = {}
        slots = torch.arange(block_size, dtype=torch.long, device=cache.device)
        for part in ("k", "v"):
            found = []
            for code in (torch.arange(n) % 255 + 1, torch.arange(n) // 255 + 1):  # exact in bf16/fp16 too
                probe = code.view(block_size, heads, dim).to(cache.device, cache.dtype)
                zero = torch.zeros_like(probe)
                scratch = torch.zeros_like(cache[:1])
                layer.impl.do_kv_cache_update(layer, *((probe, zero) if part == "k" else (zero, probe)), scratch, slots)
                found.append(scratch.flatten().long().cpu())
            low, high = found
            hit = low.nonzero().flatten()
            index = (low[hit] - 1) + 255 * (high[hit] - 1)
            if len(hit) != n or not torch.equal(index.sort().values, torch.arange(n)):
                raise RuntimeError(f"lcx's KV connector cannot read this attention backend's cache layout "
                                   f"({type(layer.impl).__name__}, cache {tuple(cache.shape)})")
            at = torch.empty(n, dtype=torch.long)
            at[index] = hit
            where[part] = at.view(block_size, heads, dim)
        self.where, self.block_size = where, block_size

    def read(self, cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = cache[slot // self.block_size].flatten()
        off = slot % self.block_size
        return (block[self.where["k"][off].to(block.device)].clone(),
                block[self.where["v"][off].to(block.device)].clone())

    def read_many(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``read`` of every slot in ``slots`` (n,): keys, values (n, H_kv, D)."""
        flat, per_block = cache.view(-1), cache[0].numel()
        slots = slots.to(cache.device)
        first = (slots // self.block_size * per_block)[:, None, None]  # each slot's block, as a flat offset
        off = slots % self.block_size
        return tuple(flat[first + self.where[part].to(cache.device)[off]] for part in ("k", "v"))


def write_cache(attn: Any, key: torch.Tensor, value: torch.Tensor, md: Any) -> None:
    """Writes this step's keys/values (1, Hkv, N, D) into vLLM's paged cache, through the backend's own op, as
    vLLM's attention would (lcx's answers the queries; vLLM's prefix cache hands these blocks to later
    requests with the same prefix, whose state ``CachedPrefix`` rebuilds from them)."""
    n = int(md.num_actual_tokens)
    attn.impl.do_kv_cache_update(attn, key[0, :, :n].transpose(0, 1).contiguous(),
                                 value[0, :, :n].transpose(0, 1).contiguous(), attn.kv_cache, md.slot_mapping[:n])


#: (cache shape, dtype, backend) -> ``CacheReader``, learned once per process
_READERS: dict[tuple, Any] = {}
#: vLLM's KV block size (``block_size``), once found
_BLOCK_SIZE: list[int] = []


class CachedPrefix:
    """``Seq.cached`` of row ``row``: the keys/values of its positions [0, start) in a layer's paged cache
    (blocks vLLM's prefix cache found for it)."""

    def __init__(self, md: Any, row: int, start: int) -> None:
        self.md, self.row, self.start = md, row, start

    def __call__(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        attn, md = module.attn, self.md
        cache = attn.kv_cache
        hint = cache[0].numel() // (2 * int(attn.num_kv_heads) * int(attn.head_size))  # a block holding K and V
        if not _BLOCK_SIZE:  # the server's block size: found once per process
            _BLOCK_SIZE.append(block_size(md, hint))
        bs = _BLOCK_SIZE[0]
        key = (tuple(cache.shape[1:]), cache.dtype, type(attn.impl).__name__)
        if key not in _READERS:
            _READERS[key] = CacheReader(attn, cache, bs)
        pos = torch.arange(self.start, device=md.block_table.device)
        slots = md.block_table[self.row, pos // bs].long() * bs + pos % bs
        k, v = _READERS[key].read_many(cache, slots)  # (n, Hkv, D)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


def block_size(md: Any, hint: int | None = None) -> int:
    """vLLM's KV block size, from a step's attention metadata: the one size for which every scheduled token's
    cache slot is its block-table entry's (the metadata does not carry it; the worker's config is not at
    hand in the attention function).  Where block ids happen to fit two sizes, ``hint`` (the size the cache's
    shape suggests: the CPU backend's blocks hold both keys and values) decides."""
    lens = md.seq_lens.tolist()
    starts = md.query_start_loc[:len(lens) + 1].tolist()
    table, slots = md.block_table.long(), md.slot_mapping.long()
    found = []
    for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        ok = True
        for i, total in enumerate(lens):
            n = starts[i + 1] - starts[i]
            if not n:
                continue
            pos = torch.arange(total - n, total, device=table.device)
            if int(pos[-1]) // bs >= table.shape[1] or not torch.equal(
                    table[i, pos // bs] * bs + pos % bs, slots[starts[i]:starts[i + 1]]):
                ok = False
                break
        if ok:
            found.append(bs)
    if len(found) > 1 and hint in found:
        return hint
    if len(found) != 1:
        raise RuntimeError(f"lcx: cannot tell vLLM's KV block size from this step's slots (fits: {found})")
    return found[0]


