"""KV-cache operations against plain decoding of the same tokens."""

import numpy as np
import pytest
from checkpoints import load_reference, reference_logits

from mlcrun.errors import MlcrunError
from mlcrun.runtime import Model

TOL = 1e-4
PROMPT = [1, 45, 77, 3, 200, 19, 8, 90, 33, 61, 250, 7, 11, 14, 5, 300, 42, 9]  # 18 > one page


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def loaded(request, checkpoints, artifacts):
    name = request.param
    return Model(artifacts(name)), load_reference(checkpoints(name))


@pytest.fixture
def setup(loaded):
    model, ref = loaded
    model.create_kv_cache()  # a fresh cache with the artifact's defaults for every test
    return model, ref


def prefill(model, seq_id, tokens):
    return model.batch_prefill(model.token_embed(tokens), [seq_id], [len(tokens)])[0]


def decode(model, seq_ids, tokens):
    return model.batch_decode(model.token_embed(tokens), seq_ids)


def expect(ref, tokens):
    return reference_logits(ref, tokens)[-1].numpy()


def test_decode_after_fork_equals_fresh_sequence(setup):
    model, ref = setup
    model.reset()
    model.add_new_sequence(0)
    prefill(model, 0, PROMPT)
    model.fork_sequence(0, 1, fork_pos=10)  # mid-page fork: the child shares the first 10
    model.fork_sequence(0, 2)  # full fork
    out = decode(model, [1, 2, 0], [123, 124, 125])
    np.testing.assert_allclose(out[0], expect(ref, PROMPT[:10] + [123]), atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], expect(ref, PROMPT + [124]), atol=TOL, rtol=0)
    np.testing.assert_allclose(out[2], expect(ref, PROMPT + [125]), atol=TOL, rtol=0)
    # The fresh sequence with the same tokens gives the same logits as the forked one.
    model.add_new_sequence(3)
    fresh = prefill(model, 3, PROMPT[:10] + [123])
    np.testing.assert_allclose(fresh, out[0], atol=TOL, rtol=0)
    assert model.sequence_length(1) == 11


def test_popn_then_decode_equals_never_appended(setup):
    model, ref = setup
    model.reset()
    model.add_new_sequence(0)
    prefill(model, 0, PROMPT)
    decode(model, [0], [50])
    decode(model, [0], [51])
    model.popn(0, 3)  # drops 51, 50 and the last prompt token
    out = decode(model, [0], [60])[0]
    np.testing.assert_allclose(out, expect(ref, PROMPT[:-1] + [60]), atol=TOL, rtol=0)
    with pytest.raises(MlcrunError):
        model.popn(0, 100)


def test_tree_verify_equals_sequential_paths_and_commit(setup):
    model, ref = setup
    model.reset()
    model.add_new_sequence(0)
    model.add_new_sequence(1)
    prefill(model, 0, PROMPT)
    prefill(model, 1, PROMPT[:7])
    # seq 0: a -> b -> d, a -> c ; seq 1: a chain x -> y
    tree0, parents0 = [20, 21, 22, 23], [-1, 0, 0, 1]
    tree1, parents1 = [30, 31], [-1, 0]
    logits = model.batch_verify(
        model.token_embed(tree0 + tree1), [0, 1], [4, 2], parents0 + parents1
    )
    paths0 = [[20], [20, 21], [20, 22], [20, 21, 23]]
    for i, path in enumerate(paths0):
        np.testing.assert_allclose(logits[i], expect(ref, PROMPT + path), atol=TOL, rtol=0)
    for i, path in enumerate([[30], [30, 31]]):
        np.testing.assert_allclose(logits[4 + i], expect(ref, PROMPT[:7] + path), atol=TOL, rtol=0)

    model.commit_accepted_token_tree_nodes([0, 1], [3, 0])  # keep a-b-d, and x
    assert model.sequence_length(0) == len(PROMPT) + 3
    assert model.sequence_length(1) == 8
    out = decode(model, [0, 1], [99, 98])
    np.testing.assert_allclose(out[0], expect(ref, PROMPT + [20, 21, 23, 99]), atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], expect(ref, PROMPT[:7] + [30, 98]), atol=TOL, rtol=0)


def test_pages_and_lengths_are_accounted(setup):
    model, _ = setup
    model.create_kv_cache(page_size=16, max_num_sequence=4, max_total_sequence_length=128)
    free = model.get_num_available_pages()
    model.add_new_sequence(0)
    prefill(model, 0, PROMPT)  # 18 tokens -> 2 pages
    assert model.get_num_available_pages() == free - 2
    assert model.get_current_total_sequence_length() == len(PROMPT)
    model.remove_sequence(0)
    assert model.get_num_available_pages() == free
    with pytest.raises(MlcrunError, match="not in the KV cache"):
        decode(model, [0], [5])


def test_context_window_is_enforced(setup):
    model, _ = setup
    model.add_new_sequence(0)
    window = model.artifact.context_window
    with pytest.raises(MlcrunError, match="context window"):
        prefill(model, 0, [5] * (window + 1))


def _verify_trees(model, seqs):
    """seqs: (seq_id, prompt length, tree tokens, tree parent pointers), prefilled then verified
    in this order."""
    model.reset()
    for seq_id, *_ in seqs:
        model.add_new_sequence(seq_id)
    model.batch_prefill(
        model.token_embed(sum((PROMPT[:n] for _, n, _, _ in seqs), [])),
        [s[0] for s in seqs],
        [s[1] for s in seqs],
    )
    return model.batch_verify(
        model.token_embed(sum((s[2] for s in seqs), [])),
        [s[0] for s in seqs],
        [len(s[2]) for s in seqs],
        sum((s[3] for s in seqs), []),
    )


TREE = (0, len(PROMPT), [20, 21, 22, 23], [-1, 0, 0, 1])  # not a chain; leaf 3: path a-b-d
CHAIN = (1, 7, [30, 31], [-1, 0])


@pytest.fixture
def upstream_order(monkeypatch):
    """batch_verify hands the sequences to the cache in the caller's order, as without
    TVM-0.27-TREE-COMMIT."""
    monkeypatch.setattr(Model, "_tree_commit_order", staticmethod(lambda t: list(range(len(t)))))


def _raw_commit(model, seq_ids, leaves):
    """The builtin itself, behind Model's back (no TVM-0.27-TREE-COMMIT ordering)."""
    import tvm
    from tvm.runtime import ShapeTuple

    from mlcrun import abi

    model._trees = {}
    tvm.get_global_func(abi.KV_COMMIT_TREE)(model.kv, ShapeTuple(seq_ids), ShapeTuple(leaves))


def test_upstream_multi_sequence_commit_bug(setup, upstream_order):
    """TVM-0.27-TREE-COMMIT (runtime/model.py): the raw builtin corrupts sequence 0 here,
    because the last sequence's tree is a chain (upstream's commit takes `is_chain` from the
    last sequence only, and then moves no K/V at all). When this test fails, upstream is
    fixed: drop Model._tree_commit_order."""
    model, ref = setup
    model.create_kv_cache()
    _verify_trees(model, [TREE, CHAIN])
    _raw_commit(model, [0, 1], [3, 0])
    out = decode(model, [0, 1], [99, 98])
    assert np.abs(out[0] - expect(ref, PROMPT + [20, 21, 23, 99])).max() > 1e-2
    np.testing.assert_allclose(out[1], expect(ref, PROMPT[:7] + [30, 98]), atol=TOL, rtol=0)


def test_upstream_commit_is_exact_when_last_tree_is_not_a_chain(setup, upstream_order):
    """What TVM-0.27-TREE-COMMIT relies on: the same trees verified and committed with the
    non-chain tree last are exact (upstream's compaction, CPU kernel included, is right)."""
    model, ref = setup
    model.create_kv_cache()
    _verify_trees(model, [CHAIN, TREE])
    _raw_commit(model, [1, 0], [0, 3])
    out = decode(model, [1, 0], [98, 99])
    np.testing.assert_allclose(out[0], expect(ref, PROMPT[:7] + [30, 98]), atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], expect(ref, PROMPT + [20, 21, 23, 99]), atol=TOL, rtol=0)


def test_upstream_commit_must_name_the_verified_batch(setup, upstream_order):
    """Why TVM-0.27-TREE-COMMIT cannot commit one sequence at a time instead: upstream's commit
    reads the verify's state by batch index (the copy kernel gets the verify's batch size, and
    PopN the verify's i-th sequence)."""
    model, _ = setup
    model.create_kv_cache()
    _verify_trees(model, [TREE, CHAIN])
    with pytest.raises(ValueError, match="batch_size"):
        _raw_commit(model, [0], [3])  # needs a copy: the kernel rejects a batch of one
    model.create_kv_cache()
    _verify_trees(model, [TREE, CHAIN])
    _raw_commit(model, [1], [1])  # no copy: pops sequence 0's tree, keeps all of sequence 1's
    assert model.sequence_length(0) == len(PROMPT) + 2
    assert model.sequence_length(1) == 7 + 2


@pytest.mark.parametrize(
    ("trees", "order"),
    [
        ([], []),
        ([[-1]], [0]),
        ([[-1, 0], [-1, 0, 1]], [0, 1]),  # all chains: nothing to move
        ([[-1, 0], [-1, 0, 0]], [0, 1]),  # the last tree is not a chain
        ([[-1, 0, 0], [-1, 0]], [1, 0]),
        ([[-1, 0, 0], [-1], [-1, -1], [-1, 0]], [0, 1, 3, 2]),  # the last non-chain moves
        ([[-1, 0, 0], [-1, 0], [-1]], [1, 2, 0]),
    ],
)
def test_tree_commit_order(trees, order):
    assert Model._tree_commit_order(trees) == order


def test_verify_logits_keep_the_callers_order_when_reordered(setup):
    """[TREE, CHAIN] runs as [CHAIN, TREE] in the cache (TVM-0.27-TREE-COMMIT); the logits and
    the commit still follow the caller's order."""
    model, ref = setup
    model.create_kv_cache()
    logits = _verify_trees(model, [TREE, CHAIN])
    paths = [[20], [20, 21], [20, 22], [20, 21, 23]]
    for i, path in enumerate(paths):
        np.testing.assert_allclose(logits[i], expect(ref, PROMPT + path), atol=TOL, rtol=0)
    for i, path in enumerate([[30], [30, 31]]):
        np.testing.assert_allclose(logits[4 + i], expect(ref, PROMPT[:7] + path), atol=TOL, rtol=0)
    with pytest.raises(MlcrunError, match="in order"):
        model.commit_accepted_token_tree_nodes([1, 0], [0, 3])
    model.commit_accepted_token_tree_nodes([0, 1], [3, 0])
    out = decode(model, [0, 1], [99, 98])
    np.testing.assert_allclose(out[0], expect(ref, PROMPT + [20, 21, 23, 99]), atol=TOL, rtol=0)
    np.testing.assert_allclose(out[1], expect(ref, PROMPT[:7] + [30, 98]), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_random_tree_batches_commit_exactly(setup, seed):
    model, ref = setup
    rng = np.random.default_rng(seed)
    for _ in range(6):
        model.reset()
        n = int(rng.integers(2, 4))
        sizes = rng.integers(1, 6, size=n).tolist()
        plens = rng.integers(1, len(PROMPT) + 1, size=n).tolist()
        parents = [[-1] + [int(rng.integers(0, j)) for j in range(1, s)] for s in sizes]
        leaves = [int(rng.integers(0, s)) for s in sizes]
        tokens = [rng.integers(3, 320, size=s).tolist() for s in sizes]
        for i in range(n):
            model.add_new_sequence(i)
        model.batch_prefill(
            model.token_embed(sum((PROMPT[:p] for p in plens), [])), list(range(n)), plens
        )
        model.batch_verify(
            model.token_embed(sum(tokens, [])), list(range(n)), sizes, sum(parents, [])
        )
        model.commit_accepted_token_tree_nodes(list(range(n)), leaves)
        out = decode(model, list(range(n)), [99] * n)
        for i in range(n):
            leaf, path = leaves[i], []
            while leaf >= 0:
                path.append(tokens[i][leaf])
                leaf = parents[i][leaf]
            want = expect(ref, PROMPT[: plens[i]] + path[::-1] + [99])
            np.testing.assert_allclose(
                out[i],
                want,
                atol=TOL,
                rtol=0,
                err_msg=f"sizes={sizes} parents={parents} leaves={leaves}",
            )


def _random_tree(rng, size, chain):
    """Parent pointers of a random tree of `size` nodes (a chain if `chain`; else a random
    tree, sometimes with a second root)."""
    if chain or size == 1:
        return [j - 1 for j in range(size)]
    parents = [-1] + [int(rng.integers(-1 if rng.random() < 0.1 else 0, j)) for j in range(1, size)]
    if parents == [j - 1 for j in range(size)]:
        parents[-1] = parents[-1] - 1  # make sure it is not a chain
    return parents


def _path(parents, leaf):
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_random_multi_step_tree_commits_are_exact(setup, seed):
    """TVM-0.27-TREE-COMMIT under stress: 2-6 sequences with arbitrary ids, two verify+commit
    rounds each in a random sequence order, chains and trees (often a chain last), accepted
    paths that need K/V moves and paths that do not, trees across page boundaries; every
    verify logit and the decode after the commits against the reference."""
    model, ref = setup
    rng = np.random.default_rng(100 + seed)
    for _ in range(3):
        n = int(rng.integers(2, 7))
        seq_ids = rng.choice(50, size=n, replace=False).tolist()
        history = {s: PROMPT[: int(rng.integers(1, len(PROMPT) + 1))] for s in seq_ids}
        model.reset()
        for s in seq_ids:
            model.add_new_sequence(s)
            prefill(model, s, history[s])  # one at a time: within the prefill chunk
        for _round in range(2):
            order = rng.permutation(seq_ids).tolist()
            last_chain = bool(rng.random() < 0.6)
            trees, tokens, leaves = [], [], []
            for k in range(len(order)):
                size = int(rng.integers(1, 9))
                chain = last_chain if k == len(order) - 1 else bool(rng.random() < 0.3)
                trees.append(_random_tree(rng, size, chain))
                tokens.append(rng.integers(3, 320, size=size).tolist())
                leaves.append(int(rng.integers(0, size)))
            logits = model.batch_verify(
                model.token_embed(sum(tokens, [])),
                order,
                [len(t) for t in trees],
                sum(trees, []),
            )
            row = 0
            for s, parents, toks in zip(order, trees, tokens, strict=True):
                for node in range(len(parents)):
                    path = [toks[j] for j in _path(parents, node)]
                    np.testing.assert_allclose(
                        logits[row],
                        expect(ref, history[s] + path),
                        atol=TOL,
                        rtol=0,
                        err_msg=f"verify: order={order} trees={trees} seq={s} node={node}",
                    )
                    row += 1
            model.commit_accepted_token_tree_nodes(order, leaves)
            for s, parents, toks, leaf in zip(order, trees, tokens, leaves, strict=True):
                history[s] = history[s] + [toks[j] for j in _path(parents, leaf)]
                assert model.sequence_length(s) == len(history[s])
        out = decode(model, seq_ids, [99] * n)
        for i, s in enumerate(seq_ids):
            np.testing.assert_allclose(
                out[i], expect(ref, history[s] + [99]), atol=TOL, rtol=0, err_msg=f"seq {s}"
            )
