"""Hub downloads against a local stand-in for the Hub's file API (tests/hub_server.py, reached
through HF_ENDPOINT): only the files mlcrun reads are fetched, with --revision; a GGUF repo by
file name; the cache serves HF_HUB_OFFLINE; unknown, gated and offline-uncached repos are
one-line errors that leave nothing behind."""

import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import write_gguf
from hub_server import COMMIT, HubServer

from mlcrun import LLM, SamplingParams


@pytest.fixture(scope="module")
def hub(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    llama = checkpoints("llama")
    (llama / "pytorch_model.bin").write_bytes(b"not read by mlcrun")  # must not be fetched
    gguf_repo = root / "gguf-repo"
    gguf_repo.mkdir()
    write_gguf(llama, gguf_repo / "tiny-Q8_0.gguf", Q.Q8_0)
    server = HubServer({"tiny/llama": llama, "tiny/llama-GGUF": gguf_repo})
    yield server
    server.close()
    (llama / "pytorch_model.bin").unlink()


def run(hub, tmp_path, *args, **env):
    environ = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "MLCRUN_HOME": str(tmp_path / "mlcrun"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **env,
    }
    environ.pop("HF_HUB_OFFLINE", None) if "HF_HUB_OFFLINE" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        env=environ,
    )


def test_chat_downloads_what_mlcrun_reads_then_runs_offline(hub, artifacts, tmp_path):
    want = (
        LLM(artifacts("llama"))
        .chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=8, temperature=0))[
            0
        ]
        .text
    )
    hub.requests.clear()
    args = ("chat", "tiny/llama", "--revision", "v1", "--prompt", "Hello")
    args += ("--temperature", "0", "--max-tokens", "8")
    result = run(hub, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"
    fetched = {r.split(f"/resolve/{COMMIT}/")[1] for r in hub.requests if "/resolve/" in r}
    assert "config.json" in fetched and "model.safetensors" in fetched
    assert "tokenizer.json" in fetched and "pytorch_model.bin" not in fetched
    assert "GET /api/models/tiny/llama/revision/v1" in hub.requests
    snapshot = tmp_path / "hf" / "hub" / "models--tiny--llama" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").is_file()
    assert not (snapshot / "pytorch_model.bin").exists()
    hub.requests.clear()  # again, offline: the cached snapshot and the compiled artifact
    result = run(hub, tmp_path, *args, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n" and hub.requests == []


def test_gguf_repo_file_by_name(hub, tmp_path):
    out = tmp_path / "art"
    result = run(hub, tmp_path, "compile", "tiny/llama-GGUF/tiny-Q8_0.gguf", "-o", out)
    assert result.returncode == 0, result.stderr
    assert LLM(out).model.artifact.quantization == "q8f16"


@pytest.mark.parametrize(
    ("model", "env", "message"),
    [
        ("tiny/nope", {}, "tiny/nope: no such model repository on the Hub"),
        ("gated/model", {}, "gated/model is gated on the Hub: accept its license"),
        ("tiny/llama", {"HF_HUB_OFFLINE": "1"}, "not in the local Hugging Face cache"),
        ("tiny/llama-GGUF/missing.gguf", {}, "no file 'missing.gguf'"),
        ("tiny/llama-GGUF", {}, "has no config.json (a GGUF repo? name the file"),
    ],
)
def test_hub_errors_are_one_line(hub, tmp_path, model, env, message):
    out = tmp_path / "art"
    result = run(hub, tmp_path, "compile", model, "-o", out, **env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    # one line besides huggingface_hub's progress bars ("Fetching 0 files: 0it [...it/s]")
    lines = [line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert not out.exists()
