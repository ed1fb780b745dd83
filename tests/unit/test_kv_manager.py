"""KVManager (the one owner of sequences, pages, prefix tree and retained LRU) and the
FakeRunner's token trees, which speculative decoding builds on."""

import numpy as np
import pytest
from fake_runner import FakeRunner

from mlcrun.engine.kv_manager import KVManager


def caches(n=2, pages=16, page_size=4):
    out = []
    for _ in range(n):
        runner = FakeRunner()
        runner.create_kv_cache(page_size, 8, pages * page_size, 64)
        out.append(runner)
    return out


def fill(runners, seq_id, tokens):
    for r in runners:
        r.batch_prefill(list(tokens), [seq_id], [len(tokens)])


def test_every_sequence_operation_is_mirrored_on_each_cache():
    target, draft = runners = caches()
    kv = KVManager(runners, 4, prefix_cache=True, max_retained=4)
    a, cached, _ = kv.open([1, 2, 3, 4, 5, 6])
    assert cached == 0 and a in target.seqs and a in draft.seqs
    fill(runners, a, [1, 2, 3, 4, 5, 6])
    kv.index(a, [1, 2, 3, 4, 5, 6])
    b, cached, _ = kv.open([1, 2, 3, 4, 5, 9])  # forks a's first five tokens on both
    assert cached == 5
    assert target.seqs[b] == draft.seqs[b] == [1, 2, 3, 4, 5]
    kv.popn(b, 2, caches=[draft])  # rejected drafts leave the draft cache only
    assert target.seqs[b] == [1, 2, 3, 4, 5] and draft.seqs[b] == [1, 2, 3]
    kv.popn(b, 3)
    assert target.seqs[b] == [1, 2] and draft.seqs[b] == []
    kv.close(a, keep=[1, 2, 3, 4, 5, 6])  # retained on both
    assert kv.num_retained == 1 and a in target.seqs and a in draft.seqs
    kv.close(b)
    assert b not in target.seqs and b not in draft.seqs
    assert kv.clear_retained() == 1
    assert not target.seqs and not draft.seqs
    assert kv.free_pages() == kv.total_pages == target.num_pages


def test_a_fork_takes_from_a_follower_only_what_it_holds():
    target, draft = runners = caches()
    kv = KVManager(runners, 4, prefix_cache=True, max_retained=4)
    a, _, _ = kv.open([])
    target.batch_prefill(list(range(1, 11)), [a], [10])
    draft.batch_prefill([1, 2, 3], [a], [3])  # the draft lags: it holds 3 of the 10 tokens
    kv.close(a, keep=list(range(1, 11)))  # the target's whole sequence is offered
    b, held, draft_held = kv.open(list(range(1, 10)) + [42])
    assert (held, draft_held) == (9, 3)
    assert target.seqs[b] == list(range(1, 10)) and draft.seqs[b] == [1, 2, 3]
    draft.remove_sequence(a)  # a draft that holds nothing of the parent starts empty
    draft.add_new_sequence(a)
    c, held, draft_held = kv.open(list(range(1, 6)))
    assert (held, draft_held) == (5, 0) and draft.seqs[c] == []


def test_free_pages_is_the_tightest_cache():
    big, small = caches(2)[0], caches(1, pages=4)[0]
    kv = KVManager([big, small], 4, prefix_cache=False, max_retained=0)
    assert kv.free_pages() == small.get_num_available_pages() == 5


def test_retained_sequences_are_evicted_least_recently_used_first():
    (runner,) = runners = caches(1)
    kv = KVManager(runners, 4, prefix_cache=True, max_retained=2)
    seqs = []
    for first in (10, 20, 30):
        seq_id, _, _ = kv.open([first, 1, 2])
        fill(runners, seq_id, [first, 1, 2])
        kv.close(seq_id, keep=[first, 1, 2])
        seqs.append(seq_id)
    assert seqs[0] not in runner.seqs and kv.num_retained == 2  # bounded: the oldest went
    _, cached, _ = kv.open([20, 1, 2, 7])  # a hit touches seqs[1]
    assert cached == 3
    assert kv.evict_oldest() and seqs[2] not in runner.seqs and seqs[1] in runner.seqs


def test_page_arithmetic():
    kv = KVManager(caches(1), 4, prefix_cache=False, max_retained=0)
    assert [kv.pages(n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert kv.new_pages(length=3, tokens=1) == 0 and kv.new_pages(length=4, tokens=1) == 1
    assert kv.fit(length=3, want=10, free=1) == 5  # 1 slot left in the page + 4 in a new one
    assert kv.fit(length=3, want=2, free=0) == 1


def decode_logits(runner, history, token):
    return runner.logits(history + [token])


def test_fake_runner_tree_verify_scores_every_path_and_commit_keeps_one():
    runner = caches(1, pages=8)[0]
    for s in (0, 1):
        runner.add_new_sequence(s)
    runner.batch_prefill([5, 6, 7, 8, 9, 10, 11], [0, 1], [4, 3])
    free = runner.get_num_available_pages()
    # seq 0: a tree 20 -> (21 -> 23, 22); seq 1: a chain 30 -> 31
    logits = runner.batch_verify([20, 21, 22, 23, 30, 31], [0, 1], [4, 2], [-1, 0, 0, 1, -1, 0])
    history0, history1 = [5, 6, 7, 8], [9, 10, 11]
    for row, path in enumerate([[20], [20, 21], [20, 22], [20, 21, 23]]):
        np.testing.assert_array_equal(logits[row], runner.logits(history0 + path))
    np.testing.assert_array_equal(logits[5], runner.logits(history1 + [30, 31]))
    assert runner.get_num_available_pages() < free  # every node took a slot
    with pytest.raises(AssertionError, match="commit"):
        runner.batch_decode([1, 1], [0, 1])  # TVM needs the commit first
    runner.commit_accepted_token_tree_nodes([0, 1], [2, 0])
    assert runner.seqs[0] == history0 + [20, 22] and runner.seqs[1] == history1 + [30]
    assert runner.get_num_available_pages() == free - 1  # seq 0 grew into a second page
    runner.batch_decode([40, 41], [0, 1])  # and forwards work again
