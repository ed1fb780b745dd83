"""runtime.Model on TVM's runtime alone (runtime/ffi.py): the same results as with all of tvm
imported, logits handed out without copies that later forwards leave alone, sequence
bookkeeping without C++ exceptions, and the decode profile."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mlcrun import LLM, MlcrunError, SamplingParams
from mlcrun.bench.profile import profile_decode
from mlcrun.runtime import Model, ffi

PROMPT = [1, 5, 9, 14, 3]


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_generate_without_the_tvm_package_equals_generate_with_it(artifacts):
    folder = artifacts("llama")  # compiled in this process: tvm is imported here
    assert "tvm.relax" in sys.modules
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    llm = LLM(folder)
    here = [o.token_ids for o in llm.generate([PROMPT, PROMPT], [params, sampled])]
    code = (
        "import json, sys\n"
        "from mlcrun import LLM, SamplingParams\n"
        f"llm = LLM({str(folder)!r})\n"
        "outs = llm.generate([{p}, {p}], [SamplingParams(max_tokens=10, temperature=0, "
        "ignore_eos=True), SamplingParams(max_tokens=10, temperature=0.8, seed=3, "
        "ignore_eos=True)])\n"
        "tvm = sorted({{m.split('.')[0] for m in sys.modules if m.startswith('tvm')}})\n"
        "compiler = 'libtvm_compiler' in open('/proc/self/maps').read()\n"
        "print(json.dumps([[o.token_ids for o in outs], tvm, compiler]))"
    ).format(p=PROMPT)
    tokens, modules, compiler = json.loads(_run(code))
    assert modules == ["tvm_ffi"] and not compiler
    assert tokens == here


def test_chat_cli_runs_on_the_tvm_runtime_only(artifacts):
    folder = artifacts("llama")
    code = (
        "import atexit, sys\n"
        "def report():\n"
        "    mods = sorted({m.split('.')[0] for m in sys.modules if m.startswith('tvm')})\n"
        "    maps = open('/proc/self/maps').read()\n"
        "    print(mods, 'libtvm_compiler' in maps, 'torch' in sys.modules)\n"
        "atexit.register(report)\n"
        "from mlcrun.cli.main import main\n"
        f"sys.argv = ['mlcrun', 'chat', {str(folder)!r}, '--prompt', 'Hi', "
        "'--max-tokens', '3', '--temperature', '0']\n"
        "main()\n"
    )
    assert _run(code) == "['tvm_ffi'] False False"


@pytest.fixture(scope="module")
def model(artifacts):
    return Model(artifacts("llama"))


def test_logits_are_not_overwritten_by_later_forwards(model):
    model.create_kv_cache()
    model.add_new_sequence(0)
    model.add_new_sequence(1)
    prefill = model.batch_prefill(model.token_embed(PROMPT + PROMPT[:3]), [0, 1], [5, 3])
    kept_prefill = prefill.copy()
    first = model.batch_decode(model.token_embed([7, 8]), [0, 1])
    kept = first.copy()
    for token in range(10, 16):
        later = model.batch_decode(model.token_embed([token, token + 1]), [0, 1])
        assert not np.shares_memory(later, first)
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_array_equal(prefill, kept_prefill)
    first[:] = 0  # the caller's own memory: writing to it breaks nothing
    again = model.batch_decode(model.token_embed([20, 21]), [0, 1])
    assert np.isfinite(again).all() and again.any()


def test_embeddings_do_not_share_the_staged_ids(model):
    a = model.token_embed([3, 4])
    a_values = ffi.as_numpy(a).copy()
    b = model.token_embed([5, 6])
    c = model.token_embed(list(range(100)))  # grows the staging buffer
    np.testing.assert_array_equal(ffi.as_numpy(a), a_values)
    np.testing.assert_array_equal(ffi.as_numpy(model.token_embed([3, 4])), a_values)
    np.testing.assert_array_equal(ffi.as_numpy(c)[5:7], ffi.as_numpy(b))
    with pytest.raises(MlcrunError, match="token ids must be in"):
        model.token_embed([model.vocab_size])
    with pytest.raises(MlcrunError, match="token ids must be in"):
        model.token_embed(np.array([-1, 2]))


def test_sequence_bookkeeping_follows_the_cache(model):
    model.create_kv_cache()
    model.add_new_sequence(0)
    with pytest.raises(MlcrunError, match="already exists"):
        model.add_new_sequence(0)
    model.batch_prefill(model.token_embed(PROMPT), [0], [len(PROMPT)])
    model.fork_sequence(0, 1, 3)
    assert model.sequence_length(1) == 3
    with pytest.raises(MlcrunError, match="already exists"):
        model.fork_sequence(0, 1)
    with pytest.raises(MlcrunError, match="sequence 7 is not in the KV cache"):
        model.fork_sequence(7, 8)
    model.remove_sequence(0)
    with pytest.raises(MlcrunError, match="not in the KV cache"):
        model.sequence_length(0)
    model.add_new_sequence(0)  # the id is free again
    assert model.sequence_length(0) == 0
    model.reset()
    with pytest.raises(MlcrunError, match="not in the KV cache"):
        model.remove_sequence(1)
    model.add_new_sequence(1)
    model.create_kv_cache()  # a new cache holds nothing
    with pytest.raises(MlcrunError, match="not in the KV cache"):
        model.sequence_length(1)


@pytest.mark.parametrize("tokens", [1, 3])
def test_profile_runs_more_steps_than_the_slack_and_names_other(model, tokens):
    """tokens = 3: each step a verify of a 3-token chain per sequence and its commit, which the
    cache must have room for (3 x 2 x 30 tokens per round beyond the depth, within the test
    model's 256-token window)."""
    steps = 40 if tokens == 1 else 30
    profile = profile_decode(model, batch=2, depth=16, steps=steps, rounds=2, tokens=tokens)
    assert profile["tokens"] == tokens
    names = [k["name"] for k in profile["kernels"]]
    assert "other" in names and "VM builtins" in names
    assert any("attention" in name for name in names)
    for seq in (0, 1):  # every sequence removed again
        with pytest.raises(MlcrunError, match="not in the KV cache"):
            model.sequence_length(seq)
    assert profile["step_ms"] > 0 and all(k["ms"] >= 0 for k in profile["kernels"])
    assert all(0 <= k["share"] for k in profile["kernels"])


def test_profile_prefills_a_depth_beyond_the_prefill_chunk_in_chunks(model):
    """The artifact's prefill chunk is 64 tokens: a depth of 100 is two forwards."""
    profile = profile_decode(model, batch=1, depth=100, steps=4, rounds=1)
    assert profile["depth"] == 100 and profile["step_ms"] > 0
    with pytest.raises(MlcrunError, match="not in the KV cache"):
        model.sequence_length(0)


def test_a_forward_over_the_prefill_chunk_is_refused_by_name(model):
    """The KV cache's workspaces hold one prefill chunk (64 tokens here, or what
    create_kv_cache was given): a longer forward is refused before it runs, and the cache
    takes the same tokens in chunks."""
    model.create_kv_cache(prefill_chunk_size=32)
    model.add_new_sequence(0)
    ids = list(range(3, 36))  # 33 tokens
    with pytest.raises(
        MlcrunError, match="33 tokens in one forward, over the KV cache's prefill chunk of 32"
    ):
        model.batch_prefill(model.token_embed(ids), [0], [33])
    assert model.sequence_length(0) == 0
    model.batch_prefill(model.token_embed(ids[:32]), [0], [32])
    model.batch_prefill(model.token_embed(ids[32:]), [0], [1])
    assert model.sequence_length(0) == 33
    model.create_kv_cache()


def test_a_token_tree_over_the_caches_limit_is_refused_by_name(model):
    """Refused before anything else is checked (this artifact's chunk and window are smaller
    than any such tree) and before the cache is touched."""
    model.create_kv_cache()
    model.add_new_sequence(0)
    nodes = 257
    with pytest.raises(
        MlcrunError, match="a token tree of 257 nodes: the KV cache verifies at most 256"
    ):
        model.batch_verify(model.token_embed([5] * nodes), [0], [nodes], list(range(-1, nodes - 1)))
    assert model.sequence_length(0) == 0


def test_an_artifact_for_missing_cpu_features_is_refused(artifacts, tmp_path, monkeypatch):
    """The target of every artifact compiled here switches on at least SSE4.2: a host whose
    /proc/cpuinfo lacks it gets a one-line refusal before the library is loaded."""
    from mlcrun import cpu_features

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu tsc\n")
    monkeypatch.setattr(cpu_features, "CPUINFO", info)
    with pytest.raises(
        MlcrunError, match=r"compiled for a CPU with .*sse4_2.*which this CPU lacks"
    ):
        Model(artifacts("llama"))
