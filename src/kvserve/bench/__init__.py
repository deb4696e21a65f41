"""Benchmarks against a running server: `kvserve bench serve` (ShareGPT, Poisson arrivals).

dataset.py  ShareGPT records (the packaged JSON, cut at its truncation) -> sessions of turns
serve.py    the client: Poisson session arrivals, streamed requests, TTFT / ITL timing
report.py   throughput and latency statistics, the printed table
cli.py      `add_arguments` / `main` for `kvserve bench serve`
"""
