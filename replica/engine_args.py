"""The engine's flags, declared once (vLLM's EngineArgs): each is a field of EngineArgs with its default and help.

`python -m fastgen.replica` and `fastgen-deploy start` both build their engine arguments from it (add_arguments),
a parsed command line becomes EngineArgs again (from_namespace), and launch writes a replica's command line from it
(to_argv). A flag's name comes from its field (max_seqs: --max-seqs; a bool that defaults on: --no-prefix-caching),
its type from the annotation (int, float, str, X | None, tuple[X, ...] as one or more values), its default from the
field; a field whose text needs more than that names a reader in its metadata (arg's parse).

No torch: the deploy CLI imports this."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..server.sla import DEFAULT_PROMPT_RATE, DEFAULT_TOKEN_RATES
from .config import (
    ADMISSIONS,
    DEPLOYMENT_SCHEDULER,
    DTYPES,
    KERNEL_BACKENDS,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULERS,
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SloConfig,
    default_max_batch_tokens,
    parse_lora_module,
    parse_size,
    parse_speculative_config,
)


# ---- readers of a flag's text: argparse `type`s, whose ArgumentTypeError message argparse prints as is ----
def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def size(text: str) -> int:
    """'512MiB', '2GiB', '1073741824' -> bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def speculative_json(text: str) -> str:
    """The JSON as given, once it reads as a speculative config: a bad key fails on the command line, and a
    deployment passes every replica the text its user wrote."""
    try:
        parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def lora_module(text: str) -> str:
    """'name=path', kept as text (the form a deployment's config.json and a replica's command line carry)."""
    try:
        parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def arg(
    default: Any,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    flag: str | None = None,
) -> Any:
    """A field that is a flag: its default and help; parse reads its text where the annotation's type does not
    say enough, choices are what it accepts, flag its name where that is not the field's."""
    meta = {"help": help, "parse": parse, "choices": choices, "metavar": metavar, "flag": flag}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineArgs:
    """Every replica's engine settings as flags; engine_config() makes the engine's EngineConfig of them. The order
    of the fields is the order of a replica's command line (to_argv)."""

    model: str = arg(
        EngineConfig.model,
        "embedded alias, preset (llama-3-8b, llama-3-70b, llama-3.2-1b, mistral-7b, qwen2-7b; with --load-format "
        "dummy), Hugging Face folder or .gguf file (default: %(default)s)",
    )
    device: str = arg(
        EngineConfig.device,
        "auto, cpu, cuda or cuda:N (auto: cuda where GPUs are found, else cpu). fastgen-deploy gives every replica "
        "process (every rank with --tp) a GPU of its own on cuda, so replicas x tp GPUs are needed "
        "(default: %(default)s)",
    )
    kernels: str = arg(
        EngineConfig.kernels,
        "auto: triton on cuda, the C kernels on cpu (default: %(default)s)",
        choices=KERNEL_BACKENDS,
    )
    load_format: str = arg(
        EngineConfig.load_format,
        "auto: read the checkpoint; dummy: random weights made on the device (any model, and the presets, which ship "
        "without weights) (default: %(default)s)",
        choices=LOAD_FORMATS,
    )
    quantization: str = arg(
        EngineConfig.quantization,
        "auto: serve a checkpoint in the format it ships in (a GGUF's block types on the CPU, AWQ/GPTQ int4); none: "
        "dequantize to --dtype; int8: weight-only int8, per-channel scales (CPU); fp8: E4M3 weights and per-token "
        "activations (CUDA; --kernels torch on a CPU); awq, gptq: auto, for a checkpoint that must be in that format "
        "(default: %(default)s)",
        choices=QUANTIZATIONS,
    )
    dtype: str = arg(
        "auto",
        "auto: bfloat16 where the hardware has it, else float32 with a GGUF's decode rows on int8 activations, as "
        "llama.cpp's (default: %(default)s)",
        choices=DTYPES,
    )
    max_batch_tokens: int | None = arg(
        None,
        f"tokens of one forward pass: the slo scheduler's cap (default {default_max_batch_tokens('slo')}), the "
        f"budget of the others (default {default_max_batch_tokens('splitfuse')})",
        parse=positive,
    )
    max_seqs: int = arg(SchedulerConfig.max_seqs, "sequences per forward pass (default: %(default)s)", parse=positive)
    block_size: int = arg(CacheConfig.block_size, "tokens per KV block (default: %(default)s)", parse=positive)
    num_blocks: int | None = arg(None, "exact KV pool size; overrides --kv-cache-memory", parse=positive)
    kv_cache_memory: int | None = arg(
        None,
        f"KV pool per replica (per rank with --tp): 512MiB, 2GiB or bytes (default: "
        f"{CacheConfig.memory_bytes >> 20}MiB on CPU; on CUDA what --gpu-memory-utilization leaves)",
        parse=size,
    )
    gpu_memory_utilization: float = arg(
        0.9,  # vLLM's
        "on CUDA, the share of the device's memory for weights, activations and the KV pool, which gets what a "
        "profiling pass leaves; --kv-cache-memory or --num-blocks override it (default: %(default)g)",
        parse=share,
    )
    scheduler: str = arg(
        DEPLOYMENT_SCHEDULER,
        "slo: each step's token budget from the requests' deadlines (--sla-prompt-rate, the largest "
        "--sla-token-rate) and a step-time model fitted on the replica; --max-batch-tokens caps it "
        "(default: %(default)s)",
        choices=SCHEDULERS,
    )
    admission: str = arg(
        SloConfig.admission,
        "slo: while even decoding alone would break the token-rate floors, keep admitting new requests or refuse "
        "them with RESOURCE_EXHAUSTED and a retry hint (default: %(default)s)",
        choices=ADMISSIONS,
    )
    allow_client_slo_tightening: bool = arg(
        SloConfig.allow_client_tightening,
        "let a request's slo ask for more than the SLA (a higher token_rate or prompt_rate, a shorter ttft); by "
        "default the slo scheduler only lets a request loosen it, so that no client can claim the replica for "
        "itself. Turn on only behind a balancer that decides who may ask for more",
    )
    max_model_len: int | None = arg(None, "context per sequence (default: the model's)", parse=positive)
    default_max_new_tokens: int = arg(
        EngineConfig.default_max_new_tokens,
        "tokens generated for a request that leaves max_new_tokens unset (default: %(default)s)",
        parse=positive,
    )
    prefix_caching: bool = arg(
        CacheConfig.prefix_caching,
        "recompute every prompt from its first token instead of reusing cached KV blocks of equal prefixes",
    )
    enforce_eager: bool = arg(
        EngineConfig.enforce_eager, "no CUDA graphs: run every decode step op by op (vLLM's flag)"
    )
    enable_expert_parallel: bool = arg(
        EngineConfig.enable_expert_parallel,
        "with --tp: each rank holds whole experts of a mixture-of-experts model instead of a slice of every expert "
        "(vLLM's flag)",
    )
    speculative_config: str | None = arg(
        None,
        'speculative decoding, as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\' (optional "disable_by_batch_size": N); default: off',
        parse=speculative_json,
    )
    # Multi-LoRA serving, vLLM's flags (docs/lora.md)
    enable_lora: bool = arg(LoraConfig.enable_lora, "serve LoRA adapters chosen per request by name")
    lora_modules: tuple[str, ...] = arg(
        (),
        "adapters to serve from the start: a name and a PEFT adapter folder each (needs --enable-lora)",
        parse=lora_module,
        metavar="NAME=PATH",
    )
    max_loras: int = arg(
        LoraConfig.max_loras,
        "adapters resident at once; beyond it the least recently used idle one is evicted (default: %(default)s)",
        parse=positive,
    )
    max_lora_rank: int = arg(
        LoraConfig.max_lora_rank,
        "the largest adapter rank served; an adapter of higher rank is refused (default: %(default)s)",
        parse=positive,
    )
    threads: int = arg(
        1,
        "torch threads per replica process, so per rank with --tp (default: 1; fastgen-deploy: cores // "
        "(replicas * tp))",
        parse=positive,
    )
    # Last but --tp: --sla-token-rate takes several values.
    sla_prompt_rate: float = arg(
        DEFAULT_PROMPT_RATE,
        "SLA: first token within prompt_tokens / P seconds (default: %(default)g)",
        parse=positive_float,
        metavar="P",
    )
    sla_token_rates: tuple[float, ...] = arg(
        DEFAULT_TOKEN_RATES,
        "SLA: inter-token moving average at most 1 / R seconds; every R given is exported as its own token_rate "
        "label, and the slo scheduler holds the largest (default: 1 2 4)",
        parse=positive_float,
        metavar="R",
        flag="--sla-token-rate",
    )
    tp: int = arg(1, "tensor-parallel ranks of each replica, one process each (default: %(default)s)", parse=positive)

    def __post_init__(self) -> None:
        # argparse and config.json hand over lists
        for f in fields(self):
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def engine_config(self) -> EngineConfig:
        """The engine's settings (vLLM's create_engine_config); ValueError for settings it cannot run with."""
        return EngineConfig(
            model=self.model,
            dtype=None if self.dtype == "auto" else self.dtype,
            device=self.device,
            kernels=self.kernels,
            load_format=self.load_format,
            quantization=self.quantization,
            enforce_eager=self.enforce_eager,
            enable_expert_parallel=self.enable_expert_parallel,
            speculative_config=parse_speculative_config(self.speculative_config),
            lora=LoraConfig(
                self.enable_lora, tuple(map(parse_lora_module, self.lora_modules)), self.max_loras, self.max_lora_rank
            ),
            scheduler=SchedulerConfig(
                max_batch_tokens=self.max_batch_tokens or default_max_batch_tokens(self.scheduler),
                max_seqs=self.max_seqs,
                policy=self.scheduler,
                # The floor the scheduler holds is the strictest R the deployment is scored against.
                slo=SloConfig(
                    self.sla_prompt_rate, max(self.sla_token_rates), self.admission, self.allow_client_slo_tightening
                ),
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                memory_bytes=self.kv_cache_memory or CacheConfig.memory_bytes,
                # An explicit --kv-cache-memory is the budget on every device; num_blocks overrides both in the builder.
                gpu_memory_utilization=None if self.kv_cache_memory else self.gpu_memory_utilization,
                prefix_caching=self.prefix_caching,
            ),
            max_model_len=self.max_model_len,
            default_max_new_tokens=self.default_max_new_tokens,
        )


def flag_of(f) -> str:
    """A field's flag: --max-seqs for max_seqs; a switch that is on by default turns it off (--no-prefix-caching)."""
    name = f.metadata["flag"] or "--" + f.name.replace("_", "-")
    return "--no-" + name[2:] if f.default is True else name


def _argument(f, hint, default) -> dict:
    """add_argument's keywords for a field, from its annotation and metadata."""
    meta = f.metadata
    kw = {"dest": f.name, "default": default, "help": meta["help"]}
    if hint is bool:
        kw["action"] = "store_false" if f.default else "store_true"
        return kw
    if typing.get_origin(hint) in (types.UnionType, typing.Union):  # X | None: None is the default, not a value
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: one or more values
        kw["nargs"] = "+"
        hint = typing.get_args(hint)[0]
    kw["type"] = meta["parse"] or hint
    for key in ("choices", "metavar"):
        if meta[key] is not None:
            kw[key] = meta[key]
    return kw


def add_arguments(parser, defaults: EngineArgs | None = None) -> None:
    """Every EngineArgs field as a flag of parser (an ArgumentParser or an argument group). defaults: a command's
    own, where they differ from EngineArgs' (fastgen-deploy's DeployConfig: device auto)."""
    defaults = EngineArgs() if defaults is None else defaults
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        parser.add_argument(flag_of(f), **_argument(f, hints[f.name], getattr(defaults, f.name)))


def from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of a command line parsed with add_arguments' flags."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def _text(value) -> str:
    # 100.0 as 100, as a user writes it; other floats in full, so that the replica reads back the same number
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def to_argv(args: EngineArgs, pinned: Collection[str] = ()) -> list[str]:
    """The replica's flags for args, in field order: each setting that differs from the replica's default, and
    the pinned fields' even at it (None is always the default, and a switch can only say its other value)."""
    default, argv = EngineArgs(), []
    for f in fields(EngineArgs):
        value = getattr(args, f.name)
        if value is None or (value == getattr(default, f.name) and (f.name not in pinned or isinstance(value, bool))):
            continue
        if isinstance(value, bool):
            argv.append(flag_of(f))
        elif isinstance(value, tuple):
            argv += [flag_of(f), *map(_text, value)] if value else []
        else:
            argv += [flag_of(f), _text(value)]
    return argv
