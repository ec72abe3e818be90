"""Mixtures of experts equal transformers (eager attention, float32) token for token: tiny random Mixtral, Qwen2-MoE
(a shared expert, a dense layer among the sparse ones, no renormalisation) and Qwen3-MoE (q/k norms, top-3
renormalised) built from transformers' config classes and saved as safetensors; prompts split across passes, on the
torch and the C kernels, with preemption, and under tensor and expert parallelism (2 ranks, gloo)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastgen.replica.models import ModelConfig
from fastgen.replica.weights import load_hf_config

from .helpers import assert_matches
from .test_model_families import NEW, hf_greedy_eager, make_family_model, prompts_for, run
from .tp_ranks import engine_rank, run_ranks

MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True),
    ),
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """family -> (folder, prompts, transformers' tokens), built once per module."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for i, family in enumerate(MOE_FAMILIES):
        folder = make_family_model(root / family, family, seed=100 + i, families=MOE_FAMILIES)
        prompts = prompts_for(100 + i)
        out[family] = (folder, prompts, hf_greedy_eager(folder, prompts, NEW))
    return out


def test_configs_name_the_sparse_layers_and_routing(tmp_path):
    q2 = ModelConfig.from_hf(load_hf_config(make_family_model(tmp_path / "q2", "qwen2-moe", families=MOE_FAMILIES)))
    assert q2.moe.sparse_layers == (True, False, True) and not q2.moe.renormalize and q2.qkv_bias
    assert (q2.moe.num_experts, q2.moe.experts_per_token, q2.moe.intermediate_size) == (8, 2, 48)
    assert q2.moe.shared_expert_intermediate_size == 96
    q3 = ModelConfig.from_hf({**load_hf_config(tmp_path / "q2"), "architectures": ["Qwen3MoeForCausalLM"]})
    assert q3.qk_norm and q3.moe.shared_expert_intermediate_size == 96  # read as given
    sparse_step = {**load_hf_config(tmp_path / "q2"), "mlp_only_layers": [], "decoder_sparse_step": 2}
    assert ModelConfig.from_hf(sparse_step).moe.sparse_layers == (False, True, False)
    mix = ModelConfig.from_hf(load_hf_config(make_family_model(tmp_path / "mx", "mixtral", families=MOE_FAMILIES)))
    assert mix.moe.renormalize and mix.moe.sparse_layers == (True,) * 3 and mix.moe.active_fraction() == 0.25


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_moe_matches_transformers_across_budgets(moe_models, family, kernels):
    folder, prompts, refs = moe_models[family]
    for budget in (7, 64):  # 7: every prompt split across passes
        assert_matches(run(folder, prompts, max_batch_tokens=budget, kernels=kernels)[1], refs)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_matches_with_preemption(moe_models, family):
    folder, prompts, refs = moe_models[family]
    pipe, outs = run(folder, prompts, max_batch_tokens=16, block_size=4, num_blocks=14)
    assert_matches(outs, refs)
    assert pipe.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_moe_matches_under_tensor_and_expert_parallelism(moe_models, tmp_path):
    """Every family twice on 2 ranks: experts split by intermediate rows, then by whole experts."""
    runs, expected = [], []
    for expert_parallel in (False, True):
        for folder, prompts, refs in moe_models.values():
            runs.append(
                dict(
                    model=str(folder),
                    prompts=prompts,
                    new=NEW,
                    budget=16,
                    block_size=4,
                    num_blocks=14,
                    expert_parallel=expert_parallel,
                )
            )
            expected.append(refs)
    run_ranks(engine_rank, runs, str(tmp_path / "out"), timeout=300)
    results = json.loads((tmp_path / "out.0").read_text())
    for result, refs in zip(results, expected, strict=True):
        assert_matches([SimpleNamespace(token_ids=t) for t in result["tokens"]], refs)
    # each rank holds half of the experts' weights either way
    held = [json.loads((tmp_path / f"out.{r}").read_text())[0]["numel"] for r in (0, 1)]
    assert held[0] == held[1]


def test_transformers5_fused_experts_load_as_per_expert_tensors(tmp_path):
    """A checkpoint with each layer's experts fused (experts.gate_up_proj / experts.down_proj, transformers 5's
    in-memory form) gives the same logits as the per-expert tensors real checkpoints ship."""
    from fastgen.kernels import TORCH_KERNELS
    from fastgen.replica.models import DecoderModel
    from fastgen.replica.parallel import TPGroup
    from fastgen.replica.weights import iter_safetensors

    folder = make_family_model(tmp_path / "q3", "qwen3-moe", families=MOE_FAMILIES)
    cfg = ModelConfig.from_hf(load_hf_config(folder))
    tensors = load_file(folder / "model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        e = range(cfg.moe.num_experts)
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{i}.gate_proj.weight"], tensors[f"{p}.{i}.up_proj.weight"]]) for i in e]
        )
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{i}.down_proj.weight"] for i in e])
    other = tmp_path / "fused"
    other.mkdir()
    (other / "config.json").write_text((folder / "config.json").read_text())
    save_file(fused, other / "model.safetensors")
    models = []
    for source in (folder, other):
        model = DecoderModel(cfg, TPGroup(), TORCH_KERNELS)
        model.load_weights(iter_safetensors(source, progress=False))
        models.append(model)
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_expert_parallelism_needs_experts_divisible_by_ranks():
    from fastgen.kernels import TORCH_KERNELS
    from fastgen.replica.models.moe import FusedExperts, MoEConfig
    from fastgen.replica.parallel import TPGroup

    moe = MoEConfig(num_experts=6, experts_per_token=2, intermediate_size=8, renormalize=True, sparse_layers=(True,))
    with pytest.raises(ValueError, match=r"experts \(6\) is not divisible by the tensor-parallel size 4"):
        FusedExperts(moe, 16, TPGroup(0, 4), True, TORCH_KERNELS)
    assert FusedExperts(moe, 16, TPGroup(1, 2), True, TORCH_KERNELS).first == 3


def test_a_rank_skips_the_slots_of_experts_it_does_not_hold():
    """Expert parallel: each rank's share computed by the torch kernels, summed, is the whole layer's output."""
    from fastgen.kernels import TORCH_KERNELS
    from fastgen.kernels.moe import route
    from fastgen.replica.models.moe import FusedExperts, MoEConfig
    from fastgen.replica.parallel import TPGroup

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=8, renormalize=True, sparse_layers=(True,))
    w13, w2, x = torch.randn(4, 16, 16), torch.randn(4, 16, 8), torch.randn(5, 16)
    routing = route(torch.randn(5, 4), 2, True)
    whole = FusedExperts(moe, 16, TPGroup(), False, TORCH_KERNELS)
    shares = [FusedExperts(moe, 16, TPGroup(r, 2), True, TORCH_KERNELS) for r in (0, 1)]
    for experts in (whole, *shares):
        for e in range(4):
            experts.load_expert(e, "gate_proj", w13[e, :8])
            experts.load_expert(e, "up_proj", w13[e, 8:])
            experts.load_expert(e, "down_proj", w2[e])
    torch.testing.assert_close(shares[0](x, routing) + shares[1](x, routing), whole(x, routing))


@pytest.mark.slow
@pytest.mark.cuda(interpreted=True)
def test_moe_matches_on_the_triton_kernels(moe_models):
    """Triton's fused experts in the engine, the graphed decode path included (its alignment reads nothing on the
    host): interpreted on a CPU, compiled on a GPU. Qwen2-MoE: a shared expert and a dense layer too."""
    from .test_model_families import triton_tokens

    folder, prompts, refs = moe_models["qwen2-moe"]
    tokens, _ = triton_tokens(folder, prompts, NEW)
    assert_matches([SimpleNamespace(token_ids=t) for t in tokens], refs)
