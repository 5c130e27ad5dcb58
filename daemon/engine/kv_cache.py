"""Block pool and per-sequence block tables for the paged KV cache.

Plain Python over plain data: it decides which cache blocks belong to which sequence,
and never touches tensors (the model runner owns the K/V tensors that the block ids
index; see wattserve_kernels/attention.py for the layout). No torch import here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of the pool; bytes_per_block counts K and V over all layers."""

    num_blocks: int
    block_size_tokens: int
    bytes_per_block: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(
    num_layers: int, block_size_tokens: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    return 2 * num_layers * block_size_tokens * kv_heads * head_dim * dtype_bytes


class KVCacheManager:
    """Hands out fixed-size blocks; a sequence's table grows as its tokens do."""

    def __init__(self, num_blocks: int, block_size_tokens: int) -> None:
        if num_blocks <= 0 or block_size_tokens <= 0:
            raise ValueError("num_blocks and block_size_tokens must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size_tokens
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def extra_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.table(seq_id)))

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow seq_id's table to hold num_tokens. All or nothing: False if the pool is short."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return False
        if need:
            table = self._tables.setdefault(seq_id, [])
            table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, seq_id: str) -> int:
        """Return seq_id's blocks to the pool; returns how many were freed."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(table)
        return len(table)
