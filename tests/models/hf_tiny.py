"""Tiny seeded random models of every family, built from transformers' config classes.

A random model is only a useful reference (../shared/notes/hf_hybrids.md) with
initializer_range 0.2, untied embeddings and every constant parameter perturbed (zero
gates, all-ones norms and zero biases would hide whole paths or weight-layout bugs).
Each model is saved with `save_pretrained` and loaded back through kvserve's own
loader (as an HF directory), so the config parsing and weight names are tested too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.memory.spec import LayerKind
from kvserve.models.loader import _load_hf_dir, build_model

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class NoTokenizer:
    """The engine's tokenizer for token-id prompts: ids are their own text."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter or saved buffer that holds one repeated value seeded noise.

    Buffers `save_pretrained` leaves out (Gemma's embed_scale) stay: perturbed, the
    in-memory reference would no longer be the model on disk."""
    g = torch.Generator().manual_seed(seed)
    saved = model.state_dict().keys()
    buffers = [b for name, b in model.named_buffers() if name in saved]
    with torch.no_grad():
        for t in [*model.parameters(), *buffers]:
            if t.is_floating_point() and t.numel() > 0 and bool((t == t.flatten()[0]).all()):
                t.add_(torch.randn(t.shape, generator=g) * 0.2)


def save_tiny(hf_config, model_cls, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Build, perturb and save an HF model; returns it (float32, eval)."""
    torch.manual_seed(seed)
    model = model_cls(hf_config).eval()
    perturb(model, seed)
    model.save_pretrained(str(directory))
    return model


def load_engine(directory: Path, **cfg) -> LLMEngine:
    """The HF directory through kvserve's loader into an engine (float32, small pages)."""
    config, state_dict = _load_hf_dir(Path(directory))
    model = build_model(config, state_dict)
    args = dict(kv_memory=2 << 20, tokens_per_page=4, max_num_batched_tokens=64,
                quantization="none", dtype="float32")
    args.update(cfg)
    return LLMEngine(model, NoTokenizer(), EngineConfig(**args))


def engine_run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int,
               ids: list[str] | None = None,
               each_step: Callable[[LLMEngine], None] | None = None,
               ) -> tuple[list[list[int]], list[int]]:
    """All prompts added at once: greedy tokens of each (EOS ignored) and how many of its
    prompt tokens came from the prefix cache. `each_step` runs after every step."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = ids or [str(i) for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    done = {}
    while eng.has_unfinished():
        done.update({out.request_id: out for out in eng.step() if out.finished})
        if each_step is not None:
            each_step(eng)
    return ([list(done[r].outputs[0].token_ids) for r in ids],
            [done[r].num_cached_tokens for r in ids])


def engine_greedy(eng: LLMEngine, prompts: list[list[int]], max_tokens: int,
                  ids: list[str] | None = None) -> list[list[int]]:
    """All prompts added at once; greedy tokens of each (EOS ignored)."""
    return engine_run(eng, prompts, max_tokens, ids)[0]


# ------------------------------------------------- what every family's tests check


def check_greedy(directory: Path, prompts: list[list[int]], want: list[list[int]],
                 torch_attention: bool = False, **cfg) -> None:
    """Batched through the engine: HF's tokens. torch_attention: the GPU path (gathers and
    torch ops) instead of the compiled CPU kernels."""
    eng = load_engine(directory, **cfg)
    if torch_attention:
        eng.runner.attn.kernels = None
    assert engine_greedy(eng, prompts, len(want[0])) == want


def check_alone_then_cached(eng: LLMEngine, prompts: list[list[int]],
                            want: list[list[int]], long: int = 40) -> None:
    """Each prompt alone, then all of them again: HF's tokens both times, and every prompt
    of at least `long` tokens served in part from the prefix cache the second time."""
    n = len(want[0])
    for i, p in enumerate(prompts):
        assert engine_greedy(eng, [p], n, [f"alone{i}"]) == [want[i]]
    got, cached = engine_run(eng, prompts, n, [f"again{i}" for i in range(len(prompts))])
    assert got == want
    assert all(c > 0 for p, c in zip(prompts, cached) if len(p) >= long), cached


def check_preemption(directory: Path, prompts: list[list[int]], want: list[list[int]],
                     room_tokens: int) -> None:
    """A pool of `room_tokens` tokens of every spec: requests are preempted and resumed,
    and their tokens do not change."""
    per_token = sum(s.token_bytes() for s in load_engine(directory).kv.layout.specs)
    eng = load_engine(directory, kv_memory=per_token * room_tokens, max_num_seqs=4,
                      max_num_batched_tokens=16)
    assert engine_greedy(eng, prompts, len(want[0])) == want
    assert eng.scheduler.num_preemptions > 0


def check_bounded(directory: Path, prompts: list[list[int]], kind: LayerKind,
                  tokens: int, max_tokens: int) -> None:
    """After every step, the `kind` spec holds at most `tokens` tokens per running request
    (a window or chunk plus a page), and something at some point."""
    eng = load_engine(directory)
    spec = next(s for s in eng.kv.layout.specs if s.kind is kind)
    most = [0]

    def check(e: LLMEngine) -> None:
        used = {s.name: s.used for s in e.kv.stats().specs}[spec.name]
        assert used <= len(e.scheduler.running) * tokens * spec.token_bytes()
        most[0] = max(most[0], used)
    engine_run(eng, prompts, max_tokens, each_step=check)
    assert most[0] > 0


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt, EOS ignored (no stop token at all:
    min_new_tokens would instead forbid EOS, changing the argmax)."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                         dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
