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


# Running a compiled library needs TVM's runtime only (tvm_ffi and libtvm_runtime.so): not the
# `tvm` package, whose import loads the compiler (libtvm_compiler.so, relax, tirx, ...).
RUNTIME_ONLY = (
    "import sys, {module}; "
    "maps = open('/proc/self/maps').read(); "
    "print(sorted({{m.split('.')[0] for m in sys.modules if m.startswith('tvm')}}), "
    "'libtvm_runtime.so' in maps, 'libtvm_compiler' in maps, 'torch' in sys.modules)"
)


@pytest.mark.parametrize(
    "module", ["mlcrun.runtime", "mlcrun.llm", "mlcrun.chat", "mlcrun.bench.kernel"]
)
def test_the_run_path_loads_the_tvm_runtime_only(module):
    assert run(RUNTIME_ONLY.format(module=module)) == "['tvm_ffi'] True False False"


def test_tvm_imports_in_full_after_the_runtime():
    code = (
        "import sys, mlcrun.runtime, mlcrun.compiler.build, tvm; "
        "from mlcrun.runtime import ffi; "
        "print(hasattr(tvm, 'relax'), 'libtvm_compiler' in open('/proc/self/maps').read(), "
        "'torch' in sys.modules, type(ffi.empty([2], 'float32')).__module__)"
    )
    assert run(code) == "True True False tvm.runtime._tensor"
