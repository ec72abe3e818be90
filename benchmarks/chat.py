"""The chat workload (BENCHMARKS.md "Chat workload (prefix reuse)"): conversations of several turns, every turn
resending the whole history plus a new user message, against FastGen deployments with the prefix cache off and on
under each routing policy, or against an OpenAI-compatible server (vLLM) with the same conversations.

    python -m fastgen.benchmarks.chat --replicas 1,2 --clients 4 --conversations 16 --systems off,rr,ll,pa \\
        --json benchmarks/results/chat/summary.json
    python -m fastgen.benchmarks.chat --skew --replicas 2 --clients 4 --requests 64 --systems ll,pa \\
        --json benchmarks/results/chat/skew.json                                  # hot prefix: p99 TTFT
    python -m fastgen.benchmarks.chat --openai http://127.0.0.1:8000 --clients 4 --conversations 16

Systems: `off` (prefix caching off, least_loaded), `rr`, `ll`, `pa` (caching on, with round_robin, least_loaded,
prefix_aware routing). Each is a fastgen-deploy deployment of --replicas replicas started for its run and stopped
after it, so every run starts with a cold cache. The conversations share one system prompt; lengths and turn counts
come from --seed. Closed loop: each of --clients clients takes the next conversation not yet started and sends its
turns one after another, each when the previous reply has arrived. Replies are exactly --reply-tokens long (greedy,
ignore_eos) and their text is appended to the history: every system does the same work, and the history a turn
resends is the one the server saw. `--skew` runs the hot-prefix variant instead: single-turn chats, --hot-fraction of
them sharing one long system prompt, for the p99 time to first token of prefix_aware against least_loaded.

Reported per run: throughput, TTFT p50/p95/p99, and the prefix-cache hit rate in tokens (hits / queries of the
replicas' fastgen_prefix_cache_* counters over the run) per replica and for the deployment. `--json` writes every
run's summary with its provenance (command, commit, date, machine); a Markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from http.client import HTTPConnection
from pathlib import Path
from urllib.request import urlopen

from .provenance import machine_name, run_info
from .stats import SLA, RequestRecord, summarize
from .workload import ChatWorkload, Conversation, make_conversations, make_hot_prefix_requests

now = time.perf_counter


@dataclass(frozen=True)
class ChatSystem:
    label: str
    policy: str
    prefix_caching: bool


SYSTEMS = {
    "off": ChatSystem("off", "least_loaded", False),
    "rr": ChatSystem("rr", "round_robin", True),
    "ll": ChatSystem("ll", "least_loaded", True),
    "pa": ChatSystem("pa", "prefix_aware", True),
}


# ---- clients ----
class FastGenChat:
    """Chat turns over fastgen.v1 GenerateStream (to a balancer)."""

    def __init__(self, address: str, timeout: float = 900.0, **credentials) -> None:
        self.address, self.timeout, self.credentials = address, timeout, credentials
        self._client = None

    async def open(self) -> None:
        from ..server.client import AsyncClient

        self._client = AsyncClient(self.address, timeout=self.timeout, **self.credentials)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def send(self, messages: list[dict], reply_tokens: int, client: int) -> tuple[RequestRecord, str]:
        rec = RequestRecord(start=now(), token_times=[], prompt_tokens=0, client=client)
        text = []
        try:
            chunks = self._client.stream_chunks(messages, max_new_tokens=reply_tokens, ignore_eos=True, temperature=0.0)
            async for chunk in chunks:
                rec.token_times.extend([now()] * len(chunk.token_ids))
                text.append(chunk.text)
                if chunk.finish_reason:
                    rec.prompt_tokens = chunk.prompt_tokens
            rec.end = now()
        except Exception as e:  # a failed turn is a result, not a crash of the run
            rec.error = f"{type(e).__name__}: {e}"
        return rec, "".join(text)


class OpenAIChat:
    """Chat turns over an OpenAI-compatible /v1/chat/completions stream (vLLM, FastGen's HTTP API), one thread per
    turn in flight. An event with content counts as one token; the usage block fixes the count of the last one."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 900.0) -> None:
        from .backends import api_base

        self.host, self.port, v1 = api_base(url)
        self.path = v1 + "/chat/completions"
        self.model, self.timeout = model, timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def send(self, messages: list[dict], reply_tokens: int, client: int) -> tuple[RequestRecord, str]:
        return await asyncio.to_thread(self._send, messages, reply_tokens, client)

    def _send(self, messages: list[dict], reply_tokens: int, client: int) -> tuple[RequestRecord, str]:
        rec = RequestRecord(start=now(), token_times=[], prompt_tokens=0, client=client)
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": reply_tokens,
            "min_tokens": reply_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text = []
        conn = HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", self.path, body=json.dumps(body).encode(), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                t, event = now(), json.loads(line[5:])
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    missing = usage.get("completion_tokens", 0) - len(rec.token_times)
                    if missing > 0 and rec.token_times:
                        rec.token_times.extend([rec.token_times[-1]] * missing)
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        rec.token_times.append(t)
                        text.append(content)
            rec.end = now()
        except Exception as e:
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        return rec, "".join(text)


async def run_conversations(chat, conversations: list[Conversation], clients: int) -> list[RequestRecord]:
    """Closed loop: each client runs whole conversations, one turn at a time, until none is left."""
    pending = deque(conversations)
    records: list[RequestRecord] = []

    async def client(i: int) -> None:
        while pending:
            conv = pending.popleft()
            messages = [{"role": "system", "content": conv.system}]
            for user in conv.user_messages:
                messages.append({"role": "user", "content": user})
                rec, reply = await chat.send(list(messages), conv.reply_tokens, i)
                records.append(rec)
                if rec.error:
                    break  # the history would not be the one the server saw
                messages.append({"role": "assistant", "content": reply})

    await asyncio.gather(*(client(i) for i in range(clients)))
    return records


# ---- the replicas' prefix-cache counters ----
def scrape_prefix_cache(ports: list[int], host: str = "127.0.0.1") -> dict[str, dict[str, float]]:
    """{replica: {"queries": tokens, "hits": tokens}} from the replicas' /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    names = {"fastgen_prefix_cache_queries": "queries", "fastgen_prefix_cache_hits": "hits"}
    for port in ports:
        with urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name not in names:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    row = out.setdefault(sample.labels.get("replica", str(port)), {"queries": 0.0, "hits": 0.0})
                    row[names[family.name]] += sample.value
    return out


def hit_rates(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per replica and for the deployment ("all"): query and hit tokens over the run, and their ratio."""
    rows = {}
    for replica in sorted(after):
        q = after[replica]["queries"] - before.get(replica, {}).get("queries", 0.0)
        h = after[replica]["hits"] - before.get(replica, {}).get("hits", 0.0)
        rows[replica] = {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0}
    q, h = sum(r["queries"] for r in rows.values()), sum(r["hits"] for r in rows.values())
    rows["all"] = {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0}
    return rows


# ---- one run ----
def workload_of(args: argparse.Namespace, tag: str) -> list[Conversation]:
    if args.skew:
        return make_hot_prefix_requests(
            args.requests,
            args.tokenizer,
            args.hot_fraction,
            args.prefix_tokens,
            args.user_tokens,
            args.reply_tokens,
            args.seed,
            tag,
        )
    spec = ChatWorkload(args.conversations, args.system_tokens, args.user_tokens, args.turns, args.reply_tokens)
    return make_conversations(spec, args.tokenizer, args.seed, tag)


async def measure(chat, conversations: list[Conversation], clients: int, ports: list[int]) -> dict:
    before = scrape_prefix_cache(ports) if ports else {}
    await chat.open()
    try:
        records = await run_conversations(chat, conversations, clients)
    finally:
        await chat.close()
    after = scrape_prefix_cache(ports) if ports else {}
    summary = asdict(summarize(records, SLA()))
    summary["turns"] = len(records)
    summary["prompt_tokens"] = sum(r.prompt_tokens for r in records)
    summary["prefix_cache"] = hit_rates(before, after) if ports else {}
    return summary


def run_fastgen(system: ChatSystem, replicas: int, args: argparse.Namespace) -> dict:
    from ..launch import deployment
    from ..launch.config import DeployConfig, default_threads
    from ..launch.state import fastgen_home
    from .backends import deployment_credentials
    from .serving import cpu_count, free_base_port, stopped_after

    base = free_base_port(2 * (replicas + 1))
    config = DeployConfig(
        name=f"chat-{system.label}-r{replicas}-{os.getpid()}",
        model=args.model,
        replicas=replicas,
        policy=system.policy,
        prefix_caching=system.prefix_caching,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        max_seqs=min(args.max_seqs, args.max_batch_tokens),
        num_blocks=args.num_blocks,
        threads=args.threads or default_threads(cpu_count(), replicas),
        port=base,
        metrics_port=base + replicas + 1,
        http_port=0,
        timeout=args.start_timeout,
    )
    home = fastgen_home()
    deployment.start(config, home)
    with stopped_after(home, config.name):
        chat = FastGenChat(f"127.0.0.1:{base}", **deployment_credentials(config.name))
        ports = [config.metrics_port + 1 + i for i in range(replicas)]
        tag = f"{args.tag}-{system.label}-r{replicas}"
        summary = asyncio.run(measure(chat, workload_of(args, tag), args.clients, ports))
    settings = {
        "policy": system.policy,
        "prefix_caching": system.prefix_caching,
        "replicas": replicas,
        "threads": config.threads,
        "max_batch_tokens": config.max_batch_tokens,
        "num_blocks": config.num_blocks,
        "model": args.model,
    }
    return {"system": system.label, "replicas": replicas, "settings": settings, "summary": summary}


def run_openai(args: argparse.Namespace) -> dict:
    from .backends import served_models

    api_key = args.api_key or os.environ.get("FASTGEN_API_KEY")
    model = args.openai_model or served_models(args.openai, api_key)[0]
    chat = OpenAIChat(args.openai, model, api_key)
    summary = asyncio.run(measure(chat, workload_of(args, f"{args.tag}-openai"), args.clients, []))
    return {"system": "openai", "replicas": None, "settings": {"url": args.openai, "model": model}, "summary": summary}


# ---- report ----
def markdown(runs: list[dict]) -> str:
    lines = [
        "| system | replicas | turns | failed | req/s | tok/s | TTFT p50 (s) | TTFT p95 (s) | TTFT p99 (s) | hit rate "
        "| hit rate per replica |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run["summary"]
        cache = s.get("prefix_cache") or {}
        per = ", ".join(f"{r}: {v['hit_rate']:.0%}" for r, v in cache.items() if r != "all") or "-"
        overall = f"{cache['all']['hit_rate']:.0%}" if "all" in cache else "-"
        lines.append(
            f"| {run['system']} | {run['replicas'] or '-'} | {s['turns']} | {s['failed']} | {s['throughput']:.3f} "
            f"| {s['token_throughput']:.1f} | {s['ttft']['p50']:.3f} | {s['ttft']['p95']:.3f} | {s['ttft']['p99']:.3f} "
            f"| {overall} | {per} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.chat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--systems", default="off,rr,ll,pa", help="of off, rr, ll, pa (default: all four)")
    p.add_argument("--replicas", default="2", help="replica counts to run each system with, e.g. 1,2 (default 2)")
    p.add_argument("--openai", default=None, help="base URL of an OpenAI-compatible server to run instead (vLLM)")
    p.add_argument("--openai-model", default=None, help="model name it serves (default: the first it lists)")
    p.add_argument("--api-key", default=None, help="bearer token for --openai (default: $FASTGEN_API_KEY)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4, help="mean turns per conversation (default 4)")
    p.add_argument("--system-tokens", type=int, default=300, help="shared system prompt length (default 300)")
    p.add_argument("--user-tokens", type=int, default=60, help="mean user message length (default 60)")
    p.add_argument("--reply-tokens", type=int, default=32, help="every reply's length (default 32)")
    p.add_argument("--skew", action="store_true", help="the hot-prefix variant: single-turn chats, one hot prefix")
    p.add_argument("--requests", type=int, default=64, help="--skew: requests (default 64)")
    p.add_argument("--hot-fraction", type=float, default=0.9, help="--skew: share with the hot prefix (default 0.9)")
    p.add_argument("--prefix-tokens", type=int, default=600, help="--skew: system prompt length (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None, help="opens every system prompt (default: unique per run)")
    p.add_argument("--model", default="smollm2-135m", help="alias or Hugging Face folder (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="folder of the served model's tokenizer (default: the model's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (default: the replica's)")
    p.add_argument("--threads", type=int, default=None, help="threads per replica (default: cores / replicas)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="write every run's summary and provenance here")
    args = p.parse_args(argv)
    try:
        args.systems = [SYSTEMS[s] for s in args.systems.split(",") if s]
        args.replicas = [int(r) for r in args.replicas.split(",") if r]
    except (KeyError, ValueError) as e:
        p.error(f"--systems takes {', '.join(SYSTEMS)} and --replicas integers ({e})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.tag = args.tag or f"{os.getpid()}-{time.strftime('%H%M%S')}"
    if args.tokenizer is None:
        from ..replica.weights import resolve_model

        args.tokenizer = str(resolve_model(args.model))
    runs = []
    if args.openai:
        runs.append(run_openai(args))
    else:
        for replicas in args.replicas:
            for system in args.systems:
                print(f"[{system.label} r{replicas}] running", file=sys.stderr, flush=True)
                runs.append(run_fastgen(system, replicas, args))
                print(markdown(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    info = run_info("chat", argv)
    variant = "hot prefix" if args.skew else "conversations"
    print(f"Chat workload ({variant}), {machine_name(info.get('machine'))}\n\n{markdown(runs)}")
    if args.json:
        from .loadgen import write_json

        write_json(args.json, {"meta": info | {"variant": variant, "args": _args_json(args)}, "runs": runs}, indent=1)
    return 0


def _args_json(args: argparse.Namespace) -> dict:
    out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("systems", "api_key")}
    out["systems"] = [s.label for s in args.systems]
    return out


if __name__ == "__main__":
    sys.exit(main())
