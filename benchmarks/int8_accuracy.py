"""What int8 activations (`mlcrun compile --activations int8`) and a float16 KV cache
(`--kv-dtype float16`) cost in accuracy, against the exact compile of the same weights.

Give it two or more artifacts of the same model: the first is the reference (e.g. compiled
with `--activations exact --kv-dtype float32`), each other one is compared with it. The text
is English prose (public-domain passages below, a few hundred tokens with SmolLM2's
tokenizer). Two paths, because they run different kernels:

* teacher-forced: every position's logits from `batch_verify` over the text as chains of
  128 tokens (the GEMM / prefill kernels);
* decode: a 16-token prefill, then one `batch_decode` per token (the GEMV kernels, M = 1;
  with a long text this also reads a long KV cache).

Per artifact and path it prints top-1 agreement with the reference, mean and max
KL(reference || other) in nats over the positions, and max |logit difference|.

    .venv/bin/python benchmarks/int8_accuracy.py EXACT_ARTIFACT INT8_ARTIFACT [FP16KV_ARTIFACT]

Not a test: it asserts nothing about the numbers (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from mlcrun.errors import MlcrunError
from mlcrun.runtime import Model
from mlcrun.tokenizer import Tokenizer

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered as the rightful property of "
    'some one or other of their daughters. "My dear Mr. Bennet," said his lady to him one '
    'day, "have you heard that Netherfield Park is let at last?" Mr. Bennet replied that he '
    'had not. "But it is," returned she; "for Mrs. Long has just been here, and she told '
    'me all about it." Mr. Bennet made no answer. "Do not you want to know who has taken '
    'it?" cried his wife impatiently. "You want to tell me, and I have no objection to '
    'hearing it." This was invitation enough.\n\n'
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would "
    "sail about a little and see the watery part of the world. It is a way I have of driving "
    "off the spleen, and regulating the circulation. Whenever I find myself growing grim "
    "about the mouth; whenever it is a damp, drizzly November in my soul; whenever I find "
    "myself involuntarily pausing before coffin warehouses, and bringing up the rear of every "
    "funeral I meet; and especially whenever my hypos get such an upper hand of me, that it "
    "requires a strong moral principle to prevent me from deliberately stepping into the "
    "street, and methodically knocking people's hats off - then, I account it high time to "
    "get to sea as soon as I can. This is my substitute for pistol and ball."
)
PREFIX = 16
TREE = 128  # tokens per batch_verify chain (TVM allows trees of up to 256)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def teacher_forced(folder: str, tokens: list[int]) -> np.ndarray:
    """Chains of at most TREE tokens (TVM's tree limit), each committed before the next."""
    model = Model(folder)
    model.add_new_sequence(0)
    rows = []
    for start in range(0, len(tokens), TREE):
        part = tokens[start : start + TREE]
        parents = list(range(-1, len(part) - 1))
        rows.append(model.batch_verify(model.token_embed(part), [0], [len(part)], parents))
        model.commit_accepted_token_tree_nodes([0], [len(part) - 1])
    return np.concatenate(rows)


def decoded(folder: str, tokens: list[int]) -> np.ndarray:
    model = Model(folder)
    model.add_new_sequence(0)
    rows = [model.batch_prefill(model.token_embed(tokens[:PREFIX]), [0], [PREFIX])[0]]
    for token in tokens[PREFIX:]:
        rows.append(model.batch_decode(model.token_embed([token]), [0])[0])
    return np.stack(rows)


def compare(want: np.ndarray, got: np.ndarray) -> dict:
    lp, lq = _log_softmax(want), _log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {
        "positions": len(want),
        "top1_agreement": float((want.argmax(-1) == got.argmax(-1)).mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "max_abs_logit_diff": float(np.abs(want - got).max()),
        "max_abs_logit": float(np.abs(want).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference")
    parser.add_argument("others", nargs="+")
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    tokens = Tokenizer.from_dir(args.reference).encode(TEXT)[: args.max_tokens]
    print(f"{len(tokens)} tokens")
    paths = {"teacher_forced": teacher_forced, "decode": decoded}
    want = {}
    for name, run in paths.items():
        try:
            want[name] = run(args.reference, tokens)
        except MlcrunError as err:  # e.g. no token chains over Gemma 3's sliding windows
            print(f"{name}: skipped ({err})")
    results = {}
    for other in args.others:
        for name in want:
            results[f"{other} {name}"] = compare(want[name], paths[name](other, tokens))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
