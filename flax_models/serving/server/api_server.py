"""The HTTP routes (FastAPI, thin) and the uvicorn server around them.

Routes: ``GET /health`` (200 while the engine loop runs, else 503), ``GET /metrics``
(Prometheus text), ``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (JSON, or server-sent events with ``stream: true``). Bodies are
validated by the ``protocol`` models; every error is OpenAI's JSON body
``{"error": {"message", "type", "param", "code"}}`` with its status (400 for a bad request,
401 without the API key, 404 for an unknown model, 503 when the server is full or
stopping, 500 for a bug), and the server stays up.

Streams run until their requests end or the client goes away: a disconnect is noticed at
once (a listener on the connection beside the stream) and aborts the requests, which
frees their slots at the engine's next step. SIGINT or SIGTERM stops the server: no new
connections, every request aborted (open streams end with ``finish_reason: "abort"``),
the engine thread stopped, exit status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flax_models.serving.server import protocol
from flax_models.serving.server.engine_loop import AsyncEngine
from flax_models.serving.server.metrics import CONTENT_TYPE_LATEST, Metrics
from flax_models.serving.server.serving_chat import OpenAIServingChat
from flax_models.serving.server.serving_completion import OpenAIServingCompletion
from flax_models.serving.server.serving_engine import EventStream, OpenAIError

__all__ = ["ParentWatchdog", "ServerState", "build_app", "serve"]

logger = logging.getLogger(__name__)


class ServerState:
    """What the routes serve from: the engine loop, the handlers, the metrics."""

    def __init__(
        self,
        llm,
        *,
        served_model_names: list[str],
        max_waiting: int,
        api_key: str | None = None,
    ):
        self.llm = llm
        self.served_model_names = served_model_names
        self.max_model_len = int(llm.max_model_len)
        self.api_key = api_key
        self.metrics = Metrics(served_model_names[0], max_model_len=self.max_model_len)
        self.engine = AsyncEngine(llm.engine, metrics=self.metrics, max_waiting=max_waiting)
        common = dict(served_model_names=served_model_names, max_model_len=self.max_model_len)
        self.completion = OpenAIServingCompletion(llm, self.engine, **common)
        self.chat = OpenAIServingChat(llm, self.engine, **common)


def _error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.response().model_dump(), status_code=error.status)


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that end when the stream does or the client leaves (a listener
    on the connection beside the stream, whatever the ASGI version), then ``on_close``
    (aborts what is left of the requests, even if the stream never started)."""

    def __init__(self, stream: EventStream):
        super().__init__(stream.events, media_type="text/event-stream")
        self._on_close = stream.abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def run(job: Callable[[], Awaitable[None]]) -> None:
                    await job()
                    group.cancel_scope.cancel()

                group.start_soon(run, lambda: self.stream_response(send))
                await run(lambda: self.listen_for_disconnect(receive))
        except OSError:  # the client went away mid-send
            pass
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


class _ApiKeyMiddleware:
    """401 for a ``/v1`` request without ``Authorization: Bearer <api key>`` (plain ASGI:
    streams and disconnects pass through untouched)."""

    def __init__(self, app, *, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(
                    OpenAIError(
                        "a valid API key is required (Authorization: Bearer KEY)",
                        status=401,
                        type="AuthenticationError",
                    )
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    """Returns once the client has disconnected (the body is read already, so the next
    message on the connection is the disconnect)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def _validation_error(problems: list[dict]) -> OpenAIError:
    """pydantic's errors as one 400: each ``field: message``; ``param`` the first field."""
    if problems and problems[0].get("type") == "json_invalid":
        return OpenAIError(f"the body is not valid JSON: {problems[0].get('ctx', {})}")
    fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") for e in problems]
    message = "; ".join(
        f"{field or 'body'}: {e.get('msg', '')}" for field, e in zip(fields, problems, strict=True)
    )
    return OpenAIError(message or "invalid request", param=(fields[0] if fields else None) or None)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="flax_models OpenAI-compatible server")
    app.state.server = state

    if state.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError):
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        return _error(_validation_error(error.errors()))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception):
        logger.exception("unhandled error in a request")
        return _error(
            OpenAIError(f"internal error: {error!r}", status=500, type="InternalServerError")
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> protocol.ModelList:
        root = str(getattr(state.llm, "directory", state.served_model_names[0]))
        return protocol.ModelList(
            data=[
                protocol.ModelCard(id=name, root=root, max_model_len=state.max_model_len)
                for name in state.served_model_names
            ]
        )

    async def respond(result) -> Response:
        if result is None:  # the client left: nobody to answer
            return Response(status_code=499)
        if isinstance(result, EventStream):
            return _EventStreamResponse(result)
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        return await respond(await state.completion.create_completion(body, _disconnected(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request) -> Response:
        return await respond(await state.chat.create_chat_completion(body, _disconnected(request)))

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, told when it is ready, stopping the engine when it stops, and
    exiting 0 when a signal stops it."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        # NOTE: uvicorn's own records the signal and raises it again after shutting down,
        # so the process dies of it; a server asked to stop has done its job and exits 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            config = self.config
            logger.info(
                "ready: serving %s at http://%s:%d/v1",
                ", ".join(self.state.served_model_names),
                config.host,
                config.port,
            )

    async def shutdown(self, sockets=None) -> None:
        logger.info("stopping: aborting open requests")
        # Refuses new requests, aborts the open ones (their streams end) and joins the
        # engine thread, off the event loop so the streams can finish meanwhile.
        await asyncio.to_thread(self.state.engine.shutdown)
        await super().shutdown(sockets)


class ParentWatchdog:
    """Ends this process once process ``pid`` has ended (a supervisor or a test that died
    without stopping it): before the server runs, at once; while it runs, through its
    graceful shutdown, and hard if that has not finished ``grace_s`` seconds later."""

    def __init__(self, pid: int, *, grace_s: float = 30.0):
        self.pid, self.grace_s = pid, grace_s
        self.server: uvicorn.Server | None = None
        self._was_parent = os.getppid() == pid

    def start(self) -> None:
        threading.Thread(target=self._run, name="parent-watchdog", daemon=True).start()

    def parent_alive(self) -> bool:
        if self._was_parent and os.getppid() != self.pid:
            return False  # reparented: the parent has ended
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # it exists, owned by someone else
            return True
        return True

    def _run(self) -> None:
        while self.parent_alive():
            time.sleep(0.5)
        logger.warning("process %d has ended: shutting down", self.pid)
        if self.server is None:
            os._exit(1)
        self.server.should_exit = True
        time.sleep(self.grace_s)
        logger.error("not stopped %.0f s after process %d ended: exiting", self.grace_s, self.pid)
        os._exit(1)


def serve(
    state: ServerState,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    access_log: bool = True,
    shutdown_timeout: float = 10.0,
    watchdog: ParentWatchdog | None = None,
) -> None:
    """Runs the server until a signal (or the ``watchdog``'s process ending) stops it."""
    config = uvicorn.Config(
        build_app(state),
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout,
        lifespan="off",
    )
    server = _Server(config, state)
    if watchdog is not None:
        watchdog.server = server
    state.engine.start()
    try:
        server.run()
    finally:
        state.engine.shutdown()
