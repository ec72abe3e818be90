"""Tensor parallelism across processes: one replica runs as `--tp K` ranks under torch.distributed, NCCL between
GPUs and gloo between CPU processes (chosen from --device).

Every rank reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and gets the same
command line, so the same replica runs under `fastgen-deploy start --tp K` on one host and under torchrun on one
or several hosts:

    torchrun --nproc-per-node 2 -m fastgen.replica --tp 2 --port 50051 --device cuda

Rank 0 is the replica that the balancer and clients see: it serves gRPC, owns the scheduler and the sampler, and
sends each step's batch to the other ranks (ModelRunner.run). Ranks > 0 hold their shards of the weights and the KV
cache of their heads, and only run the model (ModelRunner.follow) until rank 0 says stop, which it does once it has
drained. A rank that loses a peer exits non-zero, so the launcher restarts the whole group. Each rank runs
--threads torch threads; a CUDA rank takes the GPU of its LOCAL_RANK.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .batch_broadcast import EXIT_GROUP_BROKEN, IDLE_TIMEOUT, BatchBroadcast, exit_now
from .builder import build_runner
from .config import TP_TIMEOUT_S, EngineConfig
from .parallel import TPGroup

# dist.TCPStore is public, documented API, but torch's typing does not mark it re-exported from torch.distributed
# (reportPrivateImportUsage): hence the ignores where it is named.
if TYPE_CHECKING:
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

log = logging.getLogger("fastgen.replica")
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str], tp: int) -> RankEnv:
        """This process's place in its group, from torchrun's variables; ValueError says what is missing."""
        missing = [name for name in ENV_NAMES if not environ.get(name)]
        if missing:
            raise ValueError(
                f"--tp {tp} runs one process per rank, and this one lacks {', '.join(missing)}: start the ranks with "
                f"`fastgen-deploy start --tp {tp}` or `torchrun --nproc-per-node {tp} -m fastgen.replica --tp {tp} ...`"
            )
        env = cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]))
        if env.world_size != tp:
            raise ValueError(f"WORLD_SIZE is {env.world_size} but --tp is {tp}: start exactly --tp ranks")
        if not 0 <= env.rank < tp:
            raise ValueError(f"RANK {env.rank} is outside 0..{tp - 1}")
        return env


def rank_device(device: str, local_rank: int) -> torch.device:
    """A CUDA rank takes the GPU of its local rank (whatever index --device names); CPU ranks share the CPU."""
    d = torch.device(device)
    return torch.device("cuda", local_rank) if d.type == "cuda" else d


def listen_on(host: str, port: int) -> socket.socket:
    """A listening socket on host:port alone (a name: its first address)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(sockaddr, family=family, backlog=128)


def rendezvous_store(env: RankEnv, environ: Mapping[str, str], timeout: timedelta) -> TCPStore | None:
    """The group's store at MASTER_ADDR:MASTER_PORT, hosted by rank 0. torch's own server would listen on every
    interface whatever MASTER_ADDR says, so anyone who reaches the host could join or feed the group: rank 0 binds
    MASTER_ADDR alone (127.0.0.1 for the groups fastgen-deploy starts on one host, the address the other hosts use
    under torchrun) and hands that socket to the store. `timeout`: env:// gives its store the group's too. None under
    a torchrun agent that hosts the store itself (env:// then joins it, as before)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    if env.rank != 0:
        return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            host, port, env.world_size, False, timeout, multi_tenant=True
        )
    try:
        fd = listen_on(host, port).detach()  # the store owns the descriptor from here
    except OSError as exc:  # taken meanwhile: the group cannot form here, and its launcher picks another port
        raise RuntimeError(f"cannot host the rendezvous on {host}:{port}: {exc}") from exc
    return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        host, port, env.world_size, True, timeout, multi_tenant=True, master_listen_fd=fd
    )


def init_process_group(env: RankEnv, device: torch.device, timeout: timedelta) -> None:
    """Joins the group at MASTER_ADDR:MASTER_PORT (rank 0 hosts the rendezvous). Its collectives (the model's
    all-reduces) fail after `timeout`: a peer that hangs without closing its sockets (a wedged GPU, a stopped process)
    must surface as an error that restarts the group, not hold rank 0 in a step forever."""
    store = rendezvous_store(env, os.environ, timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=env.rank, world_size=env.world_size, device_id=device, timeout=timeout
        )
    else:
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def run_tensor_parallel(
    args: argparse.Namespace,
    run_replica: Callable[..., int],
    engine_config: Callable[[argparse.Namespace], EngineConfig],
) -> int:
    """Runs this process as its rank of the replica. Once the group exists, the process ends here with its status
    (exit_now: interpreter finalization could abort it), 0 once the group has ended in order. run_replica(args, tp,
    broadcast) is the single-process replica's server, run by rank 0."""
    try:
        env = RankEnv.from_env(os.environ, args.tp)
    except ValueError as exc:
        print(f"fastgen.replica: {exc}", file=sys.stderr)
        return 2
    device = rank_device(args.device, env.local_rank)
    args = argparse.Namespace(**{**vars(args), "device": str(device)})
    torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=getattr(args, "tp_timeout", TP_TIMEOUT_S))
    try:
        init_process_group(env, device, timeout)
        # Rank 0's sends are bounded like any collective; the other ranks wait for its next batch without a deadline
        # (an idle replica sends nothing for hours), and learn of its end when its sockets close.
        broadcast = BatchBroadcast(env.rank, timeout if env.rank == 0 else IDLE_TIMEOUT)
    except RuntimeError as exc:  # a peer died while the group was forming: the group is broken before it served
        log.critical("rank %d could not form its tensor-parallel group: %s", env.rank, exc)
        exit_now(EXIT_GROUP_BROKEN)
    tp = TPGroup(env.rank, env.world_size)
    log.info("rank %d of %d joined (%s, %s)", env.rank, env.world_size, dist.get_backend(), device)
    if env.rank == 0:
        code = run_replica(args, tp, broadcast)
        # 0: it drained, and the other ranks wait in follow() for stop. If they are gone, its group is broken as
        # after any failed collective, and it leaves at once too (with the status of its drain).
        if code == 0 and not broadcast.stop():
            exit_now(code)
    else:
        code = follow(engine_config(args), tp, broadcast)
    # After a failure a peer may be gone, and tearing down could wait on it. On NCCL never: destroying a communicator
    # whose collectives were captured in CUDA graphs can hang (the graphs still hold it), and exit_now below releases
    # everything the group held anyway.
    if code == 0 and dist.get_backend() != "nccl":
        dist.destroy_process_group()
    # Even an orderly end leaves without interpreter finalization: a gloo worker thread may still be releasing the
    # last collective (the stop message) when it begins, and dies of SIGABRT asking for the GIL (see exit_now).
    exit_now(code)


def follow(config: EngineConfig, tp: TPGroup, broadcast: BatchBroadcast) -> int:
    """Ranks > 0: loads this rank's shards, then runs every batch rank 0 sends until it says stop. A rank that
    loses rank 0, or fails between two collectives, ends its process with EXIT_GROUP_BROKEN (abandon)."""
    try:
        runner, num_blocks = build_runner(config, tp, broadcast)
    except ValueError as exc:  # bad model or settings: rank 0 reports the same
        print(f"fastgen.replica: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a collective of the load failed: rank 0 is gone
        broadcast.abandon(exc)
    # From here rank 0 decides when the group ends, after draining its requests; a SIGTERM sent to every rank
    # (fastgen-deploy stop, torchrun) must not cut them off.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.info("rank %d of %d ready (%d KV blocks)", tp.rank, tp.size, num_blocks)
    try:
        runner.follow()
    except Exception as exc:  # noqa: BLE001 - rank 0 is gone (RuntimeError), or this rank is out of step
        # Not a return: this thread would leave through interpreter finalization while a gloo worker thread may
        # still hold the failed collective, and that worker dies of SIGABRT when it frees the collective's tensors.
        broadcast.abandon(exc)
    log.info("rank %d stopped", tp.rank)
    return 0
