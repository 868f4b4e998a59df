"""Block manager of a paged KV cache: a free list and reference counts over fixed-size blocks.

PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", §4.2-4.4): each sequence's KV cache is a list of physical blocks of ``block_size``
token slots (its *block table*); blocks are taken from a free list only when a sequence grows into
them, so at most ``block_size - 1`` slots per sequence are unused. Blocks can be shared between
sequences (a forked prefix) with a reference count; writing into a shared block first copies it
(copy-on-write, §4.4).

The manager is pure bookkeeping (host side, no tensors); the cache applies the copies it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_accel._checks import check_int


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than an operation needs; nothing was changed."""

    def __init__(self, needed: int, available: int, num_blocks: int, block_size: int):
        self.needed, self.available = needed, available
        super().__init__(
            f"paged KV cache out of blocks: needed {needed} more block(s) of {block_size} tokens, "
            f"{available} free of {num_blocks}; create the cache with a larger num_blocks (or a larger memory "
            "fraction, or PagedCache(..., growable=True)), or use a smaller batch / max_new_tokens"
        )


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored


class BlockManager:
    """Allocates ``num_blocks`` blocks of ``block_size`` token slots to sequences.

    Args:
        num_blocks: number of physical blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).

    Invariants (checked by :meth:`check`): every block is either free (refcount 0, on the free list
    once) or referenced by exactly ``refcount`` entries of the block tables; no sequence holds more
    blocks than ``ceil(length / block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int):
        num_blocks, block_size = check_int(num_blocks, "num_blocks"), check_int(block_size, "block_size")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._refcount = [0] * num_blocks
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of the sequence, in logical order."""
        return list(self._get(seq_id).blocks)

    def length(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def tokens_stored(self) -> int:
        return sum(s.length for s in self._seqs.values())

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Fresh blocks :meth:`append` would take (including a copy-on-write of a shared last block)."""
        s = self._get(seq_id)
        num_new_tokens = check_int(num_new_tokens, "num_new_tokens")
        new_len = s.length + num_new_tokens
        need = -(-new_len // self.block_size) - len(s.blocks)
        if num_new_tokens > 0 and s.length % self.block_size and self._refcount[s.blocks[-1]] > 1:
            need += 1
        return max(need, 0)

    def blocks_needed_together(self, seq_ids, num_new_tokens: int) -> int:
        """Fresh blocks that :meth:`append` of ``num_new_tokens`` to every sequence of ``seq_ids`` (distinct ids)
        would take in all. Less than the sum of :meth:`blocks_needed` where all the holders of a shared, partly
        filled last block append: each but the last copies it, and the last writes into it in place."""
        seq_ids = list(seq_ids)
        need = sum(self.blocks_needed(s, num_new_tokens) for s in seq_ids)
        if num_new_tokens > 0:
            appending: dict[int, int] = {}  # shared partly filled last block -> holders appending to it
            for s in map(self._get, seq_ids):
                if s.length % self.block_size and self._refcount[s.blocks[-1]] > 1:
                    appending[s.blocks[-1]] = appending.get(s.blocks[-1], 0) + 1
            need -= sum(k == self._refcount[b] for b, k in appending.items())
        return need

    # -- operations ---------------------------------------------------------------------------
    def allocate(self, num_tokens: int = 0) -> int:
        """A new sequence holding ``num_tokens`` slots; returns its id.

        Raises:
            OutOfBlocksError: not enough free blocks (nothing is allocated).
            ValueError: ``num_tokens`` not an int >= 0 (nothing is allocated).
        """
        num_tokens = check_int(num_tokens, "num_tokens", minimum=0)
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = _Sequence()
        try:
            self.append(seq_id, num_tokens)
        except OutOfBlocksError:
            del self._seqs[seq_id]
            raise
        return seq_id

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the sequence by ``num_tokens`` slots.

        Returns:
            Copy-on-write pairs (src_block, dst_block) the cache must copy before writing: the last,
            partly filled block was shared and has been replaced by a private copy.

        Raises:
            OutOfBlocksError: not enough free blocks (the sequence is unchanged).
            ValueError: ``num_tokens`` not an int >= 0.
        """
        num_tokens = check_int(num_tokens, "num_tokens")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        s = self._get(seq_id)
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(need, len(self._free), self.num_blocks, self.block_size)
        copies = []
        if num_tokens > 0 and s.length % self.block_size and self._refcount[s.blocks[-1]] > 1:
            src = s.blocks[-1]
            dst = self._take()
            self._refcount[src] -= 1
            s.blocks[-1] = dst
            copies.append((src, dst))
        s.length += num_tokens
        while len(s.blocks) * self.block_size < s.length:
            s.blocks.append(self._take())
        return copies

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing all blocks of ``seq_id`` (refcounts + 1); returns its id."""
        src = self._get(seq_id)
        child = self._next_id
        self._next_id += 1
        for b in src.blocks:
            self._refcount[b] += 1
        self._seqs[child] = _Sequence(blocks=list(src.blocks), length=src.length)
        return child

    def truncate(self, seq_id: int, new_length: int) -> None:
        """Shrink the sequence to ``new_length`` tokens (0 <= new_length <= length), freeing whole blocks."""
        s = self._get(seq_id)
        new_length = check_int(new_length, "new_length")
        if not 0 <= new_length <= s.length:
            raise ValueError(f"new_length {new_length} outside [0, {s.length}] for sequence {seq_id}")
        keep = -(-new_length // self.block_size)
        for b in s.blocks[keep:]:
            self._release(b)
        del s.blocks[keep:]
        s.length = new_length

    def free(self, seq_id: int) -> None:
        """Release all blocks of the sequence and forget it."""
        s = self._get(seq_id)
        del self._seqs[seq_id]
        for b in s.blocks:
            self._release(b)

    def grow(self, extra: int) -> None:
        """Add ``extra`` (>= 0) free blocks, ids ``num_blocks ..``; existing block tables are unchanged."""
        extra = check_int(extra, "extra")
        if extra < 0:
            raise ValueError(f"extra must be >= 0, got {extra}")
        old = self.num_blocks
        self.num_blocks += extra
        self._free[:0] = range(self.num_blocks - 1, old - 1, -1)  # taken after the blocks free already
        self._refcount += [0] * extra

    def free_all(self) -> None:
        for seq_id in list(self._seqs):
            self.free(seq_id)

    def check(self) -> None:
        """Assert the invariants (used by tests); raises AssertionError on corruption."""
        counts = [0] * self.num_blocks
        for s in self._seqs.values():
            assert len(s.blocks) == -(-s.length // self.block_size), "block count does not match length"
            for b in s.blocks:
                counts[b] += 1
        assert counts == self._refcount, "reference counts do not match the block tables"
        assert len(set(self._free)) == len(self._free), "a block is on the free list twice"
        for b in self._free:
            assert self._refcount[b] == 0, f"block {b} is free but referenced"
        assert sum(1 for c in counts if c == 0) == len(self._free), "a block leaked (unreferenced, not free)"

    # -- internals ----------------------------------------------------------------------------
    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id}") from None

    def _take(self) -> int:
        b = self._free.pop()
        self._refcount[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._refcount[b] -= 1
        if self._refcount[b] == 0:
            self._free.append(b)
