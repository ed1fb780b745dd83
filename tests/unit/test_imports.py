"""What importing mlcrun loads (real interpreters: sys.modules is per process)."""

import subprocess
import sys

import pytest


def run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_cli_imports_no_tvm():
    assert run("import sys, mlcrun.cli.main; print('tvm' in sys.modules)") == "False"


@pytest.mark.parametrize(
    "module", ["mlcrun.runtime", "mlcrun.compiler.build", "mlcrun.quant.modules"]
)
def test_tvm_loads_without_torch_and_torch_still_imports(module):
    code = (
        f"import sys, {module}; print('torch' in sys.modules); "
        "import torch; print(torch.ones(2).sum().item())"
    )
    assert run(code).split() == ["False", "2.0"]


# The layering: compiler -> models, quant, weights -> artifact; runtime -> artifact (not models).
@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("mlcrun.compiler.build", "mlcrun.tokenizer"),
        ("mlcrun.runtime.model", "mlcrun.models"),
    ],
)
def test_layering(module, forbidden):
    code = (
        f"import sys, {module}; "
        f"print(sorted(m for m in sys.modules if m == {forbidden!r} "
        f"or m.startswith({forbidden + '.'!r})))"
    )
    assert run(code) == "[]"
