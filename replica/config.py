"""Engine settings: small frozen dataclasses, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULERS = ("splitfuse", "prefill_first", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512  # token budget of one forward pass
    max_seqs: int = 64  # sequences in one forward pass
    policy: str = "splitfuse"  # splitfuse | prefill_first | static
    max_model_len: int = 2048  # prompt + generated tokens of one sequence

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.policy!r}: use one of {', '.join(SCHEDULERS)}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {self.max_seqs}")
        if self.max_seqs > self.max_batch_tokens:
            raise ValueError(
                f"max_seqs ({self.max_seqs}) exceeds max_batch_tokens ({self.max_batch_tokens}): every decoding "
                "sequence needs one token of the budget; lower max_seqs or raise max_batch_tokens"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # exact pool size; None: derive from memory_bytes
    memory_bytes: int = 1 << 30  # KV pool budget when num_blocks is None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.memory_bytes < 1:
            raise ValueError(f"kv cache memory must be positive, got {self.memory_bytes}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # alias, Hugging Face folder or .gguf file
    dtype: str | None = None  # float32 | bfloat16 | float16; None: bfloat16 where the hardware has it
    device: str = "cpu"
    kernels: str = "auto"  # auto | torch | triton
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    max_model_len: int | None = None  # None: the model's own context
    default_max_new_tokens: int = 256  # used when a request leaves max_new_tokens at 0
    progress: bool = True  # show weight-loading progress
