"""keep_large_blocks: a block made and freed every step stops being page-faulted in every
step (in a subprocess: the setting is the whole process's)."""

import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent("""
    import resource, torch
    from kvserve.engine.heap import keep_large_blocks

    def faults():  # minor page faults of making and filling a 64 MiB tensor, then freeing it
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults(); print("before", faults())
    print("took", keep_large_blocks())
    for _ in range(3):  # the heap grows to hold the block beside what else is allocated
        faults()
    print("after", faults())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_block_freed_and_made_again_is_not_faulted_in_again():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = dict(line.split() for line in done.stdout.splitlines())
    if out["took"] != "True":
        pytest.skip("the C library is not glibc")
    assert int(out["before"]) >= 8000  # 16,384 pages of 4 KiB, mapped fresh each time
    assert int(out["after"]) < 100
