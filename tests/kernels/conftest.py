import pytest

from kvserve.cpu_features import cpu_flags
from kvserve.kernels.cpu import cpu_kernels

# The machine's own build (AVX-512 BF16 paths where the CPU has them), a portable one (what
# a CPU without AVX-512 runs) and one without AVX2 (the plain loops), so every machine's CI
# checks every path its compiler can build; where the CPU has AVX-VNNI, one without it too
# (what an AVX2-only CPU runs); where it has AMX, one without that (what an AVX-512 BF16 CPU
# such as Zen 4 runs).
BUILDS = {"native": (), "portable": ("-mno-avx512f",), "no-avx2": ("-mno-avx2", "-mno-fma")}
if "avx_vnni" in cpu_flags():  # portable has 256-bit VNNI here: AVX2's own paths too
    BUILDS["avx2"] = ("-mno-avx512f", "-mno-avxvnni")
if "amx_tile" in cpu_flags():
    BUILDS["no-amx"] = ("-mno-amx-tile",)


@pytest.fixture(params=list(BUILDS), scope="session")
def kernels(request):
    built = cpu_kernels(BUILDS[request.param])
    if built is None:
        pytest.skip(f"the {request.param} build did not compile here (no C compiler, or "
                    "flags this compiler refuses)")
    return built
