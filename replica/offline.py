"""The non-persistent API: load a model, run a list of prompts through the engine, return the outputs.

from fastgen.replica import pipeline
pipe = pipeline("smollm2-135m", dtype="bfloat16")
outs = pipe(["Hello,"], max_new_tokens=32)
print(outs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from .builder import build_engine
from .config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig, SloConfig, parse_speculative_config
from .engine import Engine
from .outputs import TokenLogprob
from .prompts import Prompt
from .request import FinishReason, SamplingParams
from .weights import resolve_device


@dataclass(frozen=True)
class Output:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids, with logprobs=k
    # With prompt_logprobs=k: one per prompt token from the second on (its log-probability given those before it).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


class Pipeline:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._next_id = 0

    def __call__(self, prompts: Seq[Prompt] | str, lora: str | Seq[str] = "", **sampling) -> list[Output]:
        """Generates for every prompt (strings, token-id lists or chat-message lists) with the same sampling
        settings (SamplingParams fields); outputs come back in prompt order. `lora` names the LoRA adapter of every
        prompt, or of each (a list as long as the prompts; "": the base model)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        loras = [lora] * len(prompts) if isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"lora names {len(loras)} adapters for {len(prompts)} prompts: give one per prompt")
        if "stop" in sampling and isinstance(sampling["stop"], str):
            sampling["stop"] = (sampling["stop"],)
        elif "stop" in sampling:
            sampling["stop"] = tuple(sampling["stop"])
        params = SamplingParams(**sampling)
        if params.n != 1:
            raise ValueError(
                f"the pipeline returns one output per prompt, so n must be 1 (got {params.n}): repeat the prompt"
            )
        ids = []
        try:
            for prompt, adapter in zip(prompts, loras):
                ids.append(f"pipeline-{self._next_id}")
                self._next_id += 1
                self.engine.add_request(ids[-1], prompt, params, lora=adapter)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, Output] = {}
        while len(done) < len(ids):
            for out in self.engine.step().outputs:
                if out.finish_reason is not None:  # out.finished
                    done[out.request_id] = Output(
                        out.text,
                        out.token_ids,
                        out.finish_reason,
                        out.prompt_tokens,
                        out.generated_tokens,
                        out.logprobs,
                        out.prompt_logprobs,
                    )
        return [done[rid] for rid in ids]

    generate = __call__


def pipeline(
    model: str = EngineConfig.model,
    dtype: str | None = None,
    max_batch_tokens: int = SchedulerConfig.max_batch_tokens,
    max_seqs: int | None = None,
    block_size: int = CacheConfig.block_size,
    num_blocks: int | None = None,
    kv_cache_memory: int = CacheConfig.memory_bytes,
    gpu_memory_utilization: float | None = CacheConfig.gpu_memory_utilization,
    scheduler: str = SchedulerConfig.policy,
    max_model_len: int | None = None,
    device: str = EngineConfig.device,
    kernels: str = EngineConfig.kernels,
    progress: bool = True,
    load_format: str = EngineConfig.load_format,
    quantization: str = EngineConfig.quantization,
    prefix_caching: bool = CacheConfig.prefix_caching,
    enforce_eager: bool = EngineConfig.enforce_eager,
    slo: SloConfig | None = None,
    speculative_config: dict | str | None = None,
    lora: LoraConfig | None = None,
) -> Pipeline:
    """Loads the model and builds an engine; max_seqs defaults to the scheduler's, capped by the token budget.
    device "auto" is cuda where there is a GPU; load_format "dummy" builds the model (a preset such as
    "llama-3-8b", or any other) with random weights instead of reading them. slo: the service level the slo
    scheduler plans every request for (SloConfig's defaults otherwise). gpu_memory_utilization: on CUDA, the KV pool
    sized from the device's memory instead of kv_cache_memory (vLLM's). speculative_config: vLLM's dict (or its
    JSON), e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}.
    lora: multi-LoRA serving (adapters named in lora.lora_modules, chosen per prompt by the call's `lora`)."""
    max_seqs = max_seqs or min(SchedulerConfig.max_seqs, max_batch_tokens)
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=resolve_device(device),
        kernels=kernels,
        load_format=load_format,
        quantization=quantization,
        scheduler=SchedulerConfig(
            max_batch_tokens=max_batch_tokens, max_seqs=max_seqs, policy=scheduler, slo=slo or SloConfig()
        ),
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            memory_bytes=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            prefix_caching=prefix_caching,
        ),
        max_model_len=max_model_len,
        progress=progress,
        enforce_eager=enforce_eager,
        speculative_config=parse_speculative_config(speculative_config),
        lora=lora or LoraConfig(),
    )
    return Pipeline(build_engine(config))
