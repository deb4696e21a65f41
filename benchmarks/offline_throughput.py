"""Offline throughput of kvserve on Gemma 3 270M (CPU or GPU), or another --model.

    python benchmarks/offline_throughput.py fixed        # 32 x 128-token prompts, 128 out
    python benchmarks/offline_throughput.py fixed --model smollm2
    python benchmarks/offline_throughput.py sharegpt     # ShareGPT vs transformers generate
    python benchmarks/offline_throughput.py step --num-prompts 100   # decode step, 100 running
    python benchmarks/offline_throughput.py capacity     # concurrent requests: jenga vs uniform
    python benchmarks/offline_throughput.py gemms --num-prompts 32   # AMX kernel vs oneDNN
    python benchmarks/offline_throughput.py window-only --prefill 8000  # TTFT, on vs off
    python benchmarks/offline_throughput.py prefill --prefill 8000  # where a prompt's time goes
    add --json to print one JSON object

Peers on this machine (2 cores) for the fixed workload, from the issue:
vLLM CPU bf16 ~340 tok/s, llama.cpp 184 (68 single stream), transformers bf16 108.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import torch

from kvserve.cpu_features import summary
from kvserve.engine.engine import EngineConfig, LLMEngine, resolve_dtype
from kvserve.engine.request import SamplingParams
from kvserve.models.quant import QUANTIZATIONS

MiB = 1 << 20


def run_engine(engine: LLMEngine, prompts: list[list[int]], outputs: list[int],
               sampling: dict | None = None) -> dict:
    """Generate exactly outputs[i] tokens for prompts[i] (greedy, or with `sampling`'s
    temperature and top_p); returns timing and token counts."""
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"b{i}", {"prompt_token_ids": p},
                           SamplingParams(**{"temperature": 0, **(sampling or {})},
                                          max_tokens=n, ignore_eos=True))
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    out_tokens = sum(outputs)
    return {"seconds": round(elapsed, 2), "steps": steps, "output_tokens": out_tokens,
            "output_tok_s": round(out_tokens / elapsed, 1),
            "total_tok_s": round((out_tokens + sum(map(len, prompts))) / elapsed, 1)}


def first_token(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Median seconds from a prompt's arrival to its first token, one prompt at a time
    (TTFT on an idle engine: the prefill of one prompt and the sampling of a token;
    llama-batched-bench's T_PP at npl 1). The prompts must be new to the engine: a
    prefix-cache hit would skip the prefill."""
    times = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"ttft{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2], 4)


def warm(engine: LLMEngine) -> None:
    """A short prompt and a 40-token one, then 17 short ones at once: every step size's
    path is ready before anything is timed (q8+bf16 and q8+fp16 make their second copies
    on the first step of more than their row counts, the LM head's on the first that
    samples that many)."""
    run_engine(engine, [[2, 100, 200, 300], list(range(1000, 1040))], [4, 2])
    run_engine(engine, [[2, 100 + i, 200, 300] for i in range(17)], [2] * 17)


def load(args: argparse.Namespace, kv_memory: int) -> LLMEngine:
    return LLMEngine.load(EngineConfig(model=args.model, kv_memory=kv_memory, dtype=args.dtype,
                                       quantization=args.quantization))


def fixed_prompts(vocab_size: int, n: int = 32, seed: int = 0) -> list[list[int]]:
    """The fixed workload's prompts of 128 random token ids (seeded; peers read them from
    here: benchmarks/vllm_cpu_peer.sh). Seed 1: prompts no cache holds, for TTFT."""
    g = torch.Generator().manual_seed(seed)
    top = min(200_000, vocab_size)
    return [torch.randint(10, top, (128,), generator=g).tolist() for _ in range(n)]


def fixed(args: argparse.Namespace) -> dict:
    engine = load(args, 1 << 30)
    warm(engine)
    prompts = fixed_prompts(engine.config.vocab_size, args.batch)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    how = ("greedy" if not args.temperature else
           f"temperature {args.temperature}, top_p {args.top_p}")
    out = {"workload": f"{args.batch} prompts x 128 tokens, 128 output tokens ({how}), "
                       "EOS ignored",
           "model": args.model or "gemma3-270m",
           "dtype": str(engine.model.dtype), "quantization": engine.model.quantization,
           "device": str(engine.model.device), "cpu": summary(),
           f"batch{args.batch}": run_engine(engine, prompts, [128] * args.batch, sampling),
           "single_stream": run_engine(engine, prompts[:1], [128], sampling),
           "first_token_s": first_token(engine, fixed_prompts(engine.config.vocab_size, 5, 1))}
    if args.hf:  # transformers' generate on the same GGUF and prompts, in the engine's dtype
        dtype = engine.model.dtype
        del engine
        out["transformers"] = {f"batch{args.batch}": hf_generate(prompts, [128] * args.batch,
                                                                  dtype, args.batch),
                               "single_stream": hf_generate(prompts[:1], [128], dtype, 1)}
    return out


def sharegpt_workload(tokenizer, n: int, max_input: int, max_output: int):
    from kvserve.datasets.sharegpt import load_conversations

    prompts, outputs = [], []
    for conv in load_conversations():
        q, a = conv.first_exchange()
        p = tokenizer(q).input_ids[:max_input]
        o = min(max_output, max(4, len(tokenizer(a, add_special_tokens=False).input_ids)))
        prompts.append(p)
        outputs.append(o)
        if len(prompts) == n:
            break
    return prompts, outputs


def hf_generate(prompts: list[list[int]], outputs: list[int], dtype: torch.dtype,
                batch: int) -> dict:
    """transformers' batched generate on the same GGUF, prompts left-padded, EOS ignored."""
    from transformers import AutoModelForCausalLM

    from kvserve.models import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype).eval()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], outputs[i:i + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(os_)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    return {"seconds": round(elapsed, 2), "batch": batch,
            "output_tok_s": round(sum(outputs) / elapsed, 1)}


def sharegpt(args: argparse.Namespace) -> dict:
    engine = load(args, 1 << 30)
    dtype = engine.model.dtype
    warm(engine)
    prompts, outputs = sharegpt_workload(engine.tokenizer, args.num_prompts, args.max_input,
                                         args.max_output)
    result = {"workload": f"ShareGPT first turns: {len(prompts)} prompts (input <= "
                          f"{args.max_input}, output = answer length <= {args.max_output})",
              "dtype": str(dtype), "quantization": engine.model.quantization,
              "cpu": summary(), "input_tokens": sum(map(len, prompts)),
              "kvserve": run_engine(engine, prompts, outputs)}
    if not args.skip_hf:
        result["transformers"] = hf_generate(prompts, outputs, dtype, args.hf_batch)
    return result


def decode_step(args: argparse.Namespace) -> dict:
    """Time decode steps with --num-prompts ShareGPT requests running at once."""
    engine = load(args, 2 << 30)
    warm(engine)
    prompts, _ = sharegpt_workload(engine.tokenizer, args.num_prompts, args.max_input, 1)
    reqs = [engine.add_request(f"s{i}", {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while not all(r.output_ids for r in reqs):  # every prompt prefilled: decode only from here
        engine.step()
    for _ in range(10):
        engine.step()
    rounds = []  # best of 5 rounds: other jobs on a shared VM slow some rounds, not the code
    for _ in range(5):
        t0, steps = time.perf_counter(), 30
        for _ in range(steps):
            engine.step()
        rounds.append((time.perf_counter() - t0) / steps * 1e3)
    ms = min(rounds)
    return {"workload": f"{len(prompts)} ShareGPT first turns decoding at once (input <= "
                        f"{args.max_input})", "dtype": args.dtype,
            "ms_per_step": round(ms, 2), "rounds_ms": [round(r, 2) for r in rounds],
            "output_tok_s": round(len(prompts) / ms * 1e3, 1)}


def capacity(args: argparse.Namespace) -> dict:
    """How many ShareGPT requests (prompt + full answer) fit a fixed KV budget at once."""
    from kvserve.engine.runner import kv_specs
    from kvserve.memory import KVCacheManager
    from kvserve.memory.fill import fill
    from kvserve.models.loader import load_model_files

    config, _, tokenizer = load_model_files(None)
    layers = config.kv_layers()
    specs, _, _ = kv_specs(layers, resolve_dtype(args.dtype, torch.device("cpu")))
    prompts, outputs = sharegpt_workload(tokenizer, 2000, 4096, 4096)
    lengths = [len(p) + o for p, o in zip(prompts, outputs)]
    result = {"kv_budget_MiB": args.kv_mib, "dtype": args.dtype,
              "mean_request_tokens": round(sum(lengths) / len(lengths), 1)}
    for policy in ("jenga", "uniform", "max_page", "static"):
        # kvserve's paged engine pages only the keys later steps read; the baselines are
        # other engines' allocators, which page every key (as in the simulator)
        mgr = KVCacheManager(specs, args.kv_mib * MiB, policy=policy,
                             window_only=policy == "jenga")
        admitted = fill(mgr, lambda rid: (list(range(rid * 10**5, rid * 10**5 + lengths[rid])),
                                          ()), limit=len(lengths))
        result[policy] = {"concurrent_requests": admitted,
                          "waste_fraction": round(mgr.stats().waste_fraction, 4)}
    return result


def _timed(totals: dict[str, float], name: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[name] += time.perf_counter() - t
    return wrapper


def machine_limits() -> dict:
    """What the step figures are held against: DRAM read bandwidth (a float32 sum over
    1 GiB, all threads) and a GEMM rate (Gemma 3 270M's head shape, 128 rows, in the
    dtype and path the engine takes for batches: Bf16Gemm where bf16 is native (our
    kernel, else oneDNN's packed copy), else fbgemm fp16)."""
    from kvserve.cpu_features import bf16_native
    from kvserve.kernels.cpu import cpu_kernels
    from kvserve.models.quant import Bf16Gemm, quantized

    def best(fn, n: int = 3) -> float:
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    x = torch.ones(1 << 28)
    read = x.numel() * 4 / best(x.sum) / 1e9
    del x
    w, a = torch.randn(262144, 640) * 0.02, torch.randn(128, 640)
    if bf16_native():
        wb, ab = Bf16Gemm(w.bfloat16()), a.bfloat16()
        gemm = best(lambda: wb(ab))
        tiles = wb.on_kernel and cpu_kernels().amx_ready()
        how = ("oneDNN bf16, packed" if not wb.on_kernel else
               f"our bf16 GEMM, {'AMX tiles' if tiles else 'vdpbf16ps'} (kernels/bf16gemm.c)")
    else:
        q = quantized(w, "fp16")
        gemm, how = best(lambda: q(a)), "fbgemm fp16"
    return {"read_gb_s": round(read, 1), "gemm_gflop_s": round(2 * w.numel() * 128 / gemm / 1e9),
            "gemm": how}


def breakdown(args: argparse.Namespace) -> dict:
    """Where a decode step's time goes at batch 1 and 32 (the fixed workload's prompts):
    the LM head, the layers' projections, attention, sampling, and the rest (norms,
    activations, embedding, scheduler and Python), in ms a step over 64 decode steps; the
    rest split into what the model's forward spends outside projections and attention
    ("in model": norms, RoPE, activations, embedding, the layers' Python) and what the
    engine does around it ("engine": scheduling, the KV manager, batch tensors,
    detokenizing). The split is of steps that run the layers module by module; "one call"
    is the step as served, where kernels/decoder.c runs them in one call
    (models/fused_layers.py: the same kernels, without the wrappers between them)."""
    from kvserve.engine.sampler import Sampler
    from kvserve.models.base import CausalLM
    from kvserve.models.fused_layers import FusedLayers
    from kvserve.models.layers import Linear
    from kvserve.models.paged_attention import PagedAttention

    engine = load(args, 1 << 30)
    warm(engine)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200_000, (128,), generator=g).tolist() for _ in range(32)]
    parts = ["head", "projections", "attention", "sampling"]
    totals = dict.fromkeys([*parts, "forward"], 0.0)
    patches = [(CausalLM, "compute_logits", "head"), (Linear, "forward", "projections"),
               (PagedAttention, "__call__", "attention"), (Sampler, "sample", "sampling"),
               (type(engine.model), "forward", "forward")]
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
    one_call = FusedLayers.__call__
    originals.append((FusedLayers, "__call__", one_call))
    out = {"cpu": summary(), "dtype": str(engine.model.dtype),
           "quantization": engine.model.quantization, "limits": machine_limits()}
    try:
        for cls, name, key in patches:
            setattr(cls, name, _timed(totals, key, getattr(cls, name)))
        FusedLayers.__call__ = _module_by_module
        for batch in (1, 32):
            for i, p in enumerate(prompts[:batch]):
                engine.add_request(f"d{batch}-{i}", {"prompt_token_ids": p},
                                   SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
            while any(r.num_computed < len(r.token_ids) - 1
                      for r in [*engine.scheduler.waiting, *engine.scheduler.running]):
                engine.step()  # prefill (and a first decode step)
            for k in totals:
                totals[k] = 0.0
            steps, t0 = 64, time.perf_counter()
            for _ in range(steps):
                engine.step()
            total = (time.perf_counter() - t0) / steps * 1e3
            ms = {k: v / steps * 1e3 for k, v in totals.items()}
            row = {k: round(ms[k], 2) for k in parts}
            row["rest"] = round(total - sum(ms[k] for k in parts), 2)
            row["in model"] = round(ms["forward"] - ms["projections"] - ms["attention"], 2)
            row["engine"] = round(row["rest"] - row["in model"], 2)
            row["step"] = round(total, 2)
            FusedLayers.__call__ = one_call
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            row["one call"] = round((time.perf_counter() - t0) / steps * 1e3, 2)
            FusedLayers.__call__ = _module_by_module
            out[f"batch{batch}"] = row
            while engine.has_unfinished():
                engine.step()
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    return out


def _module_by_module(*args: object) -> None:
    """FusedLayers.__call__ for runs that time the layers module by module: no step in one
    call."""
    return None


def gemms(args: argparse.Namespace) -> dict:
    """Decode steps of --num-prompts fixed prompts with q8+bf16's bf16 copies on our kernel
    (kernels/bf16gemm.c), then on oneDNN's, swapped in the same engine round by round (a
    busy host slows both alike): ms a step, min and median of 8 rounds of 15 steps each.
    With --prefill L, instead the time to the first token of a fresh L-token prompt (6
    rounds). Both run the layers module by module (oneDNN's copies have no call
    kernels/decoder.c could make)."""
    from kvserve.models.fused_layers import FusedLayers
    from kvserve.models.quant import Bf16Gemm, Q8Bf16Linear

    FusedLayers.__call__ = _module_by_module
    engine = load(args, 1 << 30)
    warm(engine)
    model = engine.model
    layers = [m.quant for m in model.modules() if isinstance(getattr(m, "quant", None),
                                                            Q8Bf16Linear)]
    layers += [q for q in [model.quant_head] if isinstance(q, Q8Bf16Linear)]
    copies = {"ours": [q.large for q in layers], "onednn": []}
    if not all(g.on_kernel for g in copies["ours"]):
        raise SystemExit("gemms: needs q8+bf16 on a CPU with native bf16 and the C kernels")
    for g in copies["ours"]:  # the plain weight back, exactly: identity rows pick it out
        weight = g(torch.eye(g.in_features, dtype=torch.bfloat16)).T.contiguous()
        copies["onednn"].append(Bf16Gemm(weight, use_kernel=False))
    rounds: dict[str, list[float]] = {k: [] for k in copies}

    def use(name: str) -> None:
        for q, g in zip(layers, copies[name]):
            q._copy = g

    if args.prefill:
        rounds = first_tokens(engine, args.prefill, 6, {k: partial(use, k) for k in copies})
        what = {"prefill_tokens": args.prefill}
    else:
        for i, p in enumerate(fixed_prompts(engine.config.vocab_size, args.num_prompts)):
            engine.add_request(f"g{i}", {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        for _ in range(6):
            engine.step()
        for _ in range(8):
            for name in copies:
                use(name)
                engine.step()
                t0 = time.perf_counter()
                for _ in range(15):
                    engine.step()
                rounds[name].append((time.perf_counter() - t0) / 15 * 1e3)
        what = {"rows": args.num_prompts}
    return {"cpu": summary(), **what, **spread(rounds)}


def spread(rounds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each setup's min and median of its rounds, ms."""
    return {name: {"min_ms": round(min(r), 1), "median_ms": round(sorted(r)[len(r) // 2], 1)}
            for name, r in rounds.items()}


def first_tokens(engine: LLMEngine, length: int, rounds: int,
                 setups: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    """ms to the first token of a fresh `length`-token prompt, under each setup in turn,
    round after round (a busy host slows all alike)."""
    gen = torch.Generator().manual_seed(1)
    out: dict[str, list[float]] = {name: [] for name in setups}
    for i in range(rounds):
        for name, setup in setups.items():
            setup()
            prompt = torch.randint(10, 200_000, (length,), generator=gen).tolist()
            t0 = time.perf_counter()
            engine.add_request(f"p{i}{name}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished():
                engine.step()
            out[name].append((time.perf_counter() - t0) * 1e3)
    return out


def attention(args: argparse.Namespace) -> dict:
    """Time to the first token of fresh --prefill L-token prompts under each way the
    prompt's attention can run, swapped in one engine round by round: ms, min and median of
    4 rounds. bf16 KV: blocks of 16 rows on AMX's tiles (the machine's build of
    kernels/paged_attention.c, where Linux grants them), blocks with vdpbf16ps (a build
    without AMX, or the machine's where there are no tiles) and row by row (benchmarks/
    prefill_attention.py's RowByRow). float32 KV (--dtype float32): blocks (rows in vector
    lanes), row by row, and SDPA over gathered pages (the torch path)."""
    from prefill_attention import RowByRow

    from kvserve.kernels.cpu import cpu_kernels

    engine = load(args, 1 << 30)
    warm(engine)
    attn = engine.runner.attn
    if attn.kernels is None:
        raise SystemExit("attention: needs the C kernels and one KV dtype")
    own, by_kernel = attn.kernels, attn.kernel_prefill
    if engine.model.dtype == torch.bfloat16:
        builds = ({"tiles": own, "vectors": cpu_kernels(("-mno-amx-tile",))}
                  if own.amx_ready() else {"vectors": own})
    else:
        builds = {"blocks": own}
    builds["rows"] = RowByRow(own)
    setups = {k: partial(use_kernels, attn, b, True) for k, b in builds.items()}
    if engine.model.dtype != torch.bfloat16:
        setups["sdpa"] = partial(use_kernels, attn, own, False)
    length = args.prefill or 8000
    rounds = first_tokens(engine, length, 4, setups)
    use_kernels(attn, own, by_kernel)
    return {"cpu": summary(), "dtype": str(engine.model.dtype), "prefill_tokens": length,
            **spread(rounds)}


def prefill(args: argparse.Namespace) -> dict:
    """Where a fresh --prefill L-token prompt's time to its first token goes (default 8000):
    projections, attention and the rest (norms, RoPE, the head's one row, the engine), in
    s, the layers timed module by module; 3 prompts of random ids."""
    from kvserve.models.fused_layers import FusedLayers
    from kvserve.models.layers import Linear
    from kvserve.models.paged_attention import PagedAttention

    engine = load(args, 1 << 30)
    warm(engine)
    totals = {"projections": 0.0, "attention": 0.0}
    patches = [(Linear, "forward", "projections"), (PagedAttention, "__call__", "attention"),
               (FusedLayers, "__call__", None)]
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
    rows = []
    try:
        for cls, name, key in patches:
            setattr(cls, name, _module_by_module if key is None
                    else _timed(totals, key, getattr(cls, name)))
        gen = torch.Generator().manual_seed(1)
        for i in range(3):
            totals.update(dict.fromkeys(totals, 0.0))
            prompt = torch.randint(10, 200_000, (args.prefill or 8000,), generator=gen).tolist()
            t0 = time.perf_counter()
            engine.add_request(f"split{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished():
                engine.step()
            total = time.perf_counter() - t0
            rows.append({**{k: round(v, 2) for k, v in totals.items()},
                         "rest": round(total - sum(totals.values()), 2), "total": round(total, 2)})
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    return {"cpu": summary(), "dtype": str(engine.model.dtype),
            "prefill_tokens": args.prefill or 8000, "prompts": rows}


def window_only(args: argparse.Namespace) -> dict:
    """Time to the first token of fresh --prefill L-token prompts (default 2048) with the
    memory core's window_only on (a sliding layer's keys no later step reads get step
    pages, not the pool's) and off, alternating in one engine: ms, min and median of 4
    rounds."""
    engine = load(args, 1 << 30)
    warm(engine)
    setups = {"on": partial(engine.kv.set_window_only, True),
              "off": partial(engine.kv.set_window_only, False)}
    length = args.prefill or 2048
    rounds = first_tokens(engine, length, 4, setups)
    engine.kv.set_window_only(True)
    return {"cpu": summary(), "dtype": str(engine.model.dtype), "prefill_tokens": length,
            **spread(rounds)}


def use_kernels(attn, kernels, prefill: bool) -> None:
    """The attention's kernels, and whether prefill chunks go to them (else SDPA)."""
    attn.kernels, attn.kernel_prefill = kernels, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fixed", "sharegpt", "step", "capacity", "breakdown",
                                     "gemms", "attention", "prefill", "window-only"])
    ap.add_argument("--model", default=None, help="as kvserve serve's --model")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf", action="store_true", help="fixed: transformers too")
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--batch", type=int, default=32, help="fixed: prompts run at once")
    ap.add_argument("--temperature", type=float, default=0.0, help="fixed: sample (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="fixed: with --temperature")
    ap.add_argument("--prefill", type=int, default=0,
                    help="gemms, attention, prefill, window-only: time a prompt this long")
    args = ap.parse_args()
    run = {"fixed": fixed, "sharegpt": sharegpt, "step": decode_step, "capacity": capacity,
           "breakdown": breakdown, "gemms": gemms, "attention": attention,
           "prefill": prefill, "window-only": window_only}
    result = run[args.what](args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
