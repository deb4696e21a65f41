import pytest

from kvserve.kernels.cpu import cpu_kernels


def test_without_a_working_compiler_kvserve_warns_and_keeps_torch_ops(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match="did not build"):
        assert cpu_kernels(("-DKVS_NO_SUCH_BUILD",)) is None


def test_a_build_lands_in_the_cache_dir_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if cpu_kernels(("-DKVS_CACHE_TEST",)) is None:
        pytest.skip("no C compiler")
    files = list((tmp_path / "kvserve" / "kernels").iterdir())
    # one library named by its key; the temporary file it was built in is gone
    assert len(files) == 1 and files[0].name.startswith("cpu-") and files[0].suffix == ".so"


def test_isa_options_the_compiler_does_not_know_are_dropped():
    """A -mno- option for an ISA the compiler does not know (GCC 10 has no -mno-avxvnni)
    is left out of the build rather than failing it: -march=native never turns it on."""
    import shutil

    from kvserve.kernels.cpu import _accepts

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    assert _accepts(compiler, "-mno-avx2")
    assert not _accepts(compiler, "-mno-kvs-no-such-isa")


def test_hidden_cpu_features_change_dispatch_and_build():
    """KVSERVE_CPU_FLAGS: an AVX-512 machine takes the paths of an AVX2-only one (what CI's
    second pass relies on): the flags, the bf16 verdict and the kernels' ISA follow it."""
    import json
    import os
    import subprocess
    import sys

    probe = ("import json; from kvserve.cpu_features import cpu_flags, bf16_native; "
             "from kvserve.kernels.cpu import _isa_flags; "
             "print(json.dumps([sorted(cpu_flags()), bf16_native(), _isa_flags()]))")
    env = {**os.environ, "KVSERVE_CPU_FLAGS": "avx2,fma,f16c"}
    flags, bf16, isa = json.loads(subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True,
        check=True).stdout)
    assert {"avx2", "fma"} <= set(flags) or "avx2" not in open("/proc/cpuinfo").read()
    assert not {"avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni"} & set(flags)
    assert bf16 is False
    assert "-mno-avx512f" in isa and "-mno-avxvnni" in isa  # i8matmul.c's AVX2 path, not AVX-VNNI
    env["KVSERVE_CPU_FLAGS"] = ""  # nothing relevant: the plain C paths
    flags, bf16, isa = json.loads(subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True,
        check=True).stdout)
    assert "avx2" not in flags and not bf16 and "-mno-avx2" in isa
