"""BlockManager: property tests (hypothesis state machine) and targeted cases.

The state machine keeps its own model of every sequence (its length and the token ids it holds) and
a simulated physical pool: each append writes fresh token ids through the block table after applying
the copy-on-write pairs the manager returned. Reading every sequence back through its block table
must give exactly its modelled tokens, so a block handed out twice, a missing copy-on-write or a
block freed while still in use shows up as corrupted content, not only as a broken refcount.
"""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_accel.cache.block_manager import BlockManager, OutOfBlocksError


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _snapshot(m: BlockManager):
    return (
        {s: (m.block_table(s), m.length(s)) for s in m.sequences()},
        list(m._free),
        list(m._refcount),
        m.num_free_blocks,
    )


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / truncate / free / free_all sequences."""

    def __init__(self):
        super().__init__()
        self.m: BlockManager | None = None
        self.tokens: dict[int, list[int]] = {}  # model: seq id -> token ids it holds
        self.pool: dict[int, list] = {}  # simulated physical blocks: id -> block_size slots
        self.counter = itertools.count(1)

    # -- helpers ----------------------------------------------------------------------------------
    def _refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for s in self.tokens:
            for b in self.m.block_table(s):
                refs[b] = refs.get(b, 0) + 1
        return refs

    def _expected_need(self, seq: int, n: int) -> tuple[int, bool]:
        length = len(self.tokens[seq])
        bs = self.m.block_size
        cow = n > 0 and length % bs != 0 and self._refs()[self.m.block_table(seq)[-1]] > 1
        return _ceil(length + n, bs) - _ceil(length, bs) + int(cow), cow

    def _write(self, seq: int, start: int, values: list[int]) -> None:
        table, bs = self.m.block_table(seq), self.m.block_size
        for i, v in enumerate(values, start):
            self.pool.setdefault(table[i // bs], [None] * bs)[i % bs] = v

    def _pick(self, i: int) -> int:
        live = sorted(self.tokens)
        return live[i % len(live)]

    # -- rules ------------------------------------------------------------------------------------
    @precondition(lambda self: self.m is None)
    @rule(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def init(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size)
        assert self.m.num_free_blocks == num_blocks

    @precondition(lambda self: self.m is not None)
    @rule(n=st.integers(0, 40))
    def allocate(self, n):
        m = self.m
        need = _ceil(n, m.block_size)
        before = _snapshot(m)
        if need > m.num_free_blocks:
            with pytest.raises(OutOfBlocksError) as e:
                m.allocate(n)
            assert (e.value.needed, e.value.available) == (need, before[3])
            assert _snapshot(m) == before
            return
        s = m.allocate(n)
        assert s not in self.tokens
        assert m.length(s) == n and len(m.block_table(s)) == need
        values = [next(self.counter) for _ in range(n)]
        self.tokens[s] = values
        self._write(s, 0, values)

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(i=st.integers(0, 10**6), n=st.integers(0, 20))
    def append(self, i, n):
        m, s = self.m, self._pick(i)
        need, cow = self._expected_need(s, n)
        assert m.blocks_needed(s, n) == need
        before = _snapshot(m)
        if need > m.num_free_blocks:
            with pytest.raises(OutOfBlocksError) as e:
                m.append(s, n)
            assert (e.value.needed, e.value.available) == (need, before[3])
            assert _snapshot(m) == before
            return
        old_table = m.block_table(s)
        in_use = set(self._refs())
        copies = m.append(s, n)
        if cow:
            assert len(copies) == 1
            src, dst = copies[0]
            assert src == old_table[-1] and dst not in in_use
            assert m.block_table(s)[: len(old_table)] == old_table[:-1] + [dst]
            self.pool[dst] = list(self.pool[src])
        else:
            assert copies == []
            assert m.block_table(s)[: len(old_table)] == old_table
        assert m.num_free_blocks == before[3] - need
        new_blocks = m.block_table(s)[len(old_table):]
        assert not set(new_blocks) & in_use, "append handed out a block that is in use"
        values = [next(self.counter) for _ in range(n)]
        self._write(s, len(self.tokens[s]), values)
        self.tokens[s] += values

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=6), n=st.integers(0, 6))
    def append_together(self, picks, n):
        """One step of a batch (a cache's forward): ``n`` slots appended to each of several sequences. The joint
        count is exact: the appends take exactly that many blocks, or (more than are free) one of them fails. Forked
        rows sharing a partly filled last block were counted one copy too many."""
        m = self.m
        seqs = list(dict.fromkeys(self._pick(i) for i in picks))
        need = m.blocks_needed_together(seqs, n)
        trial = copy.deepcopy(m)
        try:
            for s in seqs:
                trial.append(s, n)
        except OutOfBlocksError:
            assert need > m.num_free_blocks
            return
        assert need == m.num_free_blocks - trial.num_free_blocks <= m.num_free_blocks
        for s in seqs:
            for src, dst in m.append(s, n):
                self.pool[dst] = list(self.pool[src])
            values = [next(self.counter) for _ in range(n)]
            self._write(s, len(self.tokens[s]), values)
            self.tokens[s] += values

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(i=st.integers(0, 10**6))
    def fork(self, i):
        m, s = self.m, self._pick(i)
        free = m.num_free_blocks
        child = m.fork(s)
        assert child not in self.tokens
        assert m.block_table(child) == m.block_table(s) and m.length(child) == m.length(s)
        assert m.num_free_blocks == free  # a fork takes no block
        self.tokens[child] = list(self.tokens[s])

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(i=st.integers(0, 10**6), frac=st.floats(0, 1))
    def truncate(self, i, frac):
        m, s = self.m, self._pick(i)
        new_len = int(len(self.tokens[s]) * frac)
        refs = self._refs()
        dropped = m.block_table(s)[_ceil(new_len, m.block_size):]
        freed = sum(1 for b in dropped if refs[b] == 1)
        free = m.num_free_blocks
        m.truncate(s, new_len)
        assert m.length(s) == new_len
        assert m.num_free_blocks == free + freed
        self.tokens[s] = self.tokens[s][:new_len]

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        m, s = self.m, self._pick(i)
        refs = self._refs()
        freed = sum(1 for b in m.block_table(s) if refs[b] == 1)
        free = m.num_free_blocks
        m.free(s)
        assert s not in m.sequences()
        assert m.num_free_blocks == free + freed
        del self.tokens[s]

    @precondition(lambda self: self.m is not None and self.m.num_blocks < 40)
    @rule(extra=st.integers(0, 6))
    def grow(self, extra):
        before = _snapshot(self.m)
        self.m.grow(extra)
        tables, free, _, num_free = before
        assert {s: (self.m.block_table(s), self.m.length(s)) for s in self.m.sequences()} == tables
        assert self.m.num_free_blocks == num_free + extra
        assert self.m._free[-len(free):] == free if free else True  # blocks free already are taken first

    @precondition(lambda self: self.m is not None and len(self.tokens) > 2)
    @rule()
    def free_all(self):
        self.m.free_all()
        assert self.m.sequences() == []
        assert self.m.num_free_blocks == self.m.num_blocks
        assert self.m.num_allocated_blocks == 0
        self.tokens.clear()

    # -- invariants (after every step) ------------------------------------------------------------
    @invariant()
    def consistent(self):
        m = self.m
        if m is None:
            return
        m.check()
        assert sorted(m.sequences()) == sorted(self.tokens)
        refs = self._refs()
        assert m.num_allocated_blocks == len(refs), "allocated blocks != blocks referenced by tables"
        assert not set(m._free) & set(refs)
        assert m.tokens_stored() == sum(len(t) for t in self.tokens.values())
        for s, toks in self.tokens.items():
            assert m.length(s) == len(toks)
            table = m.block_table(s)
            assert len(table) == _ceil(len(toks), m.block_size)
            got = [self.pool[table[i // m.block_size]][i % m.block_size] for i in range(len(toks))]
            assert got == toks, f"sequence {s} reads back {got}, expected {toks}"

    def teardown(self):
        if self.m is None:
            return
        for s in list(self.tokens):  # freeing one by one (forks included) returns every block
            self.m.free(s)
        self.m.check()
        assert self.m.num_free_blocks == self.m.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# --- targeted cases --------------------------------------------------------------------------------


def test_copy_on_write_exactly_for_shared_partly_filled_last_block():
    m = BlockManager(8, 4)
    a = m.allocate(6)  # blocks [0, 1], block 1 half full
    b = m.fork(a)
    assert m.block_table(b) == m.block_table(a) == [0, 1]
    assert m.blocks_needed(a, 1) == 1
    copies = m.append(a, 1)  # shared, partly filled -> private copy
    assert copies == [(1, 2)]
    assert m.block_table(a) == [0, 2] and m.block_table(b) == [0, 1]
    assert m.append(b, 1) == []  # block 1 is private to b now
    assert m.append(a, 1) == []  # block 2 is a's own
    m.check()

    # a full shared last block is not copied: the new tokens go to a fresh block
    c = m.allocate(4)
    d = m.fork(c)
    assert m.append(c, 2) == []
    assert m.block_table(c)[0] == m.block_table(d)[0]
    # appending 0 tokens never copies
    e = m.fork(a)
    assert m.append(e, 0) == [] and m.append(a, 0) == []
    m.check()
    m.free_all()
    assert m.num_free_blocks == 8


def test_truncate_into_shared_block_then_append_copies():
    m = BlockManager(6, 4)
    a = m.allocate(8)  # [0, 1], both full
    b = m.fork(a)
    m.truncate(b, 5)  # b keeps [0, 1] but block 1 is shared and now partly filled for b
    assert m.block_table(b) == [0, 1]
    assert m.append(b, 1) == [(1, 2)]
    m.truncate(a, 0)
    assert m.block_table(a) == [] and m.length(a) == 0
    m.check()
    assert m.num_allocated_blocks == 2  # b's [0, 2]; block 1 was freed by a's truncate


def test_out_of_blocks_message_and_state_unchanged():
    m = BlockManager(3, 16)
    a = m.allocate(20)  # 2 blocks
    before = _snapshot(m)
    with pytest.raises(OutOfBlocksError) as e:
        m.append(a, 60)  # 80 tokens: 5 blocks, 3 more
    assert (e.value.needed, e.value.available) == (3, 1)
    msg = str(e.value)
    assert "needed 3 more block(s) of 16 tokens" in msg and "1 free of 3" in msg
    assert _snapshot(m) == before
    with pytest.raises(OutOfBlocksError):
        m.allocate(33)
    assert _snapshot(m) == before
    # the failed operations took nothing: the remaining block is still usable
    m.append(a, 13)
    assert m.length(a) == 33 and m.num_free_blocks == 0
    m.check()


def test_out_of_blocks_counts_the_copy_on_write_block():
    m = BlockManager(2, 4)
    a = m.allocate(3)
    b = m.fork(a)
    m.allocate(4)  # takes the last free block
    before = _snapshot(m)
    with pytest.raises(OutOfBlocksError) as e:
        m.append(b, 1)  # would need a private copy of the shared block
    assert (e.value.needed, e.value.available) == (1, 0)
    assert _snapshot(m) == before


def test_argument_errors():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    m = BlockManager(4, 4)
    a = m.allocate(5)
    with pytest.raises(ValueError):
        m.append(a, -1)
    with pytest.raises(ValueError):
        m.truncate(a, 6)
    with pytest.raises(ValueError):
        m.truncate(a, -1)
    with pytest.raises(KeyError):
        m.append(99, 1)
    with pytest.raises(KeyError):
        m.fork(99)
    m.check()
    assert m.length(a) == 5


def test_non_integer_counts_and_unknown_ids_are_refused_with_the_state_unchanged():
    """Counts that are not ints (a float length was stored, ``grow(1.5)`` set num_blocks to 5.5 before raising and
    every later ``check`` failed) and a double free (a bare KeyError) raise naming the argument; nothing changes."""
    for args in ((4.0, 4), (4, True)):
        with pytest.raises(ValueError, match="must be an int"):
            BlockManager(*args)
    m = BlockManager(4, 4)
    a = m.allocate(5)
    for call, name in ((lambda: m.allocate(2.5), "num_tokens"), (lambda: m.allocate(-1), "num_tokens"),
                       (lambda: m.append(a, True), "num_tokens"), (lambda: m.append(a, 1.5), "num_tokens"),
                       (lambda: m.truncate(a, 1.5), "new_length"), (lambda: m.grow(1.5), "extra"),
                       (lambda: m.blocks_needed(a, 0.5), "num_new_tokens")):
        with pytest.raises(ValueError, match=name):
            call()
    assert (m.num_blocks, m.sequences(), m.length(a), m.num_free_blocks) == (4, [a], 5, 2)
    m.check()
    m.free(a)
    with pytest.raises(KeyError, match=f"unknown sequence id {a}"):
        m.free(a)
    m.check()


def test_low_ids_first_and_ids_never_reused():
    m = BlockManager(4, 2)
    a = m.allocate(3)
    assert m.block_table(a) == [0, 1]
    m.free(a)
    b = m.allocate(1)
    assert b != a
    assert m.num_allocated_blocks == 1
