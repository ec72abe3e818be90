"""What the load generator talks to. Each backend turns one BenchRequest into a RequestRecord with the client-side
arrival time of every token:

- FastGenBackend: fastgen.v1 GenerateStream (a balancer or a replica) through AsyncClient.stream_chunks.
- OpenAIBackend: an OpenAI-compatible /v1/completions server streaming server-sent events (vLLM's api_server,
  FastGen's balancer with --http-port), over the standard library's http.client, one thread per request in flight;
  a new connection per request, or with keepalive one kept per thread (as the openai SDK's pool does).
- HFBackend: transformers `generate` in this process with static batches: the worker takes whatever requests
  are waiting (up to max_batch), runs them together to the longest one's length, and only then takes the next
  batch. A request's tokens are timed per generation step by a streamer, and it completes at its own last token
  (as a streaming static-batch server would answer), though the next batch still waits for the whole batch.

Every backend forces the generation length (ignore_eos / min tokens) and decodes greedily.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection, RemoteDisconnected
from urllib.parse import urlsplit

from .stats import RequestRecord
from .workload import BenchRequest

now = time.perf_counter


def deployment_credentials(name: str, role: str = "balancer") -> dict:
    """FastGenBackend's credentials for the local fastgen-deploy deployment `name`: its internal token (which its
    balancer and its replicas both take) and TLS where it has it; role "replica" to call a replica directly."""
    from ..launch import deployment
    from ..launch.state import fastgen_home

    return {"security": deployment.access_of(fastgen_home(), name)[role]}


class FastGenBackend:
    """`credentials`: AsyncClient's keyword arguments (api_key, default $FASTGEN_API_KEY; tls_ca, tls_cert,
    tls_key)."""

    kind = "fastgen"

    def __init__(self, address: str, timeout: float = 900.0, **credentials):
        self.address = address
        self.timeout = timeout
        self.credentials = credentials
        self._client = None

    async def open(self) -> None:
        from ..server.client import AsyncClient  # the channel must be made inside the running loop

        self._client = AsyncClient(self.address, timeout=self.timeout, **self.credentials)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def run(self, req: BenchRequest, client: int = 0) -> RequestRecord:
        rec = RequestRecord(start=now(), token_times=[], prompt_tokens=len(req.prompt), client=client)
        try:
            chunks = self._client.stream_chunks(
                req.prompt, max_new_tokens=req.max_new_tokens, ignore_eos=True, temperature=0.0
            )
            async for chunk in chunks:
                t = now()
                rec.token_times.extend([t] * len(chunk.token_ids))
            rec.end = now()
        except Exception as e:  # a failed request is a result (it misses the SLA), not a crash of the run
            rec.error = f"{type(e).__name__}: {e}"
        return rec


class OpenAIBackend:
    """Streams /v1/completions with the prompt as token ids. An event is counted as one token unless it carries
    token information (logprobs); the final usage block, when sent, fixes the count of the last event.

    `url` is the server's base URL, with or without the /v1 the openai SDK takes. `api_key` goes out as a bearer
    token. `keepalive` keeps one HTTP/1.1 connection per worker thread across requests (the stream is read to its
    end so the connection can be reused; a kept connection the server has closed meanwhile is replaced once)."""

    kind = "openai"

    def __init__(
        self,
        url: str,
        model: str,
        max_in_flight: int = 64,
        timeout: float = 900.0,
        api_key: str | None = None,
        keepalive: bool = False,
    ):
        self.host, self.port, v1 = api_base(url)
        self.path = v1 + "/completions"
        self.model = model
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.keepalive = keepalive
        self._local = threading.local()
        self._connections: list[HTTPConnection] = []
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="openai")

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for conn in self._connections:
            conn.close()

    async def run(self, req: BenchRequest, client: int = 0) -> RequestRecord:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.run_blocking, req, client)

    def body(self, req: BenchRequest) -> bytes:
        return json.dumps(
            {
                "model": self.model,
                "prompt": req.prompt,
                "max_tokens": req.max_new_tokens,
                "min_tokens": req.max_new_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()

    def run_blocking(self, req: BenchRequest, client: int = 0) -> RequestRecord:
        rec = RequestRecord(start=now(), token_times=[], prompt_tokens=len(req.prompt), client=client)
        conn = self._connection()
        keep = False
        try:
            resp = self._send(conn, self.body(req))
            if resp is None:  # a kept connection the server had closed: once more on a new one
                conn = self._connection(fresh=True)
                resp = self._send(conn, self.body(req), retry=False)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
            self._read_events(resp, rec)
            rec.end = now()
            if self.keepalive and not resp.will_close:
                resp.read()  # what follows [DONE] (the chunked body's end), so the next request can use conn
                keep = True
        except Exception as e:
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            if not keep:
                self._drop(conn)
        return rec

    def _send(self, conn: HTTPConnection, body: bytes, retry: bool = True):
        """The response, or None when a reused connection turned out closed before any answer came."""
        reused = conn.sock is not None
        try:
            conn.request("POST", self.path, body=body, headers=self.headers)
            return conn.getresponse()
        except (RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if retry and reused:
                return None
            raise

    def _connection(self, fresh: bool = False) -> HTTPConnection:
        conn = getattr(self._local, "conn", None) if self.keepalive else None
        if conn is None or fresh:
            if conn is not None:
                self._drop(conn)
            conn = HTTPConnection(self.host, self.port, timeout=self.timeout)
            if self.keepalive:
                self._local.conn = conn
                self._connections.append(conn)
        return conn

    def _drop(self, conn: HTTPConnection) -> None:
        conn.close()
        if self.keepalive and getattr(self._local, "conn", None) is conn:
            self._local.conn = None
            self._connections.remove(conn)

    @staticmethod
    def _read_events(resp, rec: RequestRecord) -> None:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            t = now()
            event = json.loads(data)
            if event.get("choices"):
                rec.token_times.extend([t] * tokens_in(event))
            usage = event.get("usage")  # a usage-only event closes the stream (llama.cpp: its last choice carries it)
            if usage:
                # Tokens no event counted: several in one event's text (a server holds back bytes of an unfinished
                # UTF-8 character, llama.cpp for dozens of tokens at times), timed as the last seen.
                missing = usage.get("completion_tokens", 0) - len(rec.token_times)
                if missing > 0 and rec.token_times:
                    rec.token_times.extend([rec.token_times[-1]] * missing)


def api_base(url: str) -> tuple[str, int, str]:
    """(host, port, path of /v1) of a server's base URL given with or without its /v1 (scheme optional)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    base = parts.path.rstrip("/")
    return parts.hostname, parts.port or 80, base if base.endswith("/v1") else base + "/v1"


def served_models(url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """The model names an OpenAI-compatible server lists at GET /v1/models (the name its requests must carry)."""
    host, port, v1 = api_base(url)
    conn = HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        conn.request("GET", v1 + "/models", headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        return [m["id"] for m in json.loads(resp.read())["data"]]
    finally:
        conn.close()


def tokens_in(event: dict) -> int:
    choice = (event.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {}
    if logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    return 1 if choice.get("text") or choice.get("finish_reason") is None else 0


class HFBackend:
    kind = "hf"

    def __init__(self, model_dir: str, dtype: str = "bfloat16", threads: int | None = None, max_batch: int = 8):
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.threads = threads
        self.max_batch = max_batch
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._model = None

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._serve, name="hf-generate", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        self._model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype)).eval()

    async def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join, 60)

    async def run(self, req: BenchRequest, client: int = 0) -> RequestRecord:
        rec = RequestRecord(start=now(), token_times=[], prompt_tokens=len(req.prompt), client=client)
        done = self._loop.create_future()
        self._queue.put((req, rec, done))
        await done
        return rec

    def _serve(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                self._generate(batch)
            except Exception as e:
                for _, rec, done in batch:
                    rec.error = rec.error or f"{type(e).__name__}: {e}"
                    self._finish(rec, done)

    def _finish(self, rec: RequestRecord, done: asyncio.Future) -> None:
        def settle() -> None:
            if not done.done():
                done.set_result(None)

        self._loop.call_soon_threadsafe(settle)

    def _generate(self, batch: list) -> None:
        import torch

        prompts = [req.prompt for req, _, _ in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(req.max_new_tokens for req, _, _ in batch)
        with torch.inference_mode():
            self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
                streamer=StepTimer(batch, self._finish),
            )


class StepTimer:
    """A transformers streamer that stamps every generation step and completes each request at its own length."""

    def __init__(self, batch: list, finish):
        self.batch = batch
        self.finish = finish
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt ids
            self.prompt_seen = True
            return
        t = now()
        for req, rec, done in self.batch:
            if len(rec.token_times) < req.max_new_tokens:
                rec.token_times.append(t)
                if len(rec.token_times) == req.max_new_tokens:
                    rec.end = t
                    self.finish(rec, done)

    def end(self) -> None:
        for _, rec, done in self.batch:
            if rec.end is None:
                rec.error = rec.error or f"generate stopped after {len(rec.token_times)} tokens"
            self.finish(rec, done)
