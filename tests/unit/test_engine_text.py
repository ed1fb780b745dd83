"""Text out of the engine: UTF-8 streaming and stop strings, with a real byte-level tokenizer."""

import pytest
from checkpoints import write_tokenizer
from fake_runner import FakeRunner

from mlcrun.engine.config import EngineConfig
from mlcrun.engine.engine import Engine
from mlcrun.engine.types import SamplingParams
from mlcrun.tokenizer import Tokenizer

TEXT = "héllo 世界 🙂 ok"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_dir(folder)


def run(tokenizer, params, script):
    prompt = [1, 70, 71]
    runner = FakeRunner(vocab_size=320, eos=2, script=script, script_from=len(prompt))
    config = EngineConfig(
        max_num_sequence=2,
        max_total_sequence_length=256,
        prefill_chunk_size=64,
        kv_cache_page_size=16,
    )
    engine = Engine(
        runner,
        config,
        eos_token_ids=[2],
        context_window=256,
        decoder_factory=lambda p: tokenizer.stream(prefix_ids=p[-4:]),
    )
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_multibyte_characters_split_across_tokens_stream_whole(tokenizer):
    script = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(script) > len(TEXT)  # several characters span several byte tokens
    outs = run(tokenizer, SamplingParams(max_tokens=len(script), temperature=0), script)
    deltas = [o.delta_text for o in outs]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == outs[-1].text
    assert outs[-1].finish_reason == "length"


@pytest.mark.parametrize("stop", ["世界", "o 世", "🙂 o", "k"])
def test_stop_strings_straddling_tokens_are_cut_and_not_returned(tokenizer, stop):
    script = tokenizer.encode(TEXT, add_special_tokens=False)
    outs = run(tokenizer, SamplingParams(max_tokens=60, temperature=0, stop=(stop,)), script)
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].text == TEXT[: TEXT.index(stop)]
    assert "".join(o.delta_text for o in outs) == outs[-1].text


def test_text_is_held_back_only_while_it_may_start_a_stop_string(tokenizer):
    script = tokenizer.encode(TEXT, add_special_tokens=False)
    outs = run(
        tokenizer, SamplingParams(max_tokens=len(script), temperature=0, stop=("zzzz",)), script
    )
    assert "".join(o.delta_text for o in outs) == TEXT
    assert outs[-1].finish_reason == "length"
