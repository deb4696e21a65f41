"""The Mamba-2 mixer in plain PyTorch, over states kept in the KV pool.

A layer projects x to [gate z | xBC | dt], runs a causal depthwise conv (width K) over
xBC, splits it into the SSM input x (heads x head_dim) and B, C (groups x d_state), and
runs the selective state space recurrence per head h:

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T,    y_t = S_t C_t + D_h * x_t

with dt_t = softplus(dt_raw + dt_bias) and A_h = -exp(A_log). y goes through an RMSNorm
gated by silu(z) (per group) and the output projection. A sequence's state is the conv's
last K - 1 inputs and S: [conv_dim, K - 1] and [heads, head_dim, d_state], float32.

Prefill runs the chunked form (SSD, Mamba-2 paper §6): within a chunk of `chunk_size`
tokens a masked attention-like product, across chunks the recurrence on chunk states.
Chunks sit at multiples of `chunk_size` in absolute positions (a segment that starts
mid-chunk is padded in front with dt = 0 tokens, which leave the state alone), so a
prompt is chunked as HF chunks a whole prompt, whatever the prefill steps. Decode runs
the recurrence one token at a time, batched over sequences.

Numerics follow transformers' torch path (BambaMixer.torch_forward): float32 scan, dt
clamped to `time_step_limit` in the chunked form only (HF's one-token update ignores the
limit; the default (0, inf) makes both the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.base import STATE_DTYPE, AttentionBackend, StateSeq
from kvserve.models.layers import Linear


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group` channels, in float32."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.float() * F.silu(z.float())
        g = y.unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(dtype)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., c] -> [..., c, c] with out[..., l, s] = a[s+1] + .. + a[l] for l >= s, -inf
    above the diagonal. Summed per (l, s) rather than as a difference of two cumulative
    sums, which would cancel badly."""
    c = a.shape[-1]
    ones = torch.ones(c, c, dtype=torch.bool, device=a.device)
    m = a[..., :, None].expand(*a.shape, c).masked_fill(~ones.tril(-1), 0)
    return m.cumsum(-2).masked_fill(~ones.tril(0), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk: int, state: torch.Tensor | None,
             offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan of one sequence's segment (no D skip).

    x [L, H, P], dt [L, H], A [H], B and C [L, H, N] (per head), all float32; `state`
    [H, P, N] before the segment (None: zero); `offset` the position of x[0]. Returns y
    [L, H, P] and the state after the segment.
    """
    L, H, P = x.shape
    front = offset % chunk
    back = -(front + L) % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (front, back))
        return t.view(-1, chunk, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # [Z, c, H, P]
    B, C = chunks(B), chunks(C)  # [Z, c, H, N]
    dA = chunks(dt * A).transpose(1, 2)  # [Z, H, c]; padding: dt = 0, no decay, no input
    cum = dA.cumsum(-1)
    # Inside chunks: y_l = sum_{s <= l} (C_l . B_s) exp(dA_{s+1} + .. + dA_l) xdt_s.
    scores = torch.einsum("zlhn,zshn->zhls", C, B) * torch.exp(_segsum(dA))
    y = torch.einsum("zhls,zshp->zlhp", scores, xdt)
    # Each chunk's contribution to the state at its end, then the recurrence over chunks.
    to_end = torch.exp(cum[..., -1:] - cum)  # [Z, H, c]
    inputs = torch.einsum("zshn,zhs,zshp->zhpn", B, to_end, xdt)
    decay = torch.exp(cum[..., -1])  # [Z, H]
    S = state if state is not None else x.new_zeros(H, P, B.shape[-1])
    starts = []
    for z in range(inputs.shape[0]):
        starts.append(S)
        S = S * decay[z][:, None, None] + inputs[z]
    # Across chunks: y_l += exp(dA_1 + .. + dA_l) C_l . S_start.
    y = y + torch.einsum("zlhn,zhpn->zlhp", C, torch.stack(starts)) * \
        torch.exp(cum).transpose(1, 2)[..., None]
    return y.reshape(-1, H, P)[front:front + L], S


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer (HF parameter names: in_proj, conv1d, dt_bias, A_log, D, norm,
    out_proj) whose states live in the backend's pages (`AttentionBackend.states`)."""

    def __init__(self, layer_idx: int, hidden: int, n_heads: int, head_dim: int,
                 n_groups: int, d_state: int, d_conv: int, chunk_size: int, eps: float,
                 conv_bias: bool = True, proj_bias: bool = False,
                 dt_limit: tuple[float, float] = (0.0, float("inf"))) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.n_groups = n_heads, head_dim, n_groups
        self.d_state, self.d_conv, self.chunk_size = d_state, d_conv, chunk_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.inner = n_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * d_state
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + n_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim,
                                bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(n_heads))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // n_groups, eps)
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's state: the conv's last inputs, the SSM state."""
        return (self.conv_dim, self.d_conv - 1), (self.n_heads, self.head_dim, self.d_state)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        seqs, (conv, ssm) = backend.states(self.layer_idx)
        z, xBC, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.n_heads], dim=-1)
        y = torch.empty(x.shape[0], self.inner, dtype=STATE_DTYPE, device=x.device)
        steps = [s for s in seqs if s.num_tokens == 1]
        if steps:
            self._decode(steps, xBC, dt, conv, ssm, y)
        for s in seqs:
            if s.num_tokens > 1:
                self._prefill(s, xBC, dt, conv, ssm, y)
        return self.out_proj(self.norm(y, z, x.dtype))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[..., groups * d_state] -> [..., heads, d_state] (each group's heads share it)."""
        t = t.unflatten(-1, (self.n_groups, self.d_state))
        return t.repeat_interleave(self.n_heads // self.n_groups, dim=-2)

    def _split(self, xBC: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xs, B, C = xBC.split([self.inner, self.n_groups * self.d_state,
                              self.n_groups * self.d_state], dim=-1)
        return xs.unflatten(-1, (self.n_heads, self.head_dim)), self._heads(B), self._heads(C)

    def _prefill(self, s: StateSeq, xBC: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
                 ssm: torch.Tensor, y: torch.Tensor) -> None:
        """One sequence's segment: conv, then the chunked scan piece by piece, each piece
        ending where a state is to be written."""
        K, n = self.d_conv, s.num_tokens
        if s.source is None:
            history = conv.new_zeros(self.conv_dim, K - 1)
            S = None
        else:
            history, S = conv[s.source], ssm[s.source].clone()
        # Inputs of the conv: the K - 1 before the segment, then the segment's.
        inputs = torch.cat([history, xBC[s.rows].to(STATE_DTYPE).T], dim=1)
        w = self.conv1d.weight.to(STATE_DTYPE)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.to(STATE_DTYPE)
        act = F.silu(F.conv1d(inputs[None], w, bias, groups=self.conv_dim)[0].T)
        xs, B, C = self._split(act)
        dts = F.softplus(dt[s.rows].to(STATE_DTYPE) + self.dt_bias.to(STATE_DTYPE))
        dts = dts.clamp(*self.dt_limit)
        A = -torch.exp(self.A_log.to(STATE_DTYPE))
        D = self.D.to(STATE_DTYPE)[:, None]
        done = 0
        for k, pages in s.writes:
            part = slice(done, k)
            out, S = ssd_scan(xs[part], dts[part], A, B[part], C[part], self.chunk_size, S,
                              s.start + done)
            rows = slice(s.rows.start + done, s.rows.start + k)
            y[rows] = (out + D * xs[part]).flatten(1)
            for page in pages:  # the state after k tokens: the conv's last K - 1 inputs, S
                conv[page] = inputs[:, k:k + K - 1]
                ssm[page] = S
            done = k
        assert done == n, "a state layer's writes must end at the segment's end"

    def _decode(self, steps: list[StateSeq], xBC: torch.Tensor, dt: torch.Tensor,
                conv: torch.Tensor, ssm: torch.Tensor, y: torch.Tensor) -> None:
        """One token of each sequence: the recurrence, batched."""
        dev = xBC.device
        rows = torch.tensor([s.rows.start for s in steps], device=dev)
        src = torch.tensor([0 if s.source is None else s.source for s in steps], device=dev)
        history, S = conv.index_select(0, src), ssm.index_select(0, src)
        fresh = [i for i, s in enumerate(steps) if s.source is None]
        if fresh:  # one-token prompts start from the zero state
            history[fresh], S[fresh] = 0, 0
        inputs = torch.cat([history, xBC[rows].to(STATE_DTYPE)[:, :, None]], dim=2)
        w = self.conv1d.weight.to(STATE_DTYPE)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.to(STATE_DTYPE)
        act = F.silu(F.conv1d(inputs, w, bias, groups=self.conv_dim)[:, :, -1])
        xs, B, C = self._split(act)  # [b, H, P], [b, H, N], [b, H, N]
        dts = F.softplus(dt[rows].to(STATE_DTYPE) + self.dt_bias.to(STATE_DTYPE))  # [b, H]
        A = -torch.exp(self.A_log.to(STATE_DTYPE))
        dA = torch.exp(dts * A)[:, :, None, None]
        dBx = (dts[:, :, None, None] * B[:, :, None, :]) * xs[..., None]  # [b, H, P, N]
        S = S * dA + dBx
        out = torch.einsum("bhpn,bhn->bhp", S, C) + self.D.to(STATE_DTYPE)[:, None] * xs
        y[rows] = out.flatten(1)
        which = [(i, page) for i, s in enumerate(steps) for _, pages in s.writes
                 for page in pages]
        index = torch.tensor([i for i, _ in which], device=dev)
        pages = torch.tensor([p for _, p in which], device=dev)
        conv.index_copy_(0, pages, inputs[:, :, 1:].index_select(0, index))
        ssm.index_copy_(0, pages, S.index_select(0, index))
