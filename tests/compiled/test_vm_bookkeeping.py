"""trim_vm_bookkeeping: the same results from fewer VM instructions."""

from collections import Counter

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn

from mlcrun.compiler.pipeline import get_pipeline
from mlcrun.compiler.target import cpu_target


class Stack(nn.Module):
    """`layers` residual blocks over a symbolic batch: every intermediate is a planned view."""

    def __init__(self, layers: int) -> None:
        self.up = nn.ModuleList([nn.Linear(24, 40) for _ in range(layers)])
        self.down = nn.ModuleList([nn.Linear(40, 24) for _ in range(layers)])

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        for up, down in zip(self.up, self.down, strict=True):
            h = nn.op.reshape(up(x), (x.shape[0], 5, 8))
            x = x + down(nn.op.reshape(nn.op.silu(h), (x.shape[0], 40)))
        return x


def _run(layers: int, trim_vm: bool, x: np.ndarray) -> tuple[np.ndarray, Counter]:
    packed = {"param_mode": "packed", "effect_mode": "none"}
    spec = {"forward": {"x": nn.spec.Tensor(["b", 24], "float32"), "$": packed}}
    with cpu_target() as target:
        mod, named = Stack(layers).export_tvm(spec)
        exe = tvm.compile(mod, target=target, relax_pipeline=get_pipeline(target, trim_vm))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    rng = np.random.default_rng(layers)
    params = [
        tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.shape]).astype("float32"))
        for _, p in named
    ]
    calls: Counter = Counter()

    def count(func, name, before, ret, *args):
        if before:
            calls[name] += 1
        return 0

    vm.set_instrument(count)
    out = vm["forward"](tvm.runtime.tensor(x), params).numpy()
    return out, calls


@pytest.mark.parametrize("batch", [1, 3])
def test_trimmed_vm_code_gives_the_same_results_with_fewer_calls(batch):
    x = np.random.default_rng(batch).standard_normal((batch, 24)).astype("float32")
    plain, plain_calls = _run(4, False, x)
    trimmed, calls = _run(4, True, x)
    np.testing.assert_array_equal(trimmed, plain)
    assert plain_calls["vm.builtin.null_value"] > 0 and calls["vm.builtin.null_value"] == 0
    assert calls["vm.builtin.alloc_tensor"] < plain_calls["vm.builtin.alloc_tensor"]
    # The kernels run as before.
    assert {n: c for n, c in calls.items() if not n.startswith("vm.")} == {
        n: c for n, c in plain_calls.items() if not n.startswith("vm.")
    }


def test_views_and_shapes_do_not_grow_with_depth():
    # Untrimmed, every layer adds its views and shapes (30 and 55 calls at 10 layers); trimmed,
    # a view per planned storage region serves every layer.
    x = np.ones((2, 24), "float32")
    _, shallow = _run(6, True, x)
    _, deep = _run(10, True, x)
    names = ("alloc_tensor", "make_shape", "alloc_storage", "reshape")
    for name in (f"vm.builtin.{n}" for n in names):
        assert deep[name] == shallow[name] > 0, name
    assert deep["vm.builtin.alloc_tensor"] <= deep["vm.builtin.alloc_storage"] + 1
