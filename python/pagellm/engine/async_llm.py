"""AsyncLLM: the engine loop in a background thread, many asyncio clients in front of it.

Three stages, overlapped (continuous batching keeps the batch full while clients come and go):

    1. input processing   (caller's coroutine -> tokenizer thread): the engine's InputProcessor
                          tokenizes and validates; a bad request is refused here, in the caller's
                          coroutine. Never on the engine thread (which only re-checks token ids).
    2. engine core        (engine thread, async_engine_thread.py): drain the inbox (adds, aborts), `engine.step()`,
                          hand the step's outputs to the event loop with ONE
                          `loop.call_soon_threadsafe` per step, then go straight on to the next step.
    3. output processing  (event loop): fan the outputs out to per-request streams; each client's
                          coroutine builds its own response (text deltas, logprob formatting, JSON)
                          while the engine thread is already computing the next step.

The engine is not thread-safe, so only the engine thread touches it: clients post commands to an
inbox that is drained before every step. An abort (explicit, or because a client's generator was
closed or cancelled, e.g. an HTTP disconnect) is therefore applied before the next step runs, and
the request's KV blocks are free within one step.

Per-request streams hold only the latest (cumulative) RequestOutput, so a slow client never makes
memory grow: it skips intermediate snapshots and its next read sees everything generated so far.

Faults: a bad request is refused in its caller; a failure inside an engine step fails only that step's
requests (LLMEngine.step returns their final outputs with `error` set; their streams raise
EngineStepError) and the loop goes on. Only when the engine cannot go on (its step raised: recovery
failed) does the loop stop and mark this AsyncLLM dead: `errored` / `dead_error` are set, every stream
and every later call raise EngineDeadError, and `check_health()` raises it (a server's /health: 503).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncGenerator

from pagellm.engine.async_engine_thread import EngineThreadMixin
from pagellm.engine.async_engine_thread import (  # noqa: F401  (re-exported)
    EngineDeadError,
    EngineStepError,
    QueueFullError,
)
from pagellm.engine.engine_calls import EngineCallQueue
from pagellm.engine.maintenance import EngineSleepingError
from pagellm.engine.stats import EngineStats
from pagellm.inputs import InputProcessor, ProcessedRequest, PromptType
from pagellm.inputs import PromptTooLongError  # noqa: F401  (re-exported: raised by generate/submit)
from pagellm.inputs.processor import DEFAULT_MAX_LOGPROBS
from pagellm.logger import init_logger
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass
class _Stream:
    """One request's mailbox on the event loop: the latest output, and a wake-up event."""

    request_id: str
    latest: RequestOutput | None = None
    error: BaseException | None = None
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    num_seqs: int = 1


class AsyncLLM(EngineThreadMixin):
    """Asynchronous front of an LLMEngine (vLLM's AsyncLLM names).

        llm = AsyncLLM(LLMEngine(...))          # or AsyncLLM.from_engine_args(model=..., ...)
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text)          # cumulative, like vLLM
        llm.shutdown()

    max_queue_len: at most this many requests may wait for a batch slot (beyond max_num_seqs
        running); further `generate` calls raise QueueFullError. None = unbounded.
    max_model_len: prompts with >= this many tokens are rejected (PromptTooLongError) before they
        reach the engine; probed from the engine when not given.
    tokenizer: the tokenizer for text prompts (default: the engine's).
    Inputs go through `input_processor`: the engine's own, unless a tokenizer or max_model_len of
    this front's differs from the engine's, or the engine has none (a test double).
    """

    def __init__(self, engine, *, max_queue_len: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, tokenizer=None, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
        self.max_model_len = max_model_len or engine.max_model_len
        self.max_num_seqs = max_num_seqs or engine.max_num_seqs
        self.max_queue_len = max_queue_len
        self.input_processor = self._make_input_processor(engine, tokenizer)
        self._idle_poll_s = idle_poll_s

        # Inbox (any thread -> engine thread).
        self._inbox_lock = threading.Lock()
        self._pending_adds: list[tuple[str, ProcessedRequest, float, int, object]] = []  # + LoRARequest | None
        self._pending_aborts: list[str] = []
        self._wake = threading.Event()
        self._engine_calls = EngineCallQueue()  # admin calls (weights, sleep) run between steps

        # Event-loop side state (only touched on the loop thread).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._tok_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-tokenizer")

        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self.stats = EngineStats()
        self._counter = itertools.count()
        # Per-step stage timings (engine thread), for benchmarks and debugging.
        self.step_time_total = 0.0
        self.num_steps = 0
        self.num_output_batches = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(cls, model: str | None = None, *, max_queue_len: int | None = None, **engine_kwargs
                         ) -> "AsyncLLM":
        from pagellm.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(model=model, **engine_kwargs)
        return cls(engine, max_queue_len=max_queue_len, max_model_len=engine_kwargs.get("max_model_len"),
                   max_num_seqs=engine_kwargs.get("max_num_seqs"))

    # ------------------------------------------------------------------ lifecycle
    def _ensure_started(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._stopped.is_set():
            raise EngineDeadError("AsyncLLM was shut down")
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._engine_loop, name="pagellm-engine", daemon=True)
            self._thread.start()
        elif loop is not self._loop:
            raise RuntimeError("AsyncLLM is bound to the event loop it was first used from")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests get EngineDeadError) and free its resources."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        release_workers = getattr(self.engine, "shutdown", None)  # worker processes of the "mp" executor
        if callable(release_workers) and (self._thread is None or not self._thread.is_alive()):
            release_workers()
        self._tok_executor.shutdown(wait=False, cancel_futures=True)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_all, EngineDeadError("AsyncLLM shut down"))
            except RuntimeError:
                pass

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    @property
    def errored(self) -> bool:
        """True once the engine loop has died (a step it could not recover from); never cleared."""
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine loop died, as the EngineDeadError requests get; None while it is alive."""
        return None if self._dead is None else EngineDeadError(f"engine loop died: {self._dead!r}")

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine loop crashed or was shut down."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._stopped.is_set() or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError("engine loop is not running")
        workers_gone = getattr(getattr(self.engine, "executor", None), "broken_error", None)  # e.g. a dead TP rank
        if isinstance(workers_gone, BaseException):
            raise EngineDeadError(f"engine workers are gone: {workers_gone}")

    def _make_input_processor(self, engine, tokenizer) -> InputProcessor:
        own = getattr(engine, "input_processor", None)
        if own is not None and tokenizer is None and self.max_model_len == engine.max_model_len:
            return own
        return InputProcessor(self.tokenizer, engine.vocab_size, self.max_model_len,
                              eos_token_ids=getattr(engine, "eos_token_ids", ()),
                              max_logprobs=getattr(engine, "max_logprobs", DEFAULT_MAX_LOGPROBS),
                              logprobs_mode=getattr(engine, "logprobs_mode", "raw_logprobs"),
                              max_num_seqs=self.max_num_seqs)

    # ------------------------------------------------------------------ stage 1: input processing
    async def run_in_tokenizer_thread(self, fn, *args):
        """fn(*args) on the tokenizer thread: off the event loop and off the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tok_executor, fn, *args)

    async def process_inputs(self, prompt: PromptType, sampling_params: SamplingParams | None = None
                             ) -> ProcessedRequest:
        """The input processor's ProcessedRequest (token ids, completed SamplingParams); text is
        tokenized on the tokenizer thread. Raises TypeError / ValueError (PromptTooLongError)."""
        needs_tokenizer = isinstance(prompt, str) or isinstance(prompt, dict) and "prompt_token_ids" not in prompt
        if needs_tokenizer:
            return await self.run_in_tokenizer_thread(self.input_processor.process, prompt, sampling_params)
        return self.input_processor.process(prompt, sampling_params)

    def num_queued(self) -> int:
        """Requests in flight that cannot be running (each running seq takes one of max_num_seqs)."""
        in_flight = sum(s.num_seqs for s in self._streams.values())
        if self.max_num_seqs:
            return max(0, in_flight - int(self.max_num_seqs))
        return self.stats.num_waiting + len(self._pending_adds)

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt: PromptType | ProcessedRequest, sampling_params: SamplingParams | None,
                       request_id: str | None = None, *, priority: int = 0, arrival_time: float | None = None,
                       lora_request=None) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its (cumulative) RequestOutputs until it finishes.

        prompt: a string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of token ids; or a
        ProcessedRequest from `process_inputs` (then sampling_params must be None: it carries its own).
        Closing / cancelling the generator aborts the request in the engine. `lora_request`: a LoRARequest.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time=arrival_time,
                                        priority=priority, lora_request=lora_request)
        async for out in self.iterate(stream):
            yield out

    async def submit(self, prompt: PromptType | ProcessedRequest, sampling_params: SamplingParams | None,
                     request_id: str | None = None, *, priority: int = 0, arrival_time: float | None = None,
                     lora_request=None) -> AsyncGenerator[RequestOutput, None]:
        """Like generate, but the request is admitted (or rejected: QueueFullError,
        PromptTooLongError, ...) before this returns; iterate the returned generator for outputs.
        The caller must iterate it to the end, close it, or call abort(request_id)."""
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time=arrival_time,
                                        priority=priority, lora_request=lora_request)
        return self.iterate(stream)

    async def iterate(self, stream: "_Stream") -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                out = await self._next(stream)
                if out is None:
                    return
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self._abort_local(stream.request_id)

    async def add_request(self, request_id: str | None, prompt: PromptType | ProcessedRequest,
                          sampling_params: SamplingParams | None, *, arrival_time: float | None = None,
                          priority: int = 0, lora_request=None) -> _Stream:
        self._ensure_started()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        arrival_time = time.time() if arrival_time is None else arrival_time
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self.max_queue_len is not None and self.num_queued() >= self.max_queue_len:
            raise QueueFullError(
                f"The server is overloaded: {self.num_queued()} requests are queued (max_queue_len="
                f"{self.max_queue_len}). Retry later.")
        if isinstance(prompt, ProcessedRequest):
            if sampling_params is not None:
                raise TypeError("a ProcessedRequest carries its own SamplingParams; pass sampling_params=None")
            processed = prompt
        else:
            processed = await self.process_inputs(prompt, sampling_params)
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if getattr(self.engine, "sleep_level", None) is not None:
            raise EngineSleepingError("the engine is asleep (its KV cache is released); POST /wake_up first")
        stream = _Stream(request_id, num_seqs=processed.params.n)
        self._streams[request_id] = stream
        with self._inbox_lock:
            self._pending_adds.append((request_id, processed, arrival_time, priority, lora_request))
        self._wake.set()
        return stream

    async def _next(self, stream: _Stream) -> RequestOutput | None:
        while stream.latest is None and stream.error is None and not stream.finished:
            stream.event.clear()
            await stream.event.wait()
        if stream.error is not None:
            stream.finished = True
            err, stream.error = stream.error, None
            raise err
        out, stream.latest = stream.latest, None
        return out

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort request(s): removed from the engine before its next step (blocks freed)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._abort_local(rid)

    def _abort_local(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished (or never admitted): nothing to free
        stream.finished = True
        stream.event.set()
        with self._inbox_lock:
            self._pending_aborts.append(request_id)
        self._wake.set()

    # weights and memory (engine/maintenance.py), run on the engine thread between steps ------------------
    async def run_engine_call(self, fn):
        """`fn(engine)` on the engine thread between steps; returns its result or raises its exception."""
        self._ensure_started()
        fut = self._engine_calls.post(fn)
        self._wake.set()
        return await fut

    async def update_weights_from_disk(self, path: str, *, check_finite: bool = False,
                                       reset_prefix_cache: bool = True) -> dict:
        return await self.run_engine_call(lambda e: e.update_weights_from_disk(
            path, check_finite=check_finite, reset_prefix_cache=reset_prefix_cache))

    async def sleep(self, level: int = 1) -> dict:
        return await self.run_engine_call(lambda e: e.sleep(level))

    async def wake_up(self) -> None:
        await self.run_engine_call(lambda e: e.wake_up())

    def is_sleeping(self) -> bool:
        return getattr(self.engine, "sleep_level", None) is not None

    # stats accessors ----------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.stats

    def get_num_unfinished_requests(self) -> int:
        return len(self._streams)

    def get_tokenizer(self):
        return self.tokenizer

    async def get_free_blocks(self) -> int | None:
        return self.stats.num_free_blocks

    # ------------------------------------------------------------------ stage 3: event loop
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.latest = out
            if getattr(out, "error", None) is not None:
                stream.error = EngineStepError(f"request {out.request_id!r} failed: {out.error}", out)
            if out.finished:
                stream.finished = True
                del streams[out.request_id]
            stream.event.set()

    def _fail_some(self, failed: list[tuple[str, BaseException]]) -> None:
        for rid, err in failed:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.error = err
                stream.event.set()

    def _fail_all(self, err: BaseException) -> None:
        self._engine_calls.fail_pending(err)
        for stream in list(self._streams.values()):
            stream.error = err
            stream.event.set()
        self._streams.clear()
