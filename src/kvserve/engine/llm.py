"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvserve.engine.engine import EngineConfig, LLMEngine, PromptInput
from kvserve.engine.request import RequestOutput, SamplingParams
from kvserve.memory import Stats


class LLM:
    """Load a model (default: Gemma 3 270M) and generate for batches of prompts.

    kv_memory is the KV pool size: bytes (int) or a fraction of free memory.
    kv_backend: "paged" (default) or "vtensor" (contiguous virtual KV, plain SDPA).
    kv_idle_release_s (an engine arg): KV memory unused this long goes back to the OS
    (a CPU) when `generate` finds it (default 60 s; see EngineConfig).
    host_kv_memory (an engine arg): bytes of host memory keeping what the KV pool evicts.
    kv_share (an engine arg): a `kvserve.physical.share.KVShare(ceiling_bytes)` given to
    several LLMs in one process: their KV pools together hold at most its ceiling, each
    at most its own kv_memory, and free memory moves to whichever runs.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        kv_memory: int | float | None = None,
        dtype: torch.dtype | str = "auto",
        device: str | None = None,
        kv_backend: str = "paged",
        **engine_args: object,
    ) -> None:
        cfg = EngineConfig(model=model, kv_memory=kv_memory, dtype=dtype, device=device,
                           kv_backend=kv_backend, **engine_args)  # type: ignore[arg-type]
        self.engine = LLMEngine.load(cfg)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_stats(self) -> Stats:
        """The KV memory now: bytes per layer type, prefix-cache tokens queried and hit,
        and with a host tier (host_kv_memory=...) its bytes, swaps and hits (`.host`)."""
        return self.engine.kv.stats()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in order."""
        self.engine.maybe_release_idle()  # memory the previous calls left unused that long
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt, or one for all")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves nothing queued
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
