"""The rendezvous store of a tensor-parallel group (replica/tp_worker.py) listens on the address its ranks meet at
and nowhere else: torch's own server would take every interface, so anyone who reaches the host could join or feed
the group. A group on one host (fastgen-deploy's) meets on 127.0.0.1; a group across hosts on MASTER_ADDR."""

from __future__ import annotations

import socket
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from fastgen.replica import tp_worker
from fastgen.replica.tp_worker import RankEnv
from fastgen.testing import free_port


def another_address() -> str:
    """An address of this host other than loopback's 127.0.0.1: a network interface's, else 127.0.0.2 (still one
    address among many, which is what the test needs)."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return "127.0.0.2"


def listening_on(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


@pytest.fixture
def rendezvous(monkeypatch):
    """Sets MASTER_ADDR (as given) and a free MASTER_PORT; returns that port. Not under a torchrun agent."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def at(host: str) -> int:
        port = free_port()
        monkeypatch.setenv("MASTER_ADDR", host)
        monkeypatch.setenv("MASTER_PORT", str(port))
        return port

    return at


@pytest.mark.parametrize("where", ["single-host", "multi-host"])
def test_rank_0_hosts_the_rendezvous_on_the_groups_address_alone(rendezvous, where):
    host = "127.0.0.1" if where == "single-host" else another_address()
    port = rendezvous(host)
    tp_worker.init_process_group(RankEnv(0, 1, 0), torch.device("cpu"), timedelta(seconds=60))
    try:
        assert listening_on(port) == {host}, f"the store of a {where} group listens beyond {host}"
    finally:
        dist.destroy_process_group()


def test_a_rendezvous_port_taken_meanwhile_breaks_the_group_cleanly(rendezvous):
    port = rendezvous("127.0.0.1")
    with socket.create_server(("127.0.0.1", port)):  # someone else bound it after the launcher chose it
        with pytest.raises(RuntimeError, match="cannot host the rendezvous"):
            tp_worker.rendezvous_store(
                RankEnv(0, 2, 0), {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timedelta(seconds=5)
            )
