"""An artifact compiled for SIMD features this CPU lacks is refused with a message."""

import json

import pytest

from mlcrun import cpu_features, env
from mlcrun.errors import MlcrunError

TARGET = json.dumps(
    {
        "kind": "llvm",
        "mcpu": "znver4",
        "mattr": ["+avx2", "+fma", "+avx512f", "+avx512vnni", "-avx512bf16", "-amx-tile"],
    }
)


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\n")
    return path


def test_required_flags_are_the_features_switched_on():
    assert cpu_features.required_flags(TARGET) == {"avx2", "fma", "avx512f", "avx512_vnni"}
    assert cpu_features.required_flags(json.dumps({"kind": "cuda"})) == set()


def test_a_cpu_with_every_flag_loads(tmp_path):
    info = _cpuinfo(tmp_path, "fpu sse4_2 avx avx2 fma avx512f avx512_vnni")
    cpu_features.check_host(TARGET, "model", info)


def test_a_missing_feature_is_named(tmp_path):
    info = _cpuinfo(tmp_path, "fpu sse4_2 avx avx2 fma")
    with pytest.raises(MlcrunError) as err:
        cpu_features.check_host(TARGET, "model", info)
    assert str(err.value) == (
        "model: compiled for a CPU with avx512_vnni, avx512f, which this CPU lacks; "
        "compile the model again on this machine"
    )


def test_without_cpuinfo_nothing_is_refused(tmp_path):
    cpu_features.check_host(TARGET, "model", tmp_path / "absent")


def _cache(root, index: str, level: str, kind: str, size: str) -> None:
    folder = root / index
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size)):
        (folder / name).write_text(value + "\n")


def test_l2_size_is_read_from_sysfs(tmp_path):
    _cache(tmp_path, "index0", "1", "Data", "48K")
    _cache(tmp_path, "index1", "1", "Instruction", "32K")
    _cache(tmp_path, "index2", "2", "Unified", "2048K")
    _cache(tmp_path, "index3", "3", "Unified", "105M")
    assert cpu_features.l2_cache_bytes(tmp_path) == 2 * 1024 * 1024
    other = tmp_path / "mb"
    _cache(other, "index2", "2", "Unified", "1M")
    assert cpu_features.l2_cache_bytes(other) == 1024 * 1024


def test_unknown_l2_size_is_none(tmp_path):
    assert cpu_features.l2_cache_bytes(tmp_path / "missing") is None
    _cache(tmp_path, "index2", "2", "Unified", "lots")
    assert cpu_features.l2_cache_bytes(tmp_path) is None


AMX_TARGET = json.dumps({"kind": "llvm", "mattr": ["+avx512f", "+amx-tile", "+amx-bf16"]})


def test_an_amx_library_needs_the_amx_flags(tmp_path):
    assert cpu_features.required_flags(AMX_TARGET) == {"avx512f", "amx_tile", "amx_bf16"}
    assert cpu_features.uses_amx(AMX_TARGET) and not cpu_features.uses_amx(TARGET)
    with pytest.raises(MlcrunError, match="with amx_bf16, amx_tile, which this CPU lacks"):
        cpu_features.check_host(AMX_TARGET, "model", _cpuinfo(tmp_path, "avx512f"))


def test_an_amx_library_asks_for_the_tile_state(tmp_path, monkeypatch):
    info = _cpuinfo(tmp_path, "avx512f amx_tile amx_bf16")
    monkeypatch.setattr(cpu_features, "request_amx", lambda: True)
    cpu_features.check_host(AMX_TARGET, "model", info)
    monkeypatch.setattr(cpu_features, "request_amx", lambda: False)
    with pytest.raises(MlcrunError) as err:
        cpu_features.check_host(AMX_TARGET, "model", info)
    assert str(err.value) == (
        "model: compiled with AMX kernels, but this process was refused the AMX tile state "
        "(arch_prctl); compile the model again with MLCRUN_AMX=0"
    )
    plain = json.dumps({"kind": "llvm", "mattr": ["+avx512f", "-amx-tile"]})
    cpu_features.check_host(plain, "model", info)  # no AMX in the library: no request


def test_the_tile_state_request_matches_the_cpu():
    granted = cpu_features.request_amx()
    assert granted == cpu_features.request_amx()  # asked once per process
    if "amx_tile" not in cpu_features.host_flags():
        assert not granted


@pytest.mark.parametrize(
    ("value", "allowed"), [(None, True), ("1", True), ("0", False), (" ", True)]
)
def test_mlcrun_amx(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv(env.MLCRUN_AMX, raising=False)
    else:
        monkeypatch.setenv(env.MLCRUN_AMX, value)
    assert env.amx_allowed() is allowed


def test_a_bad_mlcrun_amx_is_named(monkeypatch):
    monkeypatch.setenv(env.MLCRUN_AMX, "yes")
    with pytest.raises(MlcrunError, match="MLCRUN_AMX must be 0 or 1, got 'yes'"):
        env.amx_allowed()
