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


def _verify_two_trees(model):
    """seq 0: tree a-b, a-c, b-d over PROMPT; seq 1: chain x-y over PROMPT[:7]."""
    model.reset()
    model.add_new_sequence(0)
    model.add_new_sequence(1)
    model.batch_prefill(model.token_embed(PROMPT + PROMPT[:7]), [0, 1], [len(PROMPT), 7])
    model.batch_verify(
        model.token_embed([20, 21, 22, 23, 30, 31]), [0, 1], [4, 2], [-1, 0, 0, 1, -1, 0]
    )


def test_upstream_multi_sequence_commit_bug(setup):
    """TVM-0.27-TREE-COMMIT (runtime/model.py): the raw builtin corrupts sequence 0 here.
    When this test fails, upstream is fixed: drop Model._commit_by_recompute."""
    import tvm
    from tvm.runtime import ShapeTuple

    from mlcrun import abi

    model, ref = setup
    _verify_two_trees(model)
    tvm.get_global_func(abi.KV_COMMIT_TREE)(model.kv, ShapeTuple([0, 1]), ShapeTuple([3, 0]))
    model._trees = {}  # committed behind Model's back
    out = decode(model, [0, 1], [99, 98])
    assert np.abs(out[0] - expect(ref, PROMPT + [20, 21, 23, 99])).max() > 1e-2


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
