"""Multi-LoRA serving: adapters made here with peft on the tiny random Llama, served together in one batch, each
adapter's greedy tokens equal to transformers running the model with that adapter merged (peft's merge_and_unload);
the slot pool's LRU eviction, the prefix cache kept apart per adapter, and adapters refused with what to change."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastgen.prefix_hash import adapter_salt, prefix_hashes
from fastgen.replica import pipeline
from fastgen.replica.config import LoraConfig, parse_lora_module
from fastgen.replica.lora_pool import LoraPool, UnknownAdapter

from .helpers import assert_matches, hf_greedy, in_process_replica
from .tp_ranks import engine_rank, run_ranks

peft = pytest.importorskip("peft")

# name -> (rank, alpha, target modules, rsLoRA): different ranks and targets, the packed layers' parts apart
ADAPTERS = {
    "qv": (4, 8, ["q_proj", "v_proj", "down_proj"], False),
    "all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp": (2, 4, ["up_proj", "o_proj"], False),
}
NEW = 8


def make_adapter(base: Path, out: Path, name: str, seed: int) -> Path:
    """Saves a random LoRA adapter (B non-zero and large enough to change the greedy tokens) to out/name, and the
    model with it merged to out/name-merged; returns the adapter's folder."""
    from transformers import AutoModelForCausalLM

    rank, alpha, targets, rslora = ADAPTERS[name]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    lora_model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param_name, p in lora_model.named_parameters():
            if "lora_" in param_name:
                p.normal_(0, 0.3)
    lora_model.save_pretrained(out / name)
    lora_model.merge_and_unload().save_pretrained(out / f"{name}-merged", safe_serialization=True)
    return out / name


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(9, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def lora_setup(tiny_model_dir, tmp_path_factory):
    """(base folder, adapter folders, prompts, transformers' tokens per adapter name ("" the base)), built once."""
    root = tmp_path_factory.mktemp("lora")
    folders = {name: make_adapter(tiny_model_dir, root, name, i) for i, name in enumerate(ADAPTERS)}
    prompts = prompts_for(0, 3)
    refs = {"": hf_greedy(tiny_model_dir, prompts, NEW)}
    for name in ADAPTERS:
        refs[name] = hf_greedy(root / f"{name}-merged", prompts, NEW)
    for name in ADAPTERS:  # the adapters change the tokens: else the comparison could not fail
        assert refs[name] != refs[""]
    return tiny_model_dir, folders, prompts, refs


def lora_pipe(base, folders, names=None, max_loras=4, **options):
    modules = tuple((n, str(folders[n])) for n in (names or folders))
    config = LoraConfig(enable_lora=True, lora_modules=modules, max_loras=max_loras, max_lora_rank=8)
    return pipeline(str(base), dtype="float32", progress=False, lora=config, **options)


def mixed(prompts, refs, names):
    """Every prompt under every name, the names interleaved: (prompts, adapter per prompt, expected tokens)."""
    ps, ls, rs = [], [], []
    for i, p in enumerate(prompts):
        for name in names:
            ps.append(p)
            ls.append(name)
            rs.append(refs[name][i])
    return ps, ls, rs


def test_adapters_and_the_base_match_transformers_in_one_batch(lora_setup):
    base, folders, prompts, refs = lora_setup
    ps, ls, rs = mixed(prompts, refs, ["", *ADAPTERS])
    pipe = lora_pipe(base, folders, max_batch_tokens=16, block_size=4)  # prompts split across passes
    runner, mixes = pipe.engine.runner, []
    run = runner.run

    def recording(batch):  # how many adapters (and the base: -1) each pass carried
        mixes.append(len({s.lora_slot for s in batch.seqs}))
        return run(batch)

    runner.run = recording
    assert_matches(pipe(ps, lora=ls, max_new_tokens=NEW, min_new_tokens=NEW), rs)
    assert pipe.engine.loras.num_loads == len(ADAPTERS)
    assert max(mixes) == len(ADAPTERS) + 1  # some pass carried every adapter and the base together


def test_adapters_match_with_preemption_and_eviction(lora_setup):
    base, folders, prompts, refs = lora_setup
    ps, ls, rs = mixed(prompts, refs, ["all", "", "qv", "mlp", "all"])
    # Two slots for three adapters: sequences wait for a slot and evict the least recently used idle adapter; 20
    # blocks of 4 tokens hold few sequences, so some are preempted and recomputed.
    pipe = lora_pipe(base, folders, max_loras=2, max_batch_tokens=16, block_size=4, num_blocks=20)
    assert_matches(pipe(ps, lora=ls, max_new_tokens=NEW, min_new_tokens=NEW), rs)
    assert pipe.engine.scheduler.num_preemptions > 0
    assert pipe.engine.loras.num_loads > len(ADAPTERS)  # an evicted adapter came back


def test_prefix_cache_is_not_shared_across_adapters(lora_setup):
    base, folders, prompts, refs = lora_setup
    pipe = lora_pipe(base, folders, block_size=4)
    prompt = prompts[0]
    first = pipe([prompt], lora="qv", max_new_tokens=NEW, min_new_tokens=NEW)
    again = pipe.engine
    assert_matches(first, [refs["qv"][0]])
    for name in ("", "all", "qv"):  # the same prompt after "qv" ran it: only "qv" itself finds it cached
        rid = f"r-{name}"
        again.add_request(rid, prompt, pipe_params(), lora=name)
        outs = run_to_end(again)
        cached = outs[rid].cached_prompt_tokens
        assert (cached > 0) == (name == "qv"), (name, cached)
        assert_matches([outs[rid]], [refs[name][0]])
    assert adapter_salt("s", "") == "s" and prefix_hashes(prompt, 4, adapter_salt("", "a")) != prefix_hashes(prompt, 4)


def pipe_params():
    from fastgen.replica.request import SamplingParams

    return SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)


def run_to_end(engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out
    return done


def test_unknown_and_bad_adapters_are_refused(lora_setup, tmp_path):
    base, folders, prompts, refs = lora_setup
    pipe = lora_pipe(base, folders, names=["qv"])
    engine = pipe.engine
    with pytest.raises(UnknownAdapter, match="unknown LoRA adapter 'nope': this replica serves qv"):
        engine.add_request("x", prompts[0], pipe_params(), lora="nope")
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="rank 8 but --max-lora-rank is 4: raise --max-lora-rank"):
        config = LoraConfig(enable_lora=True, lora_modules=(("all", str(folders["all"])),), max_lora_rank=4)
        pipeline(str(base), dtype="float32", progress=False, lora=config)
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(ValueError, match="needs adapter_config.json and adapter_model.safetensors"):
        engine.add_lora("bad", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes((folders["qv"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="DoRA"):
        engine.add_lora("bad", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ValueError, match="PREFIX_TUNING adapter: FastGen serves LoRA"):
        engine.add_lora("bad", str(bad))
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("qv", str(folders["mlp"]))
    no_lora = pipeline(str(base), dtype="float32", progress=False)
    with pytest.raises(ValueError, match="LoRA is off: start with --enable-lora"):
        no_lora.engine.add_request("x", prompts[0], pipe_params(), lora="qv")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("qv")
    with pytest.raises(ValueError, match="needs --enable-lora"):
        LoraConfig(lora_modules=(("a", "/x"),))


def test_load_and_unload_at_run_time(lora_setup):
    from fastgen.replica.request import SamplingParams

    base, folders, prompts, refs = lora_setup
    pipe = lora_pipe(base, folders, names=["qv"])
    engine = pipe.engine
    engine.add_lora("mlp", str(folders["mlp"]))
    engine.add_request("r", prompts[1], pipe_params(), lora="mlp")
    with pytest.raises(ValueError, match="unfinished requests: retry later"):
        engine.remove_lora("mlp")
    assert_matches([run_to_end(engine)["r"]], [refs["mlp"][1]])
    engine.remove_lora("mlp")
    assert engine.loras.names() == ["qv"]
    # n = 2 under an adapter: the forked completion runs under it too (greedy: both the adapter's tokens)
    engine.add_request("n2", prompts[2], SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, n=2), lora="qv")
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.finished]
    assert sorted(o.index for o in outs) == [0, 1]
    assert_matches(outs, [refs["qv"][2]] * 2)
    with pytest.raises(UnknownAdapter):
        engine.add_request("r2", prompts[1], pipe_params(), lora="mlp")


def test_the_pool_evicts_the_least_recently_used_idle_adapter():
    pool = LoraPool(2)
    for name in "abc":
        pool.add(name, f"/{name}")
    assert pool.acquire("a") == 0 and pool.acquire("b") == 1
    assert not pool.can_acquire("c")  # both slots held
    pool.release("a")
    pool.release("b")
    assert pool.acquire("b") == 1  # resident: no load
    pool.release("b")
    assert pool.acquire("c") == 0  # a is the least recently used idle adapter
    assert pool.drain_loads() == [(0, "/a"), (1, "/b"), (0, "/c")] and pool.drain_loads() == []
    assert sorted(pool.resident()) == ["b", "c"]


@pytest.mark.slow  # two spawned ranks building the engine: ~10 s
def test_adapters_match_under_tensor_parallelism(lora_setup, tmp_path):
    base, folders, prompts, refs = lora_setup
    ps, ls, rs = mixed(prompts, refs, ["", "qv", "all"])
    run = dict(model=str(base), prompts=ps, new=NEW, budget=16, block_size=4, num_blocks=40)
    run["lora"] = dict(modules=[[n, str(f)] for n, f in folders.items()], max_loras=2, max_rank=8, names=ls)
    run_ranks(engine_rank, [run], str(tmp_path / "out"), timeout=300)
    result = json.loads((tmp_path / "out.0").read_text())[0]
    assert_matches([SimpleNamespace(token_ids=t) for t in result["tokens"]], rs)


def test_adapters_by_name_through_the_replica_service(lora_setup):
    """A real gRPC server: lora_name picks the adapter (its tokens are transformers + peft's), an unknown name is
    NOT_FOUND before any work."""
    import asyncio

    import grpc

    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import CacheConfig, EngineConfig
    from fastgen.server import AsyncClient, GenerationError

    base, folders, prompts, refs = lora_setup
    modules = tuple((n, str(f)) for n, f in folders.items())

    def build():
        lora = LoraConfig(enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=8)
        config = EngineConfig(model=str(base), dtype="float32", cache=CacheConfig(num_blocks=64), lora=lora)
        return build_engine(config)

    async def main():
        async with in_process_replica(build) as (port, _):
            async with AsyncClient(f"127.0.0.1:{port}", timeout=60) as client:
                calls = [
                    client.generate(prompts[0], lora_name=name, max_new_tokens=NEW, min_new_tokens=NEW)
                    for name in ("all", "", "qv")
                ]
                results = await asyncio.gather(*calls)
                assert_matches(results, [refs["all"][0], refs[""][0], refs["qv"][0]])
                with pytest.raises(GenerationError) as err:
                    await client.generate(prompts[0], lora_name="nope", max_new_tokens=2)
                assert (
                    err.value.code == grpc.StatusCode.NOT_FOUND and "unknown LoRA adapter 'nope'" in err.value.details
                )

    asyncio.run(main())


@pytest.mark.slow  # a deployment of two replicas and a balancer: ~20 s
def test_adapters_through_a_deployment_and_the_openai_sdk(lora_setup, tmp_path):
    """fastgen-deploy with --enable-lora: `model` names the adapter (tokens equal transformers + peft's on both
    replicas), /v1/models lists the adapters, /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run
    time behind the API key while requests are in flight, and the balancer refuses an adapter no replica serves."""
    import os
    import signal
    import threading
    import urllib.error
    import urllib.request

    import openai

    from fastgen.launch.config import API_KEY_ENV

    from .helpers import Deploy, alive, free_port, tiny_start

    base, folders, prompts, refs = lora_setup
    key, name = "sk-lora", "lora"
    deploy = Deploy(tmp_path / "home")
    deploy.env[API_KEY_ENV] = key
    port = free_port(3)
    metrics = free_port(3)
    http = free_port(1)
    lora = ["--enable-lora", "--lora-modules", f"qv={folders['qv']}", "--max-loras", "2", "--max-lora-rank", "8"]
    done = deploy(*tiny_start(name, base, 2, port, metrics, "--dtype", "float32", *lora, http_port=http), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    url = f"http://127.0.0.1:{http}/v1"

    def post(path: str, body: dict, api_key: str = key) -> tuple[int, str]:
        request = urllib.request.Request(
            url + path, json.dumps(body).encode(), {"Authorization": f"Bearer {api_key}"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def complete(model: str, i: int) -> str:
        extra = {"min_tokens": NEW}
        out = client.completions.create(model=model, prompt=prompts[i], max_tokens=NEW, temperature=0, extra_body=extra)
        return out.choices[0].text

    def matches(got: str, ref: list[int]) -> bool:
        """The HTTP API answers text: the reference's text (a prefix where transformers' tokens stop at a near-tie)."""
        want = tokenizer.decode(ref, skip_special_tokens=True)
        return got == want if len(ref) == NEW else got.startswith(want)

    try:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        ids = [m.id for m in client.models.list().data]
        assert ids[1:] == ["qv"]
        for i in range(2):  # both replicas serve it (round robin or least loaded: two calls may land on each)
            assert matches(complete("qv", i), refs["qv"][i]) and matches(complete(ids[0], i), refs[""][i])
        assert post("/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(folders["mlp"])}, "wrong")[0] == 401
        busy = threading.Thread(target=lambda: [complete("qv", 2) for _ in range(3)])
        busy.start()  # requests in flight while adapters come and go
        status, body = post("/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(folders["mlp"])})
        assert status == 200 and "added successfully" in body
        assert matches(complete("mlp", 1), refs["mlp"][1])
        assert [m.id for m in client.models.list().data][1:] == ["mlp", "qv"]
        status, body = post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
        assert status == 400 and "adapter_config.json" in body
        assert post("/unload_lora_adapter", {"lora_name": "mlp"})[0] == 200
        busy.join()
        with pytest.raises(openai.NotFoundError):
            complete("mlp", 0)
    finally:
        deploy("stop", "--name", name, "--timeout", "10")
        for pid in deploy.seen_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_balancer_routes_by_adapter():
    """Replicas that do not serve a request's adapter are no candidates; among equal loads one holding the adapter in
    a slot wins; the prefix key of an adapter's prompt is the replica's (its own salt)."""
    from fastgen.balancer.policy import ReplicaLoad, least_loaded, prefix_aware
    from fastgen.balancer.pool import Replica
    from fastgen.balancer.prefix_index import PromptHasher
    from fastgen.proto import fastgen_pb2 as pb

    idle, resident = ReplicaLoad(), ReplicaLoad(lora_resident=True)
    for pick in (least_loaded, prefix_aware):
        assert pick({0: idle, 1: resident}, 0, 2) == 1
    assert least_loaded({0: idle, 1: dataclasses.replace(resident, in_flight=1)}, 0, 2) == 0  # load comes first
    replica = Replica.__new__(Replica)
    replica.reports, replica.status = 0, pb.ReplicaStatus()
    assert replica.serves("qv")  # not reported yet: the replica answers for itself
    replica.reports, replica.status = 1, pb.ReplicaStatus(lora_adapters=["qv"], resident_lora_adapters=["qv"])
    assert replica.serves("qv") and replica.serves("") and not replica.serves("mlp")
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 20))), lora_name="qv")
    key = PromptHasher().key(request, 4)
    assert key.hashes == tuple(prefix_hashes(list(range(3, 20)), 4, adapter_salt("", "qv")))
    assert PromptHasher().key(pb.GenerateRequest(token_ids=request.token_ids), 4).hashes != key.hashes


@pytest.mark.slow  # SmolLM2-135M in float32 under transformers (base and each adapter) and FastGen: ~15 s
def test_adapters_on_the_embedded_smollm2_match_transformers(tmp_path):
    """Real weights: two peft adapters of different ranks and targets on SmolLM2-135M, mixed with the base in one
    batch split across passes, each adapter's greedy tokens equal to transformers with the adapter merged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastgen.replica.weights import resolve_model

    folder = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = ["The capital of France is", "def fibonacci(n):\n", "List three colors: red,"]
    prompts = [tokenizer(t).input_ids for t in texts]
    specs = {"attn": (4, ["q_proj", "v_proj", "o_proj"], 0.05), "mlp": (8, ["gate_proj", "down_proj"], 0.05)}
    refs = {"": []}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs[""] = [generate(model, p) for p in prompts]
    for seed, (name, (rank, targets, std)) in enumerate(specs.items()):
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        lora_model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        torch.manual_seed(seed)
        with torch.no_grad():
            for param_name, p in lora_model.named_parameters():
                if "lora_" in param_name:
                    p.normal_(0, std)
        lora_model.save_pretrained(tmp_path / name)
        refs[name] = [generate(lora_model.merge_and_unload().eval(), p) for p in prompts]
        assert refs[name] != refs[""]
    modules = tuple((n, str(tmp_path / n)) for n in specs)
    config = LoraConfig(enable_lora=True, lora_modules=modules, max_loras=2, max_lora_rank=8)
    pipe = pipeline("smollm2-135m", dtype="float32", max_batch_tokens=8, progress=False, lora=config)
    ps, ls, rs = mixed(prompts, refs, ["", *specs])
    for out, ref in zip(pipe(ps, lora=ls, max_new_tokens=SMOL_NEW, min_new_tokens=SMOL_NEW), rs, strict=True):
        assert out.token_ids == ref


SMOL_NEW = 12


def generate(model, ids: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=SMOL_NEW, min_new_tokens=SMOL_NEW, do_sample=False, pad_token_id=2
    )
    return out[0, len(ids) :].tolist()


TRITON_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from fastgen.replica import pipeline
from fastgen.replica.config import LoraConfig
base, modules, prompts, names, new = json.loads(sys.argv[1])
config = LoraConfig(enable_lora=True, lora_modules=tuple(map(tuple, modules)), max_loras=2, max_lora_rank=8)
options = dict(dtype="float32", kernels="triton", device="auto", max_batch_tokens=16, block_size=8, progress=False)
pipe = pipeline(base, lora=config, **options)
assert pipe.engine.runner.graphs is None  # LoRA steps run eagerly
print(json.dumps([o.token_ids for o in pipe(prompts, lora=names, max_new_tokens=new, min_new_tokens=new)]))
"""


@pytest.mark.slow  # the Triton interpreter on CPU, in a subprocess (TRITON_INTERPRET before triton's import)
@pytest.mark.cuda(interpreted=True)
def test_adapters_match_on_the_triton_kernels(lora_setup):
    import os
    import subprocess
    import sys

    base, folders, prompts, refs = lora_setup
    ps, ls, rs = mixed(prompts[:2], refs, ["", "qv", "all"])
    modules = [[n, str(folders[n])] for n in ("qv", "all")]
    env = dict(os.environ) if torch.cuda.is_available() else dict(os.environ, TRITON_INTERPRET="1")
    arg = json.dumps([str(base), modules, ps, ls, NEW])
    out = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, arg], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert_matches([SimpleNamespace(token_ids=t) for t in json.loads(out.stdout.strip().splitlines()[-1])], rs)
