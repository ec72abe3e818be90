"""A FastGen deployment on Kubernetes: the manifests for a deployment's settings, so that the flags of
`fastgen-deploy start` drive both worlds (`fastgen-deploy k8s render --replicas 4 --device cuda ... | kubectl apply
-f -`).

Kubernetes supervises here, not fastgen-deploy: it restarts failed pods, places them and scales them. The replicas
are a StatefulSet behind a headless Service; the balancer (a Deployment behind a Service) resolves that Service's
name every few seconds (--replicas-dns), so replicas join once healthy and leave after their requests finish. Each
pod answers Kubernetes' gRPC probes on grpc.health.v1: readiness asks the server's health (a replica loading its
model or draining, a balancer without a healthy replica, are not ready), liveness asks the "liveness" service,
SERVING while the process answers. With --tp K one pod runs the K ranks under torchrun (one GPU each on CUDA); a
group spanning nodes is a LeaderWorkerSet (launch/k8s/examples/leaderworkerset.yaml).

It fails closed:
- Secrets: the internal token comes from `<name>-auth` (key `token`), the API key from `<name>-api-key` (key
  `api-key`); both are required, so a pod without them does not start. Only `--allow-unauthenticated` makes the API
  key optional (the balancer then serves anyone who reaches it).
- NetworkPolicies: a replica takes gRPC only from its deployment's balancer pods, and metrics only from Prometheus,
  that is pods labelled app.kubernetes.io/name=prometheus (the Prometheus Operator's, as kube-prometheus-stack runs
  it) in the namespace --prometheus-namespace names (default: monitoring; matched on the kubernetes.io/metadata.name
  label Kubernetes gives every namespace). Nothing else reaches a replica pod: the TP ranks' rendezvous and
  collectives stay inside it (torchrun --standalone, on loopback). The balancer takes gRPC and HTTP from anyone (its
  clients: the API key guards them) and metrics only from Prometheus.
- Pods: no service account token (they never call the API server), a read-only root filesystem with emptyDirs for
  what is written (/tmp, the cache of compiled kernels and converted weights), no privilege escalation, no
  capabilities, a non-root user.
- TLS: pass --tls-secret (a kubernetes.io/tls Secret) and the balancer serves gRPC and the HTTP API over TLS: the
  recommended path for every client, in the cluster or outside. Between the balancer and the replicas traffic is
  plaintext inside the NetworkPolicies above, authenticated by the internal token; encrypt it with a service mesh's
  mutual TLS (Istio, Linkerd) where that hop must be encrypted too (the kubelet's gRPC probes present no client
  certificate, so the replicas cannot require one themselves).
- Discovery: the balancer trusts the pods the replica Service selects by label; whoever may create pods in the
  namespace can join, so give that right (RBAC) only to the deployment's operators.

`launch/k8s/base/` is what this module renders for the defaults (`python -m fastgen.launch.kubernetes` writes it,
`--check` compares); the `cpu` and `gpu` overlays patch it, and a test checks that kustomize's build of each overlay
equals `render` for the same settings. Pure: no cluster access, no torch."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from ..server.grpc_server import LIVENESS_SERVICE
from .config import API_KEY_ENV, DEFAULT_MODEL, DeployConfig, balancer_spec, looks_like_path, replica_spec, validate
from .grafana import DASHBOARD_JSON

BASE_DIR = Path(__file__).resolve().parent / "k8s" / "base"
APP = "fastgen"
IMAGE = "fastgen"  # the image's name in the manifests; overlays and --image set the real one
TOKEN_DIR, TLS_DIR, CACHE_DIR, MODELS_DIR = "/etc/fastgen/auth", "/etc/fastgen/tls", "/var/cache/fastgen", "/models"
USER_ID = 10001  # the image's user (Dockerfile)
DRAIN_SECONDS = 120  # what a replica's and the balancer's in-flight requests get on SIGTERM
TERMINATION_GRACE_SECONDS = DRAIN_SECONDS + 30  # past the drain: the process's own exit, then SIGKILL
DEVICE_ENV = "FASTGEN_DEVICE"  # the replica's --device, as an environment variable the gpu overlay sets
# Requests per replica pod: CPU is its torch threads (per rank), memory by device (host memory beside the GPU's).
THREADS = 2  # torch threads per replica process when --threads is not given
MEMORY = {"cpu": "4Gi", "cuda": "16Gi"}
GPU_RESOURCE = "nvidia.com/gpu"
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}  # the Prometheus Operator's Prometheus pods


@dataclass(frozen=True)
class ClusterSettings:
    """What only Kubernetes asks for; the engine's and the topology's settings are the DeployConfig's."""

    image: str | None = None  # default: fastgen:cpu or fastgen:cuda
    namespace: str | None = None
    balancers: int = 2
    memory: str | None = None  # per replica pod; default by device (MEMORY)
    tls_secret: str | None = None  # a kubernetes.io/tls Secret: the balancer serves gRPC and HTTP over TLS with it
    models_claim: str | None = None  # a PersistentVolumeClaim mounted read-only at /models (--model /models/...)
    pod_monitor: bool = True  # False where the Prometheus Operator (its PodMonitor kind) is not installed
    allow_unauthenticated: bool = False  # the API key's Secret optional: the balancer may then serve anyone
    prometheus_namespace: str = "monitoring"  # where the Prometheus that may scrape the pods runs


# ---- the manifests ----
def manifests(config: DeployConfig, cluster: ClusterSettings = ClusterSettings()) -> list[dict]:
    """Every object of the deployment, for `kubectl apply`."""
    monitoring = [o for o in monitoring_objects(config) if cluster.pod_monitor or o["kind"] != "PodMonitor"]
    objects = replica_objects(config, cluster) + balancer_objects(config, cluster) + monitoring
    objects += network_policies(config, cluster)
    if cluster.namespace:
        for obj in objects:
            obj["metadata"]["namespace"] = cluster.namespace
    return objects


def render(config: DeployConfig, cluster: ClusterSettings = ClusterSettings()) -> str:
    return dump_all(manifests(config, cluster))


class _PlainDumper(yaml.SafeDumper):
    """Writes a dict shared by several objects (their labels) out in full each time: no YAML anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str_block(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    """Multi-line text (the dashboard's JSON) as a literal block, readable and diffable."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_PlainDumper.add_representer(str, _str_block)


def dump_all(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, width=120, allow_unicode=True)


def device_of(config: DeployConfig) -> str:
    """A pod has the GPUs it requests and no others: "auto" means the CPU unless asked for CUDA."""
    return "cuda" if config.device == "cuda" else "cpu"


def labels(config: DeployConfig, component: str | None = None) -> dict[str, str]:
    found = {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": config.name}
    return {**found, "app.kubernetes.io/component": component} if component else found


def replica_service_name(config: DeployConfig) -> str:
    return f"{config.name}-replica"


def replica_objects(config: DeployConfig, cluster: ClusterSettings) -> list[dict]:
    name, selector = replica_service_name(config), labels(config, "replica")
    grpc_port, metrics_port = config.port + 1, config.metrics_port + 1
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": selector},
        "spec": {
            # Headless: its DNS name answers with every pod's address, which the balancer resolves. Pods are
            # listed before they are ready: the balancer's own health checks decide when one takes traffic.
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [port_entry("grpc", grpc_port), port_entry("metrics", metrics_port)],
        },
    }
    stateful_set = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": selector},
        "spec": {
            "serviceName": name,
            "replicas": config.replicas,
            "podManagementPolicy": "Parallel",  # replicas are independent: start and stop them all at once
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": pod_spec(config, [replica_container(config, cluster)], replica_volumes(config, cluster)),
            },
        },
    }
    if device_of(config) == "cuda":
        tolerations = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        stateful_set["spec"]["template"]["spec"]["tolerations"] = tolerations
    return [service, stateful_set, disruption_budget(name, selector)]


def replica_container(config: DeployConfig, cluster: ClusterSettings) -> dict:
    device, grpc_port = device_of(config), config.port + 1
    pod_config = replace(config, host="0.0.0.0", device=f"$({DEVICE_ENV})", **in_cluster_security())
    argv = replica_spec(pod_config, "python", 0).argv
    argv[argv.index("--replica-id") + 1] = "$(POD_NAME)"  # the pod's name, stable across its restarts
    argv += ["--drain-timeout", str(DRAIN_SECONDS)]
    if config.tp > 1:  # one process per rank; torchrun gives each its RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*
        command = ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(config.tp)]
        argv = command + argv[1:]
    resources = {
        "requests": {"cpu": str(config.threads * config.tp), "memory": cluster.memory or MEMORY[device]},
        "limits": {"memory": cluster.memory or MEMORY[device]},
    }
    if device == "cuda":
        for kind in ("requests", "limits"):
            resources[kind][GPU_RESOURCE] = config.tp
    mounts = [mount("auth", TOKEN_DIR, read_only=True), mount("cache", CACHE_DIR), mount("tmp", "/tmp")]
    mounts += [mount("models", MODELS_DIR, read_only=True)] if cluster.models_claim else []
    mounts += [mount("shm", "/dev/shm")] if device == "cuda" else []
    return {
        **process(config, cluster, "replica", argv),
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": DEVICE_ENV, "value": device},
            {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},  # not ~/.triton: the root is read-only
        ],
        "ports": [container_port("grpc", grpc_port), container_port("metrics", config.metrics_port + 1)],
        **grpc_probes(grpc_port),
        "resources": resources,
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }


def replica_volumes(config: DeployConfig, cluster: ClusterSettings) -> list[dict]:
    volumes = [token_volume(config), {"name": "cache", "emptyDir": {}}, TMP_VOLUME]
    if cluster.models_claim:
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": cluster.models_claim, "readOnly": True}}
        )
    if device_of(config) == "cuda":  # NCCL and torch's workers share memory through /dev/shm (64 MiB by default)
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
    return volumes


def balancer_objects(config: DeployConfig, cluster: ClusterSettings) -> list[dict]:
    name, selector = f"{config.name}-balancer", labels(config, "balancer")
    ports = [port_entry("grpc", config.port)]
    ports += [port_entry("http", config.http_port)] if config.http_port else []
    ports += [port_entry("metrics", config.metrics_port)]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": selector},
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": selector},
        "spec": {
            "replicas": cluster.balancers,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": pod_spec(config, [balancer_container(config, cluster)], balancer_volumes(config, cluster)),
            },
        },
    }
    return [service, deployment, disruption_budget(name, selector)]


def balancer_container(config: DeployConfig, cluster: ClusterSettings) -> dict:
    tls = {"tls_cert": f"{TLS_DIR}/tls.crt", "tls_key": f"{TLS_DIR}/tls.key"} if cluster.tls_secret else {}
    pod_config = replace(config, host="0.0.0.0", **{**in_cluster_security(), **tls})
    argv = balancer_spec(pod_config, "python", []).argv
    argv += ["--replicas-dns", f"{replica_service_name(config)}:{config.port + 1}", "--grace", str(DRAIN_SECONDS)]
    ports = [container_port("grpc", config.port)]
    ports += [container_port("http", config.http_port)] if config.http_port else []
    ports += [container_port("metrics", config.metrics_port)]
    # Required: without the Secret the pod does not start, rather than serve without a key.
    api_key = {"name": config.name + "-api-key", "key": "api-key"}
    api_key |= {"optional": True} if cluster.allow_unauthenticated else {}
    mounts = [mount("auth", TOKEN_DIR, read_only=True), mount("tmp", "/tmp")]
    mounts += [mount("tls", TLS_DIR, read_only=True)] if cluster.tls_secret else []
    return {
        **process(config, cluster, "balancer", argv),
        # The API key reaches the balancer through its environment only (a command line shows in ps).
        "env": [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": api_key}}],
        "ports": ports,
        **(tls_probes(config) if cluster.tls_secret else grpc_probes(config.port)),
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }


def balancer_volumes(config: DeployConfig, cluster: ClusterSettings) -> list[dict]:
    tls = [{"name": "tls", "secret": {"secretName": cluster.tls_secret, "defaultMode": 0o440}}]
    return [token_volume(config), TMP_VOLUME] + (tls if cluster.tls_secret else [])


def monitoring_objects(config: DeployConfig) -> list[dict]:
    """A PodMonitor (the Prometheus Operator) over every pod's metrics port, each target labelled with the
    deployment as the dashboard expects, and the Grafana dashboard as a ConfigMap that Grafana's dashboard sidecar
    picks up by its label."""
    pod_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": config.name, "labels": labels(config)},
        "spec": {
            "selector": {"matchLabels": labels(config)},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": "15s",
                    "relabelings": [{"targetLabel": "deployment", "replacement": config.name}],
                }
            ],
        },
    }
    dashboard = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{config.name}-grafana-dashboard",
            "labels": {**labels(config), "grafana_dashboard": "1"},
        },
        "data": {"fastgen.json": DASHBOARD_JSON.read_text()},
    }
    return [pod_monitor, dashboard]


def network_policies(config: DeployConfig, cluster: ClusterSettings) -> list[dict]:
    """Ingress to the deployment's pods: the replicas' gRPC from its balancers only, metrics from Prometheus only,
    the balancers' gRPC and HTTP from their clients; nothing else (the TP ranks meet inside their pod)."""
    balancer_ports = [config.port] + ([config.http_port] if config.http_port else [])
    replica = [ingress(config.port + 1, {"podSelector": {"matchLabels": labels(config, "balancer")}})]
    balancer = [ingress(port) for port in balancer_ports]
    return [
        network_policy(
            f"{config.name}-replica", labels(config, "replica"), replica + [scrape(config.metrics_port + 1, cluster)]
        ),
        network_policy(
            f"{config.name}-balancer", labels(config, "balancer"), balancer + [scrape(config.metrics_port, cluster)]
        ),
    ]


def network_policy(name: str, selector: dict, rules: list[dict]) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": selector},
        "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"], "ingress": rules},
    }


def ingress(port: int, *sources: dict) -> dict:
    """Ingress to `port` from `sources` (NetworkPolicyPeers); from anywhere without any."""
    rule = {"ports": [{"protocol": "TCP", "port": port}]}
    return {**rule, "from": list(sources)} if sources else rule


def scrape(port: int, cluster: ClusterSettings) -> dict:
    namespace = {"kubernetes.io/metadata.name": cluster.prometheus_namespace}
    return ingress(
        port, {"namespaceSelector": {"matchLabels": namespace}, "podSelector": {"matchLabels": PROMETHEUS_POD}}
    )


# ---- pieces ----
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,  # what the processes write goes to emptyDirs (/tmp, the cache)
}
TMP_VOLUME = {"name": "tmp", "emptyDir": {}}


def pod_spec(config: DeployConfig, containers: list[dict], volumes: list[dict]) -> dict:
    return {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "automountServiceAccountToken": False,  # the processes never call the API server
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "runAsGroup": USER_ID,
            "fsGroup": USER_ID,  # the Secrets' files are readable by this group
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": containers,
        "volumes": volumes,
    }


def in_cluster_security() -> dict:
    """The token from its Secret. No mutual TLS inside the cluster: the kubelet's gRPC probes present no client
    certificate. The balancer's clients get TLS with --tls-secret; a service mesh's mutual TLS encrypts the
    balancer-to-replica hop where that is wanted (see the module's docstring)."""
    return {"auth_token_file": f"{TOKEN_DIR}/token", "tls_cert": None, "tls_key": None, "tls_ca": None}


def token_volume(config: DeployConfig) -> dict:
    return {"name": "auth", "secret": {"secretName": f"{config.name}-auth", "defaultMode": 0o440}}


def grpc_probes(port: int) -> dict:
    return {
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {
            "grpc": {"port": port, "service": LIVENESS_SERVICE},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def tls_probes(config: DeployConfig) -> dict:
    """The kubelet's gRPC probes speak no TLS: over TLS the balancer is ready when its HTTP API's /health says so
    (an HTTPS probe does not verify the certificate), and alive while its gRPC port accepts connections."""
    ready = {"httpGet": {"path": "/health", "port": "http", "scheme": "HTTPS"}} if config.http_port else None
    alive = {"tcpSocket": {"port": "grpc"}}
    return {
        "readinessProbe": {**(ready or alive), "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {**alive, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def disruption_budget(name: str, selector: dict) -> dict:
    """At most one pod down for voluntary disruptions (node drains, upgrades): the others keep serving."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": selector},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def process(config: DeployConfig, cluster: ClusterSettings, name: str, argv: list[str]) -> dict:
    """A container's name, image and command line."""
    return {
        "name": name,
        "image": image_of(config, cluster),
        "imagePullPolicy": "IfNotPresent",
        "command": argv[:1],
        "args": argv[1:],
    }


def image_of(config: DeployConfig, cluster: ClusterSettings) -> str:
    return cluster.image or f"{IMAGE}:{device_of(config)}"


def port_entry(name: str, port: int) -> dict:
    return {"name": name, "port": port, "targetPort": name}


def container_port(name: str, port: int) -> dict:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def mount(volume: str, path: str, read_only: bool = False) -> dict:
    return {"name": volume, "mountPath": path, **({"readOnly": True} if read_only else {})}


# ---- settings and checks ----
def problems(config: DeployConfig, cluster: ClusterSettings) -> list[str]:
    """What is wrong with the settings for Kubernetes, each saying what to change. A model path is the container's
    (an image's or a volume's), not this machine's, so it is not looked for here."""
    found = validate(replace(config, model=DEFAULT_MODEL) if looks_like_path(config.model) else config)
    if cluster.balancers < 1:
        found.append(f"--balancers must be at least 1, got {cluster.balancers}")
    return found


def add_render_flags(p: argparse.ArgumentParser) -> None:
    """`k8s render`'s own flags, beside the deployment's (cli.add_deployment_flags)."""
    p.add_argument(
        "--name", default=APP, help="prefix of the objects' names and their instance label (default: fastgen)"
    )
    p.add_argument("--namespace", default=None, help="namespace of every object (default: kubectl's)")
    p.add_argument("--image", default=None, help="container image (default: fastgen:cpu, or fastgen:cuda on cuda)")
    p.add_argument("--balancers", type=int, default=ClusterSettings.balancers, help="balancer pods (default: 2)")
    p.add_argument(
        "--memory",
        default=None,
        help=f"memory request and limit of a replica pod (default: {MEMORY['cpu']} on cpu, {MEMORY['cuda']} on cuda)",
    )
    p.add_argument(
        "--tls-secret",
        default=None,
        metavar="SECRET",
        help="a kubernetes.io/tls Secret: the balancer serves gRPC and the HTTP API over TLS with its certificate",
    )
    p.add_argument(
        "--models-claim",
        default=None,
        metavar="PVC",
        help=f"a PersistentVolumeClaim mounted read-only at {MODELS_DIR} in the replicas (--model {MODELS_DIR}/...)",
    )
    p.add_argument(
        "--no-pod-monitor",
        dest="pod_monitor",
        action="store_false",
        help="leave out the PodMonitor, where the Prometheus Operator is not installed",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="make the API key's Secret (<name>-api-key) optional: without it the balancer serves anyone who reaches "
        "it. By default the Secret is required and the balancer's pods do not start without it",
    )
    p.add_argument(
        "--prometheus-namespace",
        default=ClusterSettings.prometheus_namespace,
        metavar="NAMESPACE",
        help="the namespace of the Prometheus (pods labelled app.kubernetes.io/name=prometheus) that the "
        "NetworkPolicies let scrape the pods' metrics (default: %(default)s)",
    )


def cluster_settings(args: argparse.Namespace) -> ClusterSettings:
    return ClusterSettings(
        args.image,
        args.namespace,
        args.balancers,
        args.memory,
        args.tls_secret,
        args.models_claim,
        args.pod_monitor,
        args.allow_unauthenticated,
        args.prometheus_namespace,
    )


# ---- the committed base (launch/k8s/base) ----
BASE_FILES = {
    "replicas.yaml": "replica",
    "balancer.yaml": "balancer",
    "monitoring.yaml": "monitoring",
    "network.yaml": "network",
}
BASE_HEADER = (
    "# Generated by `python -m fastgen.launch.kubernetes` (launch/kubernetes.py) for fastgen-deploy's defaults:\n"
    "# do not edit; patch it in an overlay, or render other settings with `fastgen-deploy k8s render`.\n"
)


def base_files() -> dict[str, str]:
    """The base's files and their text: the defaults' manifests split by component, and its kustomization."""
    config = DeployConfig(name=APP, device="cpu", threads=THREADS)
    parts = {
        "replica": replica_objects(config, ClusterSettings()),
        "balancer": balancer_objects(config, ClusterSettings()),
        "monitoring": monitoring_objects(config),
        "network": network_policies(config, ClusterSettings()),
    }
    files = {file: BASE_HEADER + dump_all(parts[part]) for file, part in BASE_FILES.items()}
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(BASE_FILES),
    }
    files["kustomization.yaml"] = BASE_HEADER + dump_all([kustomization])
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.launch.kubernetes", description="write launch/k8s/base from the defaults"
    )
    p.add_argument("--check", action="store_true", help="compare instead of writing (exit 1 when stale)")
    args = p.parse_args(argv)
    stale = []
    for file, text in base_files().items():
        path = BASE_DIR / file
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run python -m fastgen.launch.kubernetes", file=sys.stderr)
        return 1
    print(f"{BASE_DIR} is up to date" if args.check else f"wrote {BASE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
