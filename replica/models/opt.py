"""OPT (OPTForCausalLM): learned positional embeddings read at position + 2, no rotary, LayerNorm, a plain ReLU MLP,
biases, q scaled before q k^T (as OPT does), tied embeddings; OPT-350m's post-norm layers and its embeddings
narrower than the layers (word_embed_proj_dim, projected in and out)."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, gpt_style

ARCHITECTURES = {"OPTForCausalLM": "opt"}
# transformers' OPT names -> the skeleton's, in this order (the model's final norm before the layers' own)
RENAMES = (
    ("decoder.final_layer_norm.", "norm."),
    ("self_attn_layer_norm.", "input_layernorm."),
    ("final_layer_norm.", "post_attention_layernorm."),
    ("self_attn.out_proj.", "self_attn.o_proj."),
    (".fc1.", ".mlp.fc1."),
    (".fc2.", ".mlp.fc2."),
    ("decoder.", ""),
)


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    pre_norm = bool(hf.get("do_layer_norm_before", True))
    if hf.get("_remove_final_layer_norm") and pre_norm or not hf.get("layer_norm_elementwise_affine", True):
        raise ValueError("unsupported OPT variant (no final or no affine LayerNorm): FastGen serves OPT's releases")
    embedding = hf.get("word_embed_proj_dim") or hidden
    return ModelConfig(
        architecture="opt",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["ffn_dim"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT keeps
        rope_theta=10000.0,
        rope_llama3=None,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=None,
        **gpt_style(bool(hf.get("enable_bias", True)), hf.get("activation_function", "relu")),
        rope=False,
        learned_positions_offset=2,
        scale_queries=True,
        renames=RENAMES,
        post_norm=not pre_norm,
        embedding_dim=embedding if embedding != hidden else 0,
    )
