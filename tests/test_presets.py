"""Real-size models without downloads: the shipped presets carry the published architectures, load_format "dummy"
builds any model with seeded random weights in place, and a model without a tokenizer borrows the embedded one."""

from __future__ import annotations

import shutil

import pytest
import torch

from fastgen.kernels import TORCH_KERNELS
from fastgen.replica import __main__ as replica_main
from fastgen.replica import pipeline, weights
from fastgen.replica.config import PRESETS_DIR, preset_path
from fastgen.replica.models.llama import DUMMY_STD, LlamaModel, ModelConfig, RMSNorm
from fastgen.replica.parallel import TPGroup

# Parameter counts as published on the models' cards; they pin every size the config sets.
PUBLISHED_PARAMETERS = {
    "llama-3-8b": 8_030_261_248,
    "llama-3-8b-awq": 8_030_261_248,  # the same architecture, its layers in AWQ int4 (4.5 bits a weight with scales)
    "llama-3-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "gemma-2-9b": 9_241_705_984,
    # Gemma 3 12B's card counts its vision tower too (12.2B); this is its text decoder, which the preset is.
    "gemma-3-12b": 11_766_034_176,
    "phi-3-mini": 3_821_079_552,
    "phi-4": 14_659_507_200,
    # Falcon-7B's card says 7.2B: its checkpoint stores the LM head beside the embedding it is tied to.
    "falcon-7b": 6_921_720_704,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen2-57b-a14b": 57_408_658_944,  # the card's 57.4B
}


def parameters(c: ModelConfig) -> int:
    """The parameters of the model FastGen builds from the config (on the meta device: no memory), a tied LM head
    counted once."""
    with torch.device("meta"):
        model = LlamaModel(c, TPGroup(), TORCH_KERNELS)
    return sum(p.numel() for p in model.parameters())


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(weights.load_hf_config(preset_path(name)))


def test_presets_are_the_published_architectures():
    assert weights.preset_names() == sorted(PUBLISHED_PARAMETERS)
    for name, count in PUBLISHED_PARAMETERS.items():
        assert parameters(preset_config(name)) == count, name
    small = preset_config("llama-3.2-1b")
    assert small.rope_llama3 == (32.0, 1.0, 4.0, 8192) and small.tie_word_embeddings
    assert small.max_position_embeddings == 131072 and small.rope_theta == 500000.0
    assert preset_config("llama-3-70b").num_kv_heads == 8 and preset_config("qwen2-7b").qkv_bias
    assert preset_config("mistral-7b").sliding_window == 4096 and preset_config("qwen2-7b").sliding_window is None
    gemma2, gemma3 = preset_config("gemma-2-9b"), preset_config("gemma-3-12b")
    assert gemma2.attn_softcap == 50.0 and gemma2.final_softcap == 30.0 and gemma2.sliding_layers[:2] == (True, False)
    assert gemma3.sliding_layers[:6] == (True,) * 5 + (False,) and gemma3.window(0) == 1024 and gemma3.window(5) == 0
    assert gemma3.local_rope_theta == 10000.0 and gemma3.rope_linear_factor == 8.0
    assert preset_config("qwen3-8b").qk_norm and preset_config("qwen3-8b").head_dim == 128
    assert preset_config("phi-3-mini").window(31) == 2047 and preset_config("phi-4").sliding_window is None
    mixtral, qwen3_moe = preset_config("mixtral-8x7b").moe, preset_config("qwen3-30b-a3b").moe
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.renormalize) == (8, 2, True)
    assert (qwen3_moe.num_experts, qwen3_moe.experts_per_token, qwen3_moe.renormalize) == (128, 8, True)
    assert preset_config("qwen2-57b-a14b").moe.shared_expert_intermediate_size == 20480


def test_a_preset_needs_the_dummy_load_format():
    with pytest.raises(ValueError, match="--load-format dummy"):
        weights.resolve_model("llama-3-8b")
    with pytest.raises(ValueError, match="--load-format dummy"):
        pipeline("llama-3-8b", progress=False)  # refused before anything is built
    assert weights.resolve_model("llama-3-8b", "dummy") == PRESETS_DIR / "llama-3-8b"
    with pytest.raises(ValueError, match="auto, dummy"):
        weights.resolve_model("llama-3-8b", "safetensors")
    assert preset_path("../presets") is None and preset_path("") is None


def test_a_config_only_folder_loads_as_dummy(tmp_path):
    shutil.copy(PRESETS_DIR / "mistral-7b" / "config.json", tmp_path / "config.json")
    assert weights.resolve_model(str(tmp_path), "dummy") == tmp_path
    with pytest.raises(ValueError, match="config.json alone with --load-format dummy"):
        weights.resolve_model(str(tmp_path))


def tiny_config(**change) -> ModelConfig:
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        **change,
    }
    return ModelConfig.from_hf(hf)


def random_model(seed: int) -> LlamaModel:
    model = LlamaModel(tiny_config(), TPGroup(), TORCH_KERNELS)
    model.init_random_weights(seed)
    return model


def test_random_weights_are_seeded_in_place_with_unit_norms():
    a, b, c = random_model(0), random_model(0), random_model(1)
    same = [torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())]
    assert all(same) and not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    assert a.lm_head.weight is a.embed_tokens.weight  # tied: drawn once, still shared
    norms = {id(m.weight) for m in a.modules() if isinstance(m, RMSNorm)}
    for p in a.parameters():
        if id(p) in norms:
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert abs(p.float().std().item() - DUMMY_STD) < 0.3 * DUMMY_STD


def test_dummy_load_format_serves_any_model(tiny_model_dir):
    real = pipeline(str(tiny_model_dir), dtype="float32", num_blocks=32, progress=False)
    dummy = pipeline(str(tiny_model_dir), dtype="float32", num_blocks=32, progress=False, load_format="dummy")
    ids = [5, 6, 7, 8]
    a = real([ids], max_new_tokens=6, ignore_eos=True)[0].token_ids
    b = dummy([ids], max_new_tokens=6, ignore_eos=True)[0].token_ids
    assert len(b) == 6 and a != b  # the checkpoint was not read


class FakeTokenizer:
    eos_token_id = 2
    chat_template = None

    def encode(self, text, **kwargs):
        return [10, 49151, 300]

    def decode(self, ids, **kwargs):
        return "x"


def test_a_borrowed_tokenizer_stays_inside_the_vocabulary_and_lends_no_eos():
    borrowed = weights.BorrowedTokenizer(FakeTokenizer(), vocab_size=32000)
    assert borrowed.encode("hi") == [10, 49151 % 32000, 300] and borrowed.decode([1]) == "x"
    assert borrowed.chat_template is None
    folder = PRESETS_DIR / "llama-3-8b"
    assert weights.eos_token_ids(folder, weights.load_hf_config(folder), borrowed) == [128001]


def test_without_any_tokenizer_token_ids_are_asked_for(tmp_path):
    t = weights.TokenIdsOnly(tmp_path)
    with pytest.raises(ValueError, match="send token ids"):
        t.encode("hello")
    assert t.decode([1, 2]) == "" and t.chat_template is None and t.eos_token_id is None


def test_replica_flags_reach_the_engine_config():
    args = replica_main.parse_args(["--port", "1", "--model", "llama-3-8b", "--load-format", "dummy"])
    config = replica_main.engine_config(args)
    assert (config.model, config.load_format, config.device, config.kernels) == ("llama-3-8b", "dummy", "cpu", "auto")
    with pytest.raises(SystemExit):
        replica_main.parse_args(["--port", "1", "--load-format", "pt"])
    assert weights.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert weights.resolve_device("cuda:1") == "cuda:1"


@pytest.mark.slow
def test_the_1b_preset_generates_from_token_ids_and_text():
    # float32: exact on every CPU; a small KV pool keeps the build to the weights themselves.
    pipe = pipeline(
        "llama-3.2-1b", load_format="dummy", dtype="float32", num_blocks=8, max_batch_tokens=64, progress=False
    )
    config = pipe.engine.model_config
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (16, 2048, 128256)
    assert pipe.engine.eos_token_ids == [128001]  # the model's, not the borrowed tokenizer's
    ids, text = pipe([[128000, 9906, 11, 856, 836, 374], "Hello, my name is"], max_new_tokens=3, ignore_eos=True)
    assert ids.prompt_tokens == 6 and len(ids.token_ids) == 3
    assert all(0 <= t < 128256 for t in ids.token_ids)
    assert text.prompt_tokens > 0 and len(text.token_ids) == 3  # through the borrowed SmolLM2 tokenizer
    again = pipe([[128000, 9906, 11, 856, 836, 374]], max_new_tokens=3, ignore_eos=True)[0]
    assert again.token_ids == ids.token_ids  # greedy on seeded weights
