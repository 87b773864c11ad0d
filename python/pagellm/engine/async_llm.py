"""AsyncLLM: the engine loop in a background thread, many asyncio clients in front of it.

Three stages, overlapped (continuous batching keeps the batch full while clients come and go):

    1. input processing   (caller's coroutine -> tokenizer thread): chat template / tokenization,
                          prompt-length checks. Never on the engine thread.
    2. engine core        (engine thread): drain the inbox (adds, aborts), `engine.step()`,
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

from pagellm.engine.stats import EngineStats
from pagellm.logger import init_logger
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the server should report unhealthy and be restarted."""


class QueueFullError(RuntimeError):
    """More requests are waiting than max_queue_len allows (HTTP 429)."""


class PromptTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit in max_model_len."""


@dataclass
class _Stream:
    """One request's mailbox on the event loop: the latest output, and a wake-up event."""

    request_id: str
    latest: RequestOutput | None = None
    error: BaseException | None = None
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    num_seqs: int = 1


class AsyncLLM:
    """Asynchronous front of an LLMEngine (vLLM's AsyncLLM names).

        llm = AsyncLLM(LLMEngine(...))          # or AsyncLLM.from_engine_args(model=..., ...)
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text)          # cumulative, like vLLM
        llm.shutdown()

    max_queue_len: at most this many requests may wait for a batch slot (beyond max_num_seqs
        running); further `generate` calls raise QueueFullError. None = unbounded.
    max_model_len: prompts with >= this many tokens are rejected (PromptTooLongError) before they
        reach the engine; probed from the engine when not given.
    """

    def __init__(self, engine, *, max_queue_len: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, tokenizer=None, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
        self.max_model_len = max_model_len or engine.max_model_len
        self.max_num_seqs = max_num_seqs or engine.max_num_seqs
        self.max_queue_len = max_queue_len
        self._idle_poll_s = idle_poll_s

        # Inbox (any thread -> engine thread).
        self._inbox_lock = threading.Lock()
        self._pending_adds: list[tuple[str, dict, SamplingParams, float, int]] = []
        self._pending_aborts: list[str] = []
        self._wake = threading.Event()

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
        return self._dead is not None

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine loop crashed or was shut down."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._stopped.is_set() or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError("engine loop is not running")

    # ------------------------------------------------------------------ stage 1: input processing
    def _tokenize(self, prompt) -> dict:
        add_special_tokens = True
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
                return {"prompt_token_ids": ids, "prompt": prompt.get("prompt")}
            add_special_tokens = prompt.get("add_special_tokens", True)
            prompt = prompt["prompt"]
        if isinstance(prompt, (list, tuple)):
            return {"prompt_token_ids": [int(t) for t in prompt], "prompt": None}
        if self.tokenizer is None:
            return {"prompt": prompt}
        try:
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except TypeError:
            ids = self.tokenizer.encode(prompt)
        if hasattr(ids, "ids"):  # raw tokenizers.Tokenizer
            ids = ids.ids
        return {"prompt_token_ids": list(ids), "prompt": prompt}

    async def process_inputs(self, prompt) -> dict:
        """Tokenize off the event loop and off the engine thread; check the length."""
        loop = asyncio.get_running_loop()
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt or isinstance(prompt, (list, tuple)):
            processed = self._tokenize(prompt)  # nothing to do but copy
        else:
            processed = await loop.run_in_executor(self._tok_executor, self._tokenize, prompt)
        self.check_prompt_len(processed.get("prompt_token_ids"))
        return processed

    def check_prompt_len(self, token_ids, max_tokens: int | None = None) -> None:
        if token_ids is None:
            return
        if len(token_ids) == 0:
            raise ValueError("The prompt is empty")
        if self.max_model_len and len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {len(token_ids)} tokens (at least one generated token must fit).")
        vocab = self.engine.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} out of vocabulary (valid range [0, {vocab}))")

    def num_queued(self) -> int:
        """Requests in flight that cannot be running (each running seq takes one of max_num_seqs)."""
        in_flight = sum(s.num_seqs for s in self._streams.values())
        if self.max_num_seqs:
            return max(0, in_flight - int(self.max_num_seqs))
        return self.stats.num_waiting + len(self._pending_adds)

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, arrival_time: float | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its (cumulative) RequestOutputs until it finishes.

        prompt: a string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of token ids.
        Closing / cancelling the generator aborts the request in the engine.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time=arrival_time,
                                        priority=priority)
        async for out in self.iterate(stream):
            yield out

    async def submit(self, prompt, sampling_params: SamplingParams, request_id: str | None = None, *,
                     priority: int = 0, arrival_time: float | None = None
                     ) -> AsyncGenerator[RequestOutput, None]:
        """Like generate, but the request is admitted (or rejected: QueueFullError,
        PromptTooLongError, ...) before this returns; iterate the returned generator for outputs.
        The caller must iterate it to the end, close it, or call abort(request_id)."""
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time=arrival_time,
                                        priority=priority)
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

    async def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams, *,
                          arrival_time: float | None = None, priority: int = 0) -> _Stream:
        self._ensure_started()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        arrival_time = time.time() if arrival_time is None else arrival_time
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self.max_queue_len is not None and self.num_queued() >= self.max_queue_len:
            raise QueueFullError(
                f"The server is overloaded: {self.num_queued()} requests are queued (max_queue_len="
                f"{self.max_queue_len}). Retry later.")
        processed = await self.process_inputs(prompt)
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        stream = _Stream(request_id, num_seqs=max(1, int(getattr(sampling_params, "n", 1) or 1)))
        self._streams[request_id] = stream
        engine_prompt = ({"prompt_token_ids": processed["prompt_token_ids"]}
                         if "prompt_token_ids" in processed else processed["prompt"])
        if isinstance(engine_prompt, dict) and processed.get("prompt") is not None:
            engine_prompt["prompt"] = processed["prompt"]
        with self._inbox_lock:
            self._pending_adds.append((request_id, engine_prompt, sampling_params, arrival_time, priority))
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

    # stats accessors ----------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.stats

    def get_num_unfinished_requests(self) -> int:
        return len(self._streams)

    def get_tokenizer(self):
        return self.tokenizer

    async def get_free_blocks(self) -> int | None:
        return self.stats.num_free_blocks

    # ------------------------------------------------------------------ stage 2: engine thread
    def _engine_loop(self) -> None:
        engine = self.engine
        loop = self._loop
        assert loop is not None
        try:
            self.stats = engine.get_stats()
        except Exception:  # stats are best-effort
            pass
        try:
            while not self._stopped.is_set():
                with self._inbox_lock:
                    adds, self._pending_adds = self._pending_adds, []
                    aborts, self._pending_aborts = self._pending_aborts, []
                failed: list[tuple[str, BaseException]] = []
                for rid, prompt, params, arrival, prio in adds:
                    if rid in aborts:
                        continue  # cancelled before it ever reached the engine
                    try:
                        try:
                            engine.add_request(rid, prompt, params, arrival_time=arrival, priority=prio)
                        except TypeError:
                            engine.add_request(rid, prompt, params)
                    except Exception as e:  # bad request: fail that stream only
                        failed.append((rid, e))
                if aborts:
                    engine.abort_request(aborts)
                if failed:
                    loop.call_soon_threadsafe(self._fail_some, failed)
                if engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = engine.step()
                    self.step_time_total += time.perf_counter() - t0
                    self.num_steps += 1
                    try:
                        stats = engine.get_stats()
                        stats.num_steps = self.num_steps
                        self.stats = stats
                    except Exception:
                        pass
                    if outputs:
                        self.num_output_batches += 1
                        loop.call_soon_threadsafe(self._dispatch, outputs)
                else:
                    try:
                        self.stats = engine.get_stats()
                    except Exception:
                        pass
                    self._wake.wait(self._idle_poll_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - report any crash to every client
            logger.exception("engine loop crashed")
            self._dead = e
            try:
                loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {e!r}"))
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ stage 3: event loop
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.latest = out
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
        for stream in list(self._streams.values()):
            stream.error = err
            stream.event.set()
        self._streams.clear()
