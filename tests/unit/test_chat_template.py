"""Chat templates render to the same ids as transformers' apply_chat_template."""

import json

import pytest
import transformers
from checkpoints import write_tokenizer

from mlcrun.errors import MlcrunError
from mlcrun.tokenizer import Tokenizer

# Templates in the styles of the major model families (written for these tests).
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
        "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == "
        "'system' else 0)) %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
        "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% else %}"
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
}
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CONVERSATION = [
    {"role": "system", "content": "Réponds brièvement. 简短回答。"},
    {"role": "user", "content": "What is 2+2? 🙂"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And the capital of France?"},
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_tokenizer(folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    next_id = 300
    for special in SPECIALS:
        tok["added_tokens"].append(
            {
                "id": next_id,
                "content": special,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        tok["model"]["vocab"][special] = next_id
        next_id += 1
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[request.param]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return request.param, folder


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_ids_equal_transformers(folder, generation_prompt):
    name, path = folder
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    messages = CONVERSATION[1:] if name == "mistral" and generation_prompt else CONVERSATION
    want = theirs.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        == want
    )
    ids = theirs(want, add_special_tokens=False)["input_ids"]
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == ids


def test_raise_exception_is_a_clean_error(folder):
    name, path = folder
    if name != "mistral":
        pytest.skip("only the mistral-style template rejects role orders")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(MlcrunError, match="roles must alternate"):
        Tokenizer.from_dir(path).apply_chat_template(bad)


def test_messages_are_validated(folder):
    _, path = folder
    with pytest.raises(MlcrunError, match="role"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "robot", "content": "x"}])
