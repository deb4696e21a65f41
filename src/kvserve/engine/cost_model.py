"""MemServe's cost model exec(x, y): prefill time of an x-token prompt with a fraction y cached.

MemServe (§5.3) fits one function per operator from a profile and sums them, rather than
fitting time-to-first-token as a whole: each operator's complexity in (x, y) is known, so a
low-degree polynomial per operator fits well and stays interpretable. Here, with
n = x(1 - y) new tokens and c = x·y cached ones:

- ``linear``: the layers' projections and MLP matmuls, a·n + b (compute-bound in n).
- ``lm_head``: logits of the last row only, a·n + b (one row whatever n: b, a fits ~0).
- ``attention_full`` / ``attention_sliding``: the attention backend's call (K/V store, page
  gather, attention), a·n·x + b·x + c·n + d, the paper's form; see `AttentionOp`.
- ``other``: everything else in the engine's forward step (embedding, norms, RoPE,
  activations, the backend's per-step bookkeeping), a·n + b: the paper's "constant"
  operators, a fixed share of the work per token.

Coefficients are fitted non-negative (every term is a cost), which makes exec non-decreasing
in x and non-increasing in y by construction. The model is used for Eq. 1 (`queue_time`,
load-balanced routing) and Eq. 2 (`worth_loading`, load KV vs recompute).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

LINEAR, LM_HEAD, OTHER = "linear", "lm_head", "other"
ATTN_FULL, ATTN_SLIDING = "attention_full", "attention_sliding"


@dataclass
class Sample:
    """One timed prefill: x prompt tokens, y of them cached, the step's seconds and the
    seconds of each operator group (``other`` = the step minus the timed groups)."""

    x: int
    y: float
    seconds: float
    ops: dict[str, float] = field(default_factory=dict)


def split(x: float, y: float) -> tuple[float, float]:
    """(new tokens, cached tokens) of an x-token prompt with cached ratio y."""
    return x * (1.0 - y), x * y


# ------------------------------------------------------------------ operators


@dataclass
class OperatorFit:
    """time(x, y) = coef · features(x, y), coefficients >= 0."""

    name: str
    coef: list[float] = field(default_factory=list)

    kind: ClassVar[str] = ""
    terms: ClassVar[tuple[str, ...]] = ()

    def features(self, x: float, y: float) -> list[float]:
        raise NotImplementedError

    def predict(self, x: float, y: float) -> float:
        return sum(c * f for c, f in zip(self.coef, self.features(x, y)))

    def fitted(self, points: Sequence[tuple[float, float, float]],
               weights: Sequence[float] | None = None) -> OperatorFit:
        """This operator with coefficients fitted to (x, y, seconds) points."""
        rows = [self.features(x, y) for x, y, _ in points]
        self.coef = nnls(rows, [t for _, _, t in points], weights)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "coef": list(self.coef)}


@dataclass
class LinearOp(OperatorFit):
    """a·n + b over the n = x(1 - y) new tokens: the matmuls (the paper's compute-bound
    operators, which see only the new rows) and the per-token elementwise ones."""

    kind: ClassVar[str] = "linear"
    terms: ClassVar[tuple[str, ...]] = ("n", "1")

    def features(self, x: float, y: float) -> list[float]:
        return [split(x, y)[0], 1.0]


@dataclass
class AttentionOp(OperatorFit):
    """Prefix attention: a·n·x + b·x + c·n + d.

    The paper's a·x²y + b·x² + c·x + d counts the query-key pairs of n = x(1 - y) new
    queries over all x keys: n·x = x² - x²y. That is what this engine computes: its prefill
    runs SDPA with an explicit mask over the whole n x x rectangle (the CPU kernel does not
    skip masked blocks), after gathering x keys (b·x); c·n stores the new K/V. Written with
    non-negative terms so a fit cannot turn the cost down as x grows or up as y grows.

    A sliding layer (``window`` > 0) keeps at most `window` cached keys, so it is the same
    operator on the clipped prompt x' = n + min(c, window): its cost stops growing with the
    cached prefix once that passes the window, but still grows as n² with the new tokens.
    """

    window: int = 0  # 0: full attention

    kind: ClassVar[str] = "attention"
    terms: ClassVar[tuple[str, ...]] = ("n*x", "x", "n", "1")

    def features(self, x: float, y: float) -> list[float]:
        n, c = split(x, y)
        keys = n + (min(c, self.window) if self.window else c)
        return [n * keys, keys, n, 1.0]

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "window": self.window}


@dataclass
class RooflineOp(OperatorFit):
    """The simulator's roofline step time of one prefill chunk (kvserve.sim.cost).

    Not split per operator: a roofline step is max(bytes / bandwidth, FLOPs / peak), which
    is no sum of per-operator terms, and the point is to give the simulator's own number.
    Saved by names (sim registries), rebuilt on load.
    """

    model: str = ""
    gpu: str = ""
    fp8_weights: bool = False
    tp: int = 1

    kind: ClassVar[str] = "roofline"

    def __post_init__(self) -> None:
        from kvserve.sim.cost import CostModel as StepCostModel
        from kvserve.sim.gpus import get_gpu
        from kvserve.sim.models import get_model

        self._step = StepCostModel(get_model(self.model), get_gpu(self.gpu),
                                   fp8_weights=self.fp8_weights, tp=self.tp)

    def predict(self, x: float, y: float) -> float:
        from kvserve.sim.cost import Chunk

        x = max(1, round(x))
        cached = min(round(x * y), x - 1)  # a prefill computes at least its last token
        return self._step.step([Chunk(cached, x - cached, sampled=True)]).seconds

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "model": self.model, "gpu": self.gpu,
                "fp8_weights": self.fp8_weights, "tp": self.tp}


OP_KINDS: dict[str, type[OperatorFit]] = {k.kind: k for k in (LinearOp, AttentionOp, RooflineOp)}


def op_from_dict(data: dict[str, Any]) -> OperatorFit:
    data = dict(data)
    return OP_KINDS[data.pop("kind")](**data)


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float],
         weights: Sequence[float] | None = None) -> list[float]:
    """Non-negative least squares, exactly, for the few (<= 4) terms of an operator.

    The optimum is the plain least-squares solution on some subset of the columns (KKT), so
    trying every subset and keeping the best non-negative one is exact; 16 tiny solves.
    Columns are scaled to unit size first: x² and 1 differ by six orders of magnitude.
    """
    A = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64)[:, None]
    if weights is not None:
        w = torch.tensor(weights, dtype=torch.float64)[:, None]
        A, b = A * w, b * w
    scale = A.abs().amax(0).clamp_min(1e-300)
    A = A / scale
    k = A.shape[1]
    best, best_err = torch.zeros(k, dtype=torch.float64), float(b.square().sum())
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sol = torch.linalg.lstsq(A[:, cols], b, driver="gelsd").solution[:, 0]
            if bool((sol < 0).any()):
                continue
            err = float((A[:, cols] @ sol[:, None] - b).square().sum())
            if err < best_err:
                best, best_err = torch.zeros(k, dtype=torch.float64), err
                best[list(cols)] = sol
    return (best / scale).tolist()


# ------------------------------------------------------------------ the model


@dataclass
class CostModel:
    """exec(x, y) = the sum of the operators' fits (seconds)."""

    ops: list[OperatorFit]
    info: dict[str, Any] = field(default_factory=dict)  # where the profile was taken

    def exec(self, x: float, y: float) -> float:
        """Predicted prefill seconds of an x-token prompt with a fraction y already cached."""
        return sum(op.predict(x, y) for op in self.ops)

    def queue_time(self, pending: Sequence[tuple[float, float]]) -> float:
        """Eq. 1's first term: the time an instance needs for its unfinished (x, y) prefills."""
        return sum(self.exec(x, y) for x, y in pending)

    def worth_loading(self, x: float, y_have: float, y_other: float, nbytes: float,
                      bandwidth: float) -> bool:
        """Eq. 2: load the KV of the (y_other - y_have)·x tokens held elsewhere (host memory,
        another instance) when moving `nbytes` at `bandwidth` bytes/s takes no longer than
        the prefill time it saves; else recompute them."""
        return nbytes / bandwidth <= self.exec(x, y_have) - self.exec(x, y_other)

    @classmethod
    def fit(cls, samples: Sequence[Sample], window: int = 0,
            info: dict[str, Any] | None = None) -> CostModel:
        """Fit every operator group found in the samples; `window`: the model's sliding window.

        Rows are weighted by 1 / the sample's step time, so the fit minimises relative error
        (timing noise on a shared CPU grows with the run, and small prompts matter as much).
        """
        if not samples:
            raise ValueError("no samples to fit")
        names = sorted({name for s in samples for name in s.ops})
        ops = []
        for name in names:
            op = _operator(name, window)
            points = [(s.x, s.y, s.ops.get(name, 0.0)) for s in samples]
            ops.append(op.fitted(points, [1.0 / max(s.seconds, 1e-9) for s in samples]))
        return cls(ops, dict(info or {}))

    @classmethod
    def from_roofline(cls, model: str, gpu: str, *, fp8_weights: bool = False,
                      tp: int = 1) -> CostModel:
        """exec(x, y) of a simulated model and GPU by name (kvserve.sim registries): the
        simulator's roofline step time of the one prefill chunk, so the simulator and the
        cluster scheduler share one interface."""
        op = RooflineOp("roofline", model=model, gpu=gpu, fp8_weights=fp8_weights, tp=tp)
        return cls([op], {"source": "roofline", "model": model, "gpu": gpu})

    def coefficients(self) -> dict[str, dict[str, float]]:
        """{operator: {term: coefficient}} of the fitted operators."""
        return {op.name: dict(zip(op.terms, op.coef)) for op in self.ops if op.terms}

    def to_dict(self) -> dict[str, Any]:
        return {"ops": [op.to_dict() for op in self.ops], "info": self.info}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        return cls([op_from_dict(d) for d in data["ops"]], dict(data.get("info", {})))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _operator(name: str, window: int) -> OperatorFit:
    if name == ATTN_FULL:
        return AttentionOp(name)
    if name == ATTN_SLIDING:
        return AttentionOp(name, window=window)
    return LinearOp(name)


# ------------------------------------------------------------------ profiling


class _Timers:
    """Seconds per operator group during the engine's forward steps.

    Forward hooks time the Linear modules; a pre-hook on each attention module hands it a
    timed wrapper of the backend (per layer type); the runner's `execute` (the whole step's
    model work) and the model's `compute_logits` are wrapped on the instance. Each hook costs
    a couple of perf_counter calls, far below the ops it times.
    """

    def __init__(self, engine: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self.cuda = engine.model.device.type == "cuda"
        self._clock = clock

    def clock(self) -> float:
        if self.cuda:  # GPU work is asynchronous: time what ran, not what was queued
            torch.cuda.synchronize()
        return self._clock()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            out = fn(*args, **kwargs)
            self.add(name, self.clock() - t0)
            return out
        return run

    def reset(self) -> None:
        self.seconds, self.steps = {}, 0

    @contextmanager
    def installed(self) -> Iterator[_Timers]:
        from kvserve.memory.spec import LayerKind
        from kvserve.models.layers import Linear

        model, runner = self.engine.model, self.engine.runner
        starts: dict[int, float] = {}
        handles = []

        def pre(mod: torch.nn.Module, args: tuple) -> None:
            starts[id(mod)] = self.clock()

        def post(mod: torch.nn.Module, args: tuple, out: Any) -> None:
            self.add(LINEAR, self.clock() - starts.pop(id(mod)))

        def wrap_backend(mod: torch.nn.Module, args: tuple) -> tuple:
            kind = model.kv_layers[mod.layer_idx].kind
            name = ATTN_SLIDING if kind is LayerKind.SLIDING else ATTN_FULL
            return (*args[:-1], self.timed(name, args[-1]))  # forward(..., attn)

        execute = self.timed("step", runner.execute)

        def step(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            return execute(*args, **kwargs)

        for mod in model.model.layers.modules():
            if isinstance(mod, Linear):
                handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
            elif mod.__class__.__name__.endswith("Attention") and hasattr(mod, "layer_idx"):
                handles.append(mod.register_forward_pre_hook(wrap_backend))
        try:
            with _patched(runner, "execute", step), _patched(
                    model, "compute_logits", self.timed(LM_HEAD, model.compute_logits)):
                yield self
        finally:
            for h in handles:
                h.remove()

    def sample(self, x: int, cached: int) -> Sample:
        ops = {k: v for k, v in self.seconds.items() if k != "step"}
        total = self.seconds["step"]
        ops[OTHER] = max(0.0, total - sum(ops.values()))
        return Sample(x, cached / x, total, ops)


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set an attribute on the instance for a while, then put back what was there."""
    before = vars(obj).get(name, _patched)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is _patched:
            delattr(obj, name)  # the class's method shows through again
        else:
            setattr(obj, name, before)


DEFAULT_LENGTHS = (64, 128, 256, 512)
DEFAULT_RATIOS = (0.0, 0.5, 0.875)


def profile_engine(engine: Any, lengths: Sequence[int] = DEFAULT_LENGTHS,
                   ratios: Sequence[float] = DEFAULT_RATIOS, repeats: int = 1,
                   seed: int | None = None, warmup: bool = True,
                   clock: Callable[[], float] = time.perf_counter) -> list[Sample]:
    """Time prefills of x tokens with y cached on a loaded (idle) LLMEngine.

    For each (x, y): a fresh random prompt's first x·y tokens (rounded to whole pages, which
    is what the prefix cache hits) are prefilled alone, then the whole prompt, which hits
    them. Both runs are samples (the first one has y = 0), each a single forward step: the
    step budget is raised to the longest prompt while profiling. y is the hit the engine
    reports, not the one asked for. With `repeats` > 1 each (x, y) runs again on fresh
    prompts and the fastest run is kept: on a shared CPU a descheduled thread stalls a
    parallel op for a time slice, and the fastest run is the one least disturbed. With
    `warmup`, an unrecorded prefill of the shortest length comes first (first calls allocate).
    Prompts are random tokens; give `seed` only to repeat a profile on a fresh engine (a
    second call with the same seed would hit the first call's prompts in the prefix cache).

    `clock` is wall time by default. On a CPU shared with other jobs, a one-thread engine
    is better timed by `time.thread_time`: the same as wall time on an idle core, but blind
    to the time slices other processes take from it.
    """
    if engine.has_unfinished():
        raise RuntimeError("profile an idle engine: its steps must hold one prefill each")
    if not engine.cfg.enable_prefix_caching and any(r > 0 for r in ratios):
        raise ValueError("cached ratios > 0 need prefix caching")
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh prompts, never the cached ones of an earlier profile
    else:
        gen.manual_seed(seed)
    vocab, page = engine.config.vocab_size, engine.kv.T
    timers = _Timers(engine, clock)
    budget = engine.scheduler.budget
    engine.scheduler.budget = max(budget, *lengths)
    samples: list[Sample] = []
    try:
        with timers.installed():
            if warmup:
                _prefill(engine, timers, torch.randint(3, vocab, (min(lengths),), generator=gen))
            for x, y in itertools.product(lengths, ratios):
                cached = min(round(x * y / page), (x - 1) // page) * page if y > 0 else 0
                runs = []
                for _ in range(repeats):
                    prompt = torch.randint(3, vocab, (x,), generator=gen)
                    prefix = [_prefill(engine, timers, prompt[:cached])] if cached > 0 else []
                    runs.append(prefix + [_prefill(engine, timers, prompt)])
                samples += [min(same, key=lambda s: s.seconds) for same in zip(*runs)]
    finally:
        engine.scheduler.budget = budget
    return samples


_ids = itertools.count()


def _prefill(engine: Any, timers: _Timers, prompt: torch.Tensor) -> Sample:
    from kvserve.engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    req = engine.add_request(f"cost-profile-{next(_ids)}", {"prompt_token_ids": prompt.tolist()},
                             params)
    timers.reset()
    while engine.has_unfinished():
        engine.step()
    if timers.steps != 1:
        raise RuntimeError(f"a {len(prompt)}-token prefill took {timers.steps} steps, not one")
    return timers.sample(len(prompt), req.num_cached_tokens)
