"""TLS with real certificates on loopback: `fastgen-deploy certs` material, TLS and mutual TLS on gRPC servers and the
HTTP API (in-process, fast), and a whole deployment started with `--tls auto` and an API key (slow): plaintext to a
TLS port fails, TLS with the CA works; clients without the key, or with a wrong one, are UNAUTHENTICATED while health
checks stay open; a replica refuses the client key and certificates from another CA, and takes its balancer's calls;
the token file is 0600 and in no process's command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import stat
import types
from pathlib import Path

import aiohttp
import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastgen.balancer.openai_api import ApiSettings, OpenAIApi, start_http
from fastgen.launch import cli
from fastgen.launch import config as cfg
from fastgen.launch.certs import cert_files, cert_info, generate, local_access
from fastgen.launch.config import API_KEY_ENV
from fastgen.server import AsyncClient, Client, GenerationError
from fastgen.server.grpc_server import ServerSecurity
from fastgen.server.tls import TlsFiles, client_ssl_context, server_ssl_context

from .helpers import Deploy, alive, free_port, tiny_start
from .test_auth import serve_echo

KEY = "sk-tls-test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> types.SimpleNamespace:
    """The deployment's CA and certificate, and a second CA with a certificate of its own (an impostor)."""
    root = tmp_path_factory.mktemp("pki")
    ours = generate(root / "ours", ["10.1.2.3", "fastgen.example"])
    theirs = generate(root / "theirs", [])
    return types.SimpleNamespace(ours=ours, theirs=theirs)


def test_certs_name_loopback_and_the_host_and_keep_keys_private(pki):
    self_signed, dns, ips = cert_info(str(pki.ours.cert))
    assert not self_signed and {"localhost", "fastgen.example"} <= set(dns)
    assert {"127.0.0.1", "::1", "10.1.2.3"} <= set(ips)
    assert cert_info(str(pki.ours.ca))[0]  # the CA is self-signed
    for key in (pki.ours.key, pki.ours.ca_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    context = ssl.create_default_context(cafile=str(pki.ours.ca))  # the chain verifies with the standard library too
    context.load_cert_chain(str(pki.ours.cert), str(pki.ours.key))


def test_certs_command_makes_them_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(["certs", "--name", "x", "--host", "192.168.7.7"]) == 0
    files = cert_files(tmp_path / "x")
    assert files.exist() and "192.168.7.7" in cert_info(str(files.cert))[2]
    before = files.cert.read_bytes()
    assert cli.main(["certs", "--name", "x"]) == 0 and files.cert.read_bytes() == before
    assert "already" in capsys.readouterr().out
    assert cli.main(["certs", "--name", "x", "--force"]) == 0 and files.cert.read_bytes() != before


def test_tls_flags_reach_the_balancer_and_with_a_ca_the_replicas(pki, tmp_path, monkeypatch):
    tls = dict(tls_cert=str(pki.ours.cert), tls_key=str(pki.ours.key))
    public = cfg.plan(cfg.DeployConfig(replicas=1, **tls), "PY")
    assert "--tls-cert" in public[0].argv and "--tls-ca" not in public[0].argv
    assert "--tls-cert" not in public[1].argv  # TLS on the public port only
    mutual = cfg.plan(cfg.DeployConfig(replicas=1, tls_ca=str(pki.ours.ca), **tls), "PY")
    for spec in mutual:
        assert spec.argv[spec.argv.index("--tls-ca") + 1] == str(pki.ours.ca) and "--tls-key" in spec.argv
    assert cfg.validate(cfg.DeployConfig(tls_cert=str(pki.ours.cert))) == [
        "--tls-cert and --tls-key go together: give both or neither"
    ]
    assert "no such file" in cfg.validate(cfg.DeployConfig(tls_cert="/nope", tls_key=str(pki.ours.key)))[0]
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(["start", "--tls", "auto", "--tls-cert", "x"]) == 1  # refused before anything starts


def test_local_tools_trust_the_ca_or_a_self_signed_certificate(pki):
    access = local_access(cfg.DeployConfig(**vars(tls_args(pki.ours, ca=True))))
    assert access["balancer"].tls.ca == str(pki.ours.ca) and access["replica"] is access["balancer"]
    assert access["balancer"].server_name is None  # the certificate names 127.0.0.1
    # A self-signed certificate without a CA (the CA's own stands in for one): trusted as itself; no mutual TLS.
    own = cfg.DeployConfig(tls_cert=str(pki.theirs.ca), tls_key=str(pki.theirs.ca_key))
    access = local_access(own)
    assert access["balancer"].tls.ca == str(pki.theirs.ca) and access["replica"].tls is None


def tls_args(files, ca: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca) if ca else None)


# ---- gRPC servers in-process ----
def test_plaintext_to_a_tls_port_fails_and_tls_with_the_ca_works(pki):
    async def main():
        server, address = await serve_echo(ServerSecurity(tls=TlsFiles(str(pki.ours.cert), str(pki.ours.key))))
        try:
            async with AsyncClient(address, timeout=3) as plain:
                with pytest.raises(GenerationError) as e:
                    await plain.generate("hi")
                assert e.value.code == grpc.StatusCode.UNAVAILABLE
            async with AsyncClient(address, timeout=3, tls_ca=str(pki.theirs.ca)) as wrong_ca:
                with pytest.raises(GenerationError) as e:
                    await wrong_ca.generate("hi")
                assert e.value.code == grpc.StatusCode.UNAVAILABLE
            async with AsyncClient(address, timeout=5, tls_ca=str(pki.ours.ca)) as client:
                assert (await client.generate("hi")).text == "hi"
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_deployments_ca(pki):
    async def main():
        tls = TlsFiles(str(pki.ours.cert), str(pki.ours.key), str(pki.ours.ca))
        server, address = await serve_echo(ServerSecurity(tls=tls))
        ca = str(pki.ours.ca)
        try:
            impostor = dict(tls_cert=str(pki.theirs.cert), tls_key=str(pki.theirs.key))
            for creds in ({}, impostor):
                async with AsyncClient(address, timeout=3, tls_ca=ca, **creds) as client:
                    with pytest.raises(GenerationError) as e:
                        await client.generate("hi")
                    assert e.value.code == grpc.StatusCode.UNAVAILABLE, creds
            ours = dict(tls_cert=str(pki.ours.cert), tls_key=str(pki.ours.key))
            async with AsyncClient(address, timeout=5, tls_ca=ca, **ours) as client:
                assert (await client.generate("hi")).text == "hi"
        finally:
            await server.stop(0)

    asyncio.run(main())


# ---- the HTTP API in-process ----
def test_https_api_refuses_plaintext_and_serves_tls_with_the_key(pki):
    balancer = types.SimpleNamespace(
        pool=types.SimpleNamespace(any_healthy=lambda: True), model=lambda: "m", lora_adapters=lambda: []
    )

    async def main():
        api = OpenAIApi(balancer, ApiSettings(api_key=KEY))
        context = server_ssl_context(TlsFiles(str(pki.ours.cert), str(pki.ours.key)))
        runner, port = await start_http(api, "127.0.0.1", 0, 1.0, context)
        trust = client_ssl_context(TlsFiles(ca=str(pki.ours.ca)))
        auth = {"Authorization": f"Bearer {KEY}"}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                with pytest.raises(aiohttp.ClientError):
                    await http.get(f"http://127.0.0.1:{port}/v1/models", headers=auth)
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await http.get(f"https://127.0.0.1:{port}/health")  # the system's roots do not know our CA
                async with http.get(f"https://127.0.0.1:{port}/v1/models", headers=auth, ssl=trust) as r:
                    assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
                async with http.get(f"https://127.0.0.1:{port}/v1/models", ssl=trust) as r:
                    assert r.status == 401
                async with http.get(f"https://127.0.0.1:{port}/health", ssl=trust) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()

    asyncio.run(main())


# ---- a whole deployment: --tls auto, an API key, one replica ----
@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("secured") / "home"
    deploy = Deploy(home)
    deploy.env[API_KEY_ENV] = KEY
    port = free_port(2)
    metrics = free_port(2)
    http = free_port(1)
    done = deploy(*tiny_start("sec", tiny_model_dir, 1, port, metrics, "--tls", "auto", http_port=http), timeout=180)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        files = cert_files(home / "sec")
        yield types.SimpleNamespace(
            deploy=deploy,
            home=home,
            port=port,
            http=http,
            files=files,
            start=done,
            token_file=home / "sec" / "auth-token",
        )
    finally:
        deploy("stop", "--name", "sec", "--timeout", "10")
        state = home / "sec" / "state.json"
        if state.exists():
            deploy.seen_pids.add(json.loads(state.read_text())["supervisor"]["pid"])
        for pid in deploy.seen_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def grpc_health(address: str, **tls) -> str:
    creds = grpc.ssl_channel_credentials(**tls) if tls else None
    options = [("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.secure_channel(address, creds, options) if creds else grpc.insecure_channel(address, options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def call_code(address: str, **kwargs) -> str:
    try:
        with Client(address, timeout=10, **kwargs) as client:
            client.generate("Hello", max_new_tokens=2)
    except GenerationError as e:
        return e.code.name
    return "OK"


@pytest.mark.slow
def test_status_and_generate_reach_a_secured_deployment(secured):
    rows = secured.deploy.status("sec")  # the supervisor's checks and status's own go over (mutual) TLS
    assert [(r["role"], r["health"]) for r in rows] == [("balancer", "SERVING"), ("replica", "SERVING")]
    assert rows[1]["kv_blocks_total"] > 0 and "replicas_serving" in rows[0]  # GetStatus passed the token check
    assert "mutual TLS" in secured.start.stdout and "https://" in secured.start.stdout
    done = secured.deploy("generate", "Hello", "--name", "sec", "--max-new-tokens", "3")
    assert done.returncode == 0 and "served by replica-0" in done.stderr, done.stderr


@pytest.mark.slow
def test_the_balancer_wants_tls_and_the_api_key_but_health_stays_open(secured):
    address, ca = f"127.0.0.1:{secured.port}", str(secured.files.ca)
    assert call_code(address, api_key=KEY) == "UNAVAILABLE"  # plaintext to a TLS port
    assert grpc_health(address) == "UNAVAILABLE"
    assert call_code(address, api_key="", tls_ca=ca) == "UNAUTHENTICATED"
    assert call_code(address, api_key="sk-wrong", tls_ca=ca) == "UNAUTHENTICATED"
    assert call_code(address, api_key=KEY, tls_ca=ca) == "OK"
    assert grpc_health(address, root_certificates=secured.files.ca.read_bytes()) == "SERVING"
    with pytest.raises(GenerationError, match="API key"):
        with Client(address, timeout=10, api_key="", tls_ca=ca) as client:
            client.status()


@pytest.mark.slow
def test_the_https_api_of_the_deployment(secured):
    async def main():
        trust = client_ssl_context(TlsFiles(ca=str(secured.files.ca)))
        url = f"127.0.0.1:{secured.http}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            with pytest.raises(aiohttp.ClientError):
                await http.get(f"http://{url}/health")
            async with http.get(f"https://{url}/health", ssl=trust) as r:
                assert r.status == 200
            body = {"prompt": "Hello", "max_tokens": 2}
            async with http.post(f"https://{url}/v1/completions", json=body, ssl=trust) as r:
                assert r.status == 401
            headers = {"Authorization": f"Bearer {KEY}"}
            async with http.post(f"https://{url}/v1/completions", json=body, ssl=trust, headers=headers) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2

    asyncio.run(main())


@pytest.mark.slow
def test_a_replica_takes_only_its_balancers_token_and_certificate(secured):
    replica, files = f"127.0.0.1:{secured.port + 1}", secured.files
    ours = dict(tls_ca=str(files.ca), tls_cert=str(files.cert), tls_key=str(files.key))
    token = secured.token_file.read_text().strip()
    assert call_code(replica, api_key=KEY, **ours) == "UNAUTHENTICATED"  # the client key opens the balancer only
    assert call_code(replica, api_key=token, **ours) == "OK"  # what the balancer sends
    impostor = generate(secured.home / "impostor", [])
    forged = dict(tls_ca=str(files.ca), tls_cert=str(impostor.cert), tls_key=str(impostor.key))
    assert call_code(replica, api_key=token, **forged) == "UNAVAILABLE"  # a certificate of another CA
    assert call_code(replica, api_key=token, tls_ca=str(files.ca)) == "UNAVAILABLE"  # no certificate
    assert call_code(replica, api_key=token) == "UNAVAILABLE"  # plaintext
    ca = files.ca.read_bytes()
    client = dict(private_key=files.key.read_bytes(), certificate_chain=files.cert.read_bytes())
    assert grpc_health(replica, root_certificates=ca, **client) == "SERVING"  # no token needed


@pytest.mark.slow
def test_the_token_file_is_private_and_in_no_command_line(secured):
    assert stat.S_IMODE(secured.token_file.stat().st_mode) == 0o600
    token = secured.token_file.read_text().strip()
    rows = secured.deploy.status("sec")
    supervisor = json.loads((secured.home / "sec" / "state.json").read_text())["supervisor"]["pid"]
    family = [psutil.Process(supervisor)] + psutil.Process(supervisor).children(recursive=True)
    assert {r["pid"] for r in rows} <= {p.pid for p in family}
    for p in family:
        cmdline = " ".join(p.cmdline())
        assert token not in cmdline and KEY not in cmdline, cmdline
    balancer = next(p for p in family if p.pid == rows[0]["pid"])
    assert str(secured.token_file) in balancer.cmdline()
    assert Path(secured.files.key).stat().st_mode & 0o077 == 0
