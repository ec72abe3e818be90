"""The engine's flags, declared once in replica/engine_args.py: both CLIs take every one of them with the same
default and help, nothing declares one by hand, and a replica's command line reads back as the settings it was
written from. No model, no torch."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, fields, replace

import pytest

from fastgen.launch import cli
from fastgen.launch import config as cfg
from fastgen.launch.config import DeployConfig
from fastgen.replica import __main__ as replica
from fastgen.replica.engine_args import EngineArgs, flag_of, from_namespace, to_argv

ENGINE_FIELDS = [f.name for f in fields(EngineArgs)]
ENGINE_FLAGS = [flag_of(f) for f in fields(EngineArgs)]
# Where fastgen-deploy's default differs from the replica's, and why: a deployment places its replicas on the GPUs it
# finds, and gives each a share of this machine's cores (config_from).
DEPLOY_DEFAULTS = {"device": "auto", "threads": None}
# Each flag's default as users, tests and docs/deploy.md know it (replica; deploy where DEPLOY_DEFAULTS says).
KNOWN_DEFAULTS = {
    "--model": "smollm2-135m",
    "--device": "cpu",
    "--kernels": "auto",
    "--load-format": "auto",
    "--quantization": "auto",
    "--dtype": "auto",
    "--max-batch-tokens": None,
    "--max-seqs": 64,
    "--block-size": 16,
    "--num-blocks": None,
    "--kv-cache-memory": None,
    "--gpu-memory-utilization": 0.9,
    "--scheduler": "slo",
    "--admission": "keep",
    "--allow-client-slo-tightening": False,
    "--max-model-len": None,
    "--default-max-new-tokens": 256,
    "--no-prefix-caching": True,
    "--enforce-eager": False,
    "--enable-expert-parallel": False,
    "--speculative-config": None,
    "--enable-lora": False,
    "--lora-modules": (),
    "--max-loras": 1,
    "--max-lora-rank": 16,
    "--threads": 1,
    "--sla-prompt-rate": 100.0,
    "--sla-token-rate": (1.0, 2.0, 4.0),
    "--tp": 1,
}
# Every field off its default, each value one its flag accepts.
CHANGED = EngineArgs(
    model="/models/m",
    device="cuda:1",
    kernels="triton",
    load_format="dummy",
    quantization="int8",
    dtype="bfloat16",
    max_batch_tokens=1000,
    max_seqs=7,
    block_size=32,
    num_blocks=99,
    kv_cache_memory=(3 << 30) + 5,
    gpu_memory_utilization=0.1 + 0.2,  # not 0.3: the command line must carry every digit
    scheduler="splitfuse",
    admission="refuse",
    allow_client_slo_tightening=True,
    max_model_len=4096,
    default_max_new_tokens=17,
    prefix_caching=False,
    enforce_eager=True,
    enable_expert_parallel=True,
    speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    enable_lora=True,
    lora_modules=("sql=/ad/sql", "chat=/ad/chat"),
    max_loras=2,
    max_lora_rank=64,
    threads=3,
    sla_prompt_rate=512.5,
    sla_token_rates=(2.0, 0.5),
    tp=2,
)


def replica_parser() -> argparse.ArgumentParser:
    return replica.build_parser()


def deploy_parser() -> argparse.ArgumentParser:
    """fastgen-deploy start's flags, as `start` declares them."""
    p = argparse.ArgumentParser(prog="fastgen-deploy start")
    cli.add_name(p)
    cli.add_start_flags(p)
    return p


def actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def engine_args_of(config: EngineArgs) -> EngineArgs:
    return EngineArgs(**{name: getattr(config, name) for name in ENGINE_FIELDS})


def test_changed_moves_every_field_off_its_default():
    """Else a new field would pass the round trips below without being tried."""
    default = EngineArgs()
    assert [n for n in ENGINE_FIELDS if getattr(CHANGED, n) == getattr(default, n)] == []


def test_each_engine_field_is_a_flag_of_both_clis_with_the_same_default_and_help():
    assert sorted(KNOWN_DEFAULTS) == sorted(ENGINE_FLAGS)
    for name, parser in (("replica", replica_parser()), ("deploy", deploy_parser())):
        by_flag = actions(parser)
        for f in fields(EngineArgs):
            action = by_flag[flag_of(f)]
            default = DEPLOY_DEFAULTS.get(f.name, KNOWN_DEFAULTS[flag_of(f)]) if name == "deploy" else f.default
            assert (action.dest, action.default, action.help) == (f.name, default, f.metadata["help"]), (name, f.name)
    assert {f: getattr(EngineArgs(), n) for f, n in zip(ENGINE_FLAGS, ENGINE_FIELDS)} == KNOWN_DEFAULTS
    replica_actions, deploy_actions = actions(replica_parser()), actions(deploy_parser())
    for flag in ENGINE_FLAGS:  # the same reader, choices and arity in both
        r, d = replica_actions[flag], deploy_actions[flag]
        assert (r.type, r.choices, r.nargs, r.const, r.metavar) == (d.type, d.choices, d.nargs, d.const, d.metavar)


def test_no_engine_flag_is_declared_by_hand():
    """Each CLI takes the engine's flags from one argument group, which add_arguments fills, and no other."""
    for parser in (replica_parser(), deploy_parser()):
        (group,) = [g for g in parser._action_groups if g.title.startswith("engine")]
        assert [a.option_strings[0] for a in group._group_actions] == ENGINE_FLAGS
        elsewhere = [a for a in parser._actions if a not in group._group_actions]
        assert {a.dest for a in elsewhere}.isdisjoint(ENGINE_FIELDS)  # no second flag for an engine setting


def test_deploy_config_is_engine_args_and_its_own():
    assert [f.name for f in fields(DeployConfig)][: len(ENGINE_FIELDS)] == ENGINE_FIELDS
    deploy, engine = DeployConfig(), EngineArgs()
    assert {n for n in ENGINE_FIELDS if getattr(deploy, n) != getattr(engine, n)} == {"device"}  # threads: 1 both
    config = DeployConfig(**asdict(CHANGED), name="x", gpus=["0", "1"])
    assert DeployConfig(**json.loads(json.dumps(asdict(config)))) == config  # config.json: lists back to tuples


@pytest.mark.parametrize("args", [EngineArgs(), CHANGED, replace(CHANGED, lora_modules=(), sla_token_rates=(8.0,))])
def test_round_trip_through_the_replica_command_line(args):
    argv = to_argv(args)
    assert from_namespace(replica.parse_args(["--port", "1", *argv])) == args
    assert from_namespace(replica.parse_args(["--port", "1", *to_argv(args, ENGINE_FIELDS)])) == args


def test_round_trip_through_fastgen_deploy_start_and_its_replicas():
    deploy = cli.config_from(cli.build_parser().parse_args(["start", "--replicas", "1", *to_argv(CHANGED)]))
    assert engine_args_of(deploy) == CHANGED
    argv = cfg.plan(deploy, "PY")[1].argv
    assert argv[:3] == ["PY", "-m", "fastgen.replica"]
    assert from_namespace(replica.parse_args(argv[3:])) == CHANGED


def test_a_default_deployment_pins_its_budget_and_leaves_the_rest_to_the_replica():
    argv = cfg.plan(DeployConfig(replicas=1, device="cpu"), "PY")[1].argv[3:]
    read = from_namespace(replica.parse_args(argv))
    assert read == replace(EngineArgs(), max_batch_tokens=2048)  # the slo scheduler's cap, as validated
    assert read.engine_config() == EngineArgs().engine_config()
    given = [a for a in argv if a.startswith("--")]
    assert given == ["--host", "--port", "--metrics-port", "--replica-id", *map(flag_of_name, cfg.PINNED)]


def flag_of_name(name: str) -> str:
    return ENGINE_FLAGS[ENGINE_FIELDS.index(name)]


def test_to_argv_names_switches_and_leaves_out_defaults_and_none():
    assert to_argv(EngineArgs()) == []
    assert to_argv(EngineArgs(), ["max_batch_tokens", "enforce_eager", "prefix_caching"]) == []  # nothing to say
    assert to_argv(replace(EngineArgs(), prefix_caching=False, enforce_eager=True, tp=2)) == [
        "--no-prefix-caching",
        "--enforce-eager",
        "--tp",
        "2",
    ]
    assert to_argv(EngineArgs(), ["sla_prompt_rate", "sla_token_rates"]) == [
        "--sla-prompt-rate",
        "100",
        "--sla-token-rate",
        "1",
        "2",
        "4",
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-seqs", "0"], "argument --max-seqs: must be at least 1, got 0"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1], got 1.5"),
        (["--kv-cache-memory", "lots"], "512MiB"),
        (["--lora-modules", "nopath"], "--lora-modules takes name=path, got 'nopath'"),
        (["--speculative-config", '{"k": 1}'], "unknown speculative_config key 'k'"),
        (["--sla-token-rate", "1", "0"], "must be > 0, got 0"),
        (["--scheduler", "fifo"], "invalid choice: 'fifo'"),
    ],
)
def test_both_clis_refuse_a_bad_value_alike(flags, message, capsys):
    for parse in (
        lambda: replica.parse_args(["--port", "1", *flags]),
        lambda: cli.build_parser().parse_args(["start", *flags]),
    ):
        with pytest.raises(SystemExit) as exit:
            parse()
        assert exit.value.code == 2 and message in capsys.readouterr().err


def engine_section(help_text: str) -> dict[str, str]:
    """The engine group of a --help: each flag's entry, by flag."""
    section = help_text[help_text.index("\nengine") :].split("\n", 2)[2].split("\n\n")[0]
    entries = re.split(r"\n(?=  --)", section.strip("\n"))
    return {entry.split()[0]: entry for entry in entries}


def test_both_helps_list_the_same_engine_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        replica.parse_args(["--help"])
    replica_help = engine_section(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["start", "--help"])
    deploy_help = engine_section(capsys.readouterr().out)
    assert list(replica_help) == list(deploy_help) == ENGINE_FLAGS
    differ = [f for f in ENGINE_FLAGS if replica_help[f] != deploy_help[f]]
    assert differ == ["--device"]  # its default: "(default: cpu)" and "(default: auto)"
    assert replica_help["--device"].replace("(default: cpu)", "(default: auto)") == deploy_help["--device"]
