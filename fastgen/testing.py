"""What tests and benchmarks share: small random-weight models saved as Hugging Face folders with SmolLM2's
tokenizer (text, chat templates and EOS handling are real while forwards take milliseconds), free ports and
polling."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_model(
    path: Path,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = True,
    rope_scaling: dict | None = None,
    max_positions: int = 1024,
    seed: int = 0,
    std: float = 0.15,
) -> Path:
    """Writes config.json, model.safetensors and SmolLM2's tokenizer files into path; returns path.

    A large init std makes logits decisive, so greedy comparisons rarely hit near-ties."""
    import torch
    import transformers

    from fastgen.replica.weights import resolve_model

    smol = resolve_model("smollm2-135m")
    vocab = 49152
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases; random ones exercise the bias path
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (smol / name).exists():
            shutil.copy(smol / name, path / name)
    return path


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it; a tiny race with other processes remains)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Polls predicate until it returns something true, and returns that; TimeoutError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")
