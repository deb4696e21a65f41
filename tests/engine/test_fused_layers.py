"""A step's decoder layers in one kernel call (kernels/decoder.c, models/fused_layers.py): the
modules' outputs bit for bit at every step (decode, chunked prefill, both together, prefix
hits, released windows, step pages, batch sizes on both sides of a split linear's SMALL),
the modules' path wherever a step has an op without a kernel of ours, and out-of-memory and refused
arguments raised as errors."""

import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch
from test_paged_engine import LENGTHS, engine, prompts, run
from tiny_gemma import tiny_gemma

from kvserve.cpu_features import bf16_native
from kvserve.kernels.cpu import AttentionView, DecoderLayer, Projection, cpu_kernels
from kvserve.models import quant
from kvserve.models.base import CausalLM
from kvserve.models.fused_layers import FusedLayers
from kvserve.models.llama import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler: no kernels")


def tiny_llama(qk_norm: bool = False) -> CausalLM:
    """tiny_gemma's sizes as a Llama (pre-norm, SwiGLU), sliding and full layers as in
    Qwen2 or Ministral; qk_norm as in Qwen3."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, qk_norm=qk_norm,
        max_position_embeddings=512, eos_token_ids=[1])
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


FAMILIES = {"gemma3": tiny_gemma, "llama": tiny_llama, "qwen3": lambda: tiny_llama(True)}


def tiny(dtype: torch.dtype, mode: str, family: str = "gemma3") -> CausalLM:
    model = FAMILIES[family]().to(dtype)
    if mode != "none":
        model.quantize(mode)
    return model


def steps(model, monkeypatch, fused: bool, ps, **kw) -> tuple[list[torch.Tensor], int, list]:
    """Every step's final hidden rows, how many steps ran fused, and the tokens."""
    hidden, ran = [], [0]
    call, logits = FusedLayers.__call__, CausalLM.compute_logits

    def layers(self, *args):
        out = call(self, *args) if fused else None
        ran[0] += out is not None
        STEP_PAGES[fused] += out is not None and bool(args[2].step_pages)
        return out

    def record(self, h):
        hidden.append(h.clone())
        return logits(self, h)

    monkeypatch.setattr(FusedLayers, "__call__", layers)
    monkeypatch.setattr(CausalLM, "compute_logits", record)
    tokens = run(engine(model, **kw), ps, max_tokens=10)
    monkeypatch.undo()
    return hidden, ran[0], tokens


SETUPS = [
    {},
    {"max_num_batched_tokens": 7},  # chunked prefill beside decode rows
    {"tokens_per_page": 1},
    {"kv_memory": 4 << 20, "max_num_batched_tokens": 512, "n": 20},  # batches past SMALL
    # past the 256-token end region and the window of 8: keys no later step reads get step
    # pages instead of the pool's (PagedAttention._step_tables)
    {"kv_memory": 4 << 20, "max_num_batched_tokens": 200, "n": 2, "lengths": [480, 450]},
]
STEP_PAGES = {True: 0, False: 0}  # fused steps that had step pages


MODES = [(torch.float32, "q8"), (torch.float32, "q8+fp16"), (torch.bfloat16, "q8"),
         (torch.bfloat16, "q8+bf16"),
         (torch.bfloat16, "q8+int8"), (torch.bfloat16, "none")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "mode"), MODES)
@pytest.mark.parametrize("kw", SETUPS)
def test_fused_steps_equal_the_modules_bitwise(family, dtype, mode, kw, monkeypatch):
    if dtype == torch.bfloat16 and not bf16_native():
        pytest.skip("bf16 projections and attention need native bf16 (AVX-512 BF16 or AMX)")
    kw = dict(kw)
    n, lengths = kw.pop("n", 6), kw.pop("lengths", LENGTHS * 4)
    ps = prompts(n, lengths[:n])
    ps += [ps[0] + [7, 8, 9]]  # a prefix hit on the first prompt
    # q8+fp16: fbgemm's copy (no kernel of ours: the modules' path) from 9 rows
    monkeypatch.setattr(quant, "fp16_small", lambda n, k: 8)
    model = tiny(dtype, mode, family)
    want, _, tokens = steps(model, monkeypatch, False, ps, **kw)
    STEP_PAGES[True] = 0
    got, ran, fused_tokens = steps(model, monkeypatch, True, ps, **kw)
    assert len(got) == len(want)
    assert ran == len(got) if mode != "q8+fp16" else 0 < ran <= len(got)
    # (q8+fp16 runs the 200-row steps that take step pages on the modules' path)
    assert (STEP_PAGES[True] > 0) == (lengths[0] > 256 and mode != "q8+fp16")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert fused_tokens == tokens
    # one plan per row count below the projections' large copies, one for all above
    assert len(model.fused_layers._plans) <= model.fused_layers._large + 1


def test_a_step_without_kernels_takes_the_modules(monkeypatch):
    """float32 projections (no kernel of ours), and the torch attention path."""
    ps = prompts(3, LENGTHS)
    _, ran, tokens = steps(tiny_gemma(), monkeypatch, True, ps)
    assert ran == 0
    _, ran, _ = steps(tiny(torch.float32, "q8"), monkeypatch, True, ps, torch_attention=True)
    assert ran == 0
    _, ran, q8_tokens = steps(tiny(torch.float32, "q8"), monkeypatch, True, ps)
    assert ran > 0 and len(q8_tokens) == len(tokens)


ONE_LAYER = textwrap.dedent("""
    import torch
    from kvserve.kernels.cpu import AttentionView, DecoderLayer, Projection, cpu_kernels
    k = cpu_kernels()
    torch.manual_seed(0)
    H, D, I, T = 64, 32, 64, 16
    shapes = [(4 * D, H), (2 * D, 2 * D), (2 * I, H), (H, I)]
    mats = [k.q8_bound(*k.q8_quantize(torch.randn(s)), s[1]) for s in shapes]
    w = torch.ones(6, 2 * D)
    cache = torch.zeros(1, 2, T, 1, D)
    cos_sin = torch.ones(1, 1, D), torch.zeros(1, 1, D)

    def layers(K=H):
        calls = [m.projection() for m in mats]
        calls[0].K = K
        return (DecoderLayer * 1)(DecoderLayer(*calls, *(w[i].data_ptr() for i in range(5)),
                                               cache.data_ptr(), *cache.stride()[:4], 0, 0.125))

    def call(n=4, K=H):
        \"\"\"One row attending to n keys, all on page 0.\"\"\"
        i32 = [torch.tensor([v], dtype=torch.int32) for v in (0, 0, n)]
        parts = (torch.zeros(1, -(-n // T), dtype=torch.int32), *i32,
                 torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None,
                 *cos_sin)
        views = (AttentionView * 1)(AttentionView.of(*parts))
        return k.decoder_layers(layers(K), views, torch.randn(1, H), (2, 1, D, I, T), 1e-6,
                              w[5, :H])
""")


def test_a_refused_projection_is_a_value_error():
    namespace: dict = {}
    exec(ONE_LAYER, namespace)
    assert torch.isfinite(namespace["call"]()).all()
    with pytest.raises(ValueError, match="a projection refused its rows"):
        namespace["call"](K=33)  # not a multiple of 32: kvs_q8_matmul refuses it


def test_attention_out_of_memory_raises_and_the_next_call_works():
    """A step whose attention scratch cannot be had raises MemoryError instead of crashing,
    and the next step computes (2^26 keys under an address-space limit 256 MiB above what
    the process holds; in a subprocess, as the limit would bind the session)."""
    code = ONE_LAYER + textwrap.dedent("""
        import resource
        call()  # threads started
        vm = next(int(line.split()[1]) for line in open("/proc/self/status")
                  if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        try:
            call(n=1 << 26)
            print("computed")
        except MemoryError as err:
            print("raised:", err)
        print("next call finite:", bool(torch.isfinite(call()).all()))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "raised: decoder_layers: no scratch memory for attention" in done.stdout
    assert "next call finite: True" in done.stdout


@pytest.mark.parametrize("name", [None, "smollm2"])
def test_real_model_greedy_tokens_equal_the_modules(name, monkeypatch):
    """Gemma 3 270M and SmolLM2-135M as served (`auto`), one and nine sequences: fused
    steps give the modules' tokens."""
    from kvserve.engine.llm import LLM
    from kvserve.engine.request import SamplingParams

    llm = LLM(name, kv_memory=1 << 27)
    g = torch.Generator().manual_seed(1)
    top = min(200_000, llm.engine.config.vocab_size)
    ps = [torch.randint(10, top, (n,), generator=g).tolist() for n in (60, 5, 130) * 3]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(batch):
        return [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in batch], sp)]

    fused = [generate(ps[:1]), generate(ps)]
    monkeypatch.setattr(FusedLayers, "__call__", lambda self, *a: None)
    assert [generate(ps[:1]), generate(ps)] == fused


def test_structures_match_decoder_c():
    """The ctypes structures' sizes are the C structs' (pointers and int64 of 8 bytes)."""
    assert ctypes.sizeof(Projection) == 40
    assert ctypes.sizeof(DecoderLayer) == 4 * 40 + 6 * 8 + 4 * 8 + 16
    assert ctypes.sizeof(AttentionView) == 11 * 8
