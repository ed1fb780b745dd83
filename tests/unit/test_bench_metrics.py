"""`mlcrun bench` without a model: metrics, workloads, datasets, the JSON document, tables and
plots, on hand-made timings whose answers are worked out by hand."""

import json
import math
import re
import sys

import numpy as np
import pytest
from rich.console import Console

from mlcrun.bench.metrics import RequestRecord, record_dict, stats, summarize
from mlcrun.bench.report import (
    SCHEMA,
    document,
    kernel_table,
    machine_info,
    serve_table,
    validate,
    write_json,
    write_plot,
)
from mlcrun.bench.workload import (
    BenchRequest,
    load_dataset,
    parse_len,
    reseeded,
    synthetic,
    with_arrivals,
)
from mlcrun.errors import MlcrunError


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word."""
    return len(text.split())


def records() -> list[RequestRecord]:
    """Two completed requests and one failure.

    #0 starts at 0, chunks at 0.1, 0.3, 0.6, 3 tokens: TTFT 100, E2EL 600, TPOT 250, ITL 200, 300.
    #1 starts at 1, chunks at 1.2, 1.4, 4 tokens (last chunk carries 3): TTFT 200, E2EL 400,
    TPOT (400 - 200) / 3, ITL 200.
    """
    return [
        RequestRecord(0, prompt_len=10, start=0.0, chunk_times=[0.1, 0.3, 0.6], output_len=3,
                      end=0.6, cached_tokens=4),
        RequestRecord(1, prompt_len=30, start=1.0, chunk_times=[1.2, 1.4], output_len=4,
                      end=1.4, cached_tokens=6),
        RequestRecord(2, prompt_len=50, start=0.5, chunk_times=[0.9], output_len=1,
                      error="HTTP 500"),
    ]  # fmt: skip


def test_stats_percentiles_match_numpy_linear_interpolation():
    result = stats([4.0, 1.0, 3.0, 2.0])
    assert result["mean"] == 2.5 and result["median"] == 2.5
    assert result["std"] == pytest.approx(math.sqrt(1.25))  # population std, as vLLM
    assert result["p90"] == pytest.approx(3.7)  # 1 + 0.9 * 3 = index 2.7 -> 3 + 0.7
    assert result["p99"] == pytest.approx(3.97)
    assert (result["min"], result["max"]) == (1.0, 4.0)
    assert stats([]) == dict.fromkeys(("mean", "std", "median", "p90", "p99", "min", "max"))


def test_request_timings():
    first = records()[0]
    assert first.ttft == pytest.approx(0.1) and first.e2el == pytest.approx(0.6)
    assert first.tpot == pytest.approx(0.25)
    assert first.itl == pytest.approx([0.2, 0.3])
    one_token = RequestRecord(0, 5, start=0.0, chunk_times=[0.2], output_len=1, end=0.2)
    assert one_token.tpot is None and one_token.itl == []


def test_summarize_counts_only_completed_requests():
    s = summarize(records(), duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (40, 7)
    assert s["duration_s"] == 2.0
    assert s["request_throughput"] == 1.0
    assert s["input_throughput"] == 20.0 and s["output_throughput"] == 3.5
    assert s["total_token_throughput"] == 23.5
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["min"] == pytest.approx(100.0)
    assert s["ttft_ms"]["max"] == pytest.approx(200.0)
    assert s["e2el_ms"]["mean"] == pytest.approx(500.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((250.0 + 200.0 / 3) / 2)
    assert s["itl_ms"]["median"] == pytest.approx(200.0)  # pooled: 200, 300, 200
    assert s["itl_ms"]["mean"] == pytest.approx(700.0 / 3)
    assert s["prefix_cache_hit_rate"] == pytest.approx(10 / 40)


def test_summarize_with_nothing_completed():
    s = summarize([records()[2]], duration=0.0)
    assert (s["completed"], s["failed"], s["total_input_tokens"]) == (0, 1, 0)
    assert s["request_throughput"] is None and s["prefix_cache_hit_rate"] is None
    assert s["ttft_ms"]["mean"] is None


def test_record_dict_is_json():
    sample = json.loads(json.dumps(record_dict(records()[0])))
    assert sample["index"] == 0 and sample["cached_tokens"] == 4 and sample["error"] is None
    assert sample["ttft_s"] == pytest.approx(0.1) and sample["e2el_s"] == pytest.approx(0.6)
    assert sample["itl_s"] == pytest.approx([0.2, 0.3])
    failed = record_dict(records()[2])
    assert failed["error"] == "HTTP 500" and failed["e2el_s"] is None


@pytest.mark.parametrize(
    "spec, expected",
    [("128", (128, 128)), (128, (128, 128)), ("64:256", (64, 256)), (" 5 : 5 ", (5, 5))],
)
def test_parse_len(spec, expected):
    assert parse_len(spec, "--input-len") == expected


@pytest.mark.parametrize("spec", ["0", 0, "-3", "9:4", "0:4", "abc", "", "1:2:3", "1.5", True])
def test_parse_len_rejects(spec):
    with pytest.raises(MlcrunError, match="--input-len must be a positive integer or MIN:MAX"):
        parse_len(spec, "--input-len")


def test_parse_len_message_quotes_the_value():
    with pytest.raises(MlcrunError) as info:
        parse_len("0", "--input-len")
    assert str(info.value) == "--input-len must be a positive integer or MIN:MAX, got '0'"


def test_synthetic_is_seeded_and_in_range():
    reqs = synthetic(200, (4, 9), (2, 3), vocab_size=50, seed=7)
    assert reqs == synthetic(200, (4, 9), (2, 3), vocab_size=50, seed=7)
    assert reqs != synthetic(200, (4, 9), (2, 3), vocab_size=50, seed=8)
    assert [r.index for r in reqs] == list(range(200))
    assert {r.prompt_len for r in reqs} == set(range(4, 10))
    assert {r.output_len for r in reqs} == {2, 3}
    ids = [t for r in reqs for t in r.prompt]
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert min(ids) == 3 and max(ids) == 49 and all(type(t) is int for t in ids)
    fixed = synthetic(3, (16, 16), (8, 8), vocab_size=1000)
    assert all((r.prompt_len, r.output_len, r.arrival) == (16, 8, 0.0) for r in fixed)


def test_reseeded_keeps_the_shape_and_draws_new_tokens():
    reqs = with_arrivals(synthetic(20, (4, 9), (2, 3), vocab_size=50, seed=7), 2.0, seed=7)
    assert reseeded(reqs, 50, seed=7, run=0) == reqs
    later = [reseeded(reqs, 50, seed=7, run=i) for i in (1, 2)]
    assert later[0] == reseeded(reqs, 50, seed=7, run=1)  # seeded
    for other in later:
        shape = [(r.index, r.prompt_len, r.output_len, r.arrival) for r in other]
        assert shape == [(r.index, r.prompt_len, r.output_len, r.arrival) for r in reqs]
        assert all(len(r.prompt) == r.prompt_len for r in other)
        assert all(3 <= t < 50 for r in other for t in r.prompt)
    prompts = [{tuple(r.prompt) for r in run} for run in (reqs, *later)]
    assert not prompts[0] & prompts[1] and not prompts[0] & prompts[2]
    assert not prompts[1] & prompts[2]
    text = [BenchRequest(0, "hello", 1, 4)]
    assert reseeded(text, 50, seed=7, run=3) == text  # a dataset's text cannot be redrawn


def test_synthetic_rejects_no_prompts():
    with pytest.raises(MlcrunError, match="--num-prompts must be positive, got 0"):
        synthetic(0, (4, 4), (4, 4), vocab_size=50)


def write_lines(path, *lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_prompts(tmp_path):
    path = write_lines(
        tmp_path / "prompts.jsonl",
        json.dumps({"prompt": "one two three", "output_len": 5}),
        "",
        json.dumps({"prompt": "four five", "max_tokens": 7}),
        json.dumps({"prompt": "six"}),
    )
    reqs = load_dataset(path, None, words)
    assert [(r.index, r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        (0, "one two three", 3, 5),
        (1, "four five", 2, 7),
        (2, "six", 1, 128),
    ]
    assert [r.prompt for r in load_dataset(path, 2, words)] == ["one two three", "four five"]
    overridden = load_dataset(path, None, words, output_len=(9, 9))
    assert [r.output_len for r in overridden] == [9, 9, 9]


def conversation(*turns):
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


SHAREGPT = [
    conversation(("human", "hello there"), ("gpt", "hi how are you")),
    conversation(("human", "lonely")),  # under 2 turns: skipped
    conversation(("system", "be brief"), ("human", "a b c"), ("gpt", "d e")),
    conversation(("gpt", "no question"), ("gpt", "at all")),  # no human turn: skipped
]


def test_sharegpt_jsonl(tmp_path):
    path = write_lines(tmp_path / "sg.jsonl", *(json.dumps(item) for item in SHAREGPT))
    reqs = load_dataset(path, None, words)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("hello there", 2, 4),
        ("a b c", 3, 2),
    ]


def test_sharegpt_json_array(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT, indent=2))
    reqs = load_dataset(path, 1, words)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 4)]
    assert len(load_dataset(path, 10, words)) == 2  # fewer usable entries than asked for


def test_sharegpt_array_errors_name_the_line(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[\n  {"conversations": []},\n  {"conversations": 3}\n]\n')
    with pytest.raises(MlcrunError) as info:
        load_dataset(path, None, words)
    assert str(info.value) == f'{path}:3: "conversations" must be a list'
    path.write_text('[\n  {"conversations": []}\n  {"conversations": []}\n]\n')
    with pytest.raises(MlcrunError, match=f"^{re.escape(str(path))}:3: expected ',' or ']'"):
        load_dataset(path, None, words)
    path.write_text('[\n  {"conversations": []},\n  {"conversations": [}\n]\n')
    with pytest.raises(MlcrunError, match=f"^{re.escape(str(path))}:3: not valid JSON"):
        load_dataset(path, None, words)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"text": "x"}', 'expected a "prompt" string or a ShareGPT "conversations" list'),
        ('{"prompt": 5}', '"prompt" must be a non-empty string'),
        ('{"prompt": "x", "output_len": "9"}', '"output_len" must be a positive integer'),
        ('{"prompt": "x", "max_tokens": 0}', '"max_tokens" must be a positive integer'),
        ('{"conversations": [{"from": "human"}]}', "conversations\\[0\\] must be an object"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, bad, message):
    path = write_lines(tmp_path / "bad.jsonl", '{"prompt": "fine"}', "", bad)
    with pytest.raises(MlcrunError, match=f"^{re.escape(str(path))}:3: {message}"):
        load_dataset(path, None, words)


def test_dataset_file_problems(tmp_path):
    with pytest.raises(MlcrunError, match="dataset file not found"):
        load_dataset(tmp_path / "missing.jsonl", None, words)
    empty = write_lines(tmp_path / "empty.jsonl", "", "  ")
    with pytest.raises(MlcrunError, match="no usable prompts"):
        load_dataset(empty, None, words)
    with pytest.raises(MlcrunError, match="--num-prompts must be positive"):
        load_dataset(empty, 0, words)


def test_poisson_arrivals():
    reqs = synthetic(2000, (4, 4), (4, 4), vocab_size=50)
    timed = with_arrivals(reqs, request_rate=5.0, seed=3)
    arrivals = np.array([r.arrival for r in timed])
    assert arrivals[0] > 0 and np.all(np.diff(arrivals) > 0)
    assert np.mean(np.diff(arrivals, prepend=0.0)) == pytest.approx(1 / 5.0, rel=0.1)
    assert timed == with_arrivals(reqs, request_rate=5.0, seed=3)
    assert all(r.arrival == 0.0 for r in reqs)  # copies, the input is untouched
    assert [r.prompt for r in timed] == [r.prompt for r in reqs]


def test_unbounded_rate_arrives_at_once():
    reqs = [BenchRequest(0, "a", 1, 1, arrival=2.0), BenchRequest(1, "b", 1, 1, arrival=3.0)]
    for rate in (None, math.inf):
        assert [r.arrival for r in with_arrivals(reqs, rate)] == [0.0, 0.0]
    for rate in (0.0, -1.0, math.nan):
        with pytest.raises(MlcrunError, match="--request-rate must be positive"):
            with_arrivals(reqs, rate)


def serve_doc() -> dict:
    recs = records()
    later = [
        RequestRecord(0, 10, start=0.0, chunk_times=[0.05, 0.15], output_len=2, end=0.15),
        RequestRecord(1, 10, start=0.0, chunk_times=[0.08, 0.2], output_len=2, end=0.2),
    ]
    runs = [
        {
            "concurrency": 1,
            "request_rate": None,
            "summary": summarize(recs, 2.0),
            "engine": {"preemptions": 3, "spec_acceptance": 0.7512},
            "samples": [record_dict(r) for r in recs],
        },
        {
            "concurrency": 4,
            "request_rate": None,
            "summary": summarize(later, 0.5),
            "engine": {},
            "samples": [record_dict(r) for r in later],
        },
    ]
    model = {"name": "tiny-llama", "artifact": "/tmp/x"}
    return document("serve-sim", ["mlcrun", "bench", "x"], model, {"seed": 0}, runs)


def kernel_doc() -> dict:
    runs = [
        {
            "test": "pp128",
            "kind": "prefill",
            "prompt_len": 128,
            "batch": 1,
            "depth": 0,
            "tokens_per_s": {"mean": 1234.5, "std": 12.25},
            "samples": [0.1, 0.11],
        },
        {
            "test": "tg1@d0",
            "kind": "decode",
            "prompt_len": None,
            "batch": 4,
            "depth": 0,
            "tokens_per_s": {"mean": 56.78, "std": 0.5},
            "samples": [0.018, 0.017],
        },
    ]
    return document("kernel", ["mlcrun", "bench", "--kernel"], {"name": "m"}, {}, runs)


def test_machine_info():
    info = machine_info()
    assert info["cores"] >= 1 and info["python"].count(".") == 2 and info["os"]
    assert info["memory_bytes"] is None or info["memory_bytes"] > 1 << 20


@pytest.mark.parametrize("make", [serve_doc, kernel_doc])
def test_document_round_trip(tmp_path, make):
    doc = make()
    assert doc["schema"] == SCHEMA and doc["created"].endswith("+00:00")
    validate(doc)
    path = tmp_path / "out" / "bench.json"
    write_json(path, doc)
    loaded = json.loads(path.read_text())
    validate(loaded)
    assert loaded == doc
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temp file left


def test_validate_names_the_problem():
    doc = serve_doc()
    del doc["runs"]
    with pytest.raises(MlcrunError, match="missing 'runs'"):
        validate(doc)
    doc = serve_doc()
    doc["runs"][1]["summary"]["ttft_ms"]["p99"] = "slow"
    with pytest.raises(MlcrunError, match=r"runs\[1\]\.summary\.ttft_ms\.p99 must be"):
        validate(doc)
    doc = kernel_doc()
    doc["runs"][0]["kind"] = "both"
    with pytest.raises(MlcrunError, match=r"runs\[0\]\.kind must be one of"):
        validate(doc)
    with pytest.raises(MlcrunError, match="schema is 'other/2'"):
        validate({**kernel_doc(), "schema": "other/2"})


def render(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_serve_table():
    text = render(serve_table(serve_doc()))
    assert "concurrency 1" in text and "concurrency 4" in text
    assert "2 / 1" in text and "1.00" in text  # requests ok / failed; req/s
    assert "20.0" in text and "3.5" in text  # input and output tok/s
    assert "150.00" in text and "65.00" in text  # TTFT means: (100 + 200) / 2, (50 + 80) / 2
    assert "158.33" in text and "500.00" in text  # TPOT mean (250 + 66.67) / 2, E2EL mean
    assert "25.0%" in text  # prefix-cache hit rate
    assert "preemptions" in text and "0.751" in text


def test_kernel_table():
    text = render(kernel_table(kernel_doc()))
    assert "pp128" in text and "tg1@d0" in text
    assert "1234.50 ± 12.25" in text and "56.78 ± 0.50" in text


@pytest.mark.parametrize("make", [serve_doc, kernel_doc])
def test_write_plot(tmp_path, make):
    path = tmp_path / "plot.png"
    write_plot(path, make())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_write_plot_problems(tmp_path, monkeypatch):
    with pytest.raises(MlcrunError, match="cannot write .xyz"):
        write_plot(tmp_path / "plot.xyz", kernel_doc())
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MlcrunError, match="--plot needs matplotlib"):
        write_plot(tmp_path / "plot.png", kernel_doc())


def test_written_files_get_the_usual_permissions(tmp_path):
    import os
    import stat

    from mlcrun.bench.report import write_json

    umask = os.umask(0o022)
    try:
        write_json(tmp_path / "out.json", {"a": 1})
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o644
