"""LLMEngine: the streaming core. One `step()` = schedule -> execute -> update.

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("r0", "Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():      # RequestOutputs that changed this step
            print(out.outputs[0].text)

The C++ scheduler owns batching and the KV blocks; Python owns the model, sampling and every stop
decision (passed back to the scheduler in `update`). n > 1: the request is prefilled once; when its
prompt's last chunk samples, n tokens are drawn (sequence i with its own generator, seeded
seed + i) and children f"{rid}#{i}" are forked sharing the prompt's blocks.

Pipeline parallelism with micro-batches (an executor with max_concurrent_batches > 1): `step()` becomes
schedule -> submit -> collect the oldest step (engine/batch_queue.py); otherwise the path above.

Faults: bad input is refused by `add_request` before anything is registered; an exception inside
`step()` fails only that step's requests (engine/step_recovery.py) and the engine stays usable.
"""

from __future__ import annotations

import random
import time
from functools import cached_property
from typing import Any, Iterable

import numpy as np
import torch

from pagellm.config import EngineArgs, EngineConfig
from pagellm.engine import maintenance
from pagellm.engine.batch_queue import BatchQueueStep
from pagellm.engine.device_check import check_device_usable
from pagellm.engine.sample_step import SampleStep
from pagellm.engine.executor import get_executor_cls
from pagellm.engine import mp_executor  # noqa: F401 (registers the "mp" executor)
from pagellm.engine import ray_executor  # noqa: F401 (registers the "ray" executor; imports Ray only when used)
from pagellm.engine.spec_step import SpecDecodeStep
from pagellm.engine.step_recovery import StepRecovery
from pagellm.engine.step_update import StepUpdate
from pagellm.engine.stats import EngineStats
from pagellm.engine.output_processor import OutputProcessor, RequestState
from pagellm.inputs import InputProcessor, PromptType
from pagellm.logger import init_logger
from pagellm.lora.engine_lora import EngineLoRA, LoRAEngineMethods
from pagellm.outputs import RequestOutput
from pagellm.sampling import Sampler
from pagellm.spec_decode import BaseProposer
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)


def _eos_ids(files, tokenizer) -> list[int]:
    gen = getattr(files, "generation_config", None) or {}
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(files, "hf_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class LLMEngine(SampleStep, SpecDecodeStep, StepRecovery, BatchQueueStep, LoRAEngineMethods,
                maintenance.MaintenanceMethods):
    def __init__(self, config: EngineConfig, *, model_files=None, log_stats: bool = True,
                 proposer: BaseProposer | None = None) -> None:
        from pagellm import _C  # noqa: PLC0415
        from pagellm.model_loader import open_model  # noqa: PLC0415

        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.device = torch.device(mc.device)
        check_device_usable(self.device)  # before anything is loaded
        files = model_files if model_files is not None else open_model(mc.model)
        self.model_files = files
        self.tokenizer = files.tokenizer
        if mc.tokenizer is not None:
            from transformers import AutoTokenizer  # noqa: PLC0415

            self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        self.generation_config: dict = dict(getattr(files, "generation_config", None) or {})
        self.eos_token_ids = _eos_ids(files, self.tokenizer)
        self.vocab_size = int(files.hf_config.vocab_size)
        self.max_model_len = sc.max_model_len
        self.max_num_seqs = sc.max_num_seqs
        self.max_logprobs = mc.max_logprobs
        self.logprobs_mode = mc.logprobs_mode

        # the workers own the device, the model, the KV cache and the runner; the engine reaches them
        # through the executor only (execute_model once per step, collective_rpc for everything else)
        self.executor = get_executor_cls(config.parallel_config.distributed_executor_backend)(config, files)
        self.num_blocks = self.executor.num_kv_blocks
        kv_infos = self.executor.collective_rpc("describe")
        kv_info = kv_infos[0]
        self.kv_cache_bytes_per_token: int = kv_info["kv_cache_bytes_per_token"]  # /metrics, capacity planning
        logger.info("KV cache: %s", kv_info["kv_cache_summary"])
        # a window > 0 (every layer slides by it) lets the block manager free blocks that left it; a hybrid cache
        # (a mixed model) adds its groups 1.., each (num_blocks, window) with its own block ids and tables
        self.scheduler = _C.Scheduler(**sc.cpp_kwargs(), **cc.cpp_kwargs(self.num_blocks),
                                      sliding_window=kv_info["kv_cache_sliding_window"],
                                      extra_groups=_common_extra_groups(kv_infos))
        self._init_batch_queue()  # pipeline micro-batches when the executor takes several steps at once
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(mc.seed))
        # plain-greedy steps take their tokens from the LM head's fused argmax (ops linear_argmax: no logits, no
        # sampler call); False: logits + the sampler's argmax, the same tokens (A/B comparisons, tests)
        self.greedy_head = True
        self.output_processor = OutputProcessor(self.tokenizer, sc.max_model_len)
        self.log_stats = log_stats
        # seq id -> torch.Generator for seeded sequences
        self._generators: dict[str, torch.Generator] = {}
        self._rng = random.Random(mc.seed)
        # adapters, their slots, and the max_loras admission limit (pagellm.lora.engine_lora); None: LoRA off
        self.lora = None if config.lora_config is None else EngineLoRA(config.lora_config, self.collective_rpc,
                                                                       random.Random(mc.seed + 1))
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._init_speculation(proposer)  # the given proposer, else config.speculative_config's (spec_step.py)
        self.sleep_level: int | None = None  # set while asleep (engine/maintenance.py)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, **kwargs: Any) -> "LLMEngine":
        """From EngineArgs (or the same keyword arguments)."""
        from pagellm.model_loader import open_model  # noqa: PLC0415

        args = engine_args if engine_args is not None else EngineArgs.from_kwargs(**kwargs)
        files = open_model(args.model)
        hf = files.hf_config
        model_max = getattr(hf, "max_position_embeddings", None)
        config = args.create_engine_config(model_max)
        return cls(config, model_files=files)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ requests
    @cached_property
    def input_processor(self) -> InputProcessor:
        """The engine's InputProcessor (pagellm.inputs): every add_request goes through it, and front ends
        (LLM, AsyncLLM, the server) use it to validate and tokenize before they submit."""
        return InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, eos_token_ids=self.eos_token_ids,
                              max_logprobs=self.max_logprobs, max_num_seqs=self.max_num_seqs,
                              logprobs_mode=self.logprobs_mode)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, lora_request=None) -> None:
        """Queue a request. The input processor checks everything before anything is registered, so on
        TypeError/ValueError the engine is unchanged and usable: a prompt of the wrong type, an empty
        prompt, token ids outside the vocabulary, prompt + max_tokens > max_model_len, invalid sampling
        parameters, or a duplicate request id. Any later failure (or an interrupt) undoes the
        registration: a request is either fully added or not at all. `lora_request` (a LoRARequest) names
        the adapter the request runs with: ValueError for an unknown one or when LoRA is off."""
        maintenance.check_awake(self, "add requests")
        request_id = str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if "#" in request_id:
            raise ValueError(f"request_id {request_id!r} must not contain '#' (reserved for n > 1 children)")
        req = self.input_processor.process(prompt, params)
        params, ids = req.params, req.prompt_token_ids
        arrival = time.time() if arrival_time is None else float(arrival_time)
        # prompt logprobs need every prompt position computed: keep such requests off the prefix
        # cache with a private hash salt
        adapter = self._resolve_lora(lora_request)
        extra_key = self._rng.getrandbits(63) + 1 if params.prompt_logprobs is not None else 0
        if adapter is not None and not extra_key:
            extra_key = adapter.extra_key  # blocks are shared only among requests of the same adapter version
        generator = None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        # ValueError on invalid; the scheduler knows max_tokens (it never schedules drafts past it)
        def hand_to_scheduler() -> None:
            self.scheduler.add_request(request_id, ids, arrival, priority, extra_key, max_tokens=params.max_tokens)

        if adapter is None:
            hand_to_scheduler()
        else:  # at most max_loras adapters in the scheduler: others wait in self.lora
            self.lora.submit(request_id, adapter.name, hand_to_scheduler)
        try:
            self.output_processor.add_request(request_id, req.prompt, ids, params, arrival)
        except BaseException:
            self.scheduler.abort(request_id)
            if self.lora is not None:
                self.lora.release(request_id)
            raise
        if generator is not None:
            self._generators[request_id] = generator
        self.num_prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            res = self.output_processor.abort(str(rid))
            if res is None:
                continue
            st, live = res
            for sid in live:
                self.scheduler.abort(sid)
            self._forget(st)

    def _forget(self, st: RequestState) -> None:
        self.output_processor.remove(st)
        if self.lora is not None:
            self.lora.release(st.request_id)
        for s in st.seqs:
            self._generators.pop(s.seq_id, None)
        if self.proposer is not None:  # e.g. a draft model's KV blocks of these sequences
            self.proposer.release([s.seq_id for s in st.seqs])

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step still in flight (its requests may all have been aborted)."""
        return bool(self.output_processor.requests) or self.num_steps_in_flight > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the target's, and a draft model's own (so that it, too, recomputes)."""
        reset_draft = getattr(self.proposer, "reset_prefix_cache", None)  # BaseProposer's; duck-typed ones may lack it
        if reset_draft is not None:
            reset_draft()
        return bool(self.scheduler.reset_prefix_cache())

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run the model on it, apply the sampled tokens; returns the RequestOutputs
        that changed this step. With a proposer, decode-ready sequences carry drafts that are verified.

        An exception inside the step (model, sampler, detokenizer, invalid drafts, ...) fails the requests
        of that step, not the engine (a proposer that raises only costs the step its drafts): each gets a final RequestOutput among the returned ones (finished,
        `error` set, unfinished completions with finish_reason "error"), their blocks are freed, the
        scheduler's pending step is closed, and the other requests go on. KeyboardInterrupt / SystemExit
        get the same cleanup, then propagate. Raises only EngineRecoveryError (the cleanup itself failed;
        the engine is unusable) or those interrupts."""
        if self._batch_queue is not None:
            return self._step_with_batch_queue()
        in_step: list[str] = []  # the sequences this step touched so far (empty: every live request)
        try:
            return self._run_step(in_step)
        except BaseException as exc:  # noqa: BLE001
            outputs = self._fail_step(exc, in_step)
            if not isinstance(exc, Exception):
                raise
            return outputs

    def _run_step(self, in_step: list[str]) -> list[RequestOutput]:
        if self.proposer is not None:
            self._propose_drafts(in_step)
        in_step.clear()  # a failure inside schedule() leaves nothing known: it fails every request
        if self.lora is not None:
            self.lora.admit_waiting()
        sched_out = self.scheduler.schedule()
        seq_ids = list(sched_out.request_ids)
        in_step.extend(seq_ids)
        if not seq_ids:
            return []
        prompt_logprob_rows = self._begin_rows(seq_ids, sched_out.num_computed_tokens)
        hidden_rows = self._hidden_state_rows(sched_out)  # none unless the proposer reads hidden states
        extra = {"hidden_state_rows": hidden_rows} if hidden_rows else {}
        draft_parents = self._draft_parents(sched_out, seq_ids) if self.proposer is not None else None
        if draft_parents is not None:  # some spec row carries a candidate tree (spec_step.py)
            extra["draft_parents"] = draft_parents
            if self._tree_pad_tokens:  # clamped trees: replayed in the full trees' shape
                extra["tree_pad_tokens"] = self._tree_pad_tokens
        lora_slots = None if self.lora is None else self.lora.row_slots(seq_ids)
        if lora_slots is not None:
            extra["lora_slots"] = lora_slots
        sampling_rows = np.flatnonzero(sched_out.do_sample)
        # every sampling row plain greedy: the LM head's fused argmax gives the tokens, and a spec row's verify needs
        # only its rows' argmax (spec_step.verify_from_argmax), so no [rows, V] logits (session 18)
        if self.greedy_head and not prompt_logprob_rows and self._all_plain_greedy(seq_ids, sampling_rows):
            extra["greedy_token_ids"] = True
        result = self.executor.execute_model(sched_out, prompt_logprob_rows, **extra)
        if self.proposer is not None and not self._over_batch_limit:
            self.proposer.warm_caches()
        if self.spec_switch is not None and result.graph_warmup:  # a one-time cost, no sample of a step's
            self.spec_switch.discard_step()
        self._record_prompt_logprobs(sched_out, seq_ids, prompt_logprob_rows, result.prompt_logits)
        if len(sched_out.draft_token_ids):
            update = self._sample_and_verify(sched_out, seq_ids, result.logits, target_ids=result.sampled_token_ids)
        else:
            targets, rows, logit_rows = self._build_sampling_rows(seq_ids, sampling_rows)
            if rows is None and result.sampled_token_ids is not None:  # the LM head's fused argmax
                token_ids, logprob_lists = result.sampled_token_ids.tolist(), None
            else:
                token_ids, logprob_lists = self._sample(result.logits, rows, logit_rows)
            update = self._apply_sampled_tokens(targets, token_ids, logprob_lists)
        self._observe_hidden_states(sched_out, seq_ids, hidden_rows, result.hidden_states, update)
        self._report_to_scheduler(sched_out, seq_ids, update)
        return self._collect_outputs(update.changed)

    def _all_plain_greedy(self, seq_ids: list[str], sampling_rows: np.ndarray) -> bool:
        """Every sampling row's request is plain greedy (RequestState.plain_greedy): its token is the logits' argmax."""
        seq_of = self.output_processor.seq
        return all(seq_of(seq_ids[r])[0].plain_greedy for r in sampling_rows.tolist())

    def _begin_rows(self, seq_ids: list[str], num_computed: np.ndarray) -> list[int]:
        """Stamp first-scheduled metrics; returns the rows whose request still misses prompt logprobs."""
        now = time.time()
        prompt_logprob_rows: list[int] = []
        for r, sid in enumerate(seq_ids):
            st, seq = self.output_processor.seq(sid)
            if st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = now
                st.num_cached_tokens = int(num_computed[r])
            if st.prompt_logprobs is not None and len(st.prompt_logprobs) < len(st.prompt_token_ids) and seq.index == 0:
                prompt_logprob_rows.append(r)
        return prompt_logprob_rows

    def _report_to_scheduler(self, sched_out, seq_ids: list[str], update: StepUpdate) -> None:
        """Fork the new children, then hand the scheduler one new token per row that sampled; children's
        first tokens follow the batch's rows, in fork order."""
        for parent_id, child_id, _ in update.forks:
            self.scheduler.fork(parent_id, child_id)
        sampled = update.token_by_seq
        if update.tokens_by_seq:  # spec rows: the kept run of tokens, 1..1+k of them
            runs = {**{sid: [tok] for sid, tok in sampled.items()}, **update.tokens_by_seq}
            num_new = [len(runs.get(sid, ())) for sid in seq_ids] + [1] * len(update.forks)
            new_ids = [tok for sid in seq_ids for tok in runs.get(sid, ())] + [tok for _, _, tok in update.forks]
        else:
            num_new = [1 if sid in sampled else 0 for sid in seq_ids] + [1] * len(update.forks)
            new_ids = [sampled[sid] for sid in seq_ids if sid in sampled] + [tok for _, _, tok in update.forks]
        self.scheduler.update(sched_out, np.asarray(num_new, dtype=np.int32), np.asarray(new_ids, dtype=np.int64),
                              update.finished)

    def _collect_outputs(self, changed: dict[str, RequestState]) -> list[RequestOutput]:
        # all built before any request is forgotten; a FINAL_ONLY request's only when it finished
        outputs = [st.make_output() for st in changed.values() if st.finished or not st.final_only]
        for st in changed.values():
            if st.finished:
                self._forget(st)
        return outputs

    # ------------------------------------------------------------------ workers
    def shutdown(self) -> None:
        """Release the workers (an out-of-process executor stops and reaps its processes). Idempotent."""
        self.executor.shutdown()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run a Worker method (by name) or `fn(worker, *args, **kwargs)` on every worker; results in rank
        order. Call between steps (an RL trainer's weight update, a kernel swap, a memory probe)."""
        return self.executor.collective_rpc(method, args, kwargs)

    @property
    def _driver_worker(self):
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError(f"{type(self.executor).__name__} keeps its workers out of process; use collective_rpc")
        return worker

    # In-process introspection (tests, notebooks): the driver worker's objects.
    model = property(lambda self: self._driver_worker.model)
    runner = property(lambda self: self._driver_worker.runner)
    kv_caches = property(lambda self: self._driver_worker.kv_caches)
    kv_cache_config = property(lambda self: self._driver_worker.kv_cache_config)
    attn_backend = property(lambda self: self._driver_worker.attn_backend)
    dtype = property(lambda self: self._driver_worker.dtype)

    # ------------------------------------------------------------------ stats
    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks

    def get_stats(self) -> EngineStats:
        """Load figures from the C++ scheduler and block manager (call between steps)."""
        s = self.scheduler
        usable_blocks = s.num_blocks - s.num_reserved_blocks  # a window's null block is never a request's
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.usage,
            num_free_blocks=s.num_free_blocks, num_total_blocks=usable_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_steps=s.num_steps, timestamp=time.time(), spec_decode=EngineStats.spec_snapshot(self),
            kv_cache_bytes_per_token=self.kv_cache_bytes_per_token,
        )  # fmt: skip


def _common_extra_groups(kv_infos: list[dict]) -> list[tuple[int, int]]:
    """A hybrid cache's groups 1.. (num_blocks, window) that every rank holds: the fewest blocks per group (the
    ranks size alike, but like `num_kv_blocks` the scheduler's count must fit each)."""
    per_rank = [info["kv_cache_extra_groups"] for info in kv_infos]
    return [(min(groups[g][0] for groups in per_rank), window) for g, (_, window) in enumerate(per_rank[0])]

