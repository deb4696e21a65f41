"""Trace-driven simulator: the real memory core and scheduler, a roofline clock, no model.

Modules: gpus (GPU data), models (model shapes -> KV specs, bytes, FLOPs),
cost (roofline step time, KV budget), traces (JSONL format, generators),
simulator (the replay loop), metrics (summaries, JSON), plots, cli.
"""
