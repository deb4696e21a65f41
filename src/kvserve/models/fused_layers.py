"""A step's decoder layers in one call of kernels/decoder.c: Gemma 3's and the Llama
family's (SmolLM2, Llama, Mistral, Qwen3; Qwen2's biases have no kernel call).

Module by module (models/gemma3.py, models/llama.py) a step makes about eleven kernel
calls a layer from Python, each behind ~10 us of wrappers (module calls, argument checks,
output tensors): 2.4-3 ms of a 9.4 ms decode step of Gemma 3 270M at one row on a 2-core
Zen 5, as much as its attention and norms compute. decoder.c makes the same calls with the
same arguments, so a step's outputs are bitwise the modules'. It runs a step where every
op of it has a kernel of ours: the attention backend sends every row to the kernel
(PagedAttention.kernel_only), each projection has a kernel call for the step's row count
(Linear.kernel), RoPE rotates whole heads, and the layers' norms share one epsilon.
Anywhere else the modules run as before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kernels.cpu import AttentionView, DecoderLayer, cpu_kernels
from kvserve.models.layers import gelu_mul, silu_mul


@dataclass
class _Plan:
    """The static half of a call for one row count and dtype: every layer's weights,
    factors and pages, and which (key, RoPE) view each layer reads."""

    layers: ctypes.Array
    views: list[tuple[tuple[str, int, int], bool]]  # ((spec, window, chunk), sliding)
    dims: tuple[int, int, int, int, int]
    eps: float
    w_out: torch.Tensor
    keep: list[Any]  # what the pointers point into


class FusedLayers:
    """The model's layers as one kernel call where a step allows it (see the module). What
    a row count calls is looked up once, at its first step, and kept: the projections'
    copies do not change after that (q8+bf16 makes its bf16 copy at its first large step,
    which is that lookup); a caller that swaps them makes a new FusedLayers."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, torch.dtype], _Plan | None] = {}
        self._attn: Any = None
        self._large = 0  # the row count from which every projection takes its large copy

    def __call__(self, model: Any, x: torch.Tensor, attn: Any,
                 local: tuple[torch.Tensor, ...], glob: tuple[torch.Tensor, ...]
                 ) -> torch.Tensor | None:
        """The final norm of the layers' output for embedded rows x [M, hidden] (updated in
        place), or None where the step takes the modules' path."""
        kernels, kernel_only = cpu_kernels(), getattr(attn, "kernel_only", None)
        if (kernels is None or kernel_only is None or attn.kernels is not kernels
                or not kernel_only() or torch.is_grad_enabled()
                or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous()):
            return None
        if attn is not self._attn:  # another pool: other pages
            self._plans, self._attn = {}, attn
            self._large = 1 + max((getattr(m.quant, "SMALL", 0) for m in model.modules()
                                   if getattr(m, "quant", None) is not None), default=0)
        # Row counts from _large up call the same kernels: one plan serves them all (a
        # prefill step's row count is anything up to the token budget).
        key = (min(x.shape[0], self._large), x.dtype)
        if key not in self._plans:
            self._plans[key] = _plan(model, attn, *key)
        plan = self._plans[key]
        if plan is None:
            return None
        if local[0].shape[-1] != plan.dims[2]:  # RoPE on part of each head (Bamba)
            return None
        views = (AttentionView * len(plan.views))(*(
            AttentionView.of(*attn.ranges[k], *attn.writes[k[0]][:2], attn.step_pages.get(k[0]),
                             *(local if sliding else glob))
            for k, sliding in plan.views))
        return kernels.decoder_layers(plan.layers, views, x, plan.dims, plan.eps, plan.w_out)


def _plan(model: Any, attn: Any, rows: int, dtype: torch.dtype) -> _Plan | None:
    """What `rows` rows of `dtype` call in every layer, or None where some op has no kernel
    of ours (or the layers are not Gemma's or a pre-norm block)."""
    config, stack = model.config, model.model
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return None
    keys: list[tuple[tuple[str, int, int], bool]] = []
    layers, keep, eps = [], [], {stack.norm.eps}
    for i, layer in enumerate(stack.layers):
        a, mlp, b = layer.self_attn, layer.mlp, attn.bindings[i]
        calls = [p.kernel(rows, dtype) for p in (a.qkv_proj, a.o_proj, mlp.gate_up_proj,
                                                  mlp.down_proj)]
        cache = attn.pool.layer(b.spec, b.index)
        if None in calls or mlp.act not in (gelu_mul, silu_mul) or cache.dtype != dtype:
            return None
        view = ((b.spec, b.window, b.chunk), config.layer_types[i] == "sliding_attention")
        if view not in keys:
            keys.append(view)
        norms, qk_norms = _norms(layer), [a.q_norm, a.k_norm] if hasattr(a, "q_norm") else []
        eps |= {n.eps for n in [*norms, *qk_norms] if n is not None}
        qk = a.qk_scale.get(*(n.weight for n in qk_norms)) if qk_norms else None
        factors = [None if n is None else n.factor() for n in norms] + [qk]
        layers.append(DecoderLayer(*(c.projection() for c in calls),
                                   *(None if f is None else f.data_ptr() for f in factors),
                                   cache.data_ptr(), *cache.stride()[:4], keys.index(view),
                                   b.scale, mlp.act is silu_mul))
        keep += [calls, factors, cache]
    if len(eps) > 1:
        return None
    a = stack.layers[0].self_attn
    dims = (a.n_heads, a.n_kv_heads, a.head_dim, config.intermediate_size, attn.T)
    w_out = stack.norm.factor()
    return _Plan((DecoderLayer * len(layers))(*layers), keys, dims, stack.norm.eps, w_out,
                 keep + [w_out])


def _norms(layer: Any) -> list[Any]:
    """A layer's norms in decoder.c's order (w_in, w_post_attn, w_pre_ff, w_post_ff): Gemma's
    four around its two sub-blocks; a pre-norm block's two, its adds plain."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        return [layer.input_layernorm, layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return [layer.input_layernorm, None, layer.post_attention_layernorm, None]
