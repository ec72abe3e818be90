"""AWQ and GPTQ int4 checkpoints (replica/int4_checkpoint.py, kernels/int4.py, kernels/triton_int4.py): tiny random
models quantized here into each layout (fastgen/int4_writer.py, AutoAWQ's and AutoGPTQ's packing), read back value
for value, and served token for token as transformers serves the same model dequantized (float32): on the torch,
C and Triton kernels, prompts split across passes, with preemption and under tensor parallelism."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from fastgen.int4_writer import write_int4_checkpoint
from fastgen.kernels.int4 import Int4Tensor, pack_nibbles, unpack_nibbles
from fastgen.kernels.quant import GGML_TYPES, QuantLinear
from fastgen.replica import pipeline
from fastgen.replica.int4_checkpoint import int4_format, iter_int4
from fastgen.replica.weights import iter_safetensors, load_hf_config

from .helpers import assert_matches, run_on_triton
from .test_model_families import hf_greedy_eager, make_family_model, prompts_for, triton_tokens
from .tp_ranks import engine_tokens

# name -> (method, writer options): AWQ (zero points), GPTQ symmetric (every zero 8), GPTQ act-order, GPTQModel's v2
VARIANTS = {
    "awq": ("awq", {}),
    "gptq-sym": ("gptq", dict(sym=True)),
    "gptq-act-order": ("gptq", dict(act_order=True)),
    "gptq-v2": ("gptq", dict(checkpoint_format="gptq_v2")),
}
NEW = 10


def random_int4(rows: int, cols: int, group: int, seed: int = 0, sym: bool = False) -> tuple[Int4Tensor, torch.Tensor]:
    """An Int4Tensor of random quants, and its values computed here from the unpacked parts."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=gen)
    zeros = torch.full((rows, cols // group), 8) if sym else torch.randint(0, 16, (rows, cols // group), generator=gen)
    scales = (torch.rand(rows, cols // group, generator=gen) * 0.05 + 0.001).half()
    values = (q.view(rows, -1, group) - zeros[..., None]).float() * scales.float()[..., None]
    return Int4Tensor(pack_nibbles(q), scales, zeros.to(torch.uint8), group), values.view(rows, cols)


# ---- the layout ----------------------------------------------------------------------------------------------------
def test_nibbles_pack_and_unpack_in_column_order():
    q = torch.arange(16).repeat(3, 2)  # (3, 32)
    words = pack_nibbles(q)
    assert words.dtype == torch.int32 and words.shape == (3, 4)
    assert words[0, 0].item() == 0x76543210 and words[0, 1].item() == 0xFEDCBA98 - 2**32  # nibble j: column 8c + j
    assert torch.equal(unpack_nibbles(words), q)


@pytest.mark.parametrize("sym", [False, True])
def test_int4_values_and_slices(sym):
    t, values = random_int4(24, 256, 64, sym=sym)
    assert t.shape == (24, 256) and t.symmetric == sym
    assert torch.equal(t.dequantize(), values)
    assert torch.equal(t.narrow(0, 5, 7).dequantize(), values[5:12])
    assert torch.equal(t.narrow(1, 128, 64).dequantize(), values[:, 128:192])
    assert t.splits_at(0, 64, 128) and not t.splits_at(32)
    with pytest.raises(ValueError, match="groups of 64"):
        t.narrow(1, 32, 64)
    index = torch.tensor([3, 0, 17])
    assert torch.equal(t.index_rows(index).dequantize(), values[index])


@pytest.mark.parametrize("sym, ggml", [(False, "Q5_0"), (True, "Q4_0")])
def test_int4_becomes_gguf_blocks_bit_for_bit(sym, ggml):
    """The CPU's form: Q5_0 (q - zero + 16 in 5 bits) holds any zero point exactly; Q4_0 holds symmetric weights. Both
    read back through the C kernels' dequantizer and gguf's own reference."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t, values = random_int4(40, 384, 128, seed=1, sym=sym)
    blocks = t.to_ggml()
    assert blocks is not None and blocks.name == ggml and blocks.shape == (40, 384)
    assert blocks.nbytes == 40 * 384 // 32 * GGML_TYPES[ggml][2]
    assert torch.equal(blocks.dequantize(), values)
    reference = dequantize(blocks.data.numpy(), GGMLQuantizationType(blocks.qtype))
    assert torch.equal(torch.from_numpy(reference.copy()).reshape(40, 384), values)
    small_groups, _ = random_int4(8, 64, 16)
    assert small_groups.to_ggml() is None  # a group of 16 is not a whole block: dequantized instead
    bf16_scales = Int4Tensor(t.qweight, t.scales.bfloat16(), t.zeros, t.group_size)
    assert bf16_scales.to_ggml() is None


# ---- reading checkpoints -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4_models(tmp_path_factory):
    """variant -> (int4 folder, dequantized reference folder, prompts, transformers' tokens on the reference)."""
    root = tmp_path_factory.mktemp("int4")
    src = make_family_model(root / "float", "qwen3")
    prompts = prompts_for(3)
    out = {}
    for i, (variant, (method, options)) in enumerate(VARIANTS.items()):
        folder, reference = root / variant, root / f"{variant}-reference"
        write_int4_checkpoint(src, folder, reference, method, seed=i, **options)
        out[variant] = (folder, reference, prompts, hf_greedy_eager(reference, prompts, NEW))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_layer_reads_as_its_dequantized_values(int4_models, variant):
    folder, reference, _, _ = int4_models[variant]
    fmt = int4_format(load_hf_config(folder))
    assert fmt is not None and fmt.method == VARIANTS[variant][0] and fmt.group_size == 32
    expected = safe_open(str(reference / "model.safetensors"), framework="pt")
    layers = 0
    for name, value in iter_int4(iter_safetensors(folder, progress=False), fmt):
        dense = value.dequantize() if isinstance(value, Int4Tensor) else value
        assert torch.equal(dense, expected.get_tensor(name)), name
        if name.endswith("proj.weight"):
            assert isinstance(value, Int4Tensor)
            # act-order's input columns out of group order: kept sorted by group, with the order they came from
            assert (value.perm is not None) == (variant == "gptq-act-order")
            layers += 1
    assert layers == 3 * 7


def test_what_the_reader_refuses(tmp_path):
    for quant, message in (
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'.*AWQ and GPTQ"),
        ({"quant_method": "gptq", "bits": 8}, "8-bit weights: FastGen reads 4-bit"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv' version: FastGen reads the GEMM"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point true"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "format 'marlin'"),
    ):
        with pytest.raises(ValueError, match=message):
            int4_format({"quantization_config": quant})
    assert int4_format({}) is None
    fmt = int4_format({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}})
    assert fmt is not None
    layer = "model.layers.0.mlp.down_proj"
    qweight = torch.zeros(64, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="down_proj has no qzeros"):
        list(iter_int4([(f"{layer}.qweight", qweight), (f"{layer}.scales", torch.ones(2, 64).half())], fmt))
    parts = {"qweight": qweight.float(), "qzeros": torch.zeros(2, 8, dtype=torch.int32), "scales": torch.ones(2, 64)}
    with pytest.raises(ValueError, match="qweight is torch.float32: AWQ and GPTQ pack int4 values in int32"):
        list(iter_int4([(f"{layer}.{k}", v) for k, v in parts.items()], fmt))
    parts = {"qweight": qweight, "qzeros": torch.zeros(3, 8, dtype=torch.int32), "scales": torch.ones(3, 64).half()}
    with pytest.raises(ValueError, match="do not fit 64 input features in groups of 32"):
        list(iter_int4([(f"{layer}.{k}", v) for k, v in parts.items()], fmt))


# ---- serving -------------------------------------------------------------------------------------------------------
def run(folder, prompts, **options):
    pipe = pipeline(str(folder), dtype="float32", progress=False, **options)
    return pipe, pipe(prompts, max_new_tokens=NEW, min_new_tokens=NEW)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_int4_checkpoints_match_transformers(int4_models, variant, kernels):
    """`auto` serves the int4 layers as shipped (GGUF blocks on the C kernels, dequantized on torch's); `none`
    dequantizes them at load: both are the reference's tokens, a budget of 7 splitting every prompt."""
    folder, _, prompts, refs = int4_models[variant]
    for quantization in ("auto", "none"):
        pipe, outs = run(folder, prompts, kernels=kernels, quantization=quantization, max_batch_tokens=7)
        assert_matches(outs, refs)
        proj = pipe.engine.runner.model.layers[0].mlp.down_proj
        as_shipped = kernels == "cpu" and quantization == "auto"
        assert isinstance(proj.packed, QuantLinear) == as_shipped
        if as_shipped:  # the weight is the blocks: no float copy kept
            assert proj.weight is None
            block = proj.packed.slabs[0][1].name
            assert block == ("Q4_0" if variant == "gptq-sym" else "Q5_0")
            assert (proj.packed.perm is not None) == (variant == "gptq-act-order")  # x taken in the stored order


@pytest.mark.slow
def test_int4_checkpoints_match_with_preemption_and_tensor_parallelism(int4_models, tmp_path):
    folder, _, prompts, refs = int4_models["awq"]
    pipe, outs = run(folder, prompts, max_batch_tokens=16, block_size=4, num_blocks=14)
    assert_matches(outs, refs)
    assert pipe.engine.scheduler.num_preemptions > 0
    runs, expected = [], []
    # each rank's shards cut at group boundaries, row- and column-parallel; act-order's rows only (its row-parallel
    # layers' groups span both ranks: dequantized)
    for variant in ("awq", "gptq-sym", "gptq-act-order"):
        folder, _, prompts, refs = int4_models[variant]
        runs.append(dict(model=str(folder), prompts=prompts, new=NEW, budget=16, block_size=4, num_blocks=64))
        expected.append(refs)
    for tokens, refs in zip(engine_tokens(runs, tmp_path / "out"), expected, strict=True):
        assert_matches([SimpleNamespace(token_ids=t) for t in tokens], refs)


@pytest.mark.slow
@pytest.mark.cuda(interpreted=True)
@pytest.mark.parametrize("variant", ["awq", "gptq-act-order"])  # zero points; act-order's permuted input
def test_int4_checkpoints_match_on_the_triton_kernels(int4_models, variant):
    """The int4 kernel in the engine, decode (split over the input) and prompt tiles, act-order's permuted input
    too: interpreted on a CPU (a subprocess, so TRITON_INTERPRET=1 is set before triton is first imported), compiled
    on a GPU."""
    folder, _, prompts, refs = int4_models[variant]
    tokens, qkv_form = triton_tokens(folder, prompts, NEW)
    assert qkv_form == "Int4Linear"  # served in int4, not dequantized
    assert_matches([SimpleNamespace(token_ids=t) for t in tokens], refs)


KERNEL_SCRIPT = """
import json, sys
import torch
from fastgen.kernels.int4 import Int4Tensor, pack_nibbles, int4_linear_reference
from fastgen.kernels.triton_int4 import _tiles, int4_linear, pack_int4
device = "cuda" if torch.cuda.is_available() else "cpu"
dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
results = []
for rows, out, fan_in, group, dtype, bias, act_order in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(rows * 1000 + out)
    q = torch.randint(0, 16, (out, fan_in), generator=gen)
    zeros = torch.randint(0, 16, (out, fan_in // group), generator=gen).to(torch.uint8)
    scales = (torch.rand(out, fan_in // group, generator=gen) * 0.05 + 0.001).half()
    perm = torch.randperm(fan_in, generator=gen) if act_order else None
    w = Int4Tensor(pack_nibbles(q), scales, zeros, group, perm)
    half = out // 2 // 8 * 8
    packed = pack_int4([(half, w.narrow(0, half, out - half)), (0, w.narrow(0, 0, half))], out)
    x = torch.randn(rows, fan_in, generator=gen).to(dtypes[dtype])
    b = torch.randn(out, generator=gen).to(dtypes[dtype]) if bias else None
    y = int4_linear(x.to(device), packed, None if b is None else b.to(device)).cpu()
    ref = int4_linear_reference(x.double(), w, None if b is None else b.double())
    err = ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()
    results.append([list(_tiles(rows, out, fan_in, group)), err, y.dtype == x.dtype, list(y.shape)])
print(json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.cuda(interpreted=True)
def test_the_triton_int4_kernel_matches_the_reference():
    """Decode shapes split across the input (SPLIT_K > 1) and prompt tiles, bias or none, groups of 32 to 128, an
    output not a multiple of the tile, parts joined out of order: float32 to rounding, float16 to its precision."""
    cases = [  # rows, out, in, group, dtype, bias, act-order
        [1, 96, 256, 128, "float32", False, False],
        [5, 80, 512, 64, "float16", True, False],
        [16, 72, 128, 32, "float32", True, True],
        [37, 200, 256, 32, "float32", True, False],
        [40, 64, 256, 128, "float16", False, True],
    ]
    if torch.cuda.is_available():  # the interpreter gets bfloat16 wrong on a CPU (tests/test_triton_kernels.py)
        cases.append([3, 96, 256, 128, "bfloat16", True, False])
    results = run_on_triton(KERNEL_SCRIPT, cases)
    assert isinstance(results, list)
    tolerance = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
    for (rows, features, _, _, dtype, _, _), (tiles, err, same_dtype, shape) in zip(cases, results, strict=True):
        assert same_dtype and shape == [rows, features]
        assert err < tolerance[dtype], (rows, features, dtype, tiles, err)
    splits = [tiles[3] for tiles, *_ in results]
    assert splits[0] > 1 and splits[1] > 1 and splits[3] == 1  # both shapes of call ran


def test_a_folder_is_found_int4_by_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    fmt = int4_format(load_hf_config(Path(tmp_path)))
    assert fmt is not None and fmt.group_size == 128 and fmt.zeros_minus_one


def test_quantization_awq_or_gptq_asks_for_that_format(int4_models):
    folder, _, prompts, refs = int4_models["gptq-sym"]
    with pytest.raises(ValueError, match=r"--quantization awq, but .*gptq-sym is a GPTQ checkpoint: pass"):
        pipeline(str(folder), quantization="awq", progress=False)
    pipe, outs = run(folder, prompts[:2], quantization="gptq", kernels="torch")
    assert_matches(outs, refs[:2])


def test_an_int4_config_with_dummy_weights_holds_int4_layers(tmp_path):
    """load_format dummy of an AWQ config (the llama-3-8b-awq preset's case, shrunk): every projection of the decoder
    layers random int4 in the kernels' form, the LM head float; the engine serves it."""
    config = json.loads((Path(__file__).parents[1] / "replica/presets/llama-3-8b-awq/config.json").read_text())
    config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    config.update(num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    pipe = pipeline(str(tmp_path), load_format="dummy", dtype="float32", progress=False)
    model = pipe.engine.runner.model
    for proj in (model.layers[1].self_attn.qkv_proj, model.layers[1].mlp.down_proj):
        assert isinstance(proj.packed, QuantLinear) and proj.weight is None
        assert proj.packed.slabs[0][1].name == "Q4_0"  # zeros 8: symmetric
    assert not isinstance(model.lm_head.packed, QuantLinear)
    (out,) = pipe([[5, 6, 7]], max_new_tokens=4, min_new_tokens=4)
    assert len(out.token_ids) == 4


# ---- the real compiler (tests/test_triton_kernels.py says why): the kernel lowered for sm_90 and sm_80, no GPU ---
def _fresh_triton_int4():
    """A private copy of kernels/triton_int4.py decorated for the compiler (an interpreted copy may be in sys.modules,
    imported by another test module); sys.modules and the environment are left as they were."""
    import importlib

    import fastgen.kernels as package

    name = "fastgen.kernels.triton_int4"
    saved, saved_attr = sys.modules.pop(name, None), package.__dict__.pop("triton_int4", None)
    saved_flag = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)
        package.__dict__.pop("triton_int4", None)
        if saved is not None:
            sys.modules[name] = saved
        if saved_attr is not None:
            package.__dict__["triton_int4"] = saved_attr
        if saved_flag is not None:
            os.environ["TRITON_INTERPRET"] = saved_flag


@pytest.mark.slow
def test_the_int4_kernel_compiles_for_gpus_and_reads_nothing_on_the_host(monkeypatch):
    """Every launch a decode or prompt call makes, from meta tensors (no data: a host read or a data-dependent shape
    would raise, so the call is CUDA-graph safe), compiled to a cubin for sm_90 and sm_80."""
    triton = pytest.importorskip("triton")
    if not isinstance(triton.language.standard.sum, triton.runtime.JITFunction):
        pytest.skip("triton was first imported with TRITON_INTERPRET=1 in this session, so it cannot compile")
    from .test_triton_kernels import _compile_for_gpu, _Recorder

    ti = _fresh_triton_int4()
    recorder = _Recorder(ti._int4_matmul_kernel)
    monkeypatch.setattr(ti, "_int4_matmul_kernel", recorder)
    out, fan_in, group = 4096, 4096, 128
    for rows, dtype, bias, act_order in [
        (1, torch.bfloat16, False, False),
        (8, torch.float16, True, True),
        (512, torch.bfloat16, True, False),
        (40, torch.float32, False, False),
    ]:
        meta = dict(device="meta")
        packed = ti.Int4Linear(
            torch.empty(out, fan_in // 8, dtype=torch.int32, **meta),
            torch.empty(out, fan_in // group, dtype=torch.float16, **meta),
            torch.empty(out, fan_in // group, dtype=torch.uint8, **meta),
            group,
            torch.empty(fan_in, dtype=torch.int64, **meta) if act_order else None,
        )
        x = torch.empty(rows, fan_in, dtype=dtype, **meta)
        y = ti.int4_linear(x, packed, torch.empty(out, dtype=dtype, **meta) if bias else None)
        assert y.shape == (rows, out) and y.dtype == dtype
    assert len(recorder.launches) == 4
    for args, kwargs in recorder.launches:
        # meta tensors carry no address: stand-ins on the CPU of the same dtypes specialise the same way
        args = [torch.empty(1, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        for capability in (90, 80):
            assert _compile_for_gpu(recorder.kernel, args, kwargs, capability).asm["cubin"]


def test_a_gptq_checkpoint_without_g_idx_reads_in_group_order(int4_models):
    """Some writers leave g_idx out where the groups are in order: the layers read as with it."""
    folder, reference, _, _ = int4_models["gptq-sym"]
    fmt = int4_format(load_hf_config(folder))
    assert fmt is not None
    tensors = [(n, t) for n, t in iter_safetensors(folder, progress=False) if not n.endswith(".g_idx")]
    expected = safe_open(str(reference / "model.safetensors"), framework="pt")
    read = dict(iter_int4(tensors, fmt))
    assert all(
        torch.equal(v.dequantize() if isinstance(v, Int4Tensor) else v, expected.get_tensor(n)) for n, v in read.items()
    )
    assert sum(isinstance(v, Int4Tensor) for v in read.values()) == 3 * 7


CHECKS_SCRIPT = """
import json, torch
from fastgen.benchmarks.kernels import quantized_linear_checks
from fastgen.kernels import select_kernels
device = "cuda" if torch.cuda.is_available() else "cpu"
print(json.dumps(quantized_linear_checks(select_kernels("triton", device), torch.float16, device, 256)))
"""


@pytest.mark.slow
@pytest.mark.cuda(interpreted=True)
def test_the_gpu_suites_quantized_checks_run():
    """The GPU suite's kernel_accuracy rows for int4 and fp8 (benchmarks/kernels.py), at a small size: they run and
    pass here, so the one GPU run does not spend its time on a broken check."""
    rows = run_on_triton(CHECKS_SCRIPT)
    assert isinstance(rows, list) and len(rows) == 6
    assert all(err < tol for _, _, err, tol in rows), rows
