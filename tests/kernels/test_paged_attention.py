"""The CPU paged-attention kernel against the same attention written in torch ops.

Random page tables over a shared pool, sequences with one query row (decode) or
several (a prefill chunk, possibly after cached keys), random windows, every GQA
ratio and head size the dispatch distinguishes; both the machine's build (the
AVX-512 BF16 path where the CPU has it) and the portable build.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.kernels.cpu import cpu_kernels


def reference(q, cache, tables, seq, lo, n, scale):
    """Gathered keys, matmul scores rounded to the input dtype, float32 softmax."""
    out = []
    T, Hkv = cache.shape[2], cache.shape[3]
    for r in range(q.shape[0]):
        pos = torch.arange(lo[r], lo[r] + n[r])
        page = torch.tensor(tables[seq[r]])[pos // T]
        k, v = cache[page, 0, pos % T], cache[page, 1, pos % T]  # [n, Hkv, D]
        qg = q[r].view(Hkv, -1, q.shape[-1])
        s = torch.matmul(qg, k.permute(1, 2, 0)).float() * scale
        p = torch.softmax(s, dim=-1).to(q.dtype)
        out.append(torch.matmul(p, v.transpose(0, 1)).reshape(q.shape[1:]))
    return torch.stack(out)


def case(seed, dtype, Hkv, G, D, T, chunks, window):
    """chunks: (tokens before, new tokens) per sequence; one query row per new token."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(a + b) // T) for a, b in chunks) + 3
    cache = torch.randn(num_pages, 2, T, Hkv, D, generator=g).to(dtype)
    free = torch.randperm(num_pages, generator=g).tolist()
    tables, seq, lo, n = [], [], [], []
    for i, (before, new) in enumerate(chunks):
        tables.append([free.pop() for _ in range(-(-(before + new) // T))])
        for p in range(before, before + new):
            first = max(0, p - window + 1) if window else 0
            seq.append(i)
            lo.append(first)
            n.append(p + 1 - first)
    q = torch.randn(len(seq), Hkv * G, D, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ints = [torch.tensor(x, dtype=torch.int32) for x in (seq, lo, n)]
    return q, cache, tables, padded, ints, (seq, lo, n)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4, 8]),
       D=st.sampled_from([16, 64, 256]), T=st.sampled_from([1, 4, 16]),
       chunks=st.lists(st.tuples(st.integers(0, 60), st.sampled_from([1, 1, 2, 9])),
                       min_size=1, max_size=5),
       window=st.sampled_from([0, 5, 32]))
def test_matches_torch_attention(kernels, seed, dtype, Hkv, G, D, T, chunks, window):
    q, cache, tables, padded, ints, lists = case(seed, dtype, Hkv, G, D, T, chunks, window)
    got = kernels.paged_attention(q, cache, padded, *ints, D**-0.5)
    want = reference(q, cache, tables, *lists, D**-0.5)
    # bfloat16: both round scores, probabilities and output, but sum in different orders,
    # so an output may land one bf16 step (2^-8 relative) away.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    # Some pages moved to step pages (ids -2 - j of `step_pages`) and the pool's copies
    # spoiled: the same output, bit for bit.
    moved = sorted({int(p) for p in padded[padded.ne(0)]})[::2]
    if moved:
        step_pages = cache[moved].clone()
        cache[moved] = float("nan")
        ids = {p: -2 - j for j, p in enumerate(moved)}
        steps = padded.clone().apply_(lambda p: ids.get(p, p))
        assert torch.equal(kernels.paged_attention(q, cache, steps, *ints, D**-0.5,
                                                   step_pages=step_pages), got)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       G=st.sampled_from([1, 4]), D=st.sampled_from([16, 64]),
       chunks=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 3])),
                       min_size=1, max_size=3),
       cut=st.floats(0, 1))
def test_split_ranges_merge_by_their_lse(kernels, seed, dtype, G, D, chunks, cut):
    """DistAttention on the kernel: each row's keys split in two ranges (one may be
    empty), each attended with its log-sum-exp, merge to the whole range's output."""
    from kvserve.models.dist_attention import merge

    q, cache, _, padded, ints, _ = case(seed, dtype, 2, G, D, 4, chunks, 0)
    seq, lo, n = ints
    mid = (n.float() * cut).int()
    whole_lse = torch.empty(q.shape[:2])
    whole = kernels.paged_attention(q, cache, padded, seq, lo, n, D**-0.5, whole_lse)
    parts = []
    for a, m in ((lo, mid), (lo + mid, n - mid)):
        lse = torch.empty(q.shape[:2])
        parts.append((kernels.paged_attention(q, cache, padded, seq, a.contiguous(),
                                              m.contiguous(), D**-0.5, lse), lse))
    assert bool(torch.isinf(parts[0][1][mid == 0]).all())
    out, lse = merge(parts)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, whole, **tol)
    torch.testing.assert_close(lse, whole_lse, atol=1e-4, rtol=1e-4)
    # The kernel's lse is the scores' log-sum-exp (float32 scores; bf16 rounds them).
    if dtype == torch.float32:
        r = 0
        pos = torch.arange(int(lo[r]), int(lo[r] + n[r]))
        page = padded[seq[r]][pos // 4].long()
        k = cache[page, 0, pos % 4]  # [n, Hkv, D]
        s = torch.einsum("hgd,lhd->hgl", q[r].view(2, G, D), k) * D**-0.5
        torch.testing.assert_close(whole_lse[r], s.logsumexp(-1).reshape(-1))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4, 8]),
       D=st.sampled_from([32, 64, 256]), T=st.sampled_from([1, 4, 16]),
       chunks=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 70)), min_size=1,
                       max_size=3),
       window=st.sampled_from([0, 5, 32, 100]), dtype=st.sampled_from(["bf16", "f32"]))
@example(seed=1, Hkv=1, G=4, D=64, T=16, chunks=[(300, 40)], window=0, dtype="f32")  # chunks
@example(seed=2, Hkv=2, G=2, D=32, T=4, chunks=[(200, 33)], window=150, dtype="f32")  # of keys
@example(seed=513, Hkv=2, G=8, D=256, T=1, chunks=[(0, 16), (96, 70)], window=5,
         dtype="bf16")  # a bf16 score rounded to its neighbour: lse 0.0031 off
def test_prefill_chunks_match_torch_attention(kernels, seed, Hkv, G, D, T, chunks, window,
                                              dtype):
    """Chunks of many rows of one sequence: their runs of 16 go as blocks (bf16: keys laid
    out once a call, on AMX's tiles or with vdpbf16ps; float32: the rows in a vector's
    lanes, keys read in place), each row masked to its own range; the rest row by row."""
    bf16 = dtype == "bf16"
    q, cache, tables, padded, ints, lists = case(seed, torch.bfloat16 if bf16 else torch.float32,
                                                 Hkv, G, D, T, chunks, window)
    lse = torch.empty(q.shape[:2])
    got = kernels.paged_attention(q, cache, padded, *ints, D**-0.5, lse)
    tol = 2e-2 if bf16 else 2e-5
    torch.testing.assert_close(got, reference(q, cache, tables, *lists, D**-0.5),
                               atol=tol, rtol=tol)
    seq, lo, n = lists
    for r in range(0, q.shape[0], 7):  # the scores' log-sum-exp, in float32 (from bf16 scores)
        pos = torch.arange(lo[r], lo[r] + n[r])
        page = padded[seq[r]][pos // T].long()
        k = cache[page, 0, pos % T].float()
        s32 = torch.einsum("hgd,lhd->hgl", q[r].float().view(Hkv, G, D), k)
        s = (s32.bfloat16().float() if bf16 else s32) * D**-0.5
        # bf16: the kernel and einsum add the products in other orders, so a score can
        # round to the neighbouring bf16 value: up to one step (ulp) of the largest score.
        ulp = 2.0 ** (float(torch.log2(s32.abs().amax())) // 1 - 7) * D**-0.5
        torch.testing.assert_close(lse[r], s.logsumexp(-1).reshape(-1),
                                   atol=max(1e-3, ulp) if bf16 else 1e-5,
                                   rtol=1e-4 if bf16 else 1e-6)


def test_reads_a_strided_query_in_place(kernels):
    # The engine hands q as a slice of the fused qkv projection: rows are not contiguous.
    q, cache, _, padded, ints, _ = case(0, torch.float32, 1, 4, 64, 4, [(8, 1), (20, 10)], 0)
    wide = torch.cat([q, torch.randn(q.shape[0], 2, 64)], dim=1)[:, :4]
    assert not wide.is_contiguous()
    torch.testing.assert_close(kernels.paged_attention(wide, cache, padded, *ints, 0.125),
                               kernels.paged_attention(q.contiguous(), cache, padded, *ints,
                                                       0.125))


def test_rejects_mixed_dtypes(kernels):
    q, cache, _, padded, ints, _ = case(0, torch.float32, 1, 1, 16, 4, [(2, 1)], 0)
    with pytest.raises(ValueError, match="share"):
        kernels.paged_attention(q.bfloat16(), cache, padded, *ints, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_token_to_its_slot(kernels, dtype):
    g = torch.Generator().manual_seed(3)
    cache = torch.zeros(6, 2, 4, 2, 16, dtype=dtype)
    qkv = torch.randn(5, 8, 16, generator=g).to(dtype)  # k and v: slices of one projection
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    pages, offs = torch.tensor([5, 5, 0, 3, 1]), torch.tensor([0, 3, 2, 1, 0])
    want = cache.clone()
    want[pages, :, offs] = torch.stack((k, v), dim=1)
    kernels.store_kv(cache, k, v, pages, offs)
    assert torch.equal(cache, want)
    with pytest.raises(ValueError, match="dtype"):
        kernels.store_kv(cache, k.double(), v.double(), pages, offs)
    # Pages -2 and -3 are step pages, steps[0] and [1]; the pool keeps what it held.
    steps, pool = torch.zeros(2, 2, 4, 2, 16, dtype=dtype), cache.clone()
    kernels.store_kv(cache, k, v, torch.tensor([-3, 5, -2, -2, 1]), offs, steps)
    assert torch.equal(steps[1, :, 0], want[5, :, 0])
    assert torch.equal(steps[0, :, 2], want[0, :, 2])
    assert torch.equal(steps[0, :, 1], want[3, :, 1]) and torch.equal(cache, pool)
    with pytest.raises(ValueError, match="laid out"):
        kernels.store_kv(cache, k, v, pages, offs, steps[:, :, :2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_out_of_memory_raise_and_the_next_call_works(dtype):
    """A block run whose scratch cannot be had raises MemoryError instead of crashing, and
    the next call computes: a 2^26-key span under an address-space limit 256 MiB above what
    the process holds (float32 blocks: 512 MiB of key pointers; bf16 blocks: 8 GiB of laid
    out keys; the row path, where a build has no blocks: each row's scores). In a
    subprocess: the limit would bind the test session."""
    code = textwrap.dedent(f"""
        import resource, torch
        from kvserve.kernels.cpu import cpu_kernels
        k = cpu_kernels()
        cache = torch.randn(1, 2, 16, 1, 64).to(torch.{dtype})
        q = torch.randn(16, 1, 64).to(torch.{dtype})
        n = 1 << 26  # keys, every one on page 0 (the table repeats it)
        tables = torch.zeros(1, n // 16, dtype=torch.int32)
        rows = torch.zeros(16, dtype=torch.int32)
        small = torch.arange(1, 17, dtype=torch.int32)
        huge = torch.full((16,), n, dtype=torch.int32)
        want = k.paged_attention(q, cache, tables, rows, rows, small, 0.125)  # threads start
        vm = next(int(line.split()[1]) for line in open("/proc/self/status")
                  if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        try:
            k.paged_attention(q, cache, tables, rows, rows, huge, 0.125)
            print("computed")
        except MemoryError as err:
            print("raised:", err)
        print("next call equal:", torch.equal(k.paged_attention(q, cache, tables, rows, rows,
                                                                small, 0.125), want))
    """)
    if cpu_kernels() is None:
        pytest.skip("no C compiler: the kernels did not build")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "raised: paged_attention: no scratch memory" in done.stdout
    assert "next call equal: True" in done.stdout
