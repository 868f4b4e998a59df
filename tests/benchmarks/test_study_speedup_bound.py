"""``benchmarks/study_speedup_bound.py``: the dynamic programme finds the fewest rounds (checked against a
breadth-first search over every commit choice on random rows), beats taking the longest commit each round where
that lands on a poor lookup, and stops rows at EOS."""

from __future__ import annotations

import random

from bench_module import load_bench


def _module():
    return load_bench("study_speedup_bound")


def _bfs_rounds(m, cont, acc):
    """Fewest rounds by breadth-first search over commit counts (commit_count cuts at EOS / max_new)."""
    end = next((i + 1 for i, t in enumerate(cont[: m.s.MAX_NEW]) if t in m.s.EOS), m.s.MAX_NEW)
    frontier, seen, rounds = {1}, {1}, 0
    while end not in frontier and frontier:
        nxt = set()
        for j in frontier:
            for n in range(acc[j - 1] + 1):
                count, finished = m.commit_count(cont[j: j + n + 1], n, m.s.MAX_NEW - j, m.s.EOS)
                nxt.add(end if finished else min(j + count, end))
        frontier, rounds = nxt - seen, rounds + 1
        seen |= nxt
    return rounds if end > 1 else 0


def test_fewest_rounds_matches_breadth_first_search():
    m = _module()
    rng = random.Random(0)
    for _ in range(60):
        cont = [rng.choice([5, 6, 7]) for _ in range(m.s.MAX_NEW + 40)]
        if rng.random() < 0.5:  # an EOS somewhere
            cont[rng.randrange(1, m.s.MAX_NEW)] = 2
        acc = [rng.choice([0, 0, 1, 3, 7, 15]) for _ in range(m.s.MAX_NEW)]
        assert m.fewest_rounds(cont, acc)[0] == _bfs_rounds(m, cont, acc)


def test_shorter_commit_can_need_fewer_rounds():
    m = _module()
    cont = [10, 11, 12, 13, 14, 2] + [9] * 200  # EOS as the 6th new token
    acc = [0] * m.s.MAX_NEW
    acc[0], acc[1] = 1, 3  # from 1 token: commit 1 or 2; from 2: up to 4, reaching the EOS
    rounds, new = m.fewest_rounds(cont, acc)
    assert new == 6 and rounds == 2  # 1 -> 2 -> 6; committing 2 first lands on 3 and takes 4 rounds
    assert m.fewest_rounds(cont, [0] * m.s.MAX_NEW) == (5, 6)  # one token per round


def test_no_eos_runs_to_max_new_tokens():
    m = _module()
    cont = [7] * (m.s.MAX_NEW + 40)
    assert m.fewest_rounds(cont, [15] * m.s.MAX_NEW) == (-(-(m.s.MAX_NEW - 1) // 16), m.s.MAX_NEW)


def test_verify_cost_weighs_rounds():
    m = _module()
    cont = [7] * (m.s.MAX_NEW + 40)
    rounds = -(-(m.s.MAX_NEW - 1) // 16)
    assert m.fewest_rounds(cont, [15] * m.s.MAX_NEW, 1.25) == (1.25 * rounds, m.s.MAX_NEW)
    # verify rounds dearer than the tokens they add: plain rounds only
    assert m.fewest_rounds(cont, [1] * m.s.MAX_NEW, 2.5) == (m.s.MAX_NEW - 1, m.s.MAX_NEW)
    # a verify round that commits 2 tokens for 1.5 plain steps beats two plain rounds
    assert m.fewest_rounds(cont, [1] * m.s.MAX_NEW, 1.5)[0] == 1.5 * ((m.s.MAX_NEW - 1) // 2) + 1
