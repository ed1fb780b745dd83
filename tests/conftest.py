import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# No test may reach the internet: huggingface_hub (hub ids, transformers) reads only its cache.
# tests/e2e/test_hub.py lifts this for its processes, which talk to a local stand-in.
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session", autouse=True)
def mlcrun_home(tmp_path_factory):
    """What mlcrun derives on first use (compiled models, self-drafts, measured speculation
    costs) goes to a folder of this session, never into the user's ~/.cache/mlcrun. Tests that
    need their own set MLCRUN_HOME themselves."""
    home = tmp_path_factory.mktemp("mlcrun-home")
    old = os.environ.get("MLCRUN_HOME")
    os.environ["MLCRUN_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("MLCRUN_HOME", None)
    else:
        os.environ["MLCRUN_HOME"] = old


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> folder of a tiny random-init HF checkpoint (built once per session)."""
    from checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_checkpoint(name, root / name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory, checkpoints):
    """name -> compiled q0f32 llvm artifact of that checkpoint (compiled once per session)."""
    from mlcrun.compiler.build import compile_model
    from mlcrun.compiler.options import CompileOptions

    root = tmp_path_factory.mktemp("artifacts")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            options = CompileOptions(prefill_chunk=64, max_batch=8)
            cache[name] = compile_model(str(checkpoints(name)), root / name, options)
        return cache[name]

    return get
