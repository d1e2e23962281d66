"""The engine's request loop: waiting and running requests, and the step in flight.

It runs one step ahead: step n + 1 is planned and launched (its decode rows fed from the
device) before the host reads step n's tokens, so the host's work for a step (reading
tokens, events, planning, launching) hides behind the device's. Step n + 1 assumes every
sequence of step n goes on; one that ends there (an eos or stop token, a stop string) has
its row of step n + 1 discarded, which is harmless: its slot's states are never read
again, and its KV pages are rewritten before they are read by whoever takes them next
(steps run in launch order). Where the plan would depend on step n's tokens (a
prefix-caching state save at a block end of a row fed from the device, or an admission
with prefix caching, which must see the blocks step n publishes), step n is read first
(``Scheduler.schedule``).

Requests join at any turn (``Engine.add_request``, ``Engine.stream``) and leave when they
end or are aborted; ``Engine.step`` and ``Engine.stream`` both turn this loop.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from flax_models.serving.output_processor import OutputProcessor
from flax_models.serving.outputs import RequestOutput, TokenEvent, progress_bar
from flax_models.serving.plan import LaunchedStep
from flax_models.serving.prefix_cache import BlockHashes
from flax_models.serving.request import RequestState, SequenceState
from flax_models.serving.sampling import SEED_LIMIT, SamplingParams
from flax_models.serving.scheduler import Scheduler

__all__ = ["RequestLoop"]

logger = logging.getLogger(__name__)


class RequestLoop:
    """The requests an engine serves and the turns of its loop.

    Attributes:
      requests: the online requests not finished yet, by id.
      sequences: every live sequence (a completion being generated), by index.
      waiting, running: the sequences waiting for a slot and those holding one.
      pending: the step launched whose tokens the host has not read yet.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        launch: Callable[..., tuple],
        output_processor: OutputProcessor,
        *,
        seed: int,
    ):
        self.scheduler = scheduler
        self.blocks = scheduler.blocks
        self._launch = launch
        self.output_processor = output_processor
        # Seeds of requests that give none (``SamplingParams(seed=None)``).
        self._seeds = np.random.default_rng(seed)
        self.requests: dict[str, RequestState] = {}
        self.sequences: dict[int, SequenceState] = {}
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []
        self.pending: LaunchedStep | None = None
        self._next_index = 0
        self._advanced: dict[str, RequestState] = {}  # online requests with new outputs

    def draw_seed(self) -> int:
        return int(self._seeds.integers(SEED_LIMIT))

    def add(self, request: RequestState) -> None:
        """Queues ``request``'s sequences (made with ``new_sequence``)."""
        self.output_processor.attach(request)
        self.requests[request.request_id] = request
        if request.params.max_tokens == 0:
            # Nothing to generate: finished at once, and reported by the next step.
            for seq in request.sequences:
                request.finish_reasons[seq.output_index] = "length"
            self._advanced[request.request_id] = request
            return
        for seq in request.sequences:
            self.sequences[seq.index] = seq
            self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            self.end_sequence(seq)
        self.output_processor.abort(request)
        self._advanced.pop(request_id, None)
        self.settle()

    def serve(self, sequences: list[SequenceState], progress: bool | None) -> Iterator[TokenEvent]:
        """``stream``'s loop: steps until its sequences end, yielding their events in
        prompt order numbering; other requests served meanwhile keep their outputs for
        ``step``."""
        order = {seq.index: i for i, seq in enumerate(sequences)}
        live = {seq.index for seq in sequences if seq.params.max_new_tokens > 0}
        bar = progress_bar(sum(s.params.max_new_tokens for s in sequences), enabled=progress)
        try:
            self.waiting.extend(s for s in sequences if s.index in live)
            self.sequences.update((s.index, s) for s in sequences if s.index in live)
            while live:
                for event in self.advance():
                    if event.index in order:
                        bar.update(1)
                        if event.finish_reason is not None:
                            live.discard(event.index)
                        yield event._replace(index=order[event.index])
        finally:
            for seq in sequences:
                self.end_sequence(seq)
            self.settle()
            bar.close()

    # ------------------------------------------------------------------------ requests

    def step_requests(self) -> list[RequestOutput]:
        """``Engine.step()``: one turn, and the outputs of the requests that advanced
        since the last call (cumulative so far); finished ones are forgotten."""
        self.advance()
        outputs = [self.output_processor.output(r) for r in self._advanced.values()]
        for request in self._advanced.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
        self._advanced.clear()
        return outputs

    def new_sequence(
        self, prompt: list[int], params: SamplingParams, stop_ids: frozenset[int], seed: int
    ) -> SequenceState:
        """A sequence of ``prompt`` drawing with ``seed``, not queued yet."""
        if seed != params.seed:
            params = dataclasses.replace(params, seed=seed)
        self._next_index += 1
        hashes = BlockHashes(self.scheduler.block_size)
        return SequenceState(self._next_index, prompt, params, stop_ids, hashes)

    def end_sequence(self, seq: SequenceState) -> None:
        """Drops ``seq`` from the loop (waiting or running: its slot and pages come back);
        rows of it in the step in flight are discarded when it lands."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            seq.ended = True
            self.running.remove(seq)
            self.scheduler.release_slot(seq.slot)
        self.sequences.pop(seq.index, None)

    def settle(self) -> None:
        """With nothing left to serve, forgets the step in flight (its tokens are nobody's;
        its snapshot entries come back)."""
        if not self.waiting and not self.running and self.pending is not None:
            self.scheduler.abandon(self.pending.plan)
            self.pending = None

    def advance(self) -> list[TokenEvent]:
        """One turn of the loop, one step ahead: plans and launches the next step, then
        lands the one in flight (waiting for its tokens); its events."""
        if not self.running and self.pending is None:
            for slot in self.scheduler.free_slots:  # pages direct ``step`` calls left
                self.blocks.release(slot)
        pending = self.pending
        launched = self._launch_next(ahead=pending is not None)
        self.pending = launched
        if pending is None:
            if launched is None and self.waiting:  # nothing runs, so nothing will free
                raise RuntimeError(self.scheduler.stall_reason(self.waiting[0]))
            return []
        tokens = np.asarray(pending.tokens)  # waits for the step
        landed_at = time.perf_counter()
        if logger.isEnabledFor(logging.DEBUG):
            _log_step(pending, landed_at, waiting=len(self.waiting))
        events = list(self.scheduler.land(pending, tokens, landed_at, self.running))
        for request in self.output_processor.process(pending, events, self.sequences):
            self._advanced[request.request_id] = request
        for event in events:
            seq = self.sequences[event.index]
            if event.finish_reason is not None and seq.request is not None:
                del self.sequences[event.index]  # (``serve`` drops its own when it ends)
        return events

    def _launch_next(self, *, ahead: bool) -> LaunchedStep | None:
        """Plans and launches the next step; None when there is nothing to launch now."""
        plan = self.scheduler.schedule(self.waiting, self.running, ahead=ahead)
        if plan is None:
            return None
        logprobs = any(f.samples and f.seq.params.logprobs is not None for f in plan.scheduled)
        launched_at = time.perf_counter()
        try:
            _, tokens, logprob_arrays = self._launch(
                plan.arrays, plan.sampling, plan.restore_ids, plan.snapshots, logprobs=logprobs
            )
        except BaseException:
            self.scheduler.abandon(plan)
            raise
        self.scheduler.commit(plan)
        return LaunchedStep(plan, tokens, launched_at, logprob_arrays)


def _log_step(step: LaunchedStep, landed_at: float, *, waiting: int) -> None:
    """One debug line per step: what it ran in which bucket, and when (the host's clock:
    launched, and how long until its tokens were read)."""
    arrays = step.plan.arrays
    decode_bucket, token_bucket = arrays.bucket
    decode = arrays.num_decode_requests
    logger.debug(
        "step: %d decode rows (bucket %d) + %d prompt tokens of %d sequences (bucket %d), "
        "%d waiting; launched at %.4f s, tokens read %.1f ms later",
        decode,
        decode_bucket,
        arrays.num_tokens - decode,
        arrays.num_requests - decode,
        token_bucket,
        waiting,
        step.launched_at,
        (landed_at - step.launched_at) * 1e3,
    )
