"""fastgen-deploy on GPUs without one: --device/--kernels/--load-format reach every process, each replica process
gets a GPU of its own through CUDA_VISIBLE_DEVICES, and a deployment that cannot run on the GPUs found is refused
before anything starts. The GPUs are an injected list; no torch here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastgen.launch import cli, deployment, gpus, supervisor
from fastgen.launch import config as cfg
from fastgen.launch.config import DeployConfig
from fastgen.launch.deployment import DeployError


def replicas_of(specs):
    return [s for s in specs if s.role != "balancer"]


def test_every_process_gets_its_own_gpu_in_plan_order():
    c = cfg.place(DeployConfig(replicas=2, tp=2, device="cuda"), ["0", "1", "2", "3", "4"])
    specs = cfg.plan(c, "PY")
    assert c.gpus == ("0", "1", "2", "3")
    assert [(s.id, s.gpu) for s in specs] == [
        ("balancer", None),
        ("replica-0", "0"),
        ("replica-0-rank-1", "1"),
        ("replica-1", "2"),
        ("replica-1-rank-1", "3"),
    ]
    assert [cfg.device_env(s) for s in specs] == [{}] + [{"CUDA_VISIBLE_DEVICES": g} for g in "0123"]
    # Each rank sees only its GPU, so it is cuda:0 for it: LOCAL_RANK 0, whatever its rank.
    env = cfg.rank_env(specs[4], 2, c.host, 29500)
    assert (env["RANK"], env["LOCAL_RANK"]) == ("1", "0")
    for s in replicas_of(specs):
        argv = s.argv
        assert argv[argv.index("--device") + 1] == "cuda" and argv[argv.index("--kernels") + 1] == "auto"


def test_gpus_named_by_cuda_visible_devices_are_the_ones_handed_out():
    c = cfg.place(DeployConfig(replicas=2, device="auto"), ["5", "7", "9"])
    assert (c.device, c.gpus) == ("cuda", ("5", "7"))
    assert [s.gpu for s in replicas_of(cfg.plan(c, "PY"))] == ["5", "7"]


def test_cpu_processes_get_no_gpu_and_keep_torchrun_local_ranks():
    for c in (cfg.place(DeployConfig(tp=2, device="auto"), []), cfg.place(DeployConfig(tp=2, device="cpu"), ["0"])):
        specs = cfg.plan(c, "PY")
        assert c.device == "cpu" and c.gpus == () and all(s.gpu is None for s in specs)
        assert cfg.rank_env(specs[2], 2, c.host, 1)["LOCAL_RANK"] == "1"
        assert specs[1].argv[specs[1].argv.index("--device") + 1] == "cpu"


def test_kernels_and_load_format_pass_through():
    c = DeployConfig(replicas=1, kernels="torch", load_format="dummy", model="llama-3.2-1b")
    argv = cfg.plan(c, "PY")[1].argv
    assert argv[argv.index("--kernels") + 1] == "torch" and argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--model") + 1] == "llama-3.2-1b" and cfg.validate(c) == []


@pytest.mark.parametrize(
    "change, found, words",
    [
        (dict(device="cuda"), [], ["no GPU found", "--device cpu"]),
        (dict(device="cuda", replicas=2, tp=2), ["0", "1", "2"], ["need 4 GPUs", "3 found", "--replicas or --tp"]),
        (dict(device="auto", replicas=3), ["0", "1"], ["need 3 GPUs", "lower --replicas"]),
        (dict(device="cuda", kernels="cpu"), ["0", "1"], ["--kernels cpu runs on CPUs only"]),
    ],
)
def test_what_cannot_run_on_the_gpus_found_is_refused(change, found, words):
    problems = cfg.device_problems(DeployConfig(**change), found)
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems


def test_fitting_and_cpu_deployments_have_no_device_problems():
    assert cfg.device_problems(DeployConfig(device="cuda", replicas=2, tp=2), list("0123")) == []
    assert cfg.device_problems(DeployConfig(device="cpu", replicas=8), []) == []
    assert cfg.device_problems(DeployConfig(device="auto", kernels="cpu"), []) == []


def test_start_refuses_before_anything_starts(tmp_path):
    home = tmp_path / "home"
    with pytest.raises(DeployError, match="need 4 GPUs"):
        deployment.start(DeployConfig(device="cuda", replicas=2, tp=2), home, find_gpus=lambda: ["0", "1"])
    with pytest.raises(DeployError, match="no GPU found"):
        deployment.start(DeployConfig(device="cuda"), home, find_gpus=list)
    assert not home.exists()


def test_prepare_places_the_deployment():
    c = deployment.prepare(DeployConfig(replicas=1, tp=2), find_gpus=lambda: ["3", "4"])
    assert (c.device, c.gpus) == ("cuda", ("3", "4"))
    asked = []
    c = deployment.prepare(DeployConfig(device="cpu"), find_gpus=lambda: asked.append(1) or ["0"])
    assert (c.device, c.gpus, asked) == ("cpu", (), [])  # --device cpu never probes


@pytest.mark.skipif(bool(gpus.visible_gpus()), reason="this machine has a GPU: the refusal needs one without")
def test_cli_refuses_cuda_without_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(["start", "--device", "cuda", "--replicas", "1"]) == 1
    err = capsys.readouterr().err
    assert "--device cuda: no GPU found" in err and "--device cpu" in err
    assert not (tmp_path / "default").exists()


def test_cli_builds_the_device_settings():
    args = cli.build_parser().parse_args(["start", "--device", "cuda", "--kernels", "triton", "--load-format", "dummy"])
    c = cli.config_from(args)
    assert (c.device, c.kernels, c.load_format, c.gpus) == ("cuda", "triton", "dummy", ())
    assert cli.config_from(cli.build_parser().parse_args(["start"])).device == "auto"


def test_gpu_is_recorded_for_status():
    c = cfg.place(DeployConfig(replicas=1, tp=2, device="cuda"), ["6", "7"])
    children = [supervisor.Child(s, Path(s.id)) for s in cfg.plan(c, "PY")]
    records = [supervisor.process_record(ch) for ch in children]
    assert [r["gpu"] for r in records] == [None, "6", "7"]
    rows = [deployment.process_status({**r, "pid": None}, "127.0.0.1", 0.1) for r in records]
    assert [r.get("gpu") for r in rows] == [None, "6", "7"]


def test_gpus_seen_through_cuda_visible_devices():
    never = lambda: pytest.fail("the machine is not probed when CUDA_VISIBLE_DEVICES is set")  # noqa: E731
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, never) == ["2", "3"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, never) == []
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, never) == ["1"]
    assert gpus.visible_gpus({}, lambda: 3) == ["0", "1", "2"]


def test_count_gpus_answers_without_torch():
    code = "import sys; from fastgen.launch import gpus; n = gpus.count_gpus(); print(n >= 0, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_saved_config_keeps_the_placement(tmp_path):
    from fastgen.launch import state

    paths = state.paths_for(tmp_path, "g")
    c = cfg.place(DeployConfig(name="g", replicas=2, device="cuda"), ["0", "1"])
    state.save_config(paths, c)
    assert state.load_config(paths) == c
