"""Request traces: a JSONL format, token-id synthesis, and the Jenga paper's workloads.

One request per line:

    {"id": "q3", "arrival": 1.5, "prompt_len": 20480, "output_len": 80,
     "prefix_id": "article-2", "prefix_len": 20400,
     "images": [{"id": "img-7", "offset": 0, "tokens": 6193}]}

`prompt_ids` (a list of ints) may replace `prompt_len`. Requests with the
same `prefix_id` share their first `prefix_len` token ids exactly, so the
prefix cache can hit; everything else gets ids no other request has.
`images` are the request's images (cross-attention models: `offset` is the
text position of the image marker); equal ids mean the same image content.
An optional `session` names a conversation: the simulators send its
requests one after another, each its trace gap after the previous one's
answer (`SessionTurns`).

Generators (`name` or `name:key=value,...`, see GENERATORS): the paper's
20 long requests at once (Fig. 15), the static and dynamic length traces
(Fig. 16), arXiv-QA-like questions over N articles (Fig. 17), MMMU-pro-like
image+text shapes (§3.2), ShareGPT (lengths from the real dataset; single
or multi-turn) and LooGLE-like document-QA sessions (MemServe §8.4).
"""

from __future__ import annotations

import inspect
import json
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvserve.memory import ImageInput

PREFIX_BASE = 1_000_000_000  # first token of shared prefix k: PREFIX_BASE + k
UNIQUE_BASE = 2_000_000_000  # first token of request i's own tokens
OUTPUT_TOKEN = 7  # the synthetic "sampled" token


@dataclass(frozen=True)
class Image:
    id: str
    offset: int
    tokens: int


@dataclass
class TraceRequest:
    id: str
    arrival: float
    output_len: int
    prompt_len: int = 0
    prefix_id: str | None = None
    prefix_len: int = 0
    images: tuple[Image, ...] = ()
    prompt_ids: list[int] | None = field(default=None, repr=False)
    session: str | None = None  # a conversation: its requests go one after another

    def __post_init__(self) -> None:
        if self.prompt_ids is not None:
            self.prompt_len = len(self.prompt_ids)
        if self.prompt_len <= 0 or self.output_len <= 0:
            raise ValueError(f"request {self.id!r}: prompt_len and output_len must be > 0")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"request {self.id!r}: prefix_len must be in [0, prompt_len]")

    def image_inputs(self) -> tuple[ImageInput, ...]:
        return tuple(ImageInput(im.id, im.offset, im.tokens) for im in self.images)

    @property
    def image_tokens(self) -> int:
        return sum(im.tokens for im in self.images)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict:
        d: dict = {"id": self.id, "arrival": self.arrival, "output_len": self.output_len}
        if self.prompt_ids is not None:
            d["prompt_ids"] = list(self.prompt_ids)
        else:
            d["prompt_len"] = self.prompt_len
        if self.prefix_id is not None:
            d["prefix_id"], d["prefix_len"] = self.prefix_id, self.prefix_len
        if self.session is not None:
            d["session"] = self.session
        if self.images:
            d["images"] = [{"id": im.id, "offset": im.offset, "tokens": im.tokens}
                           for im in self.images]
        return d

    @classmethod
    def from_json(cls, d: dict) -> TraceRequest:
        images = tuple(Image(str(i["id"]), int(i["offset"]), int(i["tokens"]))
                       for i in d.get("images", ()))
        prefix = d.get("prefix_id")
        return cls(
            id=str(d["id"]), arrival=float(d["arrival"]), output_len=int(d["output_len"]),
            prompt_len=int(d.get("prompt_len", 0)),
            prefix_id=None if prefix is None else str(prefix),
            prefix_len=int(d.get("prefix_len", 0)), images=images,
            prompt_ids=None if d.get("prompt_ids") is None else [int(t) for t in d["prompt_ids"]],
            session=None if d.get("session") is None else str(d["session"]),
        )


class SessionTurns:
    """A trace's arrivals with each conversation's turns in order: a user reads an answer
    before writing the next message, so a session's next turn arrives its trace gap (from
    the previous turn's trace arrival) after the previous turn is answered, not at its
    trace time. `first` arrive at their trace times; `after(request_id, now)` releases the
    session's next turn, its arrival moved, once that request is answered (or rejected)."""

    def __init__(self, trace: list[TraceRequest], causal: bool = True) -> None:
        self.first: list[TraceRequest] = []
        self._later: dict[str, deque[TraceRequest]] = {}  # session -> its turns to come
        self._open: dict[str, tuple[str, float]] = {}  # request id -> (session, trace arrival)
        for tr in sorted(trace, key=lambda r: r.arrival):
            if causal and tr.session is not None:
                self._open[tr.id] = (tr.session, tr.arrival)
                if tr.session in self._later:
                    self._later[tr.session].append(tr)
                    continue
                self._later[tr.session] = deque()
            self.first.append(tr)

    def after(self, request_id: str, now: float) -> TraceRequest | None:
        if request_id not in self._open:
            return None
        session, arrival = self._open.pop(request_id)
        later = self._later[session]
        if not later:
            return None
        nxt = later.popleft()
        return replace(nxt, arrival=now + nxt.arrival - arrival)


def write_jsonl(path: str | Path, trace: list[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(r.to_json()) + "\n")


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    with open(path) as f:
        return [TraceRequest.from_json(json.loads(line)) for line in f if line.strip()]


class TokenSynth:
    """Token ids for lengths-only requests: shared prefixes identical, the rest unique.

    A block hash chains every earlier token, so one distinct first token is
    enough to make every later block distinct; the rest are position ids.
    """

    def __init__(self) -> None:
        self._prefixes: dict[str, list[int]] = {}
        self._next_unique = 0

    def prompt_ids(self, r: TraceRequest) -> list[int]:
        if r.prompt_ids is not None:
            return list(r.prompt_ids)
        head = self._prefix(r.prefix_id, r.prefix_len) if r.prefix_id is not None else []
        n = r.prompt_len - len(head)
        if n <= 0:
            return list(head)
        self._next_unique += 1
        return head + [UNIQUE_BASE + self._next_unique] + list(range(len(head) + 1, r.prompt_len))

    def _prefix(self, pid: str, n: int) -> list[int]:
        have = self._prefixes.get(pid)
        if have is None:
            have = [PREFIX_BASE + len(self._prefixes)]
            self._prefixes[pid] = have
        if len(have) < n:  # requests may share prefixes of different lengths
            have.extend(range(len(have), n))
        return have[:n]


# ------------------------------------------------------------------ generators


def _poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """n arrival times of a Poisson process (rate per second); rate <= 0: all at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if rate > 0:
            t += rng.expovariate(rate)
    return out


def decode20(n: int = 20, lo: int = 55_000, hi: int = 110_000, out_lo: int = 50,
             out_hi: int = 100, seed: int = 0) -> list[TraceRequest]:
    """Fig. 15 (E2-1): n long-document requests arriving at once."""
    rng = random.Random(seed)
    return [TraceRequest(f"r{i}", 0.0, rng.randint(out_lo, out_hi), rng.randint(lo, hi))
            for i in range(n)]


def static(n: int = 60, lo: int = 16_384, hi: int = 122_880, out_lo: int = 50,
           out_hi: int = 100, rate: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """Fig. 16 static trace: one length distribution, uniform in [lo, hi], all along."""
    rng = random.Random(seed)
    times = _poisson_arrivals(rng, n, rate)
    return [TraceRequest(f"s{i}", t, rng.randint(out_lo, out_hi), rng.randint(lo, hi))
            for i, t in enumerate(times)]


def dynamic(n: int = 60, lo: int = 16_384, hi: int = 122_880, out_lo: int = 50,
            out_hi: int = 100, rate: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """Fig. 16 dynamic trace: the mean length sweeps [lo, hi] uniformly over time.

    Request i's mean is lo + (hi - lo) * i / (n - 1); its length is drawn
    within +-25% of the mean, clamped to [lo, hi].
    """
    rng = random.Random(seed)
    times = _poisson_arrivals(rng, n, rate)
    out = []
    for i, t in enumerate(times):
        mean = lo + (hi - lo) * i / max(1, n - 1)
        length = min(hi, max(lo, round(mean * rng.uniform(0.75, 1.25))))
        out.append(TraceRequest(f"d{i}", t, rng.randint(out_lo, out_hi), length))
    return out


def arxiv_qa(articles: int = 8, questions: int = 8, article_lo: int = 8_192,
             article_hi: int = 32_768, q_lo: int = 16, q_hi: int = 64, out_lo: int = 50,
             out_hi: int = 150, rate: float = 1.0, order: str = "shuffled",
             seed: int = 0) -> list[TraceRequest]:
    """Fig. 17: `questions` questions about each of `articles` articles.

    Each prompt is the article (the shared prefix) followed by a question;
    each answer is `out_lo`..`out_hi` output tokens. Article lengths are
    uniform in [article_lo, article_hi]: a synthetic stand-in for
    arxiv-march-2023 full texts (we do not have the dataset). `order`:
    `shuffled` (random order) or `round_robin` (article 0, 1, ..., N-1, 0, 1,
    ...: the longest reuse distance, where LRU caches fail first).
    """
    rng = random.Random(seed)
    lengths = [rng.randint(article_lo, article_hi) for _ in range(articles)]
    if order == "round_robin":
        pairs = [(a, q) for q in range(questions) for a in range(articles)]
    elif order == "shuffled":
        pairs = [(a, q) for a in range(articles) for q in range(questions)]
        rng.shuffle(pairs)
    else:
        raise ValueError(f"arxiv-qa order {order!r}: expected shuffled or round_robin")
    times = _poisson_arrivals(rng, len(pairs), rate)
    out = []
    for (a, q), t in zip(pairs, times):
        plen = lengths[a] + rng.randint(q_lo, q_hi)
        out.append(TraceRequest(f"a{a}q{q}", t, rng.randint(out_lo, out_hi), plen,
                                prefix_id=f"article-{a}", prefix_len=lengths[a]))
    return out


def mmmu(n: int = 200, text_lo: int = 22, text_hi: int = 64, image_lo: int = 5_800,
         image_hi: int = 6_586, out_lo: int = 16, out_hi: int = 64, rate: float = 2.0,
         seed: int = 0) -> list[TraceRequest]:
    """MMMU-pro-like shapes (Jenga §3.2: 6193 image and 43 text tokens on average).

    Text and image token counts are uniform around those means; one image per
    request, its marker first (Llama 3.2 Vision's chat template puts
    <|image|> before the text). Outputs are short: the answers are choices.
    """
    rng = random.Random(seed)
    times = _poisson_arrivals(rng, n, rate)
    return [
        TraceRequest(f"m{i}", t, rng.randint(out_lo, out_hi), rng.randint(text_lo, text_hi),
                     images=(Image(f"img-{i}", 0, rng.randint(image_lo, image_hi)),))
        for i, t in enumerate(times)
    ]


def sharegpt(n: int = 1000, rate: float = 2.0, max_len: int = 0,
             seed: int = 0) -> list[TraceRequest]:
    """The first human turn and the reply of the first n usable ShareGPT conversations.

    Token counts are estimated as ceil(characters / 4); no tokenizer is run.
    The dataset carries no timestamps, so arrivals are Poisson at `rate` per
    second. `max_len` > 0 drops pairs whose prompt + output exceed it.
    """
    from kvserve.datasets.sharegpt import load_conversations

    rng = random.Random(seed)
    pairs = []
    for conv in load_conversations():
        pair = tuple(_est_tokens(t) for t in conv.first_exchange())
        if max_len and sum(pair) > max_len:
            continue
        pairs.append(pair)
        if len(pairs) >= n:
            break
    times = _poisson_arrivals(rng, len(pairs), rate)
    return [TraceRequest(f"g{i}", t, out, prompt)
            for i, ((prompt, out), t) in enumerate(zip(pairs, times))]


def sharegpt_chat(sessions: int = 200, turns: int = 8, rate: float = 1.0,
                  think: float = 20.0, max_len: int = 16_384,
                  seed: int = 0) -> list[TraceRequest]:
    """Multi-turn ShareGPT sessions: every turn's prompt is the whole conversation so far.

    The first `sessions` conversations with at least two exchanges, up to
    `turns` exchanges each, cut before the session would pass `max_len`
    tokens. Sessions start as a Poisson process at `rate` per second; a
    turn arrives `think` seconds (exponential mean) after the previous
    one's answer (the simulators count the gap from there, `SessionTurns`:
    MemServe's causal sessions). Turn k's prompt ids are turn
    k-1's prompt, its answer as the simulator samples it (OUTPUT_TOKEN
    repeated) and the new human message (unique ids), so the previous turn's
    whole sequence can hit.
    """
    from kvserve.datasets.sharegpt import load_conversations

    rng = random.Random(seed)
    convs = [c for c in load_conversations() if len(c.turns) >= 4][:sessions]
    starts = _poisson_arrivals(rng, len(convs), rate)
    out: list[TraceRequest] = []
    unique = UNIQUE_BASE
    for i, (conv, t) in enumerate(zip(convs, starts)):
        ids: list[int] = []
        pairs = list(zip(conv.turns[0::2], conv.turns[1::2]))[:turns]
        for k, ((_, human), (_, answer)) in enumerate(pairs):
            n_in, n_out = _est_tokens(human), _est_tokens(answer)
            if len(ids) + n_in + n_out > max_len:
                break
            unique += 1
            ids = ids + [unique] + list(range(len(ids) + 1, len(ids) + n_in))
            out.append(TraceRequest(f"c{i}t{k}", t, n_out, prompt_ids=ids,
                                    prefix_id=f"chat-{i}", prefix_len=0, session=f"chat-{i}"))
            ids = ids + [OUTPUT_TOKEN] * n_out
            t += rng.expovariate(1 / think) if think > 0 else 0.0
    out.sort(key=lambda r: r.arrival)
    return out


def doc_qa(docs: int = 80, questions: int = 3, share: int = 2, doc_lo: int = 2048,
           doc_hi: int = 8192, q_lo: int = 16, q_hi: int = 64, out_lo: int = 8,
           out_hi: int = 64, rate: float = 1.0, think: float = 5.0,
           seed: int = 0) -> list[TraceRequest]:
    """LooGLE-like document-QA sessions, as in MemServe's global-scheduler study (§8.4).

    Each of `docs` documents has a session of `questions` questions; each prompt is the
    document followed by one question, each answer `out_lo`..`out_hi` tokens (LooGLE's
    answers are short). `share` copies of every session run (MemServe's share ratio: a
    copy repeats the session's requests token for token, under its own session id), so
    prompts repeat across sessions as well as within them. Sessions start as a Poisson
    process at `rate` per second, copies shuffled among the others; a session's
    questions are `think` s (exponential mean) apart. Document lengths are uniform in
    [doc_lo, doc_hi] (MemServe cut LooGLE's documents to 1k tokens for Llama 2's 4k
    context; the documents themselves are far longer).
    """
    rng = random.Random(seed)
    sessions = []
    for d in range(docs):
        n = rng.randint(doc_lo, doc_hi)
        doc = [PREFIX_BASE + d] + list(range(1, n))
        asks = []
        for q in range(questions):
            m = rng.randint(q_lo, q_hi)
            question = [UNIQUE_BASE + d * questions + q] + list(range(n + 1, n + m))
            asks.append((doc + question, rng.randint(out_lo, out_hi)))
        sessions += [(d, c, asks) for c in range(share)]
    rng.shuffle(sessions)
    starts = _poisson_arrivals(rng, len(sessions), rate)
    out = []
    for (d, c, asks), t in zip(sessions, starts):
        for q, (ids, n_out) in enumerate(asks):
            out.append(TraceRequest(f"d{d}c{c}q{q}", t, n_out, prompt_ids=ids,
                                    session=f"doc-{d}-copy-{c}"))
            t += rng.expovariate(1 / think) if think > 0 else 0.0
    out.sort(key=lambda r: r.arrival)
    return out


def long_mix(n: int = 200, long_frac: float = 0.2, long_max: int = 200_000,
             short_max: int = 60_000, rate: float = 0.0, out_max: int = 2_000,
             seed: int = 0) -> list[TraceRequest]:
    """Infinite-LLM's Table 1 mixes: short requests like its trace 0 (ShareGPT4, 1-60K,
    mean ~1.2K, heavy tail: lognormal, median 400) and a `long_frac` share like its
    traces 3-8 (1-`long_max`, mean ~long_max/4, SD ~long_max/7.6: a clipped normal).
    Outputs are ShareGPT-like (lognormal, median 200, <= out_max) for both; the
    context length is prompt + output. Poisson arrivals at `rate` (0: all at once)."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(_poisson_arrivals(rng, n, rate)):
        is_long = rng.random() < long_frac
        if is_long:
            total = int(rng.gauss(long_max / 4, long_max / 7.6))
            total = min(max(total, 2), long_max)
        else:
            total = min(max(int(rng.lognormvariate(math.log(400), 1.5)), 2), short_max)
        n_out = min(max(1, int(rng.lognormvariate(math.log(200), 1.0))), out_max, total - 1)
        out.append(TraceRequest(f"{'L' if is_long else 's'}{i}", t, n_out, total - n_out))
    return out


def _est_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "decode20": decode20,
    "static": static,
    "dynamic": dynamic,
    "arxiv-qa": arxiv_qa,
    "mmmu": mmmu,
    "sharegpt": sharegpt,
    "sharegpt-chat": sharegpt_chat,
    "doc-qa": doc_qa,
    "long-mix": long_mix,
}


def load_trace(spec: str) -> list[TraceRequest]:
    """A JSONL file, or a generator as `name` / `name:key=value,...`."""
    name, _, args = spec.partition(":")
    if name not in GENERATORS:
        if Path(spec).exists():
            return read_jsonl(spec)
        raise ValueError(f"{spec!r} is neither a file nor a generator ({sorted(GENERATORS)})")
    gen = GENERATORS[name]
    return gen(**_parse_kwargs(gen, args))


def _parse_kwargs(gen: Callable, args: str) -> dict:
    params = inspect.signature(gen).parameters
    out: dict = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in params:
            raise ValueError(f"generator option {item!r}: expected key=value, "
                             f"keys {sorted(params)}")
        out[key] = type(params[key].default)(value)
    return out
