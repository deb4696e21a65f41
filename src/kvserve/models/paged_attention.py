"""Paged attention over the shared KV pool (the engine's attention backend).

Each step the runner describes the batch once (`prepare`); every layer then
writes its new K/V into the pages of its own spec and attends. On CPU every
query row, decode token or prefill chunk token, goes to one compiled kernel
call per layer that reads the pages in place (`kvserve.kernels.cpu`). The
torch path (GPUs, or no C compiler) gathers pages instead: decode sequences
in a few padded groups of similar length, two batched matmuls each; prefill
chunks one sequence at a time through SDPA, a windowed layer's chunk over the keys
before it from pages and its own from the step's k and v (as SGLang's extend
attention), so the memory core pages only the keys later steps read
(`window_only`: a 20K-token prompt in one step holds a window of sliding pages,
not 20K tokens of them). Masks follow HF: a query at
position p sees keys k <= p, on sliding layers k > p - window and on chunked
layers (Llama 4) k >= p // chunk * chunk. Softcapped
layers (Gemma 2) always take the torch path, with eager scores in float32 where
SDPA would run: neither the kernel nor SDPA can cap scores.

State layers (Mamba) get their sequences' state pages from `states`: the live
state page, and the memory core's pending copies turned into where to read the
state (a prefix hit's checkpoint) and where to write it (checkpoints at their
exact positions, the live page at the end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.cpu_features import cpu_flags
from kvserve.kernels.cpu import kernels_for
from kvserve.models.base import StateSeq
from kvserve.models.dist_attention import Partial, RemoteKV, merge, partial_attention
from kvserve.physical.pool import KVPool


@dataclass(frozen=True)
class LayerBinding:
    """Where a model layer's KV lives and how far back it looks."""

    spec: str
    index: int  # layer index inside the spec's pages
    window: int = 0  # 0 for full attention
    chunk: int = 0  # chunked local attention: keys from p // chunk * chunk
    scale: float = 1.0
    softcap: float | None = None


@dataclass
class SeqStep:
    """One sequence's part of a step: tokens [start, start + num_new) and its page tables."""

    start: int
    num_new: int
    tables: dict[str, list[int]]
    # DistAttention: the first `lent` keys of full-attention layers live on other
    # instances (`remote`); local full attention starts there and merges with theirs
    lent: int = 0
    remote: RemoteKV | None = None
    # State specs: the memory core's pending copies, (position, page) (see `state_plan`)
    pending: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass
class _Gather:
    """Whole pages of a group of sequences for one spec, and which keys each query sees."""

    pages: torch.Tensor  # [B, P] page ids (padded with page 0, masked out)
    mask: torch.Tensor  # [B, 1, Q, P*T] bool
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive 0 / -inf bias, made once per step for all layers.

        Decode adds it to its scores (float32); prefill hands it to SDPA, which would
        otherwise turn the bool mask into exactly this bias on every call.
        """
        if dtype not in self._bias:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._bias[dtype] = zeros.masked_fill_(~self.mask, float("-inf"))
        return self._bias[dtype]


def _length_groups(rows: list[int], lengths: list[int], per_group: int = 16,
                   most: int = 4) -> list[list[int]]:
    """Split decode rows into up to `most` groups of similar context length.

    A group is padded to its longest sequence, so one group over ShareGPT-like lengths
    (one 2000-token context among 300-token ones) pays several times the attention's
    compute and memory traffic; a few groups of sorted lengths cut most of that for a
    few calls more per layer.
    """
    if not rows:
        return []
    n = min(most, max(1, len(rows) // per_group))
    ordered = sorted(rows, key=lambda i: lengths[i]) if n > 1 else rows
    size = -(-len(ordered) // n)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def first_key(start: int, window: int, chunk: int = 0) -> int:
    """The lowest key any query of a chunk starting at `start` sees (its first query's;
    HF's window counts the query itself; a chunked layer's query sees its own chunk)."""
    if chunk:
        return start // chunk * chunk
    return max(0, start - window + 1) if window else 0


class PagedAttention:
    # A windowed layer's prefill chunk reads the keys before it from pages and its own
    # from k and v (torch's path, as SGLang's extend attention) or from step pages (the
    # kernel's: _step_tables), so the memory core may page only the keys later steps read
    # (KVCacheManager.set_window_only).
    window_only = True

    def __init__(
        self, pool: KVPool, bindings: Sequence[LayerBinding], block_size: int
    ) -> None:
        self.pool = pool
        self.bindings = list(bindings)
        self._softcapped = any(b.softcap is not None for b in self.bindings)
        self.T = block_size
        self.device = pool.device
        # What a layer reads, per (spec, window, chunk); (spec, 0, 0) is full attention.
        self._windows = sorted({(b.spec, b.window, b.chunk) for b in self.bindings
                                if b.spec in pool.views})
        views = [v for per_spec in pool.views.values() for v in per_spec]
        # The compiled CPU kernels, or None: torch ops (any device) do the same.
        self.kernels = kernels_for(views[0]) if len({v.dtype for v in views}) == 1 else None
        # Prefill chunks go to the kernel too where it computes them in blocks of 16 rows:
        # bf16 with native bf16 dot products, and float32 on every CPU (rows in vector
        # lanes). Both beat SDPA over gathered pages at every prompt length measured: bf16
        # 2.6-7x from 64 to 8192 tokens, float32 1.1-2.3x from 128 to 8000 (time to the
        # first token; its AVX2 build 1.0-1.55x; docs/benchmarks.md). bf16 KV without
        # native bf16 walks one row at a time, which loses to SDPA up to ~1K-token chunks,
        # so it keeps SDPA; softcapped layers (Gemma 2) take the torch path for everything.
        self.kernel_prefill = (self.kernels is not None and not self._softcapped
                               and (views[0].dtype == torch.float32
                                    or "avx512_bf16" in cpu_flags()))
        self.state_plans: dict[str, list[StateSeq]] = {}
        self._windowed = {spec for spec, window, chunk in self._windows if window or chunk}

    # ----------------------------------------------------------------- prepare

    def prepare(self, seqs: Sequence[SeqStep]) -> torch.Tensor:
        """Describe the next batch; returns the positions of its flattened tokens.

        Built once per step, not once per layer: the new tokens' slots and, per (spec,
        window), what each query reads.
        """
        self.seqs = list(seqs)
        # Spread requests (DistAttention) and, per full-attention key, their local pages.
        self.spread = [i for i, s in enumerate(self.seqs) if s.remote is not None]
        # (the kernel's decode rows bring their own log-sum-exp: no gather for those)
        gathered = [i for i in self.spread if not self.kernels or self.seqs[i].num_new > 1]
        self.spread_local = {key: {i: self._gather([self.seqs[i]], *key) for i in gathered}
                             for key in self._windows if key[1:] == (0, 0)}
        pos = torch.cat([torch.arange(s.start, s.start + s.num_new) for s in seqs])
        self.state_plans = {spec: state_plan(self.seqs, spec) for spec in self.pool.states}
        self._step_tables()
        self.writes = {spec: self._write_slots(spec, pos) for spec in self.tables}
        if self.kernels:
            self._prepare_kernel(pos)
            if self._softcapped:  # those layers' decode rows take the torch path
                self._prepare_decode()
        else:
            self._prepare_gathers()
        return pos.to(self.device)

    def _step_tables(self) -> None:
        """Each sequence's pages per spec this step (`tables`), and the step pages of
        each windowed spec (`step_pages`, one layer's: [n, 2, T, Hkv, D]).

        Where the kernel computes prefill chunks, a windowed chunk's keys that have no
        page (window_only: no later step reads them) get a step page instead, id -2 - j
        for step_pages[j]: store_kv writes them there, and the chunk's queries read them in
        place, in the same call as the rest (kernels/paged_attention.c's kv_pages). Each
        layer of the spec writes and reads them in turn, so one layer's worth serves the
        step; the pool holds none of them."""
        T, steps = self.T, self.kernels is not None and self.kernel_prefill
        self.tables = {spec: [s.tables[spec] for s in self.seqs] for spec, *_ in self._windows}
        self.step_pages: dict[str, torch.Tensor] = {}
        for spec in self._windowed if steps else ():
            n, tables = 0, self.tables[spec]
            for i, s in enumerate(self.seqs):
                table = tables[i]
                hi = -(-(s.start + s.num_new) // T)
                if s.num_new == 1 or min(table[s.start // T:hi]) >= 0:
                    continue
                tables[i] = table = list(table)
                for b in range(s.start // T, hi):
                    if table[b] < 0:
                        table[b], n = -2 - n, n + 1
            if n:
                page = self.pool.views[spec][0]
                self.step_pages[spec] = page.new_empty((n, *page.shape[1:]))

    def _prepare_kernel(self, pos: torch.Tensor) -> None:
        """The kernel path: decode rows go to the kernel, and prefill chunks too where
        kernel_prefill says so, else to SDPA over gathered pages."""
        self._prepare_prefill(chunks=not self.kernel_prefill)
        self.ranges = {key: self._key_ranges(pos, *key) for key in self._windows}
        self.decode_index = None
        if self.prefill_rows:
            rows = [self.row_start[i] for i, s in enumerate(self.seqs) if s.num_new == 1]
            self.decode_index = pick = torch.tensor(rows, dtype=torch.long)
            self.ranges = {key: (t, seq[pick], lo[pick], n[pick])
                           for key, (t, seq, lo, n) in self.ranges.items()}

    def _prepare_prefill(self, chunks: bool = True) -> None:
        """Every sequence's first row, and (chunks) the prefill chunks, one gather each."""
        seqs = self.seqs
        self.prefill_rows = [i for i, s in enumerate(seqs) if s.num_new > 1] if chunks else []
        offsets = [0]
        for s in seqs:
            offsets.append(offsets[-1] + s.num_new)
        self.row_start = offsets
        self.prefill = {
            key: [self._gather([seqs[i]], *key, fresh=self._fresh(key))
                  for i in self.prefill_rows]
            for key in self._windows
        }

    @staticmethod
    def _fresh(key: tuple[str, int, int]) -> bool:
        """Whether prefill chunks of these layers read their own keys from k and v: the
        windowed ones (full attention's are all paged, and read there)."""
        return any(key[1:])

    def _prepare_gathers(self) -> None:
        """The torch path: decode rows in length groups, prefill chunks one by one."""
        self._prepare_prefill()
        self._prepare_decode()

    def _prepare_decode(self) -> None:
        seqs, offsets = self.seqs, self.row_start
        self.decode_rows = [i for i, s in enumerate(seqs) if s.num_new == 1]
        groups = _length_groups(self.decode_rows, [s.start for s in seqs])
        self.decode = {key: [self._gather([seqs[i] for i in g], *key) for g in groups]
                       for key in self._windows}
        self.decode_groups = [torch.tensor([offsets[i] for i in g], device=self.device)
                              for g in groups]
        self.all_decode = len(self.decode_rows) == len(seqs) and len(groups) == 1

    def kernel_only(self) -> bool:
        """Whether this step's every row goes to the kernel through `ranges` and `writes`
        alone: no prefill chunk through SDPA, no DistAttention shard, no softcapped layer
        (kernels/decoder.c runs such a step's layers in one call)."""
        return (self.kernels is not None and not self._softcapped and not self.spread
                and self.decode_index is None)

    def _write_slots(self, spec: str, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The new tokens' pages and offsets, and which rows of k and v they are (None:
        all). Only a windowed spec leaves a token without a page (window_only: no later
        step reads its key; the chunk's own queries read it from k and v, or from a step
        page where the kernel computes the chunk: _step_tables)."""
        pages = []
        for s, table in zip(self.seqs, self.tables[spec]):
            pages += [table[p // self.T] for p in range(s.start, s.start + s.num_new)]
        pages, offs, rows = torch.tensor(pages), pos % self.T, None
        if bool((pages == -1).any()):  # (-2 and below: step pages)
            if spec not in self._windowed:
                raise RuntimeError(f"spec {spec!r}: a new token has no page")
            rows = (pages >= 0).nonzero().flatten()
            pages, offs, rows = pages[rows], offs[rows], rows.to(self.device)
        return pages.to(self.device), offs.to(self.device), rows

    def _key_ranges(self, pos: torch.Tensor, spec: str, window: int,
                    chunk: int) -> tuple[torch.Tensor, ...]:
        """For the kernel: the sequences' page tables [S, P], and for every query row its
        sequence, first visible key and number of keys (int32)."""
        T, seqs = self.T, self.seqs
        rows = []
        for s, table in zip(seqs, self.tables[spec]):
            table = table[:-(-(s.start + s.num_new) // T)]
            # (chunks that SDPA computes need their last row's keys here, decode rows)
            last = s.start if self.kernel_prefill else s.start + s.num_new - 1
            first = first_key(last, window, chunk) if window or chunk else s.lent
            if -1 in table[first // T:]:
                raise RuntimeError(f"spec {spec!r}: a key inside the window has no page")
            rows.append(table)
        P = max(len(r) for r in rows)
        # Pages released before a window (-1) are never read; 0 keeps every id in bounds.
        tables = torch.tensor([r + [0] * (P - len(r)) for r in rows], dtype=torch.int32)
        tables.masked_fill_(tables == -1, 0)
        seq = torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int32),
                                      torch.tensor([s.num_new for s in seqs]))
        if chunk:
            lo = pos // chunk * chunk
        elif window:
            lo = (pos - window + 1).clamp_min(0)
        else:  # full attention: from the first key held here
            lo = torch.tensor([s.lent for s in seqs])[seq.long()]
        return (tables, seq, lo.int(), (pos + 1 - lo).int())

    def _gather(self, group: Sequence[SeqStep], spec: str, window: int,
                chunk: int = 0, fresh: bool = False) -> _Gather:
        """Gather whole pages (one index per page, not per token); the mask trims them.

        `fresh` (one prefill chunk of a windowed layer): pages only up to the chunk's
        start, and the mask goes on over the chunk's own keys, which _prefill appends
        from k and v."""
        T = self.T
        q_len = max(s.num_new for s in group)
        firsts = [(first_key(s.start, window, chunk) if window or chunk else s.lent) // T
                  for s in group]
        lasts = [-(-(s.start + (0 if fresh else s.num_new)) // T) for s in group]
        P = max(last - first for first, last in zip(firsts, lasts))
        rows = []
        for s, first, last in zip(group, firsts, lasts):
            pages = s.tables[spec][first:last]
            if pages and min(pages) < 0 and not (window or chunk):
                raise RuntimeError(f"spec {spec!r}: a needed page was released")
            rows.append(pages + [0] * (P - len(pages)))
        key_pos = torch.tensor(firsts)[:, None] * T + torch.arange(P * T)[None, :]
        q_pos = torch.stack([torch.arange(s.start, s.start + q_len) for s in group])
        if fresh:  # the pages' keys up to the chunk, then the chunk's own
            key_pos = torch.cat((key_pos.masked_fill(key_pos >= group[0].start, 1 << 62),
                                 q_pos), dim=1)
        mask = key_pos[:, None, :] <= q_pos[:, :, None]  # causal; also drops padding pages
        if window:
            mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
        if chunk:
            mask &= key_pos[:, None, :] >= q_pos[:, :, None] // chunk * chunk
        pages = torch.tensor(rows, dtype=torch.long).view(len(group), P)
        # A released page (-1) may only sit where the window already masks it out.
        released = (pages < 0).repeat_interleave(T, dim=1)[:, None, :]
        if fresh:
            released = F.pad(released, (0, q_len))
        if bool((released & mask).any()):
            raise RuntimeError(f"spec {spec!r}: a key inside the window has no page")
        return _Gather(pages.clamp_min(0).to(self.device), mask[:, None].to(self.device))

    # ------------------------------------------------------------------ states

    def states(self, layer_idx: int) -> tuple[list[StateSeq], tuple[torch.Tensor, ...]]:
        """A state layer's sequences this step and its state tensors (AttentionBackend)."""
        b = self.bindings[layer_idx]
        return self.state_plans[b.spec], self.pool.state(b.spec, b.index)

    def save_states(self) -> Callable[[], None]:
        """Copies of the live states this step updates in place; the returned call puts
        them back, so a step that fails midway (a creditor lost) can run again. KV
        writes need none: a rerun writes the same slots."""
        saved = []
        for spec, plan in self.state_plans.items():
            live = [p.source for p in plan if p.source is not None
                    and any(p.source in pages for _, pages in p.writes)]
            if live:
                pages = self.pool.pages(self.pool.layout.index(spec))
                index = torch.tensor(live, device=pages.device)
                saved.append((pages, index, pages.index_select(0, index)))

        def restore() -> None:
            for pages, index, rows in saved:
                pages.index_copy_(0, index, rows)
        return restore

    # ------------------------------------------------------------------- call

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b = self.bindings[layer_idx]
        self.scale, self.softcap = b.scale, b.softcap  # the layer's, read by every path below
        cache = self.pool.layer(b.spec, b.index)
        pages, offs, written = self.writes[b.spec]
        kw, vw = (k, v) if written is None else (k[written], v[written])
        key = (b.spec, b.window, b.chunk)
        spread = self.spread if not (b.window or b.chunk) else []
        if spread and b.softcap is not None:
            raise NotImplementedError("DistAttention does not softcap scores")
        # Creditors start on their shards first, so they compute while this instance does.
        waits = [(i, self.seqs[i].remote.attend(b.index, q[self._rows(i)])) for i in spread]
        lse = torch.empty(q.shape[:2]) if spread and self.kernels else None
        if self.kernels:
            self.kernels.store_kv(cache, kw, vw, pages, offs, self.step_pages.get(b.spec))
            out = (self._torch_attention(cache, q, key, k, v) if b.softcap is not None
                   else self._kernel_attention(cache, q, key, lse, k, v))
        else:
            cache[pages, :, offs] = torch.stack((kw, vw), dim=1).to(cache.dtype)
            out = self._torch_attention(cache, q, key, k, v)
        for i, wait in waits:
            rows = self._rows(i)
            if lse is not None and self.seqs[i].num_new == 1:  # the kernel's own row
                local = (out[rows], lse[rows])
            else:
                local = self._local_partial(cache, self.spread_local[key][i], q[rows])
            out[rows] = merge([local, *wait()])[0]
        return out

    def _rows(self, i: int) -> slice:
        return slice(self.row_start[i], self.row_start[i + 1])

    def _kernel_attention(self, cache: torch.Tensor, q: torch.Tensor,
                          key: tuple[str, int, int], lse: torch.Tensor | None,
                          k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Decode rows through the kernel (log-sum-exp into `lse` [rows, Hq] if given),
        prefill chunks through it too or through SDPA (kernel_prefill)."""
        dec, steps = self.decode_index, self.step_pages.get(key[0])
        if dec is None:  # no prefill chunk for SDPA: every row to the kernel
            return self.kernels.paged_attention(q, cache, *self.ranges[key], self.scale, lse,
                                                steps)
        out = torch.empty_like(q)
        if len(dec):
            part = None if lse is None else torch.empty((len(dec), q.shape[1]))
            out[dec] = self.kernels.paged_attention(q[dec], cache, *self.ranges[key],
                                                    self.scale, part)
            if lse is not None:
                lse[dec] = part
        return self._prefill_into(out, cache, q, key, k, v)

    def _torch_attention(self, cache: torch.Tensor, q: torch.Tensor,
                         key: tuple[str, int, int], k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
        if self.all_decode:  # rows are the sequences, in one group: no scatter needed
            return self._decode(cache, self.decode[key][0], q)
        out = torch.empty_like(q)
        for rows, g in zip(self.decode_groups, self.decode[key]):
            out[rows] = self._decode(cache, g, q[rows])
        return self._prefill_into(out, cache, q, key, k, v)

    def _local_partial(self, cache: torch.Tensor, g: _Gather, q: torch.Tensor) -> Partial:
        """A spread request's attention over the keys held here, with its log-sum-exp."""
        keys, values = self._keys_values(cache, g, q.dtype)
        return partial_attention(q, keys[0], values[0], self.scale, g.mask[0, 0])

    def _prefill_into(self, out: torch.Tensor, cache: torch.Tensor, q: torch.Tensor,
                      key: tuple[str, int, int], k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Each prefill chunk's rows of out; k, v: the step's new keys and values."""
        fresh = self._fresh(key)
        for i, g in zip(self.prefill_rows, self.prefill[key]):
            rows = slice(self.row_start[i], self.row_start[i + 1])
            # The chunk's own keys as the pages would hold them (rounded to their dtype).
            own = [x[rows][None].to(cache.dtype).to(q.dtype) for x in (k, v)] if fresh else ()
            out[rows] = self._prefill(cache, g, q[rows][None], *own)[0]
        return out

    def _keys_values(self, cache: torch.Tensor, g: _Gather,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values, each one contiguous [B, P*T, Hkv, D] copy.

        index_select over page rows (a view, never a copy of the pool) copies whole
        pages: ~5x faster on CPU than advanced indexing of the strided view.
        """
        rows = cache.view(cache.shape[0], 2, -1)
        index, B = g.pages.flatten(), g.pages.shape[0]
        kv = [rows[:, i].index_select(0, index).view(B, -1, *cache.shape[3:]).to(dtype)
              for i in (0, 1)]
        return kv[0], kv[1]

    def _decode(self, cache: torch.Tensor, g: _Gather, q: torch.Tensor) -> torch.Tensor:
        """One new token per sequence: q [B, Hq, D] -> [B, Hq, D], as two batched matmuls.

        With one query row per head, SDPA's flash kernel is ~3x slower on CPU than the
        matmuls (which also suit GPUs at this size).
        """
        B, Hq, D = q.shape
        keys, values = self._keys_values(cache, g, q.dtype)
        Hkv = keys.shape[2]
        qg = q.view(B, Hkv, Hq // Hkv, D)
        out = self._eager(qg, keys.transpose(1, 2), values.transpose(1, 2),
                          g.bias(torch.float32))
        return out.view(B, Hq, D)

    def _eager(self, qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               bias: torch.Tensor) -> torch.Tensor:
        """softmax(cap(q.k * scale) + bias) @ v, as HF's eager attention: qg [B, Hkv, R, D]
        (R query rows per KV head), keys/values [B, Hkv, L, D], a float32 bias that
        broadcasts to [B, Hkv, R, L]. Scores are rounded to the input dtype, then scaled,
        capped (tanh(s / cap) * cap, where the layer says) and soft-maxed in float32."""
        scores = torch.matmul(qg, keys.transpose(2, 3)).float().mul_(self.scale)
        if self.softcap is not None:
            scores.div_(self.softcap).tanh_().mul_(self.softcap)
        probs = torch.softmax(scores.add_(bias), dim=-1).to(qg.dtype)
        return torch.matmul(probs, values)

    def _prefill(self, cache: torch.Tensor, g: _Gather, q: torch.Tensor,
                 *own: torch.Tensor) -> torch.Tensor:
        """q [B, Q, Hq, D] -> [B, Q, Hq, D] over the gathered pages, then the chunk's own
        keys and values (`own`, each [B, Q, Hkv, D]) where the gather was `fresh`."""
        B, Q, Hq, D = q.shape
        keys, values = self._keys_values(cache, g, q.dtype)
        if own:
            keys, values = torch.cat((keys, own[0]), dim=1), torch.cat((values, own[1]), dim=1)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        Hkv = keys.shape[1]
        group = Hq // Hkv
        # Grouped-query attention without copying K/V: the query heads that share
        # a KV head become extra query rows of that head.
        qg = q.view(B, Q, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Q, D)
        mask = g.bias(q.dtype if self.softcap is None else torch.float32)
        mask = mask.repeat(1, 1, group, 1) if group > 1 and Q > 1 else mask
        if self.softcap is not None:  # SDPA cannot cap scores
            out = self._eager(qg, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask,
                                                 scale=self.scale)
        return out.view(B, Hkv, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D)


def state_plan(seqs: Sequence[SeqStep], spec: str) -> list[StateSeq]:
    """The memory core's Mamba contract (layer_types.MambaState) as reads and writes.

    A sequence's table is [live page]. Its pending (pos, page) copies: pos 0 restores
    the live state from a cached checkpoint after a prefix hit, so this step reads from
    that page instead of the live one (the first step after the hit; `advance` lets the
    page go after it); pos > 0 snapshots the state after exactly pos tokens into page,
    written here when this step computes token pos - 1. A sequence starting at 0 starts
    from the zero state.
    """
    out, row = [], 0
    for s in seqs:
        live = s.tables[spec][0]
        end = s.start + s.num_new
        pending = s.pending.get(spec, [])
        restore = [page for pos, page in pending if pos == 0]
        source = restore[-1] if restore else live if s.start else None
        writes: dict[int, list[int]] = {}
        for pos, page in sorted(pending):
            if s.start < pos <= end:
                writes.setdefault(pos - s.start, []).append(page)
        writes.setdefault(s.num_new, []).append(live)
        out.append(StateSeq(slice(row, row + s.num_new), s.start, source,
                            tuple((k, tuple(pages)) for k, pages in sorted(writes.items()))))
        row += s.num_new
    return out
