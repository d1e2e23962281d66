"""An OpenAI-compatible HTTP server over the engine (``python -m flax_models.serve``).

Split as vLLM's ``vllm/entrypoints/openai/``: ``api_server`` (FastAPI routes, thin, and
the uvicorn server), ``protocol`` (pydantic request and response bodies, validated at the
edge), ``serving_engine`` (what the handlers share: checks, sampling settings,
submission, aborts on disconnect, server-sent events), ``serving_completion`` and
``serving_chat`` (request → engine → response or event stream), ``engine_loop`` (the one
thread that owns the engine, fed by a command queue), ``metrics`` (Prometheus, vLLM's
names) and ``cli_args`` (the command line).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client); nothing under
``flax_models`` imports this package except ``flax_models.serve``.
"""
