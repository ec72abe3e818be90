"""Bearer tokens: parsing and constant-time checks, the server interceptor (health and reflection stay open), the
clients and the balancer's pool sending them, token files, and how a deployment hands its token to its processes
(in argv only as a file's path). In-process gRPC servers on loopback: fast."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fastgen.balancer.__main__ import parse_args as balancer_args
from fastgen.balancer.__main__ import security_from_args
from fastgen.balancer.pool import ReplicaPool, ReplicaSpec
from fastgen.launch import config as cfg
from fastgen.launch import deployment
from fastgen.launch.certs import ensure_token_file, local_access
from fastgen.proto import fastgen_pb2 as pb
from fastgen.proto import fastgen_pb2_grpc
from fastgen.server import AsyncClient, GenerationError
from fastgen.server.auth import (
    AuthorizedStub,
    bearer_metadata,
    bearer_token,
    read_token_file,
    token_accepted,
    write_token_file,
)
from fastgen.server.client import API_KEY_ENV, ChannelSecurity
from fastgen.server.grpc_server import ServerSecurity, create_server, set_serving
from fastgen.testing import free_port

TOKEN = "s3cret-token"
HINT = "send authorization: Bearer <the test token>"


class Echo(fastgen_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        return pb.GenerateResponse(text=request.text, replica="echo", finish_reason=pb.FINISH_REASON_LENGTH)

    async def GenerateStream(self, request, context):
        yield pb.GenerateChunk(text=request.text, replica="echo", finish_reason=pb.FINISH_REASON_LENGTH)

    async def GetStatus(self, request, context):
        return pb.StatusResponse(model="echo", role="replica")


async def serve_echo(security: ServerSecurity | None = None) -> tuple[grpc.aio.Server, str]:
    port = free_port()
    server, health = create_server(Echo(), "127.0.0.1", port, security)
    await server.start()
    await set_serving(health, True)
    return server, f"127.0.0.1:{port}"


def run(coro):
    return asyncio.run(coro)


# ---- parsing and comparing ----
@pytest.mark.parametrize(
    "header, token",
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("BEARER abc", "abc"),
        ("  Bearer abc", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer   ", None),
        ("", None),
        (None, None),
        ("abc", None),
    ],
)
def test_bearer_token_parsing(header, token):
    assert bearer_token(header) == token


def test_token_accepted_only_for_a_whole_token():
    assert token_accepted(f"Bearer {TOKEN}", [TOKEN])
    assert token_accepted(f"Bearer {TOKEN}", ["other", TOKEN])
    for header in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "", None):
        assert not token_accepted(header, [TOKEN]), header
    assert not token_accepted("Bearer x", [])
    assert bearer_metadata(TOKEN) == (("authorization", f"Bearer {TOKEN}"),) and bearer_metadata("") == ()


def test_token_file_is_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        token = write_token_file(tmp_path / "d" / "token")
    finally:
        os.umask(old)
    path = tmp_path / "d" / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token_file(path) == token and len(token) >= 40
    assert write_token_file(path) != token  # a new one each time
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="must hold one token"):
        read_token_file(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read"):
        read_token_file(tmp_path / "missing")


def test_a_given_token_file_must_be_private(tmp_path):
    given = tmp_path / "mine"
    given.write_text("tok\n")
    given.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        ensure_token_file(tmp_path, str(given))
    given.chmod(0o600)
    assert ensure_token_file(tmp_path, str(given)) == given.resolve()
    made = ensure_token_file(tmp_path / "state", None)
    assert made == tmp_path / "state" / "auth-token" and stat.S_IMODE(made.stat().st_mode) == 0o600


# ---- the interceptor on a live server ----
def test_server_refuses_calls_without_the_token_but_health_and_reflection_stay_open():
    async def main():
        server, address = await serve_echo(ServerSecurity((TOKEN,), HINT))
        try:
            for key in ("", "wrong", TOKEN[:-1]):
                async with AsyncClient(address, timeout=5, api_key=key) as client:
                    for call in (
                        client.generate("hi"),
                        client.status(),
                        anext(aiter(client.stream_chunks("hi")), None),
                    ):
                        with pytest.raises(GenerationError) as e:
                            await call
                        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and e.value.details == HINT
            async with AsyncClient(address, timeout=5, api_key=TOKEN) as client:
                assert (await client.generate("hi")).text == "hi"
                assert [c.text async for c in client.stream_chunks("yo")] == ["yo"]
                assert (await client.status()).model == "echo"
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = [s.name async for a in answers for s in a.list_services_response.service]
                assert "fastgen.v1.Generation" in names
        finally:
            await server.stop(0)

    run(main())


def test_an_open_server_takes_any_token_and_the_client_sends_the_environments_key(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, TOKEN)

    async def main():
        open_server, open_address = await serve_echo()
        closed, closed_address = await serve_echo(ServerSecurity((TOKEN,), HINT))
        try:
            async with AsyncClient(open_address, timeout=5, api_key="anything") as client:
                assert (await client.generate("a")).text == "a"
            async with AsyncClient(closed_address, timeout=5) as client:  # $FASTGEN_API_KEY
                assert (await client.generate("b")).text == "b"
        finally:
            await open_server.stop(0)
            await closed.stop(0)

    run(main())


def test_the_pool_sends_the_internal_token_on_every_call_but_the_health_check():
    async def main():
        server, address = await serve_echo(ServerSecurity((TOKEN,), HINT))
        pools = [
            ReplicaPool([ReplicaSpec("r0", address)], 0.05, 1.0, security=ChannelSecurity(bearer_metadata(t)))
            for t in (TOKEN, None)
        ]
        try:
            for pool in pools:
                pool.start()
            for _ in range(100):
                if all(p.replicas[0].reports for p in pools[:1]) and pools[1].any_healthy():
                    break
                await asyncio.sleep(0.05)
            good, bare = (p.replicas[0] for p in pools)
            assert good.healthy and good.model == "echo"  # GetStatus went through
            assert bare.healthy and bare.reports == 0  # health needs no token; GetStatus was refused
            assert (await good.stub.Generate(pb.GenerateRequest(text="x"), timeout=5)).text == "x"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await bare.stub.Generate(pb.GenerateRequest(text="x"), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            for pool in pools:
                await pool.close()
            await server.stop(0)

    run(main())


def test_authorized_stub_adds_its_metadata_and_nothing_without_any():
    seen = []

    class Stub:
        def Generate(self, request, **kwargs):
            seen.append(kwargs)

    AuthorizedStub(Stub(), bearer_metadata(TOKEN)).Generate("r", timeout=1)
    AuthorizedStub(Stub(), ()).Generate("r", timeout=2)
    assert seen == [{"timeout": 1, "metadata": bearer_metadata(TOKEN)}, {"timeout": 2}]


# ---- the balancer's and the deployment's settings ----
def test_balancer_accepts_the_api_key_and_the_internal_token_and_sends_the_token(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    token_file = tmp_path / "token"
    write_token_file(token_file, TOKEN)
    base = ["--replica", "r0=127.0.0.1:1", "--auth-token-file", str(token_file)]
    keyed = security_from_args(balancer_args([*base, "--api-key", "sk-1"]))
    assert keyed.server.tokens == ("sk-1", TOKEN) and keyed.upstream.metadata == bearer_metadata(TOKEN)
    assert keyed.server.tls is None and keyed.upstream.tls is None
    open_ = security_from_args(balancer_args(base))
    assert open_.server.tokens == () and open_.upstream.metadata == bearer_metadata(TOKEN)
    with pytest.raises(ValueError, match="cannot read"):
        security_from_args(balancer_args(["--replica", "r0=127.0.0.1:1", "--auth-token-file", str(tmp_path / "x")]))


def test_processes_get_the_token_files_path_never_the_token(tmp_path):
    token_file = tmp_path / "auth-token"
    write_token_file(token_file, TOKEN)
    c = cfg.DeployConfig(replicas=2, tp=2, auth_token_file=str(token_file))
    specs = cfg.plan(c, "PY")
    assert len(specs) == 5
    for spec in specs:
        assert spec.argv[spec.argv.index("--auth-token-file") + 1] == str(token_file)
        assert not any(TOKEN in a for a in spec.argv)
        assert "--tls-cert" not in spec.argv
    access = local_access(c)
    assert access["balancer"].metadata == access["replica"].metadata == bearer_metadata(TOKEN)
    assert access["balancer"].tls is None


def test_start_makes_relative_security_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = deployment.absolute_security_paths(cfg.DeployConfig(auth_token_file="t", tls_cert="c.pem", tls_key="k.pem"))
    assert (c.auth_token_file, c.tls_cert, c.tls_key, c.tls_ca) == (
        str(tmp_path / "t"),
        str(tmp_path / "c.pem"),
        str(tmp_path / "k.pem"),
        None,
    )
    assert Path(c.tls_cert).is_absolute()
