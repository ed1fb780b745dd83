"""HF config.json -> ModelConfig, for old and new spellings of the same settings."""

import pytest

from mlcrun.errors import MlcrunError
from mlcrun.models import registry

BASE = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_old_and_new_keys_give_the_same_config():
    old = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "llama3", **LLAMA3},
    }
    new = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
    }
    a, b = registry.model_config(old), registry.model_config(new)
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    assert a.source_dtype == "bfloat16" and a.eos_token_ids == (2, 3) and a.head_dim == 32


def test_default_rope_has_no_scaling():
    cfg = registry.model_config(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e4


@pytest.mark.parametrize(
    ("arch", "extra", "check"),
    [
        ("MistralForCausalLM", {"sliding_window": 4096}, lambda c: c.sliding_window == 4096),
        (
            "Qwen2ForCausalLM",
            {"sliding_window": 4096, "use_sliding_window": False},
            lambda c: c.attention_bias and c.sliding_window is None,
        ),
        ("Qwen3ForCausalLM", {"head_dim": 128}, lambda c: c.qk_norm and c.head_dim == 128),
    ],
)
def test_family_differences(arch, extra, check):
    assert check(registry.model_config({**BASE, "architectures": [arch], **extra}))


def test_errors_name_the_problem():
    with pytest.raises(MlcrunError, match="supported: Gemma3ForCausalLM, LlamaForCausalLM"):
        registry.model_config({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(MlcrunError, match="rope_scaling type 'yarn'"):
        registry.model_config(
            {
                **BASE,
                "architectures": ["LlamaForCausalLM"],
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )
    with pytest.raises(MlcrunError, match="num_key_value_heads"):
        registry.model_config(
            {**BASE, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3}
        )
    with pytest.raises(MlcrunError, match="hidden_size"):
        registry.model_config(
            {
                **{k: v for k, v in BASE.items() if k != "hidden_size"},
                "architectures": ["LlamaForCausalLM"],
            }
        )


GEMMA3 = {
    **BASE,
    "architectures": ["Gemma3ForCausalLM"],
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 168,
    "sliding_window": 512,
}


def test_gemma3_old_and_new_keys_give_the_same_config():
    """Legacy keys (sliding_window_pattern, rope_theta + rope_local_base_freq, rope_scaling on
    the full layers) and transformers 5's (layer_types, rope_parameters per layer kind)."""
    old = {
        **GEMMA3,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    new = {
        **GEMMA3,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    }
    cfg = registry.model_config(old)
    assert cfg == registry.model_config(new)
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types.count("full_attention") == 1
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_in_graph
    assert (cfg.local_window, cfg.query_pre_attn_scalar, cfg.head_dim) == (512, 168, 256)
    assert cfg.norm_offset == 1.0 and cfg.sandwich_norms and cfg.qk_norm
    assert cfg.hidden_activation == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(256**0.5)
    assert registry.model_config(GEMMA3).rope_scaling is None  # defaults: no scaling
    back = type(cfg).from_dict(cfg.to_dict())
    assert back == cfg


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "softcapping"),
        ({"hidden_activation": "gelu"}, "activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_gemma3_refusals_name_the_setting(extra, message):
    with pytest.raises(MlcrunError, match=message):
        registry.model_config({**GEMMA3, **extra})
