"""Every model family FastGen serves equals transformers (eager attention, float32) token for token: a tiny random
model of each, built from transformers' own config class and saved as safetensors, prompts longer than any sliding
window, split across passes by a small token budget, under every scheduler, with prefix caching on and off, with
preemption, on the torch and the C kernels, and under tensor parallelism (2 ranks, gloo)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastgen.replica import pipeline
from fastgen.replica.models import ARCHITECTURES, ModelConfig, config_from_hf
from fastgen.replica.weights import load_hf_config

from .helpers import assert_matches, hf_greedy, run_on_triton
from .tp_ranks import engine_tokens

VOCAB = 512
WINDOW = 8  # shorter than every prompt: the sliding-window layers must mask
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# family -> (transformers config class, model class, the family's own settings)
FAMILIES = {
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2-window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-window": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, attention_bias=True),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            original_max_position_embeddings=64,  # past every test sequence: transformers keeps the short factors
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,  # Phi-4-mini's: 12 of 16 dims rotate
                "short_factor": [1.0 + 0.2 * i for i in range(6)],
                "long_factor": [3.0 + 0.5 * i for i in range(6)],
            },
        ),
    ),
    "phi2": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, dropout=0.0, enable_bias=True)),
    "opt-350m": (  # post-norm layers, embeddings narrower than the layers
        "OPTConfig",
        "OPTForCausalLM",
        dict(ffn_dim=128, dropout=0.0, do_layer_norm_before=False, word_embed_proj_dim=32),
    ),
    "falcon-7b": (  # multi-query, parallel attention and MLP on one norm
        "FalconConfig",
        "FalconForCausalLM",
        dict(multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False),
    ),
    "falcon-40b": (  # new decoder architecture: grouped KV heads, a norm for each branch
        "FalconConfig",
        "FalconForCausalLM",
        dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, ffn_hidden_size=128),
    ),
    "falcon-mha": (  # no multi-query: q, k, v interleaved per head; sequential blocks
        "FalconConfig",
        "FalconForCausalLM",
        dict(multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True),
    ),
}


def make_family_model(path: Path, family: str, seed: int = 0, std: float = 0.15, families: dict = FAMILIES) -> Path:
    """A tiny random model of `family` saved as a Hugging Face safetensors folder (no tokenizer: token ids only).
    A large init std makes logits decisive, so greedy comparisons rarely hit near-ties; norms and biases are random
    too, so (1 + w) norms and bias terms are exercised."""
    import transformers

    config_name, model_name, own = families[family]
    config = getattr(transformers, config_name)(**{**COMMON, **own, "initializer_range": std})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # HF zero-inits biases
                p.normal_(0, std)
            elif "norm" in name:  # around their init: 1 (w), or 0 for Gemma's (1 + w)
                p.add_(torch.randn_like(p) * std)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy_eager(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    return hf_greedy(model_dir, prompts, max_new, attn_implementation="eager")


def prompts_for(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(WINDOW + 3, 4 * WINDOW))] for _ in range(n)]


NEW = 10


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> (folder, prompts, transformers' tokens), built once per module."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = make_family_model(root / family, family, seed=i)
        prompts = prompts_for(i)
        out[family] = (folder, prompts, hf_greedy_eager(folder, prompts, NEW))
    return out


@pytest.fixture(scope="module")
def shared_prefix_refs(family_models):
    """family -> (prompts sharing a prefix the cache may serve, transformers' tokens), computed once per family."""
    done = {}

    def of(family: str):
        if family not in done:
            folder, prompts, _ = family_models[family]
            shared = [prompts[0][:20] + p for p in prompts[:3]]
            done[family] = (shared, hf_greedy_eager(folder, shared, NEW))
        return done[family]

    return of


def run(folder, prompts, **options):
    pipe = pipeline(str(folder), dtype="float32", progress=False, **options)
    return pipe, pipe(prompts, max_new_tokens=NEW, min_new_tokens=NEW)


# ---- configs ---------------------------------------------------------------------------------------------------
def test_the_registry_reads_each_family(tmp_path):
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= set(ARCHITECTURES)
    with pytest.raises(ValueError, match="unsupported architecture.*Gemma2ForCausalLM"):
        config_from_hf({"architectures": ["NopeForCausalLM"]})
    folder = make_family_model(tmp_path / "g3", "gemma3")
    c = ModelConfig.from_hf(load_hf_config(folder))
    assert c.sliding_layers == (True, False, True) and [c.window(i) for i in range(3)] == [WINDOW, 0, WINDOW]
    assert c.local_rope_theta == 1000.0 and c.rope_theta == 50000.0 and c.rope_linear_factor == 2.0
    assert c.norm_offset == 1.0 and c.qk_norm and c.sandwich_norms and c.query_scale == 24**-0.5
    assert c.embed_scale == 8.0 and c.tie_word_embeddings and c.mlp_activation == "gelu_tanh"
    q2 = ModelConfig.from_hf(
        {
            **load_hf_config(folder),
            **json.loads(json.dumps(FAMILIES["qwen2-window"][2])),
            "architectures": ["Qwen2ForCausalLM"],
            "layer_types": None,
        }
    )
    assert q2.sliding_layers == (False, True, True) and q2.qkv_bias and not q2.qk_norm


# ---- parity ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_families_match_transformers_across_budgets(family_models, family, kernels):
    folder, prompts, refs = family_models[family]
    for budget in (7, 64):  # a budget below the shortest prompt splits every prompt across passes
        assert_matches(run(folder, prompts, max_batch_tokens=budget, kernels=kernels)[1], refs)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scheduler", ["splitfuse", "prefill_first", "static", "slo"])
def test_families_match_under_every_scheduler_and_prefix_caching(family_models, shared_prefix_refs, family, scheduler):
    folder, prompts, refs = family_models[family]
    shared, shared_refs = shared_prefix_refs(family)
    for caching in (True, False):
        options = dict(max_batch_tokens=16, block_size=4, scheduler=scheduler, prefix_caching=caching)
        assert_matches(run(folder, prompts, **options)[1], refs)
        assert_matches(run(folder, shared + shared, **options)[1], shared_refs + shared_refs)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_match_with_preemption(family_models, family):
    folder, prompts, refs = family_models[family]
    # 14 blocks of 4 tokens: one sequence fits (at most 42 tokens), several do not. Where every layer has a window,
    # a sequence gives back the blocks behind it (test_window_blocks.py runs one far longer than the pool), and
    # preemption needs blocks of 5 tokens: its window's start and its end cross blocks at different steps,
    # so a decode sometimes needs a block before it gives one back, and preempts.
    windowed = ModelConfig.from_hf(load_hf_config(folder)).kv_window is not None
    block_size, num_blocks = (5, 8) if windowed else (4, 14)
    pipe, outs = run(folder, prompts, max_batch_tokens=16, block_size=block_size, num_blocks=num_blocks)
    assert_matches(outs, refs)
    assert pipe.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_families_match_under_tensor_parallelism(family_models, tmp_path):
    runs, expected = [], []
    for folder, prompts, refs in family_models.values():
        runs.append(dict(model=str(folder), prompts=prompts, new=NEW, budget=16, block_size=4, num_blocks=14))
        expected.append(refs)
    for tokens, refs in zip(engine_tokens(runs, tmp_path / "out"), expected, strict=True):
        assert_matches([SimpleNamespace(token_ids=t) for t in tokens], refs)


# Prints {"tokens": per prompt, "qkv_form": the type of layer 0's packed q/k/v projection} (None: the plain weight)
TRITON_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from fastgen.replica import pipeline
folder, prompts, new = json.loads(sys.argv[1])
pipe = pipeline(folder, dtype="float32", kernels="triton", max_batch_tokens=16, block_size=8, progress=False)
tokens = [o.token_ids for o in pipe(prompts, max_new_tokens=new, min_new_tokens=new)]
packed = pipe.engine.runner.model.layers[0].self_attn.qkv_proj.packed
print(json.dumps({"tokens": tokens, "qkv_form": None if packed is None else type(packed).__name__}))
"""


def triton_tokens(folder, prompts: list[list[int]], new: int) -> tuple[list[list[int]], str | None]:
    """(tokens per prompt, layer 0's q/k/v packed form) of TRITON_SCRIPT's run on the Triton kernels."""
    out = run_on_triton(TRITON_SCRIPT, [str(folder), prompts, new])
    assert isinstance(out, dict)
    return out["tokens"], out["qkv_form"]


@pytest.mark.slow
@pytest.mark.cuda(interpreted=True)
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3-window", "phi3", "phi2", "opt", "falcon-40b"])
def test_families_match_on_the_triton_kernels(family_models, family):
    """Triton's window and soft-capping in the engine, graphed decode path included: interpreted on a CPU (a
    subprocess, so TRITON_INTERPRET=1 is set before triton is first imported), compiled on a GPU."""
    folder, prompts, refs = family_models[family]
    tokens, _ = triton_tokens(folder, prompts, NEW)
    assert_matches([SimpleNamespace(token_ids=t) for t in tokens], refs)


def test_longrope_table_is_transformers_short_then_long(tmp_path):
    """Positions before the original context rotate by transformers' short-factor frequencies, later ones by its
    long-factor frequencies, both scaled by its attention factor; partial rotary keeps 12 of 16 dims."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fastgen.replica.models.decoder import rope_table

    folder = make_family_model(tmp_path / "phi3", "phi3")
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    c = ModelConfig.from_hf(load_hf_config(folder))
    assert c.rotary_dim == 12 and c.sliding_layers == (True,) * 3 and c.rope_longrope[2] == 64
    table = rope_table(c, c.rope_theta)  # (positions, 12)
    for seq_len, rows in ((None, slice(0, 64)), (65, slice(64, 256))):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, seq_len=seq_len)
        freqs = torch.arange(256, dtype=torch.float32)[:, None] * inv_freq[None, :]
        expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor
        assert torch.allclose(table[rows], expected[rows], atol=1e-6)


@pytest.mark.slow
def test_a_sharded_checkpoint_loads_through_its_index(family_models, tmp_path):
    """A checkpoint in several safetensors files with its index (and a stray file the index does not name) loads
    as the single file does."""
    import transformers

    folder, prompts, refs = family_models["gemma2"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "consolidated.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    assert_matches(run(tmp_path, prompts, max_batch_tokens=7)[1], refs)
