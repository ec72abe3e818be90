"""The GPU suite: one command that measures FastGen on a CUDA machine and writes down what it found.

    python -m fastgen.benchmarks.gpu_suite --out DIR [--dry-run] [--budget-s S] [--stages a,b]

Stages, each isolated (a stage that fails records its error and the next one still runs), in the order a first GPU
run must learn things: are the kernels right, is the engine right, does it fit the memory, then how fast it is.
  environment      the GPU, driver, torch/triton/transformers versions, memory, measured copy bandwidth and bf16 matmul
                   rate
  kernel_accuracy  the Triton kernels (the int4 and fp8 linear layers too) against references in bf16 and fp16
                   at the real model's shape
  engine_tests     `pytest -m cuda` but the kernel tests, in a subprocess: the engine on CUDA, CUDA graphs replayed,
                   against transformers (full output in DIR/engine_tests.log)
  memory           a Llama-3-8B preset with dummy weights, its KV pool sized from device memory (0.9): what the
                   weights, the pool, the CUDA graphs and memory torch does not track hold, and the fullest step, a
                   full decode batch and a single decode timed; whether the device stayed within the utilization;
                   the launch overhead graphs remove (a single decode eager less graphed) as a share of the fullest
                   step, which bounds what piecewise graphs of mixed steps could gain
  kernel_tests     `pytest -m cuda` of the Triton kernel tests, compiled for the device (DIR/kernel_tests.log)
  kernels          decode attention and the fused kernels' bandwidth against the measured copy bandwidth
  offline      a Llama-3-8B preset with dummy weights in bf16: FastGen against transformers `generate`, and the decode
               step at batch 1 against the time to read the weights once, with CUDA graphs and without (--enforce-eager)
  offline_quantized  FastGen's side of the offline stage on the Llama-3-8B preset in AWQ int4 (Triton's int4
               kernel) and with --quantization fp8 (torch._scaled_mm): throughput, and the decode step at batch 1
               against the time to read its weights once
  offline_moe  the offline stage on a mixture of experts (the Qwen3-30B-A3B preset, 128 experts, 8 per token): its
               decode step against the time to read the weights a token routes through once (attention and 8 of 128
               experts a layer)
  sla          the paper's comparison at reduced size: splitfuse, prefill_first and the slo scheduler (holding the
               strictest floor, R = 6), effective throughput at P = 512, R = 2, 4, 6 (closed-loop clients on the
               in-process engine); the slo step-time model's error on the device, every step's prediction and
               measurement in DIR/sla_slo_steps.csv (and a plot where matplotlib is installed)

--budget-s plans the stages to fit that many seconds: each stage has an estimate (ESTIMATE_S, seconds on one H200;
the report records what each took, to correct them), the process's start-up is counted (STARTUP_S), stages that do not
fit are skipped and reported with why, and before each stage the time left is checked again (a stage that ran over its
estimate makes later ones skip, and the pytest stages' timeouts are cut to what is left).

Writes DIR/gpu_suite.json and DIR/gpu_suite.md after every stage (a run cut short keeps what finished); exit status 1
if any stage failed. --dry-run runs every stage at toy
size on the CPU (a shrunk preset, seconds), so that CI keeps the suite working; stages whose figures only mean
something on a GPU say "skipped: no CUDA" there, after running what can run on a CPU.
Imports only what the GPU machine has: torch, triton, transformers, pytest (as a subprocess) and FastGen.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import torch

from ..replica.config import SloConfig, preset_path
from ..replica.request import SamplingParams
from .stats import SLA, RequestRecord, summarize
from .workload import sample_length

REPO = Path(__file__).resolve().parents[1]
PROMPT_RATE = 512.0  # the paper's GPU settings (BENCHMARKS.md, "GPU profile")
TOKEN_RATES = (2.0, 4.0, 6.0)
# The floors for the GPU run; the suite reports them, it does not fail a stage on them.
FLOORS = {"decode_attention_of_copy": 0.70, "decode_step_over_bound": 1.3, "fastgen_over_transformers": 3.0}


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: FULL on the GPU, or a toy plan on the CPU (--dry-run)."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    model: str = "llama-3-8b"  # a preset name or a folder with config.json (dummy weights either way)
    copy_bytes: int = 2**30
    matmul_n: int = 8192
    attn_shape: dict = field(default_factory=lambda: dict(heads=32, kv_heads=8, head_dim=128))
    decode_attention: tuple[int, int] = (64, 2048)  # sequences x context
    single_decode_attention: int = 8192  # one sequence's context: 8 programs unsplit, flash-decoding's case
    mixed_attention: tuple[int, int, int] = (60, 4, 512)  # decodes, prompt chunks, chunk length
    fused_tokens: int = 8192
    fused_hidden: int = 4096
    tests_timeout_s: int = 240
    kv_cache_memory: int = 16 << 30
    offline_requests: int = 64
    offline_prompt: tuple[int, int] = (128, 512)
    offline_gen: int = 128
    offline_budget: int = 2048
    hf_batch: int = 16
    decode_steps: int = 32
    moe_model: str = "qwen3-30b-a3b"
    int4_model: str = "llama-3-8b-awq"  # the same architecture as `model`, its layers AWQ int4 (group 128)
    moe_requests: int = 32  # transformers' experts loop makes its side of the comparison slow: fewer requests
    sla_requests: int = 64
    sla_clients: int = 32
    sla_prompt_mean: int = 1024
    sla_gen: int = 60
    sla_budget: int = 2048


FULL = Plan()


def dry_plan(folder: Path, moe_folder: Path, int4_folder: Path | None = None) -> Plan:
    return Plan(
        device="cpu",
        dtype=torch.float32,
        model=str(folder),
        moe_model=str(moe_folder),
        int4_model=str(int4_folder or folder),
        moe_requests=4,
        copy_bytes=1 << 20,
        matmul_n=64,
        attn_shape=dict(heads=4, kv_heads=2, head_dim=32),
        decode_attention=(4, 64),
        single_decode_attention=300,
        mixed_attention=(3, 2, 16),
        fused_tokens=32,
        fused_hidden=64,
        tests_timeout_s=300,
        kv_cache_memory=64 << 20,
        offline_requests=4,
        offline_prompt=(8, 24),
        offline_gen=6,
        offline_budget=64,
        hf_batch=2,
        decode_steps=4,
        sla_requests=6,
        sla_clients=3,
        sla_prompt_mean=24,
        sla_gen=6,
        sla_budget=64,
    )


def toy_model(folder: Path, quantization_config: dict | None = None) -> Path:
    """The llama-3.2-1b preset shrunk to two small layers and a 4k vocabulary: its config, llama3 rope included (with
    a quantization_config: its layers random int4, toy_int4_model)."""
    config = json.loads((preset_path("llama-3.2-1b") / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=4096,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=8192,  # the llama3 rope's original context
    )
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def toy_int4_model(folder: Path) -> Path:
    """toy_model with the llama-3-8b-awq preset's quantization_config, in groups the toy's 64 features hold two of."""
    awq = json.loads((preset_path("llama-3-8b-awq") / "config.json").read_text())["quantization_config"]
    return toy_model(folder, {**awq, "group_size": 32})


def toy_moe_model(folder: Path) -> Path:
    """The qwen3-30b-a3b preset shrunk to two small layers of 8 experts, 2 per token."""
    config = json.loads((preset_path("qwen3-30b-a3b") / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Running stages
# ---------------------------------------------------------------------------------------------------------------


class Skipped(Exception):
    """A stage ran what it could and has no figure worth reporting here (e.g. no CUDA); results kept."""

    def __init__(self, reason: str, results: dict) -> None:
        super().__init__(reason)
        self.results = results


class StageFailed(Exception):
    """A stage that ran to the end and found a failure (e.g. failing tests); results kept."""

    def __init__(self, reason: str, results: dict) -> None:
        super().__init__(reason)
        self.results = results


@dataclass
class Context:
    plan: Plan
    out: Path
    dry_run: bool
    deadline: float | None = None  # time.perf_counter() by which the run must end (--budget-s)
    _peaks: tuple[float, float] | None = None

    def seconds_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    @property
    def cuda(self) -> bool:
        return self.plan.device.startswith("cuda")

    def timer(self):
        """ms of one call: triton's do_bench (CUDA events, median) on the GPU, a wall-clock median on the CPU."""
        if self.cuda:
            from .kernels import bench_ms

            return bench_ms
        return cpu_ms

    def peaks(self) -> tuple[float, float]:
        """(copy bytes/s, bf16 matmul flop/s), measured once per run."""
        if self._peaks is None:
            from .kernels import card_peaks

            p = self.plan
            self._peaks = card_peaks(p.device, p.copy_bytes, p.matmul_n, self.timer())
        return self._peaks


def cpu_ms(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def no_cuda(ctx: Context) -> str:
    return "no CUDA" if not torch.cuda.is_available() else "dry run"


def run_stage(name: str, fn, ctx: Context, index: int, total: int) -> dict:
    print(f"[gpu_suite] {index}/{total} {name}: running", flush=True)
    start = time.perf_counter()
    record = dict(name=name, status="ok", seconds=0.0, results={}, error=None)
    try:
        record["results"] = fn(ctx)
    except Skipped as e:
        record.update(status=f"skipped: {e}", results=e.results)
    except StageFailed as e:
        record.update(status="failed", results=e.results, error=str(e))
    except Exception as e:  # noqa: BLE001 - a stage's failure is recorded and the suite goes on
        record.update(status="failed", error="".join(traceback.format_exception(e))[-4000:])
    finally:
        release_memory(ctx)
    record["seconds"] = round(time.perf_counter() - start, 1)
    error = f": {record['error'].strip().splitlines()[-1]}" if record["error"] else ""
    print(f"[gpu_suite] {index}/{total} {name}: {record['status']} in {record['seconds']} s{error}", flush=True)
    return record


def release_memory(ctx: Context) -> None:
    """Frees what a stage left on the device, so the next stage has the memory (8B models are built twice)."""
    gc.collect()
    if ctx.cuda and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Stage: environment
# ---------------------------------------------------------------------------------------------------------------


def environment(ctx: Context) -> dict:
    info = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        triton=module_version("triton"),
        transformers=module_version("transformers"),
        cuda_available=torch.cuda.is_available(),
        device=ctx.plan.device,
    )
    if ctx.cuda:
        props = torch.cuda.get_device_properties(torch.device(ctx.plan.device))
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            driver=nvidia_smi("driver_version"),
        )
    else:
        info.update(cpu=platform.processor() or platform.machine())
    copy, matmul = ctx.peaks()
    info.update(copy_gbps=round(copy / 1e9, 1), matmul_bf16_tflops=round(matmul / 1e12, 1))
    return info


def module_version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ---------------------------------------------------------------------------------------------------------------
# Stage: the CUDA tests
# ---------------------------------------------------------------------------------------------------------------


KERNEL_TESTS = ("tests/test_triton_kernels.py", "tests/test_triton_moe.py")


def kernel_tests(ctx: Context) -> dict:
    """`pytest -m cuda` of the Triton kernel tests, compiled for the device."""
    return cuda_tests(ctx, "kernel_tests", list(KERNEL_TESTS))


def engine_tests(ctx: Context) -> dict:
    """`pytest -m cuda` of every other test: the engine, CUDA graphs, sampling and sizing on the device."""
    return cuda_tests(ctx, "engine_tests", ["tests"] + [f"--ignore={name}" for name in KERNEL_TESTS])


def cuda_tests(ctx: Context, name: str, selection: list[str]) -> dict:
    """`pytest -m cuda` over `selection` (paths from the repository root) on the device, within the time left of
    the budget; in a dry run only collected (the summary path still runs)."""
    tests = REPO / "tests"
    if not tests.is_dir():
        raise RuntimeError(f"no tests folder at {tests}: run the suite from a checkout (pip install -e .)")
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider", *selection]
    if ctx.dry_run:
        cmd.append("--collect-only")
    # The kernels must compile for the device, not run in the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    timeout = max(1, int(min(ctx.plan.tests_timeout_s, ctx.seconds_left())))
    log = ctx.out / f"{name}.log"
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, code = f"{as_text(e.stdout)}{as_text(e.stderr)}\nTIMED OUT after {e.timeout} s", None
    log.write_text(output)
    results = dict(command=" ".join(cmd[2:]), timeout_s=timeout, exit_status=code, log=log.name)
    results |= summarise_pytest(output)
    if ctx.dry_run:
        raise Skipped(f"{no_cuda(ctx)} (tests collected only)", results)
    if code != 0:  # 5 (nothing collected) is a failure too: the suite expects CUDA tests
        raise StageFailed(f"pytest -m cuda exited with {code}: {results['counts']}", results)
    return results


def as_text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?|tests? collected)")


def summarise_pytest(output: str) -> dict:
    """Counts from pytest's last summary line, the failing and erroring test ids, and the skip reasons."""
    lines = output.strip().splitlines()
    last = next((line for line in reversed(lines) if _COUNT.search(line)), "")
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _COUNT.findall(last)}
    return dict(
        counts=counts,
        summary=last.strip("= "),
        failed=[line for line in lines if line.startswith(("FAILED ", "ERROR "))][:50],
        skipped=[line for line in lines if line.startswith("SKIPPED ")][:50],
    )


# ---------------------------------------------------------------------------------------------------------------
# Stage: kernel accuracy
# ---------------------------------------------------------------------------------------------------------------


def kernel_accuracy(ctx: Context) -> dict:
    """The Triton kernels against the torch references in fp16 and bf16 at the benchmark's shape (32 heads, 8 KV
    heads, head_dim 128, contexts to 2048): the dtypes the interpreter cannot check. A dry run skips: the torch
    references at that size take minutes on a CPU, and there is nothing of ours to compare them with."""
    if not ctx.cuda:
        raise Skipped(no_cuda(ctx), {})
    from ..kernels import TORCH_KERNELS, select_kernels
    from .kernels import run_checks

    checks = [
        row(check=name, dtype=dtype, rel_err=err, tolerance=tol, ok=err < tol)
        for name, dtype, err, tol in run_checks(
            select_kernels("triton", ctx.plan.device), TORCH_KERNELS, ctx.plan.device
        )
    ]
    results = dict(checks=checks)
    failed = [f"{c['check']} ({c['dtype']})" for c in checks if not c["ok"]]
    if failed:
        raise StageFailed(f"over tolerance: {', '.join(failed)}", results)
    return results


# ---------------------------------------------------------------------------------------------------------------
# Stage: real-size memory and step times
# ---------------------------------------------------------------------------------------------------------------

MEMORY_UTILIZATION = 0.9  # the replica's default --gpu-memory-utilization


def memory(ctx: Context) -> dict:
    """The model at real size with its KV pool sized from the device (on CUDA): where the memory went, and whether
    the fullest step, a full decode batch through the graphs and a single decode kept the device within the
    utilization. Step times are medians of wall time (each step returns its sampled tokens, so it ends synchronised)."""
    p = ctx.plan
    free_before, total = device_memory(ctx)
    with logged("fastgen.replica") as lines:  # the builder's sizing: its figures, and the graphs' measured pool
        pipe = build_pipeline(p, p.offline_budget, gpu_memory_utilization=MEMORY_UTILIZATION if ctx.cuda else None)
    engine = pipe.engine
    runner, allocator = engine.runner, engine.scheduler.allocator
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    free_built, _ = device_memory(ctx)
    results = dict(
        model=p.model,
        token_budget=p.offline_budget,
        max_seqs=engine.scheduler.config.max_seqs,
        utilization=MEMORY_UTILIZATION,
        total_gib=gib(total),
        free_before_gib=gib(free_before),
        weights_gib=gib(weight_bytes(runner.model)),
        kv_pool_gib=gib(kv_bytes),
        kv_blocks=allocator.num_blocks,
        cuda_graphs_gib=gib(runner.graphs.pool_bytes if runner.graphs else 0),
        free_after_build_gib=gib(free_built),
        sizing_log=[line for line in lines if line.startswith(("device memory", "KV cache", "CUDA graphs"))],
    )
    vocab = engine.model_config.vocab_size
    seqs = engine.scheduler.config.max_seqs
    prompt = max(1, p.offline_budget // seqs)
    rng = random.Random(3)
    params = SamplingParams(max_new_tokens=p.decode_steps + 2, min_new_tokens=p.decode_steps + 2, ignore_eos=True)
    for i in range(seqs):  # every sequence's prompt in the first steps, each step at the full token budget
        engine.add_request(f"memory-{i}", [rng.randrange(3, vocab) for _ in range(prompt)], params)
    prefill, decode = [], []
    reset_peak(ctx)
    while engine.has_unfinished():
        start = time.perf_counter()
        result = engine.step()
        elapsed = time.perf_counter() - start
        if result.stats is not None:
            (prefill if result.stats.num_prefill_tokens else decode).append(elapsed)
    results.update(
        fullest_step_ms=median_ms(prefill),
        decode_batch=seqs,
        decode_step_ms=median_ms(decode),
        single_decode_step_ms=round(decode_step_ms(engine, p.decode_steps), 3),
    )
    # What graphs save a decode step is launch overhead; a mixed SplitFuse step runs eagerly and pays it too. Its share
    # of the fullest step bounds what capturing a mixed step's decode-shaped parts (vLLM's piecewise graphs) could gain.
    graphs, runner.graphs = runner.graphs, None
    eager_ms = decode_step_ms(engine, p.decode_steps)
    runner.graphs = graphs
    overhead_ms = eager_ms - results["single_decode_step_ms"]
    results.update(
        single_decode_step_eager_ms=round(eager_ms, 3),
        launch_overhead_ms=round(overhead_ms, 3),
        launch_overhead_of_fullest_step=round(overhead_ms / results["fullest_step_ms"], 3)
        if results["fullest_step_ms"]
        else None,
    )
    if ctx.cuda:
        free_min = total - max_used(ctx, free_built, total)
        reserved = torch.cuda.max_memory_reserved(torch.device(p.device))
        results.update(
            peak_reserved_gib=gib(reserved),
            untracked_gib=gib(total - free_min - reserved),  # CUDA context, cuBLAS/NCCL workspaces, kernel modules
            least_free_gib=gib(free_min),
            used_of_total=round((total - free_min) / total, 3),
        )
        results["within_utilization"] = results["used_of_total"] <= MEMORY_UTILIZATION
    del pipe, engine, runner
    if not ctx.cuda:
        raise Skipped(f"{no_cuda(ctx)} (the pool from --kv-cache-memory; steps timed on the CPU at toy size)", results)
    return results


@contextlib.contextmanager
def logged(logger: str):
    """The INFO messages `logger` writes inside the block, as a list of strings."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger(logger)
    level = log.level
    log.addHandler(handler)
    log.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def device_memory(ctx: Context) -> tuple[int, int]:
    """(free, total) bytes of the device as the driver sees them; (0, 0) on the CPU."""
    return torch.cuda.mem_get_info(torch.device(ctx.plan.device)) if ctx.cuda else (0, 0)


def reset_peak(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(torch.device(ctx.plan.device))


def max_used(ctx: Context, free_built: int, total: int) -> int:
    """Most device memory in use during the steps: what was in use after the build, plus how far torch's reserved
    memory rose above what it held then (the driver's own figure cannot be sampled mid-step)."""
    device = torch.device(ctx.plan.device)
    return total - free_built + torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)


def median_ms(times: list[float]) -> float | None:
    return round(sorted(times)[len(times) // 2] * 1e3, 3) if times else None


def gib(n: int) -> float:
    return round(n / 2**30, 3)


# ---------------------------------------------------------------------------------------------------------------
# Stage: kernels
# ---------------------------------------------------------------------------------------------------------------


def kernels(ctx: Context) -> dict:
    from ..kernels import TORCH_KERNELS, select_kernels
    from ..testing import make_paged_batch
    from .kernels import attention_rate, fused_cases

    p, timer = ctx.plan, ctx.timer()
    ours = select_kernels("triton", p.device) if ctx.cuda else TORCH_KERNELS
    copy, _ = ctx.peaks()
    shape = dict(p.attn_shape, device=p.device)
    seqs, context = p.decode_attention
    decodes, chunks, chunk = p.mixed_attention
    cases = {
        f"decode {seqs} × {context}": ([1] * seqs, [context] * seqs),
        f"decode 1 × {p.single_decode_attention} (split-KV)": ([1], [p.single_decode_attention]),
        f"mixed {chunks} chunks × {chunk} + {decodes} decodes": (
            [1] * decodes + [chunk] * chunks,
            [context] * decodes + [chunk * (i + 1) for i in range(chunks)],
        ),
    }
    attention = []
    for label, (q_lens, seq_lens) in cases.items():
        for block_size in (16, 32):
            b = make_paged_batch(q_lens, seq_lens, block_size=block_size, dtype=p.dtype, **shape)
            ms, bw, rate = attention_rate(ours, b, timer)
            attention.append(row(kernel=label, block=block_size, ms=ms, gbps=bw / 1e9, of_copy=bw / copy))
            del b
    fused = []
    for label, make, nbytes in fused_cases(p.dtype, p.fused_tokens, p.fused_hidden, shape):
        ms, ref_ms = timer(make(ours)), timer(make(TORCH_KERNELS))
        bw = nbytes / (ms * 1e-3)
        fused.append(row(kernel=label, ms=ms, torch_ms=ref_ms, gbps=bw / 1e9, of_copy=bw / copy))
    decode = [r for r in attention if r["kernel"].startswith("decode")]
    results = dict(
        kernels=ours.name,
        dtype=str(p.dtype).removeprefix("torch."),
        copy_gbps=round(copy / 1e9, 1),
        attention=attention,
        fused=fused,
        decode_attention_of_copy=max(r["of_copy"] for r in decode),
        floor=FLOORS["decode_attention_of_copy"],
    )
    results["meets_floor"] = results["decode_attention_of_copy"] >= results["floor"]
    if not ctx.cuda:
        raise Skipped(f"{no_cuda(ctx)} (torch kernels timed on the CPU at toy size)", results)
    return results


def row(**values) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}


# ---------------------------------------------------------------------------------------------------------------
# Stage: offline throughput and the decode step
# ---------------------------------------------------------------------------------------------------------------


def model_folder(plan: Plan) -> Path:
    from ..replica.weights import resolve_model

    return resolve_model(plan.model, "dummy")


def build_pipeline(
    plan: Plan,
    budget: int,
    policy: str = "splitfuse",
    enforce_eager: bool = False,
    slo=None,
    gpu_memory_utilization: float | None = None,
    quantization: str = "auto",
    kernels: str = "auto",
):
    from ..replica import pipeline

    return pipeline(
        plan.model,
        quantization=quantization,
        kernels=kernels,
        dtype=str(plan.dtype).removeprefix("torch."),
        device=plan.device,
        load_format="dummy",
        max_batch_tokens=budget,
        kv_cache_memory=plan.kv_cache_memory,
        gpu_memory_utilization=gpu_memory_utilization,
        scheduler=policy,
        progress=False,
        enforce_eager=enforce_eager,
        slo=slo,
    )


def token_prompts(n: int, lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts (presets have no tokenizer here: the embedded one does not travel)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths(rng, n)]


def offline_moe(ctx: Context) -> dict:
    p = ctx.plan
    return offline(replace(ctx, plan=replace(p, model=p.moe_model, offline_requests=p.moe_requests)))


def offline_quantized(ctx: Context) -> dict:
    """FastGen's side of the offline stage on quantized weights (transformers runs neither without kernel packages the
    machine lacks): the AWQ int4 preset (Triton's int4 kernel) and the dense model with --quantization fp8 (E4M3
    weights and per-token activations, torch._scaled_mm). Each: throughput on the offline stage's requests, and the
    decode step at batch 1 against the time to read its weights once in the form the kernels read."""
    p = ctx.plan
    # (label, model, quantization, kernels): fp8 runs on the torch kernels' reference of the op on a CPU (dry run)
    runs = [("awq", p.int4_model, "auto", "auto"), ("fp8", p.model, "fp8", "auto" if ctx.cuda else "torch")]
    results = {}
    for label, model, quantization, kernels in runs:
        plan = replace(p, model=model)
        pipe = build_pipeline(plan, p.offline_budget, quantization=quantization, kernels=kernels)
        form = type(pipe.engine.runner.model.layers[0].mlp.down_proj.packed).__name__
        fastgen_s, step_ms, read_bytes = fastgen_figures(pipe, offline_prompts(plan), p)
        del pipe
        release_memory(ctx)
        bound_ms = read_bytes / ctx.peaks()[0] * 1e3
        results[label] = dict(
            model=model,
            quantization=quantization,
            layer_form=form,  # Int4Linear / Fp8Linear on CUDA; GGUF blocks (QuantLinear) for int4 on a CPU
            fastgen_tokens_per_s=round(p.offline_requests * p.offline_gen / fastgen_s, 1),
            decode_step_ms=round(step_ms, 3),
            weights_read_gb=round(read_bytes / 1e9, 2),
            weights_read_bound_ms=round(bound_ms, 3),
            decode_step_over_bound=round(step_ms / bound_ms, 2),
        )
    return dict(dtype=str(p.dtype).removeprefix("torch."), requests=p.offline_requests, runs=results)


def offline_prompts(p: Plan) -> list[list[int]]:
    """The offline stages' requests: random token ids of the plan's lengths, below the model's vocabulary."""
    vocab = json.loads((model_folder(p) / "config.json").read_text())["vocab_size"]
    return token_prompts(p.offline_requests, lambda rng, n: [rng.randint(*p.offline_prompt) for _ in range(n)], vocab)


def fastgen_figures(pipe, prompts: list[list[int]], p: Plan) -> tuple[float, float, int]:
    """(seconds for the requests, the decode step at batch 1 in ms, bytes a decode step reads), after a warm-up."""
    pipe(prompts[: min(4, len(prompts))], max_new_tokens=4)  # compiles the kernels for prompts and decodes
    fastgen_s = run_fastgen(pipe, prompts, p.offline_gen)
    return fastgen_s, decode_step_ms(pipe.engine, p.decode_steps), weights_read_bytes(pipe.engine.runner.model)


def offline(ctx: Context) -> dict:
    p = ctx.plan
    prompts = offline_prompts(p)
    tokens = p.offline_requests * p.offline_gen

    pipe = build_pipeline(p, p.offline_budget)
    fastgen_s, step_ms, read_bytes = fastgen_figures(pipe, prompts, p)
    del pipe
    release_memory(ctx)
    pipe = build_pipeline(p, p.offline_budget, enforce_eager=True)  # the same decode step without CUDA graphs
    pipe(prompts[:1], max_new_tokens=2)
    eager_step_ms = decode_step_ms(pipe.engine, p.decode_steps)
    del pipe
    release_memory(ctx)

    model = transformers_model(model_folder(p), p.dtype, p.device)
    run_transformers(model, prompts[: p.hf_batch], 2, p.hf_batch, p.device)  # warm-up
    hf_s = run_transformers(model, prompts, p.offline_gen, p.hf_batch, p.device)
    del model

    copy, _ = ctx.peaks()
    bound_ms = read_bytes / copy * 1e3
    results = dict(
        model=p.model,
        dtype=str(p.dtype).removeprefix("torch."),
        requests=p.offline_requests,
        prompt_tokens=list(p.offline_prompt),
        generated_tokens=p.offline_gen,
        fastgen_s=round(fastgen_s, 3),
        fastgen_tokens_per_s=round(tokens / fastgen_s, 1),
        transformers_s=round(hf_s, 3),
        transformers_tokens_per_s=round(tokens / hf_s, 1),
        transformers_batch=p.hf_batch,
        fastgen_over_transformers=round(hf_s / fastgen_s, 2),
        decode_step_ms=round(step_ms, 3),
        decode_step_eager_ms=round(eager_step_ms, 3),
        cuda_graphs_speedup=round(eager_step_ms / step_ms, 2),
        weights_read_gb=round(read_bytes / 1e9, 2),
        weights_read_bound_ms=round(bound_ms, 3),
        decode_step_over_bound=round(step_ms / bound_ms, 2),
        floors={k: FLOORS[k] for k in ("fastgen_over_transformers", "decode_step_over_bound")},
    )
    return results


def run_fastgen(pipe, prompts, gen: int) -> float:
    start = time.perf_counter()
    outs = pipe(prompts, max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert all(o.generated_tokens == gen for o in outs), "FastGen stopped a request early"
    return elapsed


def decode_step_ms(engine, steps: int) -> float:
    """Median wall time of an engine step with one sequence decoding (the step returns its token, so each step
    ends with the device's work done)."""
    params = SamplingParams(max_new_tokens=steps + 2, min_new_tokens=steps + 2, ignore_eos=True)
    engine.add_request("decode-step-probe", list(range(3, 35)), params)
    engine.step()  # the prompt
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return sorted(times)[len(times) // 2] * 1e3


def weights_read_bytes(model) -> int:
    """Bytes a decode step of one token must read: every weight once, in the form its kernel reads (a packed form where
    a layer has one), except the embedding table (one row per token; a tied LM head counts the form it reads), and of a
    mixture of experts' experts only the k its token is routed to."""
    from ..replica.models.moe import FusedExperts

    total = weight_bytes(model, skip=model.embed_tokens)
    experts = sum(weight_bytes(m) for m in model.modules() if isinstance(m, FusedExperts))
    if experts:
        total -= round(experts * (1 - model.config.moe.active_fraction()))
    return total


def weight_bytes(module: torch.nn.Module, skip: torch.nn.Module | None = None) -> int:
    """Bytes of the weights a module's kernels read, each storage once: a layer's packed form (or its quantized
    blocks) in place of its plain weight, which a backend may keep beside it unread."""
    held: dict[tuple[int, int], int] = {}
    for m in module.modules():
        if m is skip:
            continue
        form = getattr(m, "packed", None) or getattr(m, "quantized", None)
        kernel_tensors = list(tensors_in(form))
        plain = ("weight", "w13", "w2") if kernel_tensors else ()
        own = [t for name, t in m.named_parameters(recurse=False) if name not in plain]
        for t in kernel_tensors + own:
            held[(t.data_ptr(), t.nbytes)] = t.nbytes
    return sum(held.values())


def tensors_in(form):
    """The tensors inside a packed form (dataclasses, tuples and lists of them, nested)."""
    if isinstance(form, torch.Tensor):
        yield form
    elif is_dataclass(form) and not isinstance(form, type):
        for f in fields(form):
            yield from tensors_in(getattr(form, f.name))
    elif isinstance(form, (tuple, list)):
        for item in form:
            yield from tensors_in(item)


def transformers_model(folder: Path, dtype: torch.dtype, device: str):
    """The same architecture in transformers, random-initialised directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the dtype keyword changed its name across transformers versions
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


def run_transformers(model, prompts, gen: int, batch: int, device: str) -> float:
    """Static batches, left padding, exactly gen new tokens each (as benchmarks/offline.py, on the device)."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(q) for q in group)
        ids = torch.tensor([[0] * (width - len(q)) + q for q in group], device=device)
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in group], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=gen,
                min_new_tokens=gen,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + gen, "transformers stopped early"
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# Stage: splitfuse against prefill_first under the paper's SLA
# ---------------------------------------------------------------------------------------------------------------


def sla(ctx: Context) -> dict:
    p = ctx.plan
    vocab = json.loads((model_folder(p) / "config.json").read_text())["vocab_size"]
    lengths = lambda rng, n: [min(p.sla_budget, sample_length(rng, p.sla_prompt_mean, lo=8)) for _ in range(n)]  # noqa: E731
    prompts = token_prompts(p.sla_requests, lengths, vocab, seed=1)
    rules = SLA(prompt_rate=PROMPT_RATE, token_rates=TOKEN_RATES)
    results = dict(
        model=p.model,
        requests=p.sla_requests,
        clients=p.sla_clients,
        prompt_mean=p.sla_prompt_mean,
        generated_tokens=p.sla_gen,
        token_budget=p.sla_budget,
        prompt_rate=PROMPT_RATE,
        token_rates=list(TOKEN_RATES),
        systems={},
    )
    steps: list[tuple[float, float]] = []  # the slo run's (predicted, measured) step seconds
    for policy in ("splitfuse", "prefill_first", "slo"):
        # The strictest floor: gaps held within 1 / max R are within every other floor too.
        pipe = build_pipeline(p, p.sla_budget, policy, slo=SloConfig(PROMPT_RATE, max(TOKEN_RATES)))
        pipe(prompts[:2], max_new_tokens=2)  # warm-up: kernels compiled before the clock starts
        if policy == "slo":
            from ..replica.slo_scheduler import calibrate

            calibrate(pipe.engine)
        records = closed_loop(pipe.engine, prompts, p.sla_gen, p.sla_clients, steps if policy == "slo" else None)
        s = summarize(records, rules)
        results["systems"][policy] = dict(
            throughput_rps=round(s.throughput, 3),
            tokens_per_s=round(s.token_throughput, 1),
            effective_rps={r: round(v, 3) for r, v in s.effective.items()},
            sla_missed={r: round(v, 3) for r, v in s.sla_missed.items()},
            ttft_p50_s=round(s.ttft["p50"], 4),
            ttft_p95_s=round(s.ttft["p95"], 4),
            inter_token_p50_s=round(s.inter_token["p50"], 4),
            inter_token_p95_s=round(s.inter_token["p95"], 4),
            failed=s.failed,
        )
        del pipe
        release_memory(ctx)
    effective = {k: v["effective_rps"] for k, v in results["systems"].items()}
    fused, first, slo = effective["splitfuse"], effective["prefill_first"], effective["slo"]
    results["splitfuse_over_prefill_first"] = {r: ratio(fused[r], first[r]) for r in fused}
    results["slo_over_best_fixed"] = {r: ratio(slo[r], max(fused[r], first[r])) for r in slo}
    results["slo_step_model"] = step_model_error(steps, ctx.out / "sla_slo_steps.csv")
    return results


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def step_model_error(steps: list[tuple[float, float]], path: Path) -> dict:
    """The step-time model's error over the (predicted, measured) seconds of the steps it predicted, written to
    `path` as CSV; a predicted-against-measured plot beside it where matplotlib is installed."""
    path.write_text("predicted_s,measured_s\n" + "".join(f"{p:.6g},{m:.6g}\n" for p, m in steps))
    errors = sorted(abs(p - m) / m for p, m in steps)
    result = dict(steps=len(steps), trace=path.name)
    if errors:
        result |= dict(mdape=round(errors[len(errors) // 2], 4), p90_ape=round(errors[int(0.9 * (len(errors) - 1))], 4))
    try:
        from .report import plot_steps

        result["plot"] = plot_steps(steps, "slo on the GPU suite's sla stage", path.with_suffix(".png")).name
    except ImportError:
        pass
    return result


def closed_loop(
    engine, prompts: list[list[int]], gen: int, clients: int, steps: list[tuple[float, float]] | None = None
) -> list[RequestRecord]:
    """`clients` clients, each sending its next prompt when its last request finished; token times are the
    engine's step times (one clock: time.monotonic). `steps` gets each step's predicted and measured seconds where the
    scheduler predicted it."""
    queue = list(enumerate(prompts))
    records: dict[str, RequestRecord] = {}
    params = SamplingParams(max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)

    def send() -> None:
        i, prompt = queue.pop(0)
        records[f"sla-{i}"] = RequestRecord(start=time.monotonic(), token_times=[], prompt_tokens=len(prompt))
        engine.add_request(f"sla-{i}", prompt, params)

    for _ in range(min(clients, len(queue))):
        send()
    while engine.has_unfinished():
        result = engine.step()
        plan = result.stats.plan if result.stats is not None else None
        if steps is not None and plan is not None and plan.predicted_s == plan.predicted_s:  # not nan
            steps.append((plan.predicted_s, result.stats.step_s))
        for out in result.outputs:
            record = records[out.request_id]
            record.token_times += [out.time] * len(out.new_token_ids)
            if out.finished:
                record.end = out.time
                if queue:
                    send()
    return list(records.values())


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

# In the order a first GPU run must learn things: kernel accuracy in bf16/fp16, the engine with graphs against
# transformers, real-size memory and step times, then speed.
STAGES = {
    "environment": environment,
    "kernel_accuracy": kernel_accuracy,
    "engine_tests": engine_tests,
    "memory": memory,
    "kernel_tests": kernel_tests,
    "kernels": kernels,
    "offline": offline,
    "offline_quantized": offline_quantized,
    "offline_moe": offline_moe,
    "sla": sla,
}
# Seconds each stage should take at full size on one H200, estimated by reading (Triton compiles cost 1-2 s a kernel
# variant, a random 8B model a few seconds to build, transformers' generate ~30 ms a token at batch 16, a 30B MoE in
# transformers' experts loop far more). Every report records each stage's seconds beside its estimate: correct these
# from the first run's.
ESTIMATE_S = {
    "environment": 20,
    "kernel_accuracy": 40,
    "engine_tests": 150,
    "memory": 90,
    "kernel_tests": 180,
    "kernels": 45,
    "offline": 150,
    "offline_quantized": 110,  # FastGen's side only, twice: a random 8B build, 64 requests, the decode step
    "offline_moe": 240,
    "sla": 200,
}
# The process before the first stage and after the last: python and torch imports, the CUDA context, the report.
STARTUP_S = 30


def plan_stages(stages: list[str], budget_s: float | None) -> tuple[list[str], dict[str, str]]:
    """The stages to run, in the order given, that fit the budget with start-up counted, and why each other one
    is skipped. A stage that does not fit does not stop a later, shorter one."""
    if budget_s is None:
        return list(stages), {}
    left = budget_s - STARTUP_S
    planned, skipped = [], {}
    for name in stages:
        if ESTIMATE_S[name] <= left:
            planned.append(name)
            left -= ESTIMATE_S[name]
        else:
            skipped[name] = f"over budget: estimated {ESTIMATE_S[name]} s, {left:.0f} s of --budget-s {budget_s:g} left"
    return planned, skipped


def plan_lines(stages: list[str], budget_s: float | None) -> list[str]:
    planned, skipped = plan_stages(stages, budget_s)
    total = STARTUP_S + sum(ESTIMATE_S[name] for name in planned)
    head = f"plan for --budget-s {budget_s:g}" if budget_s is not None else "plan (no --budget-s)"
    lines = [f"{head}: {total} s estimated on one H200, start-up {STARTUP_S} s included"]
    lines += [f"  run   {name:<16} {ESTIMATE_S[name]:>4} s" for name in planned]
    lines += [f"  skip  {name:<16} {reason}" for name, reason in skipped.items()]
    return lines


def markdown(report: dict) -> str:
    lines = [f"# GPU suite{' (dry run)' if report['dry_run'] else ''}", ""]
    lines += [f"{report['command']}  ", f"started {report['started']}, {report['seconds']} s in all", ""]
    lines += ["| stage | status | seconds | estimate (s) |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s.get('estimate_s', '')} |" for s in report["stages"]]
    for stage in report["stages"]:
        lines += ["", f"## {stage['name']}: {stage['status']}", ""]
        if stage["error"]:
            lines += ["```", stage["error"].strip(), "```", ""]
        lines += markdown_values(stage["results"])
    return "\n".join(lines) + "\n"


def markdown_values(values: dict, indent: str = "") -> list[str]:
    lines = []
    for key, value in values.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += ["", f"{indent}{key}:", ""] + markdown_table(value) + [""]
        elif isinstance(value, dict):
            lines += [f"{indent}- {key}:"] + markdown_values(value, indent + "  ")
        else:
            lines.append(f"{indent}- {key}: {value}")
    return lines


def markdown_table(rows: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return ["| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"] + [
        "| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows
    ]


def run(
    out: Path,
    dry_run: bool,
    stages: list[str],
    argv: list[str],
    tests_timeout_s: int | None = None,
    budget_s: float | None = None,
    start: float | None = None,
) -> dict:
    """Runs the stages that fit `budget_s` seconds from `start` (time.perf_counter(); now by default), writing the
    report after each; a stage the time left no longer fits is recorded as skipped."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter() if start is None else start
    planned, skipped = plan_stages(stages, budget_s)
    report = dict(
        suite="gpu_suite",
        dry_run=dry_run,
        command=" ".join(["python -m fastgen.benchmarks.gpu_suite", *argv]),
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        seconds=0.0,
        budget_s=budget_s,
        planned=[dict(name=name, estimate_s=ESTIMATE_S.get(name)) for name in planned],
        plan={},
        stages=[],
        skipped=skipped,
        failed=[],
    )
    with tempfile.TemporaryDirectory() as tmp:
        toys = Path(tmp)
        plan = (
            dry_plan(toy_model(toys / "toy"), toy_moe_model(toys / "toy-moe"), toy_int4_model(toys / "int4"))
            if dry_run
            else FULL
        )
        if tests_timeout_s:
            plan = replace(plan, tests_timeout_s=tests_timeout_s)
        report["plan"] = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(plan).items()}
        # The stages get what the plan gave them: start-up covers the imports before `start` and the last report.
        deadline = None if budget_s is None else start + budget_s - STARTUP_S
        ctx = Context(plan, out, dry_run, deadline)
        torch.manual_seed(0)
        for i, name in enumerate(stages):
            if name in skipped:
                record = dict(name=name, status=f"skipped: {skipped[name]}", seconds=0.0, results={}, error=None)
            elif budget_s is not None and ESTIMATE_S[name] > ctx.seconds_left():
                left = ctx.seconds_left()
                skipped[name] = f"over budget at run time: estimated {ESTIMATE_S[name]} s, {left:.0f} s left"
                record = dict(name=name, status=f"skipped: {skipped[name]}", seconds=0.0, results={}, error=None)
                print(f"[gpu_suite] {i + 1}/{len(stages)} {name}: {record['status']}", flush=True)
            else:
                record = run_stage(name, STAGES[name], ctx, i + 1, len(stages))
            record["estimate_s"] = ESTIMATE_S.get(name)
            report["stages"].append(record)
            report["failed"] += [name] if record["status"] == "failed" else []
            report["seconds"] = round(time.perf_counter() - start, 1)
            write_report(report, out)  # after every stage: a run cut short by a time limit keeps what it measured
    return report


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_suite.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_suite.json, gpu_suite.md and logs")
    parser.add_argument("--dry-run", action="store_true", help="every stage at toy size on the CPU (seconds)")
    parser.add_argument("--tests-timeout", type=int, default=None, help="seconds for pytest -m cuda (default 240)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds the whole run may take, start-up included: runs the stages that fit (in --stages' order) and "
        "reports the rest as skipped; 540 fits the device's 10-minute command with room to start",
    )
    start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}: choose from {', '.join(STAGES)}")
    if args.budget_s is not None and args.budget_s <= STARTUP_S:
        parser.error(f"--budget-s {args.budget_s:g} leaves nothing after the {STARTUP_S} s of start-up: give more")
    for line in plan_lines(stages, args.budget_s):
        print(f"[gpu_suite] {line}", flush=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_suite needs a CUDA GPU and torch sees none: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    report = run(args.out, args.dry_run, stages, argv, args.tests_timeout, args.budget_s, start)
    print(f"[gpu_suite] wrote {args.out / 'gpu_suite.json'} and {args.out / 'gpu_suite.md'}", flush=True)
    if report["failed"]:
        print(f"[gpu_suite] FAILED stages: {', '.join(report['failed'])}", file=sys.stderr, flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
