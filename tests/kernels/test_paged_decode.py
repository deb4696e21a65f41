"""The CPU decode kernel against the same attention written in torch ops.

Random page tables over a shared pool, random lengths and windows, every GQA
ratio and head size the dispatch distinguishes; both the machine's build (the
AVX-512 BF16 path where the CPU has it) and the portable build.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def reference(q, cache, tables, lo, n, scale):
    """Gathered keys, matmul scores rounded to the input dtype, float32 softmax."""
    out = []
    T, Hkv = cache.shape[2], cache.shape[3]
    for b in range(q.shape[0]):
        pos = torch.arange(lo[b], lo[b] + n[b])
        page = torch.tensor(tables[b])[pos // T - lo[b] // T]
        k, v = cache[page, 0, pos % T], cache[page, 1, pos % T]  # [n, Hkv, D]
        qg = q[b].view(Hkv, -1, q.shape[-1])
        s = torch.matmul(qg, k.permute(1, 2, 0)).float() * scale
        p = torch.softmax(s, dim=-1).to(q.dtype)
        out.append(torch.matmul(p, v.transpose(0, 1)).reshape(q.shape[1:]))
    return torch.stack(out)


def case(seed, dtype, Hkv, G, D, T, lengths, window):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // T) for n in lengths) + 3
    cache = torch.randn(num_pages, 2, T, Hkv, D, generator=g).to(dtype)
    free = torch.randperm(num_pages, generator=g).tolist()
    tables, lo, n = [], [], []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // T))]
        first = max(0, length - window) if window else 0
        tables.append(table[first // T:])
        lo.append(first)
        n.append(length - first)
    q = torch.randn(len(lengths), Hkv * G, D, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    pages = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, cache, tables, pages, lo, n


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4, 8]),
       D=st.sampled_from([16, 64, 256]), T=st.sampled_from([1, 4, 16]),
       lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       window=st.sampled_from([0, 5, 32]))
def test_matches_torch_attention(kernels, seed, dtype, Hkv, G, D, T, lengths, window):
    q, cache, tables, pages, lo, n = case(seed, dtype, Hkv, G, D, T, lengths, window)
    got = kernels.paged_decode(q, cache, pages, torch.tensor(lo, dtype=torch.int32),
                               torch.tensor(n, dtype=torch.int32), D**-0.5)
    want = reference(q, cache, tables, lo, n, D**-0.5)
    # bfloat16: both round scores, probabilities and output, but sum in different orders,
    # so an output may land one bf16 step (2^-8 relative) away.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_reads_a_strided_query_in_place(kernels):
    # The engine hands q as a slice of the fused qkv projection: rows are not contiguous.
    q, cache, tables, pages, lo, n = case(0, torch.float32, 1, 4, 64, 4, [9, 30], 0)
    wide = torch.cat([q, torch.randn(2, 2, 64)], dim=1)[:, :4]
    assert not wide.is_contiguous()
    args = (cache, pages, torch.tensor(lo, dtype=torch.int32),
            torch.tensor(n, dtype=torch.int32), 0.125)
    torch.testing.assert_close(kernels.paged_decode(wide, *args),
                               kernels.paged_decode(q.contiguous(), *args))


def test_rejects_mixed_dtypes(kernels):
    q, cache, _, pages, lo, n = case(0, torch.float32, 1, 1, 16, 4, [3], 0)
    with pytest.raises(ValueError, match="share"):
        kernels.paged_decode(q.bfloat16(), cache, pages, torch.tensor(lo, dtype=torch.int32),
                             torch.tensor(n, dtype=torch.int32), 0.25)


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
