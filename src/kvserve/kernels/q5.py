"""Q5_0 blocks in torch: the reference for qmatmul.c's Q5_0 rounding and what the tests
check it against.

llama.cpp's Q5_0 keeps a block of 32 weights as 5-bit codes q (0-31) and one fp16 scale d,
W = d * (q - 16). A GGUF's own Q5_0 tensors, dequantized, come back to the same codes and
scales under this rule (the block's value of largest magnitude always has code 0, so its
-16 d gives d back exactly), which is what lets the loader serve them with no further
rounding.
"""

from __future__ import annotations

import torch


def q5_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q5_0_ref on [N, K] (K a multiple of 32): codes uint8 [N, K]
    and fp16 scales [N, K / 32]. Per block, d = the value of largest magnitude (the first
    on ties, as torch's argmax picks) / -16 and code = trunc(w * (1 / d) + 16.5) capped at
    31, all in float32, as the C reference computes it."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // 32, 32)
    peak = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))
    d = peak / -16
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = (w * inv + 16.5).trunc_().clamp_(max=31).to(torch.uint8)
    return codes.reshape(n, k), d.squeeze(-1).half()


def q5_dequantize(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that Q5_0 codes and scales stand for."""
    n, k = codes.shape
    w = (codes.float() - 16).view(n, k // 32, 32) * d.float()[..., None]
    return w.view(n, k)
