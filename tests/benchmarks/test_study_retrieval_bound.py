"""``benchmarks/study_retrieval_bound.py``'s datastore on a hand-made corpus: the candidates follow the longest
suffix found, the top path takes the commonest next token at each step, hindsight the best single continuation."""

from __future__ import annotations

import numpy as np
from bench_module import load_bench


def _module():
    return load_bench("study_retrieval_bound")


#            0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20
CORPUS = [9, 1, 2, 3, 4, 5, 0, 7, 1, 2, 3, 4, 6, 0, 8, 1, 2, 3, 5, 5, 0]


def test_candidates_follow_the_longest_suffix_found():
    m = _module()
    store = m.Datastore(np.array(CORPUS))
    # "1 2 3" occurs three times; "7 1 2 3" once (after position 11)
    assert store.after_suffix([1, 2, 3], 8).tolist() == [4, 11, 18]
    assert store.after_suffix([7, 1, 2, 3], 8).tolist() == [11]
    # a longer suffix that never occurs keeps the longest one that does
    assert store.after_suffix([6, 6, 7, 1, 2, 3], 8).tolist() == [11]
    assert store.after_suffix([4, 6, 6, 7, 1, 2, 3], 4).tolist() == [11]  # capped at 4 tokens
    assert store.after_suffix([2, 3, 9], 8).tolist() == [] and store.after_suffix([2, 3], 8).tolist() == []


def test_top_path_takes_the_commonest_next_token_and_hindsight_the_best_candidate():
    m = _module()
    store = m.Datastore(np.array(CORPUS))
    after = store.after_suffix([1, 2, 3], 8)  # continuations: 4 5 0 ..., 4 6 0 ..., 5 5 0 ...
    assert store.top_path(after, 2) == [4, 5]  # 4 twice; then 5 and 6 once each: the smaller id
    assert store.top_path(after, 3) == [4, 5, 0]
    assert store.best_match(after, [5, 5, 0, 8]) == 3  # only the third candidate, as far as it goes
    assert store.best_match(after, [4, 6, 0]) == 3
    assert store.best_match(after, [7]) == 0
    assert m.matched([4, 5, 0], [4, 5, 9]) == 2 and m.matched([], [1]) == 0
