"""OpenAI-compatible HTTP server: `kvserve serve`.

protocol.py     request bodies (pydantic) and response/chunk builders, in OpenAI's shapes
errors.py       OpenAI's error body and the handlers that turn every client mistake into a 4xx
engine_loop.py  the one thread that owns the engine; HTTP handlers talk to it through queues
metrics.py      Prometheus metrics (own registry), engine gauges read once per scrape
serving.py      prompts -> engine requests -> JSON responses or SSE streams
app.py          routes, `build_app(engine, model_name)`, CLI `add_arguments` / `main`
"""
