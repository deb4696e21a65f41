"""LLMEngine: requests in, token/text deltas out, one scheduler step at a time."""

from __future__ import annotations

import math
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.cpu_features import bf16_missing, bf16_native, cpu_name
from kvserve.engine.cost_model import CostModel
from kvserve.engine.detokenizer import DetokState, detokenize_step, start_state
from kvserve.engine.heap import keep_large_blocks
from kvserve.engine.request import (
    CompletionOutput,
    InvalidRequest,
    Request,
    RequestOutput,
    SamplingParams,
)
from kvserve.engine.runner import ModelRunner, check_kv_backend, kv_specs, vtensor_shape
from kvserve.engine.sampler import Sampler
from kvserve.engine.scheduler import Lender, Scheduler
from kvserve.memory import KVCacheManager, KVSpec
from kvserve.memory.baselines import policy_layout
from kvserve.memory.manager import LoadRule
from kvserve.models.base import CausalLM
from kvserve.models.dist_attention import RemoteKVLost
from kvserve.models.loader import build_model, build_quantized, open_model
from kvserve.models.quant import resolve_quantization
from kvserve.models.virtual_attention import chunk_bytes_of, core_budget
from kvserve.physical.host import HostPool, copy_bandwidth
from kvserve.physical.mempool import MemPool
from kvserve.physical.share import KVShare, Member

GiB = 1 << 30
PromptInput = str | dict | Sequence[int]
DEFAULT_IDLE_RELEASE_S = 60.0  # see check_idle_release
KV_LOST = "kv-lost"  # stop_reason of a request whose lent KV died with another instance


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file, HF directory or packaged name; None = Gemma 3 270M
    kv_memory: int | float | None = None  # bytes, or a fraction of free memory
    dtype: torch.dtype | str = "auto"  # or a torch dtype / its name; see resolve_dtype
    device: str | None = None
    tokens_per_page: int | None = None  # None: the model's, see pick_tokens_per_page
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    policy: str = "jenga"
    quantization: str = "auto"  # auto | none | int8: see models/quant.py
    kv_backend: str = "paged"  # paged | vtensor: where KV data lives, see engine/runner.py
    # KV memory unused this long goes back to the OS (a CPU); see check_idle_release.
    kv_idle_release_s: float = DEFAULT_IDLE_RELEASE_S
    # One physical ceiling shared with other engines in this process (physical/share.py):
    # kv_memory is then this engine's own ceiling, the share's the sum's. Paged pool, CPU.
    kv_share: KVShare | None = None
    # Host tier (MemServe's DRAM pool): bytes of host memory keeping what the KV pool
    # evicts, 0 for none; optionally in a new file, so it can exceed RAM.
    host_kv_memory: int = 0
    host_kv_file: str | None = None
    # A saved exec(x, y) profile (engine/cost_model.py; benchmarks/cost_model.py --save):
    # host-tier hits are loaded only when MemServe's Eq. 2 says that beats recomputing.
    # None: always load (host memory moves KV far faster than any CPU recomputes it).
    cost_profile: str | None = None

    def __post_init__(self) -> None:
        check_kv_backend(self.kv_backend)  # before a model is loaded for nothing
        self.kv_idle_release_s = check_idle_release(self.kv_idle_release_s)
        if isinstance(self.host_kv_memory, bool) or not isinstance(self.host_kv_memory, int) \
                or self.host_kv_memory < 0:
            raise ValueError(f"host_kv_memory must be bytes >= 0, got {self.host_kv_memory!r}")
        if self.kv_share is not None and self.kv_backend != "paged":
            raise ValueError("kv_share needs kv_backend 'paged'")
        if self.host_kv_memory and self.kv_backend != "paged":
            raise ValueError("the host tier needs kv_backend 'paged' (vtensor gives idle "
                             "memory back instead)")
        if self.host_kv_memory and not self.enable_prefix_caching:
            raise ValueError("the host tier keeps cached prefixes: it needs prefix caching")
        if self.host_kv_file is not None and not self.host_kv_memory:
            raise ValueError("host_kv_file needs host_kv_memory")


def check_idle_release(seconds: object) -> float:
    """Seconds >= 0 (math.inf: never) after which unused vTensor KV memory is given back.

    The default, 60 s, weighs both sides on multi-turn ShareGPT
    (`benchmarks/vtensor_idle.py`, docs/benchmarks.md: 10 sessions, 38 requests,
    think times between turns exponential with a 10 s mean, Gemma 3 270M on two
    shared AVX2 cores). Released at once (0 s), every prefix hit of a later turn
    was recomputed (7,296 of 7,296 hit tokens; later turns' TTFT p50 1.5 s);
    after 5 s, 71% still were (TTFT p50 0.65 s: 0.32 s after a think of at most
    5 s, 1.3 s after a longer one); after 60 s only the chunk rounding was, as
    with never (192 tokens; TTFT p50 0.28 s). The other side: physical KV x time
    over the run was 2,408 / 3,299 / 10,034 / 11,855 MiB s (0 / 5 / 60 s / never),
    peak 72 / 80 / 127 / 132 MiB, and at 60 s all of it was back 71 s after the
    last answer. Holding costs the engine nothing: cached chunks are reclaimed
    on demand when running requests need memory, whatever this timer; it only
    decides when an idle engine hands memory back to the host. A chat user reads
    and types for tens of seconds between turns (an assumption: ShareGPT has no
    timestamps), longer than the benchmark's mean, so a few seconds lose most
    hits, while 60 s keeps an active conversation's follow-ups and still returns
    a quiet server's memory within 75 s (the timeout plus a quarter, the poll).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"kv_idle_release_s must be a number of seconds, got {seconds!r}")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"kv_idle_release_s must be >= 0 seconds (inf: never), got {seconds}")
    return float(seconds)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 where the device computes it natively (CUDA with bf16, a CPU
    whose oneDNN runs bf16: 2.2-2.5x float32's throughput on an AVX-512 BF16 CPU), else
    float16 on older GPUs and float32 on CPUs. Names ("bfloat16") are torch dtypes.

    An explicit bfloat16 on a CPU without native bf16 runs (torch emulates the matmuls, the
    kernels compute in float32 from bf16 storage: correct, about 3x slower than float32 on an
    AVX2 CPU), with a warning naming what is missing; float16 is refused on CPUs, where no
    path computes it well."""
    if isinstance(dtype, str) and dtype != "auto":
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = value
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if bf16_native() else torch.float32
    if device.type == "cpu":
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype {dtype} is not supported on CPU; use auto, float32 or "
                             "bfloat16")
        if dtype == torch.bfloat16 and not bf16_native():
            warnings.warn(f"kvserve: bfloat16 runs emulated: {bf16_missing()} "
                          f"({cpu_name()}); --dtype auto picks float32 here", stacklevel=2)
    return dtype


PAGE_TOKENS = (16, 32, 64)


def pick_tokens_per_page(specs: Sequence[KVSpec], policy: str, asked: int | None) -> int:
    """Tokens per page: as asked, else the first of PAGE_TOKENS whose layout the memory
    core takes. 16 serves attention-only models; a Mamba hybrid's state page (Bamba 9B:
    29 layers x 2,147,840 B) needs a larger token page for a large page of at most 256
    small pages (32 there, with the state page padded 0.4%)."""
    if asked is not None:
        return asked
    for tokens in PAGE_TOKENS:
        try:
            policy_layout(policy, specs, tokens)
            return tokens
        except ValueError as e:
            error = e
    raise error


def resolve_kv_bytes(kv_memory: int | float | None, device: torch.device,
                     reserved: int = 0) -> int:
    """Bytes for the KV pool: as given, or a fraction of the memory free now, less the
    `reserved` bytes the model will still take (CausalLM.pending_bytes)."""
    if isinstance(kv_memory, int) and not isinstance(kv_memory, bool):
        if kv_memory <= 0:
            raise ValueError(f"kv_memory must be > 0 bytes, got {kv_memory}")
        return kv_memory
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = max(free - reserved, 0)
    if kv_memory is None:  # CPU: a modest default; GPU: most of what is free
        return int(free * 0.8) if device.type == "cuda" else min(2 * GiB, int(free * 0.2))
    if not 0 < kv_memory <= 1:
        raise ValueError(f"a kv_memory fraction must be in (0, 1], got {kv_memory}")
    return int(free * kv_memory)


class LLMEngine:
    @classmethod
    def load(cls, cfg: EngineConfig | None = None) -> LLMEngine:
        """Load cfg.model (default Gemma 3 270M) and build the engine around it."""
        cfg = cfg or EngineConfig()
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        opened = open_model(cfg.model)
        dtype = resolve_dtype(cfg.dtype, device)
        quantization = resolve_quantization(cfg.quantization, device,
                                            opened.config.source_weight_types, dtype)
        if quantization == "none":
            model = build_model(opened.config, opened.state_dict, device, dtype)
        else:
            model = build_quantized(opened, quantization, dtype)
        return cls(model, opened.tokenizer().result(), cfg)

    def __init__(self, model: CausalLM, tokenizer, cfg: EngineConfig) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        if model.device.type == "cpu":  # a step's logits are made and freed every step
            keep_large_blocks()
        config = self.config = model.config
        vtensor = cfg.kv_backend == "vtensor"
        specs, bindings, shapes = kv_specs(model.kv_layers, model.dtype, full_history=vtensor)
        kv_bytes = resolve_kv_bytes(cfg.kv_memory, model.device, model.pending_bytes())
        T = pick_tokens_per_page(specs, cfg.policy, cfg.tokens_per_page)
        # Under vtensor kv_bytes is the physical ceiling; the core admits a share of it.
        core_bytes = kv_bytes
        if vtensor:
            shape = vtensor_shape(shapes, bindings)
            core_bytes = core_budget(
                kv_bytes, len(bindings), chunk_bytes_of(shape, T),
                shape.bytes_per_token() * T, cfg.max_num_seqs)
        self.kv = KVCacheManager(
            specs, core_bytes, T,
            policy=cfg.policy, enable_caching=cfg.enable_prefix_caching,
            host_bytes=cfg.host_kv_memory, worth_loading=self._load_rule(cfg, model.device),
        )
        self.runner = ModelRunner(self.model, self.kv, bindings, shapes, cfg.kv_backend,
                                  kv_bytes)
        self.kv.set_window_only(getattr(self.runner.attn, "window_only", False))
        host = None
        if self.kv.host is not None:
            host = HostPool(self.kv.layout, self.kv.host.alloc.num_large,
                            pin=model.device.type == "cuda", path=cfg.host_kv_file)
        self.mempool = MemPool(self.kv, self.runner.pool, host) if self.runner.pool else None
        self.share: Member | None = None
        if cfg.kv_share is not None:
            step_bytes = cfg.max_num_batched_tokens * sum(self.kv.layout.page_bytes) // T
            self.share = cfg.kv_share.join(self.kv.alloc, self.runner.pool, step_bytes,
                                           self.mempool.flush)
            weakref.finalize(self, cfg.kv_share.leave, self.share)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.lender: Lender | None = None
        self.sampler = Sampler()
        self.max_model_len = min(cfg.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, DetokState] = {}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}
        self._next_release = 0.0  # monotonic time of the next idle-memory check
        self._polls: deque[tuple[float, int]] = deque()  # (monotonic s, kv.now) at each check
        # Decode-only steps of a cluster instance (one with a lender): (batch, full-
        # attention blocks held here, seconds), what Infinite-LLM's performance model
        # (cluster/placement.py, Eq. 5) is fitted on.
        self.step_samples: deque[tuple[int, int, float]] = deque(maxlen=256)

    @staticmethod
    def _load_rule(cfg: EngineConfig, device: torch.device) -> LoadRule | None:
        """Eq. 2 over the saved cost profile and this machine's host-to-device copy speed."""
        if cfg.cost_profile is None or not cfg.host_kv_memory:
            return None
        cost = CostModel.load(cfg.cost_profile)
        bandwidth = copy_bandwidth(device)

        def worth(n: int, have: int, could: int, nbytes: int) -> bool:
            return cost.worth_loading(n, have / n, could / n, nbytes, bandwidth)
        return worth

    # ------------------------------------------------------------ idle memory

    def idle_poll_s(self) -> float | None:
        """How long an idle caller may block before `maybe_release_idle` has work (None: ever).

        A quarter of the idle timeout: memory unused for `kv_idle_release_s`
        is returned within 1.25 x that.
        """
        idle = self.cfg.kv_idle_release_s
        if not self.runner.releases_memory or math.isinf(idle):
            return None
        return max(idle / 4, 0.01)

    def maybe_release_idle(self, now: float | None = None) -> int:
        """Give back KV memory unused for `kv_idle_release_s`; returns the bytes returned.

        Cheap to call between any two steps: it does work at most once per
        `idle_poll_s()`, and only drops what no running request holds: under
        vtensor cached vTensors and prefix chunks last used that long ago; under
        the paged pool the large pages no one holds, after evicting the cached
        ones whose eviction key is that old (so what the cache would give up
        first goes first, as under memory pressure).
        """
        poll = self.idle_poll_s()
        now = time.monotonic() if now is None else now
        if poll is None or now < self._next_release:
            return 0
        self._next_release = now + poll
        if self.mempool is None:
            return self.runner.trim(self.cfg.kv_idle_release_s)
        return self.mempool.give_back(self._step_before(now, self.cfg.kv_idle_release_s))

    def _step_before(self, now: float, idle_s: float) -> int | None:
        """A step of the memory core's clock such that every key below it was last used
        `idle_s` before `now` or earlier: the clock at the latest poll made by then, plus
        one (polls run between steps). None: no poll is that old yet."""
        polls, cutoff = self._polls, now - idle_s
        polls.append((now, self.kv.now))
        while len(polls) > 1 and polls[1][0] <= cutoff:
            polls.popleft()
        return polls[0][1] + 1 if polls[0][0] <= cutoff else None

    # ---------------------------------------------------------------- requests

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, self._check_ids(prompt)

    def _check_ids(self, ids: object) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidRequest("prompt_token_ids must be a list of integers")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"unknown token ids {bad[:5]} (vocabulary has {vocab})")
        return list(ids)

    def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        params.validate(self.config.vocab_size)
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} so that one token can be generated"
            )
        if not self._fits(len(ids) + 1):
            raise InvalidRequest(
                f"the prompt of {len(ids)} tokens needs more KV memory than the pool's "
                f"{self._pool_ceiling() / 2**20:.0f} MiB"
            )
        req = Request(request_id, text, ids, params, time.monotonic())
        self.requests[request_id] = req
        self._detok[request_id] = start_state(ids)
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(ids)
        return req

    def _pool_ceiling(self) -> int:
        """The most KV memory this engine can hold: its pool, or a shared ceiling's."""
        if self.share is None:
            return self.kv.pool_bytes
        return min(self.kv.pool_bytes, self.cfg.kv_share.ceiling)

    def _fits(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens can run here alone. Lending KV (DistAttention),
        only its current chunks need to: the rest of its full attention goes elsewhere."""
        chunk = self.cfg.max_num_batched_tokens
        if self.lender is not None:
            num_tokens = min(num_tokens, 2 * chunk)
        limit = self._pool_ceiling() // self.kv.layout.large_page_bytes
        return self.kv.fits_alone(num_tokens, chunk, limit=limit)

    def lend_with(self, lender: Lender | None) -> None:
        """DistAttention (a cluster instance): a full pool lends running requests' KV
        through `lender` instead of preempting them, and prompts longer than the pool
        are taken."""
        self.lender = self.scheduler.lender = self.runner.lender = lender

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.finish_reason = "abort"
            self._retire(req)
            self._copy_behind()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that changed."""
        if self.share is None:
            return self._step()
        self.cfg.kv_share.draw(self.share)  # free pages for this step, from the share
        try:
            return self._step()
        finally:
            self.cfg.kv_share.settle(self.share)  # what this step left free, to others

    def _step(self) -> list[RequestOutput]:
        batch, failed = self.scheduler.schedule()
        self.runner.retain(self.scheduler.running)
        outputs = []
        for req in failed:
            req.finish_reason = "abort"
            outputs.append(self._retire(req))
        if not batch:
            return outputs
        if self.mempool is not None:
            self.mempool.flush()  # evicted pages out to the host tier, host hits in
        start = time.perf_counter()
        try:
            logits = self.runner.execute(batch)
        except RemoteKVLost as e:
            # Nothing of the step is committed: the others run it again next step.
            return outputs + [self._kv_lost(e.req_id)]
        sampled = [s for s in batch if s.completes_prompt]
        tokens = self.sampler.sample(
            logits, [s.request.request_id for s in sampled], [s.request.params for s in sampled]
        )
        if self.lender is not None and all(s.num_tokens == 1 for s in batch):
            blocks = sum(self.kv.lendable_blocks(s.request.request_id) for s in batch)
            self.step_samples.append((len(batch), blocks, time.perf_counter() - start))
        self.scheduler.commit(batch)
        now = time.monotonic()
        for s, tok in zip(sampled, tokens):
            outputs.append(self._append_token(s.request, tok, now))
        self._copy_behind()
        return outputs

    def _kv_lost(self, request_id: str) -> RequestOutput:
        """Part of the request's KV died with another instance: it ends here, marked, so
        its caller (the cluster front end) starts it again from what it streamed."""
        req = self.requests[request_id]
        req.finish_reason, req.stop_reason = "abort", KV_LOST
        return self._retire(req)

    def _copy_behind(self) -> None:
        """Tier copies finished requests left: beside the next schedule while work
        remains; at once when none does, so an idle engine holds no host page pinned."""
        if self.mempool is None:
            return
        if self.has_unfinished():
            self.mempool.write_behind()
        else:
            self.mempool.flush()

    def _append_token(self, req: Request, tok: int, now: float) -> RequestOutput:
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_ids.append(tok)
        self.counters["generation_tokens"] += 1
        req.text += detokenize_step(self.tokenizer, req.token_ids, self._detok[req.request_id])
        self._check_stop(req, tok)
        if req.finish_reason is not None:
            return self._retire(req)
        return self._output(req)

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        if tok in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", tok
        elif not p.ignore_eos and tok in self.config.eos_token_ids:
            req.finish_reason = "stop"
        elif p.stop and self._cut_stop_string(req):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or len(req.token_ids) >= self.max_model_len:
            req.finish_reason = "length"

    @staticmethod
    def _cut_stop_string(req: Request) -> bool:
        longest = max(len(s) for s in req.params.stop)
        tail = max(0, len(req.text) - 60 - longest)  # new text is short; search its end
        hits = [(req.text.find(s, tail), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        req.text = req.text[: i + len(s)] if req.params.include_stop_str_in_output else req.text[:i]
        req.stop_reason = s
        return True

    def _retire(self, req: Request) -> RequestOutput:
        self.scheduler.finish(req)
        self.runner.release(req.request_id)
        self.sampler.forget(req.request_id)
        out = self._output(req)
        del self.requests[req.request_id], self._detok[req.request_id]
        return out

    def _output(self, req: Request) -> RequestOutput:
        # While running, hold back text that may be the start of a stop string.
        hold = 0 if req.finish_reason or not req.params.stop else max(map(len, req.params.stop)) - 1
        upto = max(req.sent_text, len(req.text) - hold)
        new, req.sent_text = req.text[req.sent_text:upto], upto
        new_ids, req.sent_tokens = req.output_ids[req.sent_tokens:], len(req.output_ids)
        done = req.finish_reason is not None
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids,
            [CompletionOutput(0, req.text, list(req.output_ids), req.finish_reason,
                              req.stop_reason)],
            finished=done, num_cached_tokens=req.num_cached_tokens,
            new_text=new, new_token_ids=new_ids,
        )
