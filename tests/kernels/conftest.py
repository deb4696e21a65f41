import pytest

from kvserve.kernels.cpu import cpu_kernels

# The machine's own build (AVX-512 BF16 paths where the CPU has them) and a portable one
# (what a CPU without AVX-512 runs), so CI checks both.
BUILDS = {"native": (), "portable": ("-mno-avx512f",)}


@pytest.fixture(params=list(BUILDS), scope="session")
def kernels(request):
    built = cpu_kernels(BUILDS[request.param])
    if built is None:
        pytest.skip("no C compiler")
    return built
