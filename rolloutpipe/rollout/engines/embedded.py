"""The embedded CPU engine: a small continuous-batching scheduler over an unmodified HF causal LM.

- **Request-level continuous batching.** At most ``concurrency`` requests are in the running batch. Waiting
  requests are admitted by (``priority`` ascending, submission order) whenever a slot is free, at any decode step;
  a finished request leaves at once. No request ever waits for a batch-mate to finish.
- **One KV cache, one row per request, left padded.** Each request's keys/values occupy the rightmost
  ``num_cached_tokens`` columns of its row; the columns to their left are padding, hidden by the attention mask.
  Every request gets its own position ids (0, 1, 2, ... over its own tokens), so padding never shifts RoPE.
  Joiners are prefilled together (left padded) and their rows concatenated onto the batch; rows of finished
  requests are dropped and leading all-padding columns trimmed. Padded keys get exactly zero attention weight.
- **Batch invariant** (rollout.batch_invariant): a request's logits, tokens and log-probs are the same bits alone,
  among any batch-mates and in any row, in every dtype: attention per row over its own keys, every linear layer in
  calls of ``LINEAR_ROWS`` rows (row_attention.py: what differed, what it costs). Off: one padded call per layer, to
  rounding.
- **SGLang's seeded sampler** (sampler.py): Gumbel-max with noise hashed from the request's ``sampling_seed``, the
  token's position and the token id, so a request's tokens do not depend on its batch-mates and equal an SGLang
  server's from the same logits. ``output_logprobs``: log softmax(logits / temperature) of the sampled token.
- **Drafts** (rollout.speculative): a request's ``draft_ids`` are prefilled with its prompt, attending as decode steps,
  and kept as far as this engine's own samples reproduce them (verify.py): a draft saves decode steps, changes no bit.
- **Stops like SGLang.** A request ends on its ``stop_token_ids`` or on one of the model's own EOS ids (its
  config's and its generation config's ``eos_token_id``, as SGLang's ``ModelConfig.hf_eos_token_id``), unless it
  asks ``ignore_eos``; ``submit`` refuses a prompt plus ``max_new_tokens`` beyond the model's context
  (``max_position_embeddings``) with SGLang's words.
- **Fixed weights per step.** ``update_weights_from_disk`` is refused while any request is in flight, so every
  token of a result comes from the ``policy_version`` it reports.
- **Failure is loud.** If the scheduler thread raises (including from ``on_result``), the exception is kept in
  ``engine.error`` and logged; no further results are delivered and the public calls raise ``RuntimeError("engine
  <name> crashed: ...")``. The rollout node then retries its requests elsewhere and replaces it (supervisor.py).

Everything that depends on the transformers version (cache class, forward keyword, where a cache keeps its
tensors) lives in the three ``_hf_*`` functions below.
"""

from __future__ import annotations

import heapq
import inspect
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from rolloutpipe.rollout.engines import row_attention
from rolloutpipe.rollout.engines.base import OnResult
from rolloutpipe.rollout.engines.verify import drop_last_columns, pad_left, sample_draft_positions
from rolloutpipe.types import FinishReason, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [batch, num_kv_heads, num_columns, head_dim]."""


# --- transformers adapter: the only code that knows how the installed version passes a KV cache --------------


def _hf_cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name is deprecated)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _hf_cache(model: torch.nn.Module, kv: KV | None):
    """A DynamicCache holding ``kv`` (empty when None); the forward appends the new columns to it in place."""
    from transformers import DynamicCache

    if kv is None:
        return DynamicCache(config=model.config)
    return DynamicCache(ddp_cache_data=kv, config=model.config)


def _hf_cache_tensors(cache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


# --- request state ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _RequestState:
    request: GenerationRequest
    seq: int
    """Submission order, breaks priority ties."""
    policy_version: int
    submitted_s: float
    started_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    stop_ids: frozenset[int]
    """The request's ``stop_token_ids`` and the model's EOS ids (none with ``ignore_eos``)."""
    num_cached_tokens: int = 0
    """Tokens of this request whose keys/values are in the cache; also the position id of the next token fed."""
    num_draft_kept: int = 0

    def __lt__(self, other: _RequestState) -> bool:
        return (self.request.priority, self.seq) < (other.request.priority, other.seq)

    def finish_reason_after_last_token(self) -> FinishReason | None:
        if self.output_ids[-1] in self.stop_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= self.request.max_new_tokens:
            return FinishReason.LENGTH
        return None


class EmbeddedEngine:
    """A continuous-batching engine over an HF causal LM on CPU, run by one daemon scheduler thread.

    ``submit`` and ``abort`` may be called from any thread, including from ``on_result``. ``on_result`` is called
    from the scheduler thread, exactly once per request, and never while an engine lock is held.
    """

    def __init__(
        self,
        *,
        name: str,
        model: torch.nn.Module,
        concurrency: int,
        on_result: OnResult,
        policy_version: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} for engine {name!r}: it must be at least 1.")
        self.name = name
        self.concurrency = concurrency
        self.error: BaseException | None = None
        """The exception that stopped the scheduler thread; None while the engine is healthy."""
        self.request_error: BaseException | None = None
        """Always None: ``submit`` raises on a bad request here (the HTTP client keeps a server's refusal)."""
        self.eos_token_ids = model_eos_token_ids(model)
        """The model's own EOS ids: every request stops on them too (module docstring)."""
        self.context_len: int = model.config.max_position_embeddings
        self._model = model
        self._cache_kwarg = _hf_cache_kwarg(model)
        self._on_result = on_result
        self._policy_version = policy_version
        self._batch_invariant = batch_invariant
        if batch_invariant:
            row_attention.use_row_attention(model)

        # Shared between callers and the scheduler thread, guarded by _lock.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: list[_RequestState] = []  # heap by (priority, seq)
        self._in_flight_ids: set[str] = set()
        self._abort_ids: set[str] = set()
        self._num_submitted = 0
        self._stopping = False

        # Owned by the scheduler thread.
        self._running: list[_RequestState] = []  # row r of the cache is _running[r]
        self._cache = None  # DynamicCache with one row per running request, or None when nothing runs

        self._thread = threading.Thread(target=self._scheduler_loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # --- public API (any thread) -------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def submit(self, request: GenerationRequest, *, ignore_eos: bool = False) -> None:
        """Queue ``request``; with ``ignore_eos`` (SGLang's sampling param) it runs to ``max_new_tokens``."""
        request.check(self.context_len)
        with self._lock:
            self._raise_if_unusable()
            if request.request_id in self._in_flight_ids:
                raise ValueError(f"request {request.request_id} is already in flight on engine {self.name}.")
            state = _RequestState(
                request=request,
                seq=self._num_submitted,
                policy_version=self._policy_version,
                submitted_s=time.time(),
                stop_ids=frozenset() if ignore_eos else frozenset(request.stop_token_ids) | self.eos_token_ids,
            )
            self._num_submitted += 1
            self._in_flight_ids.add(request.request_id)
            heapq.heappush(self._waiting, state)
            self._wakeup.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._in_flight_ids:
                self._abort_ids.add(request_id)
                self._wakeup.notify()

    def update_weights_from_disk(self, path: str, policy_version: int) -> None:
        """Load HF-named safetensors weights; only between steps. Submits wait until the load is done."""
        from safetensors.torch import load_file

        state = load_file(path)
        _add_tied_copies(self._model, state)
        self.load_weights(state, policy_version, complete=True)

    def load_weights(self, state: dict[str, torch.Tensor], policy_version: int | None, *, complete: bool) -> None:
        """Load HF-named tensors: every parameter (``complete``) or some (one bucket of a broadcast, whose last
        bucket gives the version); only between steps. ``policy_version`` None leaves the served version as is."""
        with self._between_steps():
            _, unexpected = self._model.load_state_dict(state, strict=complete)
            if unexpected:
                raise ValueError(f"engine {self.name}: the model has no parameters {unexpected}")
            if policy_version is not None:
                self._policy_version = policy_version

    @contextmanager
    def weights_in_place(self, policy_version: int) -> Iterator[dict[str, torch.Tensor]]:
        """The model's state dict (HF names; a tied parameter under each of its names), to be overwritten in place
        (the rollout node fills every embedded engine in one read of a weights file: control/weights/disk.py
        ``copy_checked``); only between steps. Serves ``policy_version`` once the block ends without an error."""
        with self._between_steps():
            yield self._model.state_dict()
            self._policy_version = policy_version

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The engine's lock, with no request in flight: weights change only between steps."""
        with self._lock:
            self._raise_if_unusable()
            if self._in_flight_ids:
                raise RuntimeError(
                    f"engine {self.name}: weights loaded with {len(self._in_flight_ids)} requests in flight; "
                    "weights may change only when no request is in flight (between steps)."
                )
            yield

    def num_in_flight(self) -> int:
        with self._lock:
            self._raise_if_unusable()
            return len(self._in_flight_ids)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()

    def _raise_if_unusable(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"engine {self.name} crashed: {self.error!r}") from self.error
        if self._stopping:
            raise RuntimeError(f"engine {self.name} is shut down.")

    # --- scheduler thread ----------------------------------------------------------------------------------------

    def _scheduler_loop(self) -> None:
        """The engine's only thread: admits, prefills, decodes and hands back results.

        Consumes: the waiting heap and abort ids (filled by ``submit`` / ``abort``), the stop flag (``shutdown``).
        Produces: one ``GenerationResult`` per request, passed to ``on_result`` from this thread.
        Waits for: ``_wakeup`` while nothing runs and nothing can be admitted or aborted.
        Unblocked by: ``submit``, ``abort`` of an in-flight id, ``shutdown``.
        Each iteration: abort what was asked -> admit waiting requests into free slots and prefill them (each
        samples its first token) -> one decode step for the whole running batch (one token per request) -> finished
        requests leave the batch and are handed back.
        Shutdown, healthy: ``shutdown`` sets the stop flag; the loop aborts every waiting and running request,
        reports each with FinishReason.ABORT and returns. On a crash: the exception is stored in ``self.error`` and
        logged, nothing more is reported, and the public calls raise RuntimeError from then on.
        """
        try:
            with torch.inference_mode():
                while True:
                    joiners, aborted, abort_running_ids, stopping = self._take_work()
                    if stopping:
                        self._hand_back(self._abort_all())
                        return
                    self._hand_back(aborted + self._abort_running(abort_running_ids))
                    if joiners:
                        self._hand_back(self._prefill(joiners))
                    if self._running:
                        self._hand_back(self._decode_step())
        except BaseException as err:  # noqa: BLE001 - kept and re-raised to every caller, never swallowed
            log.exception("engine %s crashed", self.name)
            with self._lock:
                self.error = err

    def _take_work(self) -> tuple[list[_RequestState], list[GenerationResult], set[str], bool]:
        """Blocks until there is something to do.

        Returns (joiners, results of aborted waiting requests, ids of running requests to abort, stop flag).
        Every id in ``_abort_ids`` is in flight, hence waiting or running here: ``abort`` adds only in-flight ids
        and ``_hand_back`` removes an id before its result goes out.
        """
        with self._lock:
            while not (self._stopping or self._running or self._abort_ids or self._waiting):
                self._wakeup.wait()
            if self._stopping:
                return [], [], set(), True
            abort_ids, self._abort_ids = self._abort_ids, set()
            aborted = []
            if abort_ids:
                now = time.time()
                kept = []
                for state in self._waiting:
                    if state.request.request_id in abort_ids:
                        state.started_s = now  # never started: started_s == finished_s
                        aborted.append(self._result(state, FinishReason.ABORT))
                    else:
                        kept.append(state)
                heapq.heapify(kept)
                self._waiting = kept
            num_free = self.concurrency - len(self._running)
            joiners = [heapq.heappop(self._waiting) for _ in range(min(num_free, len(self._waiting)))]
            return joiners, aborted, abort_ids, False

    def _abort_running(self, ids: set[str]) -> list[GenerationResult]:
        if not ids:
            return []
        results = [self._result(s, FinishReason.ABORT) for s in self._running if s.request.request_id in ids]
        self._keep_rows([r for r, s in enumerate(self._running) if s.request.request_id not in ids])
        return results

    def _abort_all(self) -> list[GenerationResult]:
        with self._lock:
            waiting, self._waiting = sorted(self._waiting), []
        now = time.time()
        for state in waiting:
            state.started_s = now
        results = [self._result(s, FinishReason.ABORT) for s in self._running + waiting]
        self._keep_rows([])
        return results

    def _prefill(self, joiners: list[_RequestState]) -> list[GenerationResult]:
        """Runs the joiners' prompts and drafts (left padded), samples their first tokens (and verifies their drafts:
        verify.py), and appends their rows."""
        now = time.time()
        fed = [s.request.input_ids + s.request.draft_ids for s in joiners]
        lengths = [len(f) for f in fed]
        width = max(lengths)
        keep = max(len(s.request.draft_ids) for s in joiners) + 1
        # Padding columns hold id 0; any valid id would do, as the mask hides them from every real token.
        input_ids = torch.tensor([[0] * (width - len(f)) + f for f in fed], dtype=torch.long)
        attention_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], dtype=torch.long)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = _hf_cache(self._model, None)
        if self._batch_invariant:  # (a draft's positions as decode computes them: verify.py)
            logits = self._forward(input_ids, None, position_ids, cache, keep, row_key_lengths=lengths,
                                   row_decode_queries=[len(s.request.draft_ids) for s in joiners])
        else:
            logits = self._forward(input_ids, attention_mask, position_ids, cache, keep)
        for state, n in zip(joiners, lengths):
            state.started_s = now
            state.num_cached_tokens = n
        self._merge_rows(joiners, _hf_cache_tensors(cache))
        return self._sample_and_retire(logits, first_row=len(self._running) - len(joiners),
                                       drafts=[s.request.draft_ids for s in joiners])

    def _decode_step(self) -> list[GenerationResult]:
        """Feeds every running request its last sampled token and samples the next one."""
        cached = torch.tensor([s.num_cached_tokens for s in self._running], dtype=torch.long)
        input_ids = torch.tensor([[s.output_ids[-1]] for s in self._running], dtype=torch.long)
        if self._batch_invariant:
            logits = self._decode_rows(input_ids, cached)
        else:
            num_columns = self._cache.get_seq_length()
            attention_mask = (torch.arange(num_columns + 1) >= (num_columns - cached)[:, None]).long()
            logits = self._forward(input_ids, attention_mask, cached[:, None], self._cache)
        for state in self._running:
            state.num_cached_tokens += 1
        return self._sample_and_retire(logits, first_row=0)

    def _decode_rows(self, input_ids: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """The batch-invariant decode step: per-row attention (row_attention.py)."""
        return self._forward(input_ids, None, cached[:, None], self._cache, row_key_lengths=(cached + 1).tolist())

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep: int = 1, **attention_kwargs
                 ) -> torch.Tensor:
        """Logits of the last ``logits_to_keep`` positions [B, K, V]; appends the new keys/values to ``cache``."""
        with row_attention.row_blocks() if self._batch_invariant else nullcontext():
            out = self._model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_kwarg: cache},
                              **attention_kwargs)
        return out.logits

    def _sample_and_retire(self, logits: torch.Tensor, first_row: int, drafts: list[list[int]] | None = None
                           ) -> list[GenerationResult]:
        """Samples rows first_row.. (logits row i is batch row first_row + i): one token, or a draft's (verify.py)."""
        states = self._running[first_row:]
        drafts = drafts or [[]] * len(states)
        # SGLang's position of a sampled token: that of the last token fed (the prompt's last, then each output's).
        samples = sample_draft_positions(logits, [s.request for s in states], drafts,
                                         [len(s.output_ids) for s in states])
        results, keep, cuts = [], list(range(first_row)), [0] * len(self._running)
        for row, (state, draft, sampled) in enumerate(zip(states, drafts, samples), first_row):
            kept = 0  # leading draft tokens this row's own samples reproduce
            for j, (token, logprob) in enumerate(sampled):
                state.output_ids.append(token)
                state.output_logprobs.append(logprob)
                reason = state.finish_reason_after_last_token()
                agreed = j < len(draft) and token == draft[j]
                kept += agreed
                if reason is not None or not agreed:
                    break
            state.num_draft_kept += kept
            if reason is None:
                keep.append(row)
                cuts[row] = len(draft) - kept  # fed, but not what the policy sampled
                state.num_cached_tokens -= cuts[row]
            else:
                results.append(self._result(state, reason))
        if any(cuts):
            self._cache = _hf_cache(self._model, drop_last_columns(_hf_cache_tensors(self._cache), cuts))
        if len(keep) < len(self._running):
            self._keep_rows(keep)
        return results

    # --- batch cache surgery -------------------------------------------------------------------------------------

    def _merge_rows(self, joiners: list[_RequestState], joiner_kv: KV) -> None:
        """Appends the joiners' rows below the running ones, left padding whichever side is narrower."""
        if self._cache is None:
            kv = joiner_kv
        else:
            running_kv = _hf_cache_tensors(self._cache)
            width = max(running_kv[0][0].shape[2], joiner_kv[0][0].shape[2])
            kv = [
                tuple(torch.cat([pad_left(a, width), pad_left(b, width)]) for a, b in zip(layer, joiner_layer))
                for layer, joiner_layer in zip(running_kv, joiner_kv)
            ]
        self._running = self._running + joiners
        self._cache = _hf_cache(self._model, kv)

    def _keep_rows(self, rows: list[int]) -> None:
        """Drops every other row, then the leading columns that are padding in every remaining row."""
        self._running = [self._running[r] for r in rows]
        if not self._running:
            self._cache = None
            return
        index = torch.tensor(rows, dtype=torch.long)
        width = max(s.num_cached_tokens for s in self._running)
        kv = [
            (k.index_select(0, index)[:, :, -width:], v.index_select(0, index)[:, :, -width:])
            for k, v in _hf_cache_tensors(self._cache)
        ]
        self._cache = _hf_cache(self._model, kv)

    # --- results -------------------------------------------------------------------------------------------------

    def _result(self, state: _RequestState, reason: FinishReason) -> GenerationResult:
        return GenerationResult(
            request_id=state.request.request_id,
            output_ids=state.output_ids,
            output_logprobs=state.output_logprobs,
            finish_reason=reason,
            policy_version=state.policy_version,
            submitted_s=state.submitted_s,
            started_s=state.started_s,
            finished_s=time.time(),
            engine=self.name,
            num_draft_kept=state.num_draft_kept,
        )

    def _hand_back(self, results: list[GenerationResult]) -> None:
        # A request leaves the in-flight set before its callback, so a caller woken by the last result may
        # update weights at once.
        for result in results:
            with self._lock:
                self._in_flight_ids.discard(result.request_id)
                self._abort_ids.discard(result.request_id)
            self._on_result(result)


def _add_tied_copies(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """save_pretrained omits tied copies (``lm_head.weight`` when embeddings are tied); strict loading wants them."""
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    for names in names_by_param.values():
        present = [n for n in names if n in state]
        for name in names:
            if present and name not in state:
                state[name] = state[present[0]]


def model_eos_token_ids(model: torch.nn.Module) -> frozenset[int]:
    """``eos_token_id`` (an int or a list) of the model's config and of its generation config, united: what SGLang
    0.5.23 stops on besides a request's stop_token_ids (``ModelConfig._get_hf_eos_token_id``)."""
    eos = [getattr(c, "eos_token_id", None) for c in (model.config, getattr(model, "generation_config", None))]
    return frozenset(i for e in eos if e is not None for i in ([e] if isinstance(e, int) else e))
