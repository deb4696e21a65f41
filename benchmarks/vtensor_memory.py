"""vTensor memory over time, map/unmap costs, and step time with each KV backend.

    python benchmarks/vtensor_memory.py bursty [--idle 1.0] [--gap 2.5]
    python benchmarks/vtensor_memory.py timeline [--idle 5] [--png docs/img/vtensor_memory.png]
    python benchmarks/vtensor_memory.py chunks
    python benchmarks/vtensor_memory.py steps
    python benchmarks/vtensor_memory.py elastic

bursty: Gemma 3 270M with `--kv-backend vtensor`, a 256 MiB ceiling and an
idle release of `--idle` seconds; two bursts of 8 requests (prompts of
64-400 tokens of distinct text, 32 new tokens each) `--gap` seconds apart.
Prints physical / mapped / reserved KV bytes at the end of each burst and
gap, and the peak.

timeline (vtensor.md Fig. 11): the engine under bursts of ShareGPT first
exchanges (8, 3 and 12 requests, 30 s apart; each generates its answer's
length, at most 96 tokens; `--idle` s idle release), once with each KV backend;
samples the KV memory after every step and every 0.1 s while idle, and plots
the physical bytes, the bytes running requests hold, and the running batch.

chunks: per chunk, pAlloc + Map of a chunk the memfd must first allocate (one
at a time, and in runs of 16 as a prefill maps them) and of one a released
vTensor left allocated (lazy release), the first write to each page, Unmap,
and the punch-hole that gives the memory back: the engine's 64 KiB chunk and
the paper's 2 MiB, with and without MAP_POPULATE.

elastic: the paged pool over a memfd (given back when idle) against the
private memory it was before: prefill and decode step times.

steps: decode and prefill step time for the paged backend and for vtensor
with and without Extend ahead, and where vtensor's maps happen (in `prepare`,
before the forward, or in `commit`, after it) and what they cost
(`--kv-memory 512M`, `max_num_seqs` 16: the whole batch runs at once).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.cpu_features import summary
from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.models import Gemma3ForCausalLM, default_gguf_path, load_model_files
from kvserve.physical.vtensor import PAGE_BYTES, ChunkPool, CpuBackend, VTensor

MiB = 1 << 20


def text_ids(tokenizer) -> list[int]:
    """A long, varied text, so prompts cut from different offsets share no prefix."""
    text = " ".join(f"Entry {i}: {i * 7919 % 1009} units shipped to depot {i % 37}."
                    for i in range(400))
    return tokenizer(text).input_ids


def memory(engine: LLMEngine) -> tuple[float, float, float]:
    s = engine.runner.attn.stats()
    return s["physical_bytes"] / MiB, s["mapped_bytes"] / MiB, s["reserved_bytes"] / MiB


def bursty(model, tokenizer, idle_s: float, gap_s: float) -> None:
    engine = LLMEngine(model, tokenizer, EngineConfig(
        kv_memory=256 * MiB, kv_backend="vtensor", kv_idle_release_s=idle_s))
    ids, g = text_ids(tokenizer), torch.Generator().manual_seed(0)
    peak = 0.0
    for burst in range(2):
        for i in range(8):
            n, off = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                      ((64, 400), (0, 2000)))
            engine.add_request(f"b{burst}-{i}", {"prompt_token_ids": [2] + ids[off:off + n]},
                               SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            engine.maybe_release_idle()
            peak = max(peak, memory(engine)[0])
        print(f"burst {burst} done: physical {memory(engine)[0]:.1f} MiB")
        end = time.monotonic() + gap_s
        while time.monotonic() < end:
            time.sleep(0.05)
            engine.maybe_release_idle()
        phys, mapped, reserved = memory(engine)
        print(f"gap {burst} done: physical {phys:.1f} MiB, mapped {mapped:.1f}, "
              f"reserved {reserved:.1f}")
    print(f"peak physical {peak:.1f} MiB (the paged backend holds 256 MiB from the start)")


# ------------------------------------------------------------------ timeline


def sharegpt_requests(tokenizer, n: int, seed: int = 0, max_len: int = 400,
                      max_out: int = 96) -> list[tuple[list[int], int]]:
    """`n` ShareGPT first exchanges drawn at random (seeded): the user turn's ids (16 to
    `max_len` tokens) and the answer's length in tokens, capped at `max_out`."""
    from kvserve.datasets.sharegpt import load_conversations

    exchanges = [c.first_exchange() for c in load_conversations(limit=400)]
    random.Random(seed).shuffle(exchanges)
    out = []
    for question, answer in exchanges:
        ids, answer_len = tokenizer(question).input_ids, len(tokenizer(answer).input_ids)
        if 16 <= len(ids) <= max_len and answer_len >= 4:
            out.append((ids, min(answer_len, max_out)))
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT exchanges of 16..{max_len} tokens")


def held(engine: LLMEngine) -> tuple[float, float, int]:
    """(physical KV MiB, MiB that running requests hold, running requests) of either backend."""
    if engine.runner.pool is None:  # vtensor
        attn = engine.runner.attn
        s = attn.stats()
        in_use = sum(len(vt.chunks) for pool in attn.pools for vt in pool.active.values())
        return s["physical_bytes"] / MiB, in_use * s["chunk_bytes"] / MiB, s["active"]
    return (engine.runner.pool.physical_bytes() / MiB, engine.kv.stats().used / MiB,
            len(engine.scheduler.running))


def timeline(model, tokenizer, idle_s: float, png: Path, bursts=(8, 3, 12),
             every_s: float = 30.0, kv_memory: int = 256 * MiB) -> None:
    runs = {}
    for backend in ("vtensor", "paged"):
        runs[backend] = one_timeline(model, tokenizer, backend, idle_s, bursts, every_s,
                                     kv_memory)
    plot_timeline(runs, [i * every_s for i in range(len(bursts))], bursts, idle_s,
                  kv_memory / MiB, png)
    print(f"wrote {png}")


def one_timeline(model, tokenizer, backend: str, idle_s: float, bursts, every_s: float,
                 kv_memory: int) -> list[tuple[float, float, float, int]]:
    """The bursts through one backend; rows (t, physical, held by running, running)."""
    engine = LLMEngine(model, tokenizer, EngineConfig(
        kv_memory=kv_memory, kv_backend=backend, kv_idle_release_s=idle_s))
    reqs = sharegpt_requests(tokenizer, sum(bursts))
    rows: list[tuple[float, float, float, int]] = []
    t0 = time.monotonic()
    starts = [i * every_s for i in range(len(bursts))]
    linger = idle_s * 1.25 + 3  # after the last answer: time for its memory to go back
    sent, k, last_busy = 0, 0, 0.0
    while k < len(bursts) or time.monotonic() - last_busy < linger:
        if k < len(bursts) and time.monotonic() - t0 >= starts[k]:
            for ids, out_len in reqs[sent:sent + bursts[k]]:
                engine.add_request(f"r{sent}", {"prompt_token_ids": [2] + ids}, SamplingParams(
                    temperature=0, max_tokens=out_len, ignore_eos=True))
                sent += 1
            k += 1
        if engine.has_unfinished():
            engine.step()
            last_busy = time.monotonic()
        else:
            time.sleep(0.1)
        engine.maybe_release_idle()
        rows.append((time.monotonic() - t0, *held(engine)))
    peak = max(r[1] for r in rows)
    integral = sum(a[1] * (b[0] - a[0]) for a, b in zip(rows, rows[1:]))
    span = rows[-1][0] - rows[0][0]
    print(f"{backend}: {sum(bursts)} requests in bursts of {bursts}, {every_s:.0f} s apart, "
          f"idle release {idle_s:g} s: peak physical {peak:.1f} MiB, mean "
          f"{integral / span:.1f} MiB over {span:.0f} s (ceiling {kv_memory / MiB:.0f} MiB), "
          f"{rows[-1][1]:.1f} MiB at the end; {engine.scheduler.num_preemptions} preemptions "
          f"(the memory core admits {engine.kv.pool_bytes / MiB:.0f} MiB of KV)")
    for t, phys, in_use, active in rows[::max(1, len(rows) // 40)]:
        print(f"  t={t:6.1f} s  physical {phys:6.1f}  held by running requests "
              f"{in_use:6.1f} MiB  running {active}")
    return rows


def plot_timeline(runs, starts, bursts, idle_s: float, ceiling_mib: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1]})
    ax.axhline(ceiling_mib, color="tab:red", ls="--", lw=1.5,
               label=f"--kv-memory {ceiling_mib:.0f} MiB: the ceiling")
    colors = {"vtensor": "tab:blue", "paged": "tab:green"}
    top = ceiling_mib
    for backend, rows in runs.items():
        t = [r[0] for r in rows]
        ax.step(t, [r[1] for r in rows], where="post", color=colors[backend], lw=1.5,
                label=f"{backend}: physical (held: running, cached for reuse)")
        ax.step(t, [r[2] for r in rows], where="post", color=colors[backend], lw=0.8,
                ls=":", label=f"{backend}: held by running requests")
        bx.step(t, [r[3] for r in rows], where="post", color=colors[backend], lw=1)
        top = max(top, max(r[1] for r in rows))
    for s, n in zip(starts, bursts):
        ax.axvline(s, color="gray", lw=0.6)
        ax.annotate(f"{n} requests", (s, ceiling_mib * 0.9), fontsize=8, xytext=(3, 0),
                    textcoords="offset points")
    ax.set(ylabel="KV memory (MiB)", ylim=(0, top * 1.05),
           title=f"KV memory under bursty ShareGPT (Gemma 3 270M, idle release {idle_s:g} s)")
    ax.legend(loc="center right", fontsize=7)
    bx.set(xlabel="time (s)", ylabel="running")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ elastic


def elastic_cost(model, tokenizer, rounds: int = 2) -> None:
    """The paged pool over a memfd (elastic) against private memory (as before): prefill
    and decode step times, 8 prompts of 512 tokens then 64 steps, batch 8."""
    import kvserve.physical.pool as pool_module

    elastic = pool_module.PoolMemory

    class Private(elastic):
        def __init__(self, nbytes: int, device: torch.device) -> None:
            self.nbytes, self.elastic, self.fd, self.area = nbytes, False, -1, None
            self.tensor = pool_module.zeroed_bytes(nbytes, device)

    for r in range(rounds):
        for memory in (Private, elastic):
            pool_module.PoolMemory = memory
            engine = LLMEngine(model, tokenizer, EngineConfig(
                kv_memory=512 * MiB, enable_prefix_caching=False))
            g = torch.Generator().manual_seed(0)
            for i in range(8):
                ids = torch.randint(10, 20000, (512,), generator=g).tolist()
                engine.add_request(f"r{i}", {"prompt_token_ids": ids}, SamplingParams(
                    temperature=0, max_tokens=64, ignore_eos=True))
            times = []
            while engine.has_unfinished():
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            print(f"round {r} {'memfd' if memory is elastic else 'private'}: prefill "
                  f"{sum(times[:3]) * 1e3:.0f} ms, decode median "
                  f"{statistics.median(times[-40:]) * 1e3:.2f} ms")
    pool_module.PoolMemory = elastic


# ------------------------------------------------------------------ chunks


def chunk_costs(chunk_bytes: int, populate: bool, n: int = 128, run: int = 16,
                reps: int = 5) -> dict[str, float]:
    """Median us per chunk: pAlloc + Map of a fresh chunk (alone and in runs of `run`), of
    a reused one, the first write to its pages, Unmap, and the punch-hole."""
    backend = CpuBackend(chunk_bytes, n, max_mappings=10_000, populate=populate,
                         name="kvserve-bench")
    pool = ChunkPool(backend)
    cb = chunk_bytes
    times: dict[str, list[float]] = {k: [] for k in ("fresh", "run", "reused", "touch",
                                                     "unmap", "punch")}

    def grow(vt: VTensor, k: int) -> float:
        t = time.perf_counter()
        c = pool.alloc(k, after=vt.chunks[-1] if vt.chunks else None)
        vt.map(c)
        pool.decref(c)
        return time.perf_counter() - t

    for _ in range(reps):
        vt = VTensor(pool, n)
        for i in range(n):  # one chunk at a time, as a decode Extend does; the memfd is empty
            times["fresh"].append(grow(vt, 1))
            t = time.perf_counter()
            page, _owner = backend.buffer(vt.addr + i * cb, cb)
            page[::PAGE_BYTES] = 1  # one byte a page: the page-table cost, not bandwidth
            times["touch"].append(time.perf_counter() - t)
            del page, _owner
        vt.unmap(0)  # released, not punched: the chunks keep their memory (lazy release)
        for _ in range(n):  # what a cached chunk costs to map again
            times["reused"].append(grow(vt, 1))
        for i in reversed(range(n)):
            t0 = time.perf_counter()
            vt.unmap(i)
            t1 = time.perf_counter()
            pool.punch()
            times["unmap"].append(t1 - t0)
            times["punch"].append(time.perf_counter() - t1)
        for _ in range(0, n, run):  # a run at a time, as a prefill's Extend does
            times["run"].append(grow(vt, run) / run)
        vt.free()
        pool.punch()
    backend.close()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def chunks() -> None:
    print("| chunk | mapping | pAlloc+Map, fresh | in runs of 16 | reused | first write "
          "(1 B/page) | Unmap | punch-hole |")
    for cb in (64 << 10, 2 << 20):
        for populate in (True, False):
            c = chunk_costs(cb, populate)
            print(f"| {cb >> 10} KiB | {'MAP_POPULATE' if populate else 'demand faults'} | "
                  f"{c['fresh']:.1f} | {c['run']:.1f} | {c['reused']:.1f} | {c['touch']:.1f} | "
                  f"{c['unmap']:.1f} | {c['punch']:.1f} |")


# ------------------------------------------------------------------ steps


class MapClock:
    """Time spent in the backend's map calls, split by the phase of the step."""

    def __init__(self, engine: LLMEngine) -> None:
        attn = engine.runner.attn
        self.seconds = {"prepare": 0.0, "commit": 0.0}
        self.calls = {"prepare": 0, "commit": 0}
        self.phase_s = {"prepare": 0.0, "commit": 0.0}
        self.phase = "prepare"
        backend = attn.chunks.backend
        real_map = backend.map

        def timed_map(*a) -> None:
            t = time.perf_counter()
            real_map(*a)
            self.seconds[self.phase] += time.perf_counter() - t
            self.calls[self.phase] += 1

        backend.map = timed_map
        for name in ("prepare", "commit"):
            setattr(attn, name, self._phase(name, getattr(attn, name)))

    def _phase(self, name: str, fn: Callable) -> Callable:
        def wrapped(*a):
            self.phase = name
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.phase_s[name] += time.perf_counter() - t
        return wrapped


def make_engine(model, tokenizer, backend: str, ahead: int | None) -> LLMEngine:
    # max_num_seqs 16: under vtensor the memory core keeps chunk-rounding slack for every
    # possible request (core_budget); with the default 256 a 256 MiB ceiling admits 51 MiB,
    # and the batch of 8 would not all run at once.
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_memory=512 * MiB, kv_backend=backend,
                                                      max_num_seqs=16))
    if backend == "vtensor" and ahead is not None:
        engine.runner.attn.ahead_tokens = ahead
    return engine


def decode_steps(model, tokenizer, backend: str, ahead: int | None, batch: int = 8,
                 steps: int = 48) -> dict[str, float]:
    """Batch `batch`, contexts of 250 + 4i tokens (chunk boundaries crossed at different
    steps), `steps` decode steps timed one by one."""
    engine = make_engine(model, tokenizer, backend, ahead)
    ids = text_ids(tokenizer)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [2] + ids[i * 30:i * 30 + 249 + 4 * i]},
                           SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.step()
    assert len(engine.requests) == batch and not engine.scheduler.waiting, "not one batch"
    clock = MapClock(engine) if backend == "vtensor" else None
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    assert engine.scheduler.num_preemptions == 0 and len(engine.scheduler.running) == batch
    out = {"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3}
    if clock is not None:
        for ph in ("prepare", "commit"):
            out[f"{ph}_ms"] = clock.phase_s[ph] / steps * 1e3
            out[f"{ph}_map_us"] = clock.seconds[ph] / steps * 1e6
            out[f"{ph}_maps"] = clock.calls[ph] / steps
    return out


def prefill_step(model, tokenizer, backend: str, ahead: int | None, tokens: int = 512,
                 reps: int = 3) -> dict[str, float]:
    """One request's whole prompt of `tokens` in one step (distinct text each time)."""
    engine = make_engine(model, tokenizer, backend, ahead)
    clock = MapClock(engine) if backend == "vtensor" else None
    ids, times = text_ids(tokenizer), []
    for r in range(reps):
        prompt = [2] + ids[r * 700:r * 700 + tokens - 1]  # distinct text: no prefix hit
        engine.add_request(f"p{r}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
    out = {"median_ms": statistics.median(times) * 1e3}
    if clock is not None:
        out["prepare_map_us"] = clock.seconds["prepare"] / reps * 1e6
        out["prepare_maps"] = clock.calls["prepare"] / reps
    return out


STEP_CONFIGS = (("paged", "paged", None), ("vtensor, no Extend ahead", "vtensor", 0),
                ("vtensor, Extend ahead (1 chunk)", "vtensor", None))


def steps_table(model, tokenizer) -> None:
    print("decode: batch 8, contexts 250-278 tokens, 48 steps; two interleaved rounds")
    for rnd in range(2):
        for label, backend, ahead in STEP_CONFIGS:
            d = decode_steps(model, tokenizer, backend, ahead)
            line = (f"  [{rnd}] {label:32s} median {d['median_ms']:6.1f} ms, "
                    f"mean {d['mean_ms']:6.1f}")
            if backend == "vtensor":
                line += (f"; prepare {d['prepare_ms']:.2f} ms/step ({d['prepare_maps']:.2f} "
                         f"maps, {d['prepare_map_us']:.0f} us), commit {d['commit_ms']:.2f} "
                         f"ms/step ({d['commit_maps']:.2f} maps, {d['commit_map_us']:.0f} us)")
            print(line)
    print("prefill: one 512-token prompt in one step, median of 3")
    for label, backend, ahead in STEP_CONFIGS:
        p = prefill_step(model, tokenizer, backend, ahead)
        line = f"  {label:32s} {p['median_ms']:7.1f} ms"
        if backend == "vtensor":
            line += f"; {p['prepare_maps']:.0f} maps in prepare, {p['prepare_map_us']:.0f} us"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["bursty", "timeline", "chunks", "steps", "elastic"])
    ap.add_argument("--idle", type=float, default=None,
                    help="kv_idle_release_s (bursty: 1, timeline: 5)")
    ap.add_argument("--gap", type=float, default=2.5, help="bursty: seconds between bursts")
    ap.add_argument("--png", type=Path, default=Path("docs/img/vtensor_memory.png"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {summary()}; load average {os.getloadavg()[0]:.2f}")
    if args.what == "chunks":
        chunks()
        return
    config, state_dict, tokenizer = load_model_files(default_gguf_path())
    model = Gemma3ForCausalLM.from_state_dict(config, state_dict)
    if args.what == "bursty":
        bursty(model, tokenizer, 1.0 if args.idle is None else args.idle, args.gap)
    elif args.what == "timeline":
        timeline(model, tokenizer, 5.0 if args.idle is None else args.idle, args.png)
    elif args.what == "elastic":
        elastic_cost(model, tokenizer)
    else:
        steps_table(model, tokenizer)


if __name__ == "__main__":
    main()
