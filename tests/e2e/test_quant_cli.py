"""`mlcrun compile --list-quantizations` and `-q` as a real process."""

import json
import subprocess
import sys

from mlcrun.quant import PRESETS


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlcrun", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_list_quantizations_needs_no_model():
    result = run_cli("compile", "--list-quantizations")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == [*PRESETS, "auto"]
    bits = {line.split()[0]: float(line.split()[1]) for line in lines[:-1]}
    assert bits["q4f16_1"] == 5.0 and bits["q8f32"] == 9.0 and bits["q0f32"] == 32.0


def test_compile_without_model_is_a_usage_error():
    result = run_cli("compile")
    assert result.returncode == 2
    assert "MODEL" in result.stderr and "Traceback" not in result.stderr


def test_unknown_quantization_lists_presets(tmp_path, checkpoints):
    result = run_cli("compile", checkpoints("llama"), "-o", tmp_path / "out", "-q", "q3f16_0")
    assert result.returncode == 1
    assert "q3f16_0" in result.stderr and "q4f16_1" in result.stderr
    assert not (tmp_path / "out").exists()


def test_compile_q4(tmp_path, checkpoints):
    out = tmp_path / "out"
    result = run_cli("compile", checkpoints("llama"), "-o", out, "-q", "q4f16_1")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "mlcrun-config.json").read_text())
    assert config["quantization"] == "q4f16_1"
