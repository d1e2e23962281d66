"""One thread owns the engine; the server's requests reach it through a command queue.

The ``Engine`` is not thread-safe, so ``AsyncEngine`` gives it a thread of its own that
alone calls ``add_request``, ``abort_request`` and ``step``. The event loop (the HTTP
handlers) puts commands on a queue; the thread drains the queue before every step, so a
request that arrives while others run joins the running batch at the next step::

    handler ── add / abort ──> commands (queue.SimpleQueue) ──> engine thread
                                                               drain, then engine.step()
    handler <── RequestDelta ── RequestStream (asyncio.Queue) <──┘ (call_soon_threadsafe)

While no request is unfinished the thread blocks on the queue; otherwise it steps as fast
as the engine goes. ``engine.step()`` returns each advanced request's outputs cumulative
so far; the thread turns them into deltas (the new text, token ids and log-probabilities
of each completion since the last delivery), so a handler's work per step is in the new
tokens only, and records the request's metrics (TTFT, inter-token latency, TPOT, end to
end) as the tokens come out of the step.

Admission is bounded: the server holds at most ``num_slots + max_waiting`` sequences (a
request of ``n`` completions counts ``n``); past that ``add_request`` raises
``EngineOverloadedError`` (the route answers 503) instead of queueing without end. A
request the engine refuses (too long, bad ids: ``ValueError`` from ``add_request``) comes
back to its handler as that ``ValueError`` (400). An exception from ``step`` ends the
thread: every open request fails with ``EngineDeadError`` and ``/health`` reports 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

from flax_models.serving.server.metrics import Metrics

__all__ = [
    "AsyncEngine",
    "ChoiceDelta",
    "EngineDeadError",
    "EngineOverloadedError",
    "RequestDelta",
    "RequestStream",
]

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (an error, or the server is shutting down)."""


class EngineOverloadedError(RuntimeError):
    """The server holds as many sequences as it admits; retry later."""


@dataclasses.dataclass
class ChoiceDelta:
    """What one completion (``index`` among the request's ``n``) gained in a step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestDelta:
    """A request's progress in one step: the completions that advanced or ended."""

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool


class RequestStream:
    """The deltas of one API request's engine requests (one per prompt), in order, on the
    event loop's side: ``async for delta in stream`` ends once every one of them has
    delivered its ``finished`` delta; a failure of the engine is raised."""

    def __init__(self, name: str):
        self.name = name
        self._open: set[str] = set()  # engine requests not finished yet
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self._open

    def expect(self, request_id: str) -> None:
        self._open.add(request_id)

    def forget(self, request_id: str) -> None:
        self._open.discard(request_id)

    def put(self, item: RequestDelta | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return item


@dataclasses.dataclass
class _Record:
    """The engine thread's bookkeeping of one request."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    arrival: float  # time.monotonic() when the server got it
    n: int
    sent_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    sent_chars: dict[int, int] = dataclasses.field(default_factory=dict)
    done: set[int] = dataclasses.field(default_factory=set)  # finished completions
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0  # tokens over all completions
    longest: int = 0  # tokens of its longest completion

    def post(self, item: RequestDelta | BaseException) -> None:
        # RuntimeError: the event loop has closed, nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.stream.put, item)


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    record: _Record
    accepted: concurrent.futures.Future


@dataclasses.dataclass
class _Abort:
    request_id: str | None  # None: every request


class _Stop:
    pass


class AsyncEngine:
    """The engine behind a command queue and a thread of its own (module docstring).

    Args:
      engine: the ``Engine`` (only this object's thread touches it once ``start`` ran).
      metrics: where requests and engine state are recorded.
      max_waiting: sequences admitted beyond the engine's slots (>= 0).
    """

    def __init__(self, engine, *, metrics: Metrics, max_waiting: int):
        if max_waiting < 0:
            raise ValueError(f"{max_waiting=} must be >= 0")
        self.engine = engine
        self.metrics = metrics
        self.num_slots = int(engine.builder.num_slots)
        self.capacity = self.num_slots + max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._records: dict[str, _Record] = {}  # the engine thread's only
        self._admitted = 0  # sequences held; guarded by _lock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._update_gauges()

    # ------------------------------------------------------------------ any thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params,
        *,
        arrival: float,
        stream: RequestStream,
    ) -> None:
        """Hands a request to the engine thread and waits until the engine took it; its
        deltas go to ``stream``. ``ValueError`` if the engine refused it,
        ``EngineOverloadedError`` when the server is full, ``EngineDeadError`` when the
        engine has stopped."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        n = int(params.n)
        with self._lock:
            if self._admitted + n > self.capacity:
                raise EngineOverloadedError(
                    f"the server holds {self._admitted} sequences and admits at most "
                    f"{self.capacity} ({self.num_slots} slots + the waiting queue); retry later"
                )
            self._admitted += n
        record = _Record(stream, asyncio.get_running_loop(), arrival, n)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        stream.expect(request_id)
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, record, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # taken after all, or about to be: give it back
            raise
        except BaseException:
            stream.forget(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Aborts a request (its slot and pages are freed at the next drain); unknown or
        finished ids are ignored."""
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        self._commands.put(_Abort(None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts every request and stops the thread (waits up to ``timeout`` seconds for
        the step in flight)."""
        self._stopping = True
        self._commands.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        logger.info(
            "engine loop started (%d slots, admits %d sequences)", self.num_slots, self.capacity
        )
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self.metrics.steps.inc()
                    self._deliver(outputs, time.monotonic())
                self._update_gauges()
        except BaseException as error:  # noqa: BLE001 (every failure ends the loop)
            logger.exception("the engine loop failed; every open request fails with it")
            self.error = error
            dead = EngineDeadError(f"the engine failed: {error!r}")
            for record in self._records.values():
                record.post(dead)
            self._records.clear()
        finally:
            self._stopping = True
            self._fail_pending()
            for request_id in list(self._records):
                self._abort(request_id)
            self._update_gauges()
            logger.info("engine loop stopped")

    def _drain(self, *, block: bool) -> bool:
        """Applies the queued commands (waiting for one when ``block``); False on stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif command.request_id is None:
                for request_id in list(self._records):
                    self._abort(request_id)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _release(self, n: int) -> None:
        with self._lock:
            self._admitted -= n

    def _add(self, command: _Add) -> None:
        record = command.record
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except Exception as error:  # noqa: BLE001 (ValueError: a bad request; others too)
            self._release(record.n)
            command.accepted.set_exception(error)
            return
        self._records[command.request_id] = record
        self.metrics.observe_arrival(
            prompt_tokens=len(command.prompt_token_ids),
            n=record.n,
            max_tokens=int(command.params.max_tokens),
        )
        command.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        record = self._records.pop(request_id, None)
        if record is None:
            return
        self.engine.abort_request(request_id)
        left = [i for i in range(record.n) if i not in record.done]
        record.post(
            RequestDelta(
                request_id,
                [ChoiceDelta(i, "", [], None, finish_reason="abort") for i in left],
                finished=True,
            )
        )
        self._finish(record, "abort", time.monotonic())

    def _fail_pending(self) -> None:
        """Refuses the adds still queued when the loop ends."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._release(command.record.n)
                command.accepted.set_exception(EngineDeadError("the server is shutting down"))

    def _deliver(self, outputs, now: float) -> None:
        for output in outputs:
            record = self._records.get(output.request_id)
            if record is None:  # aborted in the meantime
                continue
            choices, new_tokens = [], 0
            for completion in output.outputs:
                i = completion.index
                if i in record.done:
                    continue
                t0, c0 = record.sent_tokens.get(i, 0), record.sent_chars.get(i, 0)
                ids = list(completion.token_ids[t0:])
                text = completion.text[c0:]
                if not ids and not text and completion.finish_reason is None:
                    continue
                logprobs = completion.logprobs
                record.sent_tokens[i] = t0 + len(ids)
                record.sent_chars[i] = c0 + len(text)
                record.longest = max(record.longest, record.sent_tokens[i])
                new_tokens += len(ids)
                if completion.finish_reason is not None:
                    record.done.add(i)
                choices.append(
                    ChoiceDelta(
                        i,
                        text,
                        ids,
                        None if logprobs is None else list(logprobs[t0 : t0 + len(ids)]),
                        completion.finish_reason,
                        completion.stop_reason,
                    )
                )
            if new_tokens:
                if record.first_token is None:
                    record.first_token = now
                    self.metrics.ttft.observe(now - record.arrival)
                else:
                    self.metrics.inter_token.observe(now - record.last_token)
                record.last_token = now
                record.generated += new_tokens
                self.metrics.generation_tokens.inc(new_tokens)
            finished = bool(output.finished)
            if choices or finished:
                record.post(RequestDelta(output.request_id, choices, finished))
            if finished:
                del self._records[output.request_id]
                reasons = {c.finish_reason for c in output.outputs}
                if "abort" in reasons:
                    self._finish(record, "abort", now)
                else:
                    self._finish(record, "length" if reasons == {"length"} else "stop", now)

    def _finish(self, record: _Record, reason: str, now: float) -> None:
        tpot = None
        if record.first_token is not None and record.longest > 1:
            tpot = (record.last_token - record.first_token) / (record.longest - 1)
        self.metrics.observe_finish(
            reason=reason,
            e2e_s=now - record.arrival,
            generation_tokens=record.generated,
            tpot_s=tpot,
        )
        self._release(record.n)

    def _update_gauges(self) -> None:
        engine = self.engine
        free = int(engine.num_free_slots)
        sequences = sum(r.n - len(r.done) for r in self._records.values())
        self.metrics.set_engine_state(
            num_slots=self.num_slots,
            num_free_slots=free,
            waiting=max(0, sequences - (self.num_slots - free)),
            num_pages=int(engine.blocks.num_pages),
            num_free_pages=int(engine.blocks.num_free_pages),
        )
