"""fastgen-deploy: start, inspect and stop a persistent FastGen deployment (balancer + replicas).

Imports neither torch nor fastgen.replica, so every command answers at once; the model loads in the replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from dataclasses import fields, replace
from pathlib import Path

from ..replica.engine_args import add_arguments
from . import certs, deployment, kubernetes, prometheus
from .config import (
    API_KEY_ENV,
    POLICIES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    DeployConfig,
    address,
    default_threads,
    http_url,
)
from .deployment import DeployError
from .state import fastgen_home, paths_for

PORTS_HELP = """ports: the balancer listens on --port and replica i on --port+1+i; metrics (Prometheus, /metrics) of the
balancer are on --metrics-port and those of replica i on --metrics-port+1+i; the balancer serves the OpenAI-compatible
HTTP API on --http-port (0: none). State and logs live in
$FASTGEN_HOME/<name> (default ~/.fastgen/<name>)."""


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastgen-deploy", description=__doc__.splitlines()[0], epilog=PORTS_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_start(sub)
    add_status(sub)
    add_stop(sub)
    add_restart(sub)
    sub.add_parser("list", help="list deployments").add_argument("--json", action="store_true")
    add_logs(sub)
    add_generate(sub)
    add_prometheus_config(sub)
    add_certs(sub)
    add_k8s(sub)
    return parser


def add_name(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="default", help="deployment name (default: %(default)s)")


def add_start(sub) -> None:
    p = sub.add_parser("start", help="launch a deployment and wait until it serves", epilog=PORTS_HELP)
    add_name(p)
    add_start_flags(p)


def add_start_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `start` but --name: what the deployment runs and how (`k8s render` takes them too)."""
    d = DeployConfig()
    p.add_argument("--replicas", type=int, default=d.replicas, help="default: %(default)s")
    p.add_argument("--policy", choices=POLICIES, default=d.policy, help="default: %(default)s")
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=d.tool_call_parser,
        help="the HTTP API's parser of tool calls (tool_choice auto), by model family (default: %(default)s)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=[r for r in REASONING_PARSERS if r],
        default=d.reasoning_parser,
        help="split a reasoning model's <think> block into reasoning_content (default: off)",
    )
    p.add_argument("--host", default=d.host, help="address every process binds to (default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=d.port, help="balancer gRPC port; replica i: port+1+i (default: %(default)s)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="balancer metrics port; replica i: metrics-port+1+i (default: %(default)s)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=d.http_port,
        help="the balancer's OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...); 0: none "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"key the balancer requires on gRPC and HTTP as authorization: Bearer <key> (default: ${API_KEY_ENV}). "
        "Prefer the environment variable: a command line shows in ps. The balancer gets it through its environment "
        "only",
    )
    add_security_flags(p)
    p.add_argument(
        "--step-trace-dir",
        type=lambda text: str(Path(text).expanduser().resolve()),
        default=None,
        metavar="DIR",
        help="each replica appends every step's shape and measured time (and, under slo, the prediction) to "
        "DIR/replica-N.csv",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        help="seconds to wait for every process to serve (default: %(default)s)",
    )
    add_arguments(p.add_argument_group("engine of every replica (python -m fastgen.replica takes the same flags)"), d)
    p.set_defaults(threads=None)  # config_from computes it from this machine's cores


def add_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="client API keys, one a line ('#' comments): each key is a tenant, whose requests share prefix-cache "
        "blocks only with each other (besides --api-key / $FASTGEN_API_KEY)",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        metavar="FILE",
        help="the internal token the balancer sends to the replicas, which accept nothing else (default: a new one "
        "in the state directory at every start, mode 0600)",
    )
    p.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="certificate the balancer serves gRPC and HTTP with (TLS)"
    )
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that signed --tls-cert: the balancer and the replicas then speak mutual TLS with that certificate",
    )
    p.add_argument(
        "--tls",
        choices=("off", "auto"),
        default="off",
        help="auto: TLS and mutual TLS with a private CA and certificate made for the deployment (fastgen-deploy "
        "certs), kept in its state directory (default: %(default)s)",
    )


def add_k8s(sub) -> None:
    p = sub.add_parser("k8s", help="Kubernetes: print the manifests of a deployment (see launch/k8s/)")
    render = p.add_subparsers(dest="k8s_command", required=True, metavar="COMMAND").add_parser(
        "render",
        help="print the manifests (YAML) for start's flags: kubectl apply -f - takes them",
        description="Prints the Kubernetes objects of a deployment with start's settings: replicas (a StatefulSet "
        "behind a headless Service), the balancer (a Deployment discovering them by DNS), probes, disruption "
        "budgets, a PodMonitor and the Grafana dashboard. Pods bind every interface (--host is not used); the "
        "internal token comes from the Secret <name>-auth (key token), the API key from the Secret <name>-api-key "
        "(key api-key; required unless --allow-unauthenticated) and TLS from --tls-secret (recommended), never from "
        "flags. NetworkPolicies keep the replicas and every metrics port private to the deployment and Prometheus.",
    )
    kubernetes.add_render_flags(render)
    add_start_flags(render)


def add_certs(sub) -> None:
    p = sub.add_parser("certs", help="make a private CA and a certificate for a deployment (TLS and mutual TLS)")
    add_name(p)
    p.add_argument("--host", default=None, help="a name or address the certificate must carry besides loopback")
    p.add_argument("--force", action="store_true", help="replace the certificates already there")


def add_status(sub) -> None:
    p = sub.add_parser("status", help="health and load of every process")
    add_name(p)
    p.add_argument("--json", action="store_true", help="print a JSON list of processes")


def add_stop(sub) -> None:
    p = sub.add_parser("stop", help="drain in-flight requests, then stop every process")
    add_name(p)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to drain before SIGKILL (default: 60)")


def add_restart(sub) -> None:
    p = sub.add_parser(
        "restart",
        help="replace the replicas (after an upgrade or a config change); --rolling: one at a time, no failed request",
    )
    add_name(p)
    p.add_argument(
        "--rolling",
        action="store_true",
        help="one replica at a time: drained (new requests go elsewhere, its streams move to another replica), "
        "restarted, and serving again before the next; without it all restart at once",
    )
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds each replica drains before SIGKILL (default: 60)"
    )


def add_logs(sub) -> None:
    p = sub.add_parser("logs", help="show a process's log")
    add_name(p)
    p.add_argument(
        "process",
        nargs="?",
        default=None,
        metavar="ROLE_OR_ID",
        help="supervisor (default), balancer, replica-N (rank 0 with --tp), replica-N-rank-R, or N",
    )
    p.add_argument("-n", "--lines", type=int, default=50, help="lines from the end (default: 50)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="send one prompt through the balancer and print the completion")
    p.add_argument("prompt")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--name", default="default", help="deployment name (default: %(default)s)")
    target.add_argument("--address", default=None, help="host:port of a balancer or replica")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--min-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0: greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1: off")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    p.add_argument(
        "--stop-token-id", action="append", type=int, default=None, metavar="ID", help="stop token id (repeatable)"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        type=logit_bias_arg,
        default=None,
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )
    p.add_argument("--n", type=int, default=None, help="completions of the prompt, prefilled once (default: 1)")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="print each token's logprob and its K most likely alternatives (0: the token's only)",
    )
    p.add_argument("--echo", action="store_true", help="print the prompt (as the model saw it) before the completion")
    p.add_argument(
        "--stream", action="store_true", help="print text as it is generated (with --n, each completion as it ends)"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message, rendered with the model's chat template (instructions)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer (default: 120)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token to send (default: with --name the deployment's internal token, else ${API_KEY_ENV})",
    )
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="with --address: connect over TLS, trusting this CA")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="with --address: client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="with --address: private key of --tls-cert")


def logit_bias_arg(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 50256=-100), got {text!r}") from None


def add_prometheus_config(sub) -> None:
    p = sub.add_parser("prometheus-config", help="print a prometheus.yml that scrapes the deployments")
    p.add_argument("--name", default=None, help="only this deployment (default: every deployment)")
    p.add_argument("--scrape-interval", default="5s", help="Prometheus duration (default: %(default)s)")


def config_from(args: argparse.Namespace) -> DeployConfig:
    values = {f.name: getattr(args, f.name) for f in fields(DeployConfig) if f.name not in ("threads", "gpus")}
    processes = max(1, args.replicas) * max(1, args.tp)
    threads = args.threads if args.threads is not None else default_threads(cpu_count(), processes)
    return DeployConfig(**values, threads=threads)


def announce(config: DeployConfig) -> None:
    ranks = f" ({config.tp} ranks each)" if config.tp > 1 else ""
    where = f"on GPUs {','.join(config.gpus)}" if config.gpus else f"on {config.device}"
    print(
        f"starting deployment {config.name!r}: {config.replicas} replica(s){ranks} of {config.model} {where}; "
        "waiting until "
        f"all serve (up to {config.timeout:g} s) …",
        file=sys.stderr,
        flush=True,
    )


def cmd_start(args: argparse.Namespace, home: Path) -> int:
    config = auto_tls(config_from(args), args.tls, home)
    state = deployment.start(config, home, on_launch=announce, api_key=args.api_key)
    print(
        f"deployment {config.name!r} is up: model {state['model']}, policy {state['policy']}, "
        f"supervisor pid {state['supervisor']['pid']}"
    )
    for rec in state["processes"]:
        gpu = f"  gpu {rec['gpu']}" if rec.get("gpu") is not None else ""
        if rec["port"] is None:  # a TP rank > 0 serves through its rank 0
            print(f"  {rec['id']:<18} tp rank {rec['rank']} of {rec['replica']}  pid {rec['pid']}{gpu}")
            continue
        print(
            f"  {rec['id']:<18} grpc {address(state['host'], rec['port']):<22} "
            f"metrics http://{address(state['host'], rec['metrics_port'])}/metrics  pid {rec['pid']}{gpu}"
        )
    print(
        f"send requests to {address(state['host'], state['processes'][0]['port'])}; logs: {home / config.name / 'logs'}"
    )
    if config.http_port:
        auth = " (API key required)" if args.api_key else ""
        url = http_url(state["host"], config.http_port)
        print(f"OpenAI-compatible API: {url.replace('http://', 'https://') if config.tls_cert else url}{auth}")
    if config.tls_cert:
        mutual = "; mutual TLS between the balancer and the replicas" if config.tls_ca else ""
        print(f"TLS: certificate {config.tls_cert}{mutual}; clients trust {config.tls_ca or config.tls_cert}")
    print(
        f"Prometheus targets: {paths_for(home, config.name).prometheus_targets} "
        "(fastgen-deploy prometheus-config prints a prometheus.yml that reads them)"
    )
    return 0


def cmd_status(args: argparse.Namespace, home: Path) -> int:
    state = deployment.live_state(home, args.name)
    rows = deployment.status(state, access=deployment.access_of(home, args.name))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"deployment {args.name!r}: {state['status']}, model {state['model']} on {state.get('device', 'cpu')}, "
        f"policy {state['policy']}, "
        f"supervisor pid {state['supervisor']['pid']}"
    )
    print(f"{'PROCESS':<18} {'PID':>7} {'PORT':>6} {'METRICS':>7} {'GPU':>4} {'HEALTH':<12} {'RESTARTS':>8}  LOAD")
    for r in rows:
        print(
            f"{r['id']:<18} {r['pid'] or '-':>7} {r['port'] or '-':>6} {r['metrics_port'] or '-':>7} "
            f"{r.get('gpu') or '-':>4} {r['health']:<12} {r['restarts']:>8}  {load_text(r)}"
        )
    for r in rows:
        if r.get("http_url"):
            auth = " (API key required)" if state.get("api_key_required") else ""
            print(f"OpenAI-compatible API: {r['http_url']}{auth}")
    return 0


def load_text(row: dict) -> str:
    if "in_flight" in row:
        return f"in flight {row['in_flight']}, replicas serving {row['replicas_serving']}"
    if "queued" in row:
        return (
            f"queued {row['queued']}, running {row['running']}, "
            f"KV blocks {row['kv_blocks_used']}/{row['kv_blocks_total']}"
        )
    if row["role"] == "tp_rank":
        return f"tp rank {row['rank']} of {row['replica']}"
    return "-"


def cmd_stop(args: argparse.Namespace, home: Path) -> int:
    report = deployment.stop(home, args.name, args.timeout)
    forced = f"; {len(report.forced)} needed SIGKILL" if report.forced else ""
    print(f"deployment {args.name!r} stopped ({len(report.stopped)} processes{forced})")
    if report.unreaped:
        print(f"note: pids {report.unreaped} have exited but their parent has not reaped them yet", file=sys.stderr)
    return 0


def cmd_restart(args: argparse.Namespace, home: Path) -> int:
    started = time.monotonic()

    def progress(record: dict) -> None:
        if record.get("replica"):
            print(f"restarting {record['replica']} …", file=sys.stderr, flush=True)

    record = deployment.restart(home, args.name, args.rolling, args.timeout, on_progress=progress)
    how = "one at a time" if args.rolling else "all at once"
    print(
        f"deployment {args.name!r}: restarted {', '.join(record['done'])} ({how}) in {time.monotonic() - started:.1f} s"
    )
    return 0


def cmd_list(args: argparse.Namespace, home: Path) -> int:
    rows = deployment.list_deployments(home)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no deployments under {home}")
    else:
        print(f"{'NAME':<16} {'STATUS':<9} {'ADDRESS':<22} {'REPLICAS':>8}  MODEL")
        for r in rows:
            print(f"{r['name']:<16} {r['status']:<9} {r['address']:<22} {r['replicas']:>8}  {r['model']}")
    return 0


def cmd_logs(args: argparse.Namespace, home: Path) -> int:
    path = deployment.log_path(home, args.name, args.process)
    with open(path, errors="replace") as f:
        sys.stdout.writelines(deque(f, maxlen=max(0, args.lines)))
        sys.stdout.flush()
        if args.follow:
            follow(f)
    return 0


def follow(f) -> None:
    try:
        while True:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.3)
    except KeyboardInterrupt:
        pass


GENERATE_FLAGS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "n",
)


def generate_kwargs(args: argparse.Namespace) -> dict:
    """The client's keyword arguments from `generate`'s flags (unset flags leave the server's defaults)."""
    kwargs = {k: getattr(args, k) for k in GENERATE_FLAGS if getattr(args, k) is not None}
    if args.stop_token_id:
        kwargs["stop_token_ids"] = args.stop_token_id
    if args.logit_bias:
        kwargs["logit_bias"] = dict(args.logit_bias)
    if args.logprobs is not None:
        kwargs.update(logprobs=True, top_logprobs=args.logprobs)
    if args.echo:
        kwargs["echo"] = True
    return kwargs


def print_logprobs(logprobs) -> None:
    """One token a line: its logprob, the token, and the most likely alternatives."""
    for lp in logprobs:
        top = ", ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top)
        print(f"  {lp.logprob:9.4f}  {lp.token!r}" + (f"    top: {top}" if top else ""))


def print_completion(choice, many: bool) -> None:
    """A completion's text (under a header naming it when there are several), then its logprobs."""
    if many:
        print(f"--- completion {choice.index} ({choice.generated_tokens} tokens, {choice.finish_reason}) ---")
    print(choice.text)
    print_logprobs(choice.logprobs)


def stream_generate(client, prompt, kwargs: dict) -> None:
    """Prints one completion's text as it comes, or with --n each completion once it ends; logprobs at the end."""
    from ..server.client import Choice

    many = (kwargs.get("n") or 1) > 1
    choices: dict[int, Choice] = {}
    for chunk in client.stream_chunks(prompt, **kwargs):
        if chunk.prompt_text:  # echo: the completion continues the prompt
            print(chunk.prompt_text, end="\n" if many else "", flush=True)
        c = choices.setdefault(chunk.index, Choice(chunk.index, "", [], None, 0))
        c.text += chunk.text
        c.logprobs += chunk.logprobs
        if not many:
            print(chunk.text, end="", flush=True)
        elif chunk.finish_reason is not None:
            c.finish_reason, c.generated_tokens = chunk.finish_reason, chunk.generated_tokens
            print_completion(c, many=True)
    if not many:
        print()
        print_logprobs(choices[0].logprobs if choices else [])


def cmd_generate(args: argparse.Namespace, home: Path) -> int:
    target = args.address or deployment.balancer_address(home, args.name)
    from ..server import Client, GenerationError  # here, not at the top: only this command needs the client

    kwargs = generate_kwargs(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        with Client(target, timeout=args.timeout, security=generate_security(args, home)) as client:
            if args.stream:
                stream_generate(client, prompt, kwargs)
            else:
                result = client.generate(prompt, **kwargs)
                completions = result.completions()
                if result.prompt_text:
                    print(result.prompt_text, end="\n" if len(completions) > 1 else "")
                for choice in completions:
                    print_completion(choice, len(completions) > 1)
                print(
                    f"(served by {result.replica}: {result.prompt_tokens} prompt tokens, {result.generated_tokens} "
                    f"generated, {result.finish_reason})",
                    file=sys.stderr,
                )
    except GenerationError as e:
        raise DeployError(f"request to {target} failed: {e}") from None
    return 0


def generate_security(args: argparse.Namespace, home: Path):
    """With --name, the deployment's own credentials (its internal token, which the balancer accepts, and TLS);
    with --address, the flags'. --api-key replaces the token either way."""
    from ..server.auth import bearer_metadata
    from ..server.client import channel_security

    if args.address:
        try:
            return channel_security(args.api_key, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
        except ValueError as e:
            raise DeployError(str(e)) from None
    security = deployment.access_of(home, args.name)["balancer"]
    return replace(security, metadata=bearer_metadata(args.api_key)) if args.api_key else security


def auto_tls(config: DeployConfig, mode: str, home: Path) -> DeployConfig:
    """With --tls auto, the deployment's own CA and certificate (made on first use)."""
    if mode != "auto":
        return config
    if config.tls_cert or config.tls_key or config.tls_ca:
        raise DeployError("--tls auto makes its own certificates: drop --tls-cert, --tls-key and --tls-ca, or --tls")
    files = certs.cert_files(paths_for(home, config.name).root)
    if not files.exist():
        certs.generate(files.ca.parent.parent, [config.host])
    return replace(config, tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca))


def cmd_certs(args: argparse.Namespace, home: Path) -> int:
    root = paths_for(home, args.name).root
    files = certs.cert_files(root)
    if files.exist() and not args.force:
        print(f"certificates of deployment {args.name!r} already in {files.ca.parent} (--force replaces them)")
    else:
        certs.generate(root, [args.host] if args.host else [])
        print(f"made a CA and a certificate for deployment {args.name!r} in {files.ca.parent}")
    print(
        f"  start with: fastgen-deploy start --name {args.name} --tls-cert {files.cert} --tls-key {files.key} "
        f"--tls-ca {files.ca}   (or --tls auto)"
    )
    print(f"  clients trust {files.ca}; with mutual TLS they present {files.cert} and {files.key}")
    return 0


def cmd_k8s(args: argparse.Namespace, home: Path) -> int:
    if args.auth_token_file or args.api_keys_file or args.tls_cert or args.tls_key or args.tls_ca or args.tls != "off":
        raise DeployError(
            "on Kubernetes the internal token, API keys and TLS come from Secrets: drop --auth-token-file, "
            "--api-keys-file and --tls*, create "
            f"the Secret {args.name}-auth (key token) and pass --tls-secret for a kubernetes.io/tls Secret"
        )
    config = config_from(args)
    config = replace(config, threads=args.threads or kubernetes.THREADS)  # a pod's cores, not this machine's
    cluster = kubernetes.cluster_settings(args)
    problems = kubernetes.problems(config, cluster)
    if problems:
        raise DeployError("; ".join(problems))
    if args.api_key:
        print(
            f"note: the API key is not written into manifests; create it with kubectl create secret generic "
            f"{args.name}-api-key --from-literal=api-key=...",
            file=sys.stderr,
        )
    print(kubernetes.render(config, cluster), end="")
    return 0


def cmd_prometheus_config(args: argparse.Namespace, home: Path) -> int:
    print(prometheus.scrape_config(home.resolve(), args.name, args.scrape_interval), end="")
    return 0


COMMANDS = {
    "start": cmd_start,
    "status": cmd_status,
    "stop": cmd_stop,
    "restart": cmd_restart,
    "list": cmd_list,
    "logs": cmd_logs,
    "generate": cmd_generate,
    "prometheus-config": cmd_prometheus_config,
    "certs": cmd_certs,
    "k8s": cmd_k8s,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, fastgen_home())
    except DeployError as e:
        print(f"fastgen-deploy {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.command == "start":
            print(f"fastgen-deploy start: interrupted; deployment {args.name!r} stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
