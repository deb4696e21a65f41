"""The fused norm kernels, the MLP activations and the greedy argmax against the torch ops
they replace.

Each value is rounded at the same points as the ops round it, so results differ only by
float32 summation order in the mean: in bfloat16 that almost never survives the rounding
(a rare value lands one bf16 step away), in float32 it is an ulp or so.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.layers import RotaryEmbedding, apply_rope, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


def close(got, want):
    if want.dtype == torch.bfloat16:
        # the rare value whose float32 sum order flips a bf16 rounding is one step off (and
        # RoPE's sum of two rounded products can carry that step to a smaller result)
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got, want, atol=2 ** -7, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES), n=st.integers(1, 40),
       H=st.integers(1, 6), D=st.sampled_from([2, 16, 256]), rope=st.booleans(),
       norm=st.booleans())
def test_norm_rope_matches_ops(kernels, seed, dtype, n, H, D, rope, norm):
    g = torch.Generator().manual_seed(seed)
    # a slice of a wider row, as the q/k heads of the fused qkv projection are
    x = (torch.randn(n, H + 1, D, generator=g) * 4).to(dtype)[:, :H]
    scale = 1 + torch.randn(H, D, generator=g) * 0.1 if norm else None  # None: RoPE alone
    cos_sin = (RotaryEmbedding(D, 10_000.0).cos_sin(torch.arange(7, 7 + n), dtype)
               if rope else None)
    want = rms_norm(x, scale, 1e-6) if norm else x.clone()
    if rope:
        want = apply_rope(want, *cos_sin)
    close(kernels.norm_rope(x, scale, 1e-6, cos_sin), want)
    kernels.norm_rope(x, scale, 1e-6, cos_sin, out=x)  # in place, as the attention does
    close(x, want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES), n=st.integers(1, 40),
       D=st.sampled_from([8, 640]), chained=st.booleans(), plain=st.booleans())
def test_add_norm_matches_ops(kernels, seed, dtype, n, D, chained, plain):
    g = torch.Generator().manual_seed(seed)
    x, h = (torch.randn(2, n, D, generator=g) * 3).to(dtype)
    w_add, w_next = 1 + torch.randn(2, D, generator=g) * 0.1
    if plain:  # a pre-norm block's add: torch's, bit for bit
        want_x = x + h
        y = kernels.add_norm(x, h, None, 1e-6, w_next if chained else None)
        assert torch.equal(x, want_x)
    else:
        want_x = x + rms_norm(h, w_add, 1e-6)
        y = kernels.add_norm(x, h, w_add, 1e-6, w_next if chained else None)
    close(x, want_x)
    if chained:
        close(y, rms_norm(x, w_next, 1e-6))  # the norm of the sum as x holds it
    else:
        assert y is None


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES), n=st.integers(1, 40),
       width=st.sampled_from([1, 7, 64, 1536]), spread=st.sampled_from([1.0, 8.0]),
       silu=st.booleans())
def test_act_mul_matches_ops(kernels, seed, dtype, n, width, spread, silu):
    """gelu_tanh(gate) * up and silu(gate) * up against the activation in float64, rounded
    where the ops round (the activation, then the product). tanh-GELU as x sigmoid(2u):
    torch's 0.5 x (1 + tanh(u)) cancels where gate << 0, in float64 too."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(n, 2 * width, generator=g) * spread).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    u = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)
    act = gate * torch.sigmoid(gate if silu else 2 * u)
    got = (kernels.silu_mul if silu else kernels.gelu_mul)(gate_up)
    if dtype == torch.bfloat16:
        want = (act.to(dtype).double() * up).to(dtype)
        # an activation within a float32 ulp of a bf16 tie may round the other way (and below
        # 2^-100 the kernel's exp flushes to 0 what float64 keeps: atol covers those)
        off = (got != want) & (want.double().abs() > 2 ** -100)
        assert off.sum() <= 1 + 0.01 * got.numel()
        torch.testing.assert_close(got, want, atol=2 ** -7, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got.double(), act * up, atol=1e-6, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES), B=st.integers(1, 9),
       V=st.integers(1, 5000), ties=st.booleans())
def test_argmax_is_the_first_maximum(kernels, seed, dtype, B, V, ties):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g).to(dtype)
    if ties:  # a few coarse values: many rows hold their maximum more than once
        logits = logits.round()
    logits[0] = float("-inf")
    assert torch.equal(kernels.argmax(logits), logits.max(dim=-1).indices)


def test_bad_shapes_are_refused(kernels):
    with pytest.raises(ValueError):
        kernels.norm_rope(torch.zeros(2, 1, 3), torch.ones(1, 3), 1e-6)  # odd head dim
    with pytest.raises(ValueError):
        kernels.add_norm(torch.zeros(2, 4), torch.zeros(2, 4).bfloat16(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError):
        kernels.argmax(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="float32"):
        kernels.norm_rope(torch.zeros(2, 1, 4), torch.ones(1, 4).double(), 1e-6)
