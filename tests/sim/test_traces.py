"""Trace JSONL round trip, token synthesis, generators and the ShareGPT reader."""

from __future__ import annotations

import pytest

from kvserve.memory.prefix_cache import extend_block_hashes
from kvserve.sim.traces import (
    GENERATORS,
    Image,
    TokenSynth,
    TraceRequest,
    load_trace,
    read_jsonl,
    write_jsonl,
)


def test_jsonl_round_trip(tmp_path) -> None:
    trace = [
        TraceRequest("a", 0.0, 10, 500),
        TraceRequest("b", 1.25, 3, 700, prefix_id="doc", prefix_len=600),
        TraceRequest("c", 2.5, 4, 43, images=(Image("img-1", 0, 6193), Image("img-2", 20, 99))),
        TraceRequest("d", 3.0, 1, prompt_ids=[5, 6, 7, 8]),
    ]
    path = tmp_path / "t.jsonl"
    write_jsonl(path, trace)
    assert read_jsonl(path) == trace
    assert len(path.read_text().splitlines()) == len(trace)


@pytest.mark.parametrize("name", ["decode20", "static", "dynamic", "arxiv-qa", "mmmu"])
def test_generated_traces_round_trip(name: str, tmp_path) -> None:
    trace = load_trace(f"{name}:seed=3")
    path = tmp_path / "g.jsonl"
    write_jsonl(path, trace)
    assert load_trace(str(path)) == trace


def test_bad_trace_records() -> None:
    with pytest.raises(ValueError):
        TraceRequest("x", 0.0, 0, 10)
    with pytest.raises(ValueError):
        TraceRequest("x", 0.0, 1, 10, prefix_id="p", prefix_len=11)
    with pytest.raises(ValueError, match="neither a file nor a generator"):
        load_trace("no-such-thing")
    with pytest.raises(ValueError, match="expected key=value"):
        load_trace("decode20:bogus=1")


def _hashes(tokens: list[int], T: int = 16) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, T)
    return out


def test_shared_prefixes_hash_alike_and_the_rest_differs() -> None:
    synth = TokenSynth()
    a = synth.prompt_ids(TraceRequest("a", 0, 1, 1000, prefix_id="doc", prefix_len=800))
    b = synth.prompt_ids(TraceRequest("b", 0, 1, 900, prefix_id="doc", prefix_len=800))
    c = synth.prompt_ids(TraceRequest("c", 0, 1, 1000, prefix_id="other", prefix_len=800))
    d = synth.prompt_ids(TraceRequest("d", 0, 1, 1000))
    e = synth.prompt_ids(TraceRequest("e", 0, 1, 1000))
    assert len(a) == 1000 and len(b) == 900
    ha, hb, hc, hd, he = map(_hashes, (a, b, c, d, e))
    assert ha[:50] == hb[:50] and ha[50] != hb[50]  # 800 / 16 = 50 shared blocks
    assert not set(ha) & set(hc) and not set(hd) & set(he) and not set(ha) & set(hd)


def test_decode20_matches_the_paper_setup() -> None:
    trace = load_trace("decode20")
    assert len(trace) == 20 and all(r.arrival == 0 for r in trace)
    assert all(55_000 <= r.prompt_len <= 110_000 and 50 <= r.output_len <= 100 for r in trace)


def test_arxiv_qa_shape() -> None:
    trace = load_trace("arxiv-qa:articles=3,questions=4")
    assert len(trace) == 12
    assert sorted({r.prefix_id for r in trace}) == ["article-0", "article-1", "article-2"]
    assert all(r.prefix_len < r.prompt_len for r in trace)
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)


def test_arxiv_qa_round_robin_cycles_the_articles() -> None:
    trace = load_trace("arxiv-qa:articles=3,questions=2,order=round_robin")
    assert [r.prefix_id[-1] for r in trace] == list("012012")
    with pytest.raises(ValueError, match="order"):
        load_trace("arxiv-qa:order=sorted")


def test_mmmu_shape() -> None:
    trace = load_trace("mmmu:n=400")
    text = sum(r.prompt_len for r in trace) / len(trace)
    image = sum(r.image_tokens for r in trace) / len(trace)
    assert 38 < text < 48 and 6100 < image < 6290  # the paper's 43 and 6193
    assert len({r.images[0].id for r in trace}) == len(trace)


def test_dynamic_lengths_rise_over_time() -> None:
    trace = load_trace("dynamic:n=40")
    first, last = trace[:10], trace[-10:]
    assert sum(r.prompt_len for r in last) > 3 * sum(r.prompt_len for r in first)


def test_sharegpt_reads_the_packaged_dataset() -> None:
    trace = load_trace("sharegpt:n=50,rate=4")
    assert len(trace) == 50
    assert all(r.prompt_len > 0 and r.output_len > 0 for r in trace)
    assert trace[-1].arrival > 0
    assert "sharegpt" in GENERATORS


def test_doc_qa_sessions_repeat_token_for_token(tmp_path) -> None:
    trace = load_trace("doc-qa:docs=3,questions=2,share=2,doc_lo=300,doc_hi=600")
    assert len(trace) == 12 and len({r.session for r in trace}) == 6
    by_id = {r.id: r for r in trace}
    assert by_id["d1c0q1"].prompt_ids == by_id["d1c1q1"].prompt_ids  # a copy repeats
    doc = by_id["d1c0q0"].prompt_ids
    q1 = by_id["d1c0q1"].prompt_ids
    assert q1[:len(doc) - 70] == doc[:len(doc) - 70] and q1 != doc  # same document
    path = tmp_path / "d.jsonl"
    write_jsonl(path, trace)
    assert read_jsonl(path) == trace  # sessions survive the round trip
