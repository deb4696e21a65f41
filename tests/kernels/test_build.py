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
