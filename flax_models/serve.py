"""``python -m flax_models.serve MODEL``: an OpenAI-compatible server for a checkpoint.

Loads ``LLM(MODEL)``, compiles every step program (``engine.warmup()``; JAX's persistent
compilation cache and the compiled step programs kept beside it make later starts quick),
then serves ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics`` on FastAPI +
uvicorn (``flax_models.serving.server``) until SIGINT or SIGTERM. It logs "ready" once it
accepts requests. ``--help`` lists the options; docs/serving.md has examples.

The server's dependencies are the ``serve`` extra (``pip install -e ".[serve]"``);
``import flax_models`` does not need them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger("flax_models.serve")


def enable_compilation_cache(directory) -> None:
    """JAX's persistent compilation cache in ``directory`` (made if missing): programs
    compiled once load from it in later processes."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    logger.info("compilation cache: %s", directory)


def main(argv: Sequence[str] | None = None) -> int:
    from flax_models.serving.server import cli_args

    args = cli_args.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Debug is for this library's own loggers (a line per engine step): JAX's would log
    # every trace and compile.
    logging.getLogger("jax").setLevel(max(logging.INFO, logging.getLogger().level))
    try:
        from flax_models.serving.server import api_server
    except ImportError as error:
        logger.error(
            "the server needs fastapi, uvicorn and prometheus_client (the 'serve' extra: "
            "pip install -e '.[serve]'): %s",
            error,
        )
        return 2
    options = cli_args.engine_options(args)
    if not args.no_compilation_cache:
        cache_dir = args.compilation_cache_dir or cli_args.default_compilation_cache_dir()
        enable_compilation_cache(cache_dir)
        if not args.no_executable_cache:  # the step programs, loaded untraced next time
            from flax_models.serving.executables import beside_compilation_cache

            options["executable_cache_dir"] = beside_compilation_cache(cache_dir)
    watchdog = None
    if args.parent_pid is not None:
        watchdog = api_server.ParentWatchdog(args.parent_pid)
        watchdog.start()

    from flax_models import LLM

    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        implementation=args.implementation,
        max_model_len=args.max_model_len,
        seed=args.seed,
        load_format=args.load_format,
        **options,
    )
    logger.info(
        "loaded %s in %.1f s: max_model_len %d, %d slots",
        args.model,
        time.perf_counter() - start,
        llm.max_model_len,
        llm.engine.builder.num_slots,
    )
    start = time.perf_counter()
    programs = llm.engine.warmup()
    logger.info("compiled %d programs in %.1f s", programs, time.perf_counter() - start)

    state = api_server.ServerState(
        llm,
        served_model_names=args.served_model_name,
        max_waiting=args.max_waiting_seqs,
        api_key=args.api_key,
    )
    api_server.serve(
        state,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        shutdown_timeout=args.shutdown_timeout,
        watchdog=watchdog,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
