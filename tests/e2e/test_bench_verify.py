"""`mlcrun bench --mode kernel --verify` as a real process on the tiny artifact (context window
256, max batch 8): tv rows next to tg, and tests that do not fit the window skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlcrun.bench.report import validate


def bench(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", "bench", "--mode", "kernel", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TVM_NUM_THREADS": "1", "COLUMNS": "200"},
    )


def run_doc(tmp_path, *args) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "k.json"
    result = bench(*args, "--json", out)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate(doc)
    return doc, result


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_verify_rows_follow_their_decode_row(artifacts, tmp_path):
    args = ("-p", 16, "-b", "1,3", "-d", "0,8", "-n", 4, "-r", 2, "-k", "2,4")
    doc, result = run_doc(tmp_path, artifacts("llama"), *args)
    assert doc["config"]["verify"] == [2, 4] and doc["skipped"] == []
    assert [r["test"] for r in doc["runs"]] == [
        "pp16@d0", "pp16@d8",
        "tg4x1@d0", "tv2x1@d0", "tv4x1@d0", "tg4x3@d0", "tv2x3@d0", "tv4x3@d0",
        "tg4x1@d8", "tv2x1@d8", "tv4x1@d8", "tg4x3@d8", "tv2x3@d8", "tv4x3@d8",
    ]  # fmt: skip
    verify = [r for r in doc["runs"] if r["kind"] == "verify"]
    for run in verify:
        k = int(run["test"][2])
        assert run["verify_len"] == k + 1 and run["prompt_len"] is None
        assert len(run["samples"]) == 2 and all(s > 0 for s in run["samples"])
        rates = [run["batch"] * (k + 1) / s for s in run["samples"]]  # K+1 tokens a sequence
        assert run["tokens_per_s"]["mean"] == pytest.approx(sum(rates) / 2)
        decode = next(
            r
            for r in doc["runs"]
            if r["kind"] == "decode" and (r["batch"], r["depth"]) == (run["batch"], run["depth"])
        )
        step = sum(decode["samples"]) / 2 / 4  # -n 4 steps a run
        assert run["tg_step_ratio"] > 0
        assert run["tg_step_ratio"] == pytest.approx(sum(run["samples"]) / 2 / step)
        assert run["test"] in result.stdout
    assert all("verify_len" not in r for r in doc["runs"] if r["kind"] != "verify")
    assert "tg steps" in result.stdout
    assert f"{verify[0]['tg_step_ratio']:.2f}" in result.stdout


def test_tests_over_the_context_window_are_skipped(artifacts, tmp_path):
    # Depth 250: pp16 (266) and tg8 (258) do not fit the window of 256; tv4 (255) does.
    args = ("-p", 16, "-b", 1, "-d", "0,250", "-n", 8, "-r", 1, "-k", 4)
    doc, result = run_doc(tmp_path, artifacts("llama"), *args)
    assert [r["test"] for r in doc["runs"]] == ["pp16@d0", "tg8x1@d0", "tv4x1@d0", "tv4x1@d250"]
    assert [s["test"] for s in doc["skipped"]] == ["pp16@d250", "tg8x1@d250"]
    assert all("context window (256)" in s["reason"] for s in doc["skipped"])
    notes = [line for line in result.stderr.splitlines() if line.startswith("skipped ")]
    assert notes == [
        "skipped pp16@d250: depth 250 + 16 tokens exceed the context window (256)",
        "skipped tg8x1@d250: depth 250 + 8 tokens exceed the context window (256)",
    ]
    assert "pp16@d250" not in result.stdout
    by_name = {r["test"]: r for r in doc["runs"]}
    assert by_name["tv4x1@d0"]["tg_step_ratio"] > 0
    assert by_name["tv4x1@d250"]["tg_step_ratio"] is None  # its tg test was skipped


def test_nothing_fitting_is_an_error(artifacts):
    one_line_error(
        bench(artifacts("llama"), "-p", 16, "-b", 1, "-d", "256,300", "-n", 4, "-k", 2),
        "no test fits the context window (256)",
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["-k", "0"], ["--verify"]),
        (["-k", "two"], ["--verify"]),
        (["-k", "300"], ["--verify 300", "context window"]),  # no depth could fit it
        (["-k", "2", "-b", "9"], ["max batch"]),
        (["-k", "64"], ["--verify 64 (65 tokens)", "prefill chunk (64)"]),  # one forward
        (["-k", "40", "-b", "2"], ["at batch 2: 82 tokens", "prefill chunk (64)"]),
    ],
)
def test_bad_verify_input_is_an_error(artifacts, args, needles):
    one_line_error(bench(artifacts("llama"), "-p", 16, "-d", 0, "-b", 1, *args), *needles)


def test_verify_on_a_sliding_window_model_is_an_error(artifacts):
    one_line_error(
        bench(artifacts("mistral-window"), "-p", 16, "-b", 1, "-d", 0, "-k", 2),
        "sliding-window",
    )
