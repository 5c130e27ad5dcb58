"""Block pool and per-sequence block tables for the paged KV cache, with prefix caching.

Plain Python over plain data: it decides which cache blocks belong to which sequence,
and never touches tensors (the model runner owns the K/V tensors that the block ids
index; see wattserve/kernels/attention.py for the layout). No torch import here.

With prefix caching on, a full block is content-addressed: its key is the SHA-256 of its
parent block's key and its own token ids, so equal keys mean equal token chains from
the start of the sequence (a collision would need a SHA-256 collision; token ids are not
compared again). Blocks are reference-counted: a cached prefix is shared by every
sequence that starts with it, and a block nobody references keeps its contents, stays
findable, and is reused (evicted, least recently released first) only when the pool has
no empty block left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping
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


@dataclass(frozen=True)
class PrefixMatch:
    """The cached full blocks a token sequence starts with (see KVCacheManager.match)."""

    block_ids: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()  # chain key of each of those blocks
    num_tokens: int = 0  # tokens those blocks hold


def _block_key(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class KVCacheManager:
    """Hands out fixed-size blocks; a sequence's table grows as its tokens do.

    Block table of one sequence (block_size 4), two sequences sharing a cached prefix:

        tokens  a: [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  . ]
        table   a: [    7       |     2       |     9      ]
        table   b: [    7       |     2       |     4      ]   refcount(7) = refcount(2) = 2
        key(7) = H(root, t0..t3), key(2) = H(key(7), t4..t7); 9 and 4 are private (not full)
    """

    def __init__(
        self, num_blocks: int, block_size_tokens: int, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks <= 0 or block_size_tokens <= 0:
            raise ValueError("num_blocks and block_size_tokens must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self._empty: deque[int] = deque(range(num_blocks))  # no content worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._cached: dict[bytes, int] = {}  # chain key -> block holding it
        self._key_of: dict[int, bytes] = {}  # block -> its chain key, for cached blocks
        self._seq_keys: dict[str, list[bytes]] = {}  # keys of a sequence's leading full blocks
        self._root = _block_key(b"", [])

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones plus cached ones nobody references."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reused last, LRU)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    @property
    def tables(self) -> Mapping[str, list[int]]:
        """Every sequence's block list by id (read them, never change them)."""
        return self._tables

    def extra_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.table(seq_id)))

    def set_namespace(self, name: str) -> None:
        """Key new blocks under `name`: blocks cached under another name are never matched
        again and age out LRU (KV computed at one weight level is not reused at another)."""
        self._root = _block_key(name.encode(), [])

    def _salted_root(self, salt: bytes) -> bytes:
        return _block_key(self._root + salt, []) if salt else self._root

    def match(self, token_ids: list[int], salt: bytes = b"") -> PrefixMatch:
        """The longest chain of cached full blocks token_ids starts with, leaving at least
        the last token uncovered (its logits are needed). Takes nothing: see allocate().
        salt: what else the blocks' KV depends on (a length-dependent rope's choice);
        blocks cached under another salt do not match."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        bs = self.block_size
        parent = self._salted_root(salt)
        blocks: list[int] = []
        keys: list[bytes] = []
        for i in range((len(token_ids) - 1) // bs):
            key = _block_key(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        return PrefixMatch(tuple(blocks), tuple(keys), len(blocks) * bs)

    def allocate(self, seq_id: str, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Grow seq_id's table to hold num_tokens. All or nothing: False if the pool is short.

        `prefix` (from match(), for a sequence with no table yet) puts those cached blocks
        first in the table, shared with whoever else holds them."""
        table = self._tables.get(seq_id)
        if prefix is None and table is not None and len(table) * self.block_size >= num_tokens:
            return True  # a decode inside its last block: the common case, nothing to take
        if prefix is not None and prefix.block_ids:
            if table:
                raise ValueError(f"sequence {seq_id!r} already has blocks; a prefix starts a table")
            reclaimed = sum(1 for b in prefix.block_ids if self._refs[b] == 0)
            need = self.blocks_for(num_tokens) - len(prefix.block_ids)
            if need > self.num_free_blocks - reclaimed:
                return False
            for b in prefix.block_ids:
                if self._refs[b] == 0:
                    del self._evictable[b]
                self._refs[b] += 1
            table = self._tables[seq_id] = list(prefix.block_ids)
            self._seq_keys[seq_id] = list(prefix.keys)
        else:
            need = self.extra_blocks_needed(seq_id, num_tokens)
            if need > self.num_free_blocks:
                return False
            if not need:
                return True
            table = self._tables.setdefault(seq_id, [])
        for _ in range(max(0, need)):
            block = self._take_block()
            self._refs[block] = 1
            table.append(block)
        return True

    def _take_block(self) -> int:
        if self._empty:
            return self._empty.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._key_of.pop(block)]
        return block

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], salt: bytes = b"") -> None:
        """Register seq_id's next full blocks, whose KV is now computed, under their keys.

        token_ids: the tokens of those blocks, a whole number of blocks, following the
        ones registered before (num_cached_blocks(seq_id) of them); salt: as in match()."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        keys = self._seq_keys.setdefault(seq_id, [])
        table = self._tables[seq_id]
        parent = keys[-1] if keys else self._salted_root(salt)
        for i in range(len(token_ids) // bs):
            key = _block_key(parent, token_ids[i * bs : (i + 1) * bs])
            block = table[len(keys)]
            # An equal block computed by another sequence in the same step stays private.
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key
            keys.append(key)
            parent = key

    def num_cached_blocks(self, seq_id: str) -> int:
        """How many of seq_id's leading blocks are registered (by it or before it)."""
        return len(self._seq_keys.get(seq_id, ()))

    def free(self, seq_id: str) -> int:
        """Drop seq_id's references; returns how many blocks its table held. A block nobody
        references returns to the pool, keeping its contents if it is cached."""
        table = self._tables.pop(seq_id, [])
        self._seq_keys.pop(seq_id, None)
        # Tail first: a chain's last blocks are the least shared, so they are evicted first.
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._empty.append(block)
        return len(table)
