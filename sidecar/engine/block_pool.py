"""KV block pool: blocks, ref counts, an O(1) LRU free queue and the prefix-hash map.

Invariants:
- A block is in the free queue iff its ref count is 0.
- A block keeps its hash (and stays findable through ``cached``) after it is
  freed; the hash is dropped only when the block is taken for new content
  (eviction happens at reuse, oldest-freed first).
- A block has a hash iff it is ``cached[hash]`` or in ``duplicates[hash]``: a block
  computed again while its key was cached (two sequences computing one prefix at
  once, or a hybrid model's hit cut short at a block without a state checkpoint)
  holds the same tokens, and takes over the key when the registered copy is evicted,
  so the prefix stays findable as long as one copy lives.
- Block 0 is never handed out: it is the padding target of block tables.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Iterable, Optional


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "parent_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.token_ids: Optional[tuple[int, ...]] = None  # stored to verify prefix hits
        self.parent_hash: Optional[bytes] = None  # the previous block's key in its chain (None: the first)
        self.prev_free: Optional[KVBlock] = None
        self.next_free: Optional[KVBlock] = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed), append at the tail,
    remove from anywhere in O(1) (a prefix hit revives a free cached block)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def ids(self) -> list[int]:
        out, b = [], self.head.next_free
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next_free
        return out


def hash_block(parent: Optional[bytes], token_ids: tuple[int, ...], salt: Optional[str]) -> bytes:
    """Chained key of a full block. The salt (tenant) enters through the first block's parent,
    so every block of a chain carries it."""
    h = hashlib.sha256()
    if parent is None:
        h.update(b"root:" + (salt or "").encode("utf-8"))
    else:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks: need at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[0].ref_cnt = 1  # reserved padding block, never freed
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.duplicates: dict[bytes, list[KVBlock]] = {}  # other blocks with a cached key's tokens
        # Called with a cached block (its hash and tokens still set, its data intact) just before
        # allocate() drops its hash for new content: the offload tiers copy it out here.
        self.on_evict: Optional[Callable[[KVBlock], None]] = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_usable_blocks

    def get_cached(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Optional[KVBlock]:
        """The cached block with this key and exactly these tokens, or None."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the free queue head, evicting their cached keys.
        The caller checks ``num_free_blocks()`` first; raises IndexError otherwise."""
        if n > self.free_queue.num_free:
            raise IndexError(f"need {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._unregister(block)
                block.block_hash = None
                block.token_ids = None
                block.parent_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (possibly free) cached blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue tail in the given order,
        so the first given is evicted first."""
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self,
        block: KVBlock,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent_hash: Optional[bytes] = None,
    ) -> None:
        """Register a full block under its key (``parent_hash``: the chain's previous block's). An existing
        entry for the key stays the one hits find; the new block becomes its duplicate, which takes the key
        over when that entry is evicted (``allocate``)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        first = self.cached.setdefault(block_hash, block)
        if first is not block:
            self.duplicates.setdefault(block_hash, []).append(block)

    def _unregister(self, block: KVBlock, evicted: bool = True) -> None:
        """Drop ``block`` from the key map: a duplicate, if one lives, takes the key over (a held one
        first: it is the last to be evicted); else the key leaves the pool (through ``on_evict`` when
        ``evicted``: the block is about to take new content)."""
        h = block.block_hash
        dups = self.duplicates.get(h)
        if self.cached.get(h) is block:
            if dups:
                dups.sort(key=lambda b: b.ref_cnt > 0)
                self.cached[h] = dups.pop()
            else:
                if evicted and self.on_evict is not None:
                    self.on_evict(block)
                del self.cached[h]
        elif dups and block in dups:
            dups.remove(block)
        if dups is not None and not dups:
            del self.duplicates[h]

    def reset_prefix_cache(self) -> None:
        """Forget every free block's key; keys of blocks in use stay (one of their blocks registered)."""
        for block in self.blocks[1:]:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._unregister(block, evicted=False)
                block.block_hash = None
                block.token_ids = None
                block.parent_hash = None

    def consistent(self) -> bool:
        """The key map's invariant: every block with a hash is its key's entry or one of its duplicates,
        and nothing else is listed."""
        listed = list(self.cached.items()) + [(h, b) for h, d in self.duplicates.items() for b in d]
        hashed = sorted(b.block_id for b in self.blocks if b.block_hash is not None)
        return all(b.block_hash == h for h, b in listed) and sorted(b.block_id for _, b in listed) == hashed
