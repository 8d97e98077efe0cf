"""The OpenAI-compatible server over one Engine: the app (app.py), the Server (api.py: scheduler, monitor,
metrics), the OpenAI mapping (openai_request.py, openai_response.py, schemas.py), streaming that stays exact when a
speculative step emits several tokens (stream.py, detokenize.py, parsers.py), tools and structured output
(tools.py, grammar.py), the live acceptance monitor and the metrics.

May import: the engine, the scheduler and everything below them. Nothing in the core imports this package (the
scheduler is handed the monitor and the metrics); only cli/ and bench/ (bench-serve) import it."""
