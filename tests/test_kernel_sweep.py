"""`python -m fastgen.benchmarks.kernel_sweep`: runs, and reports a case whose result depends on the thread count
with the seed that replays it."""

import pytest
import torch

from fastgen.benchmarks import kernel_sweep
from fastgen.kernels import cpu

from .helpers import require_tool


@pytest.fixture
def library():
    if cpu.load_library() is None:
        require_tool(False, "no C compiler on this machine")


def test_sweep_passes_on_the_cpu_kernels(library, capsys):
    assert kernel_sweep.main(["--seconds", "1", "--seed", "3"]) == 0
    assert "0 failures" in capsys.readouterr().out


def test_sweep_prints_the_seed_of_a_thread_dependent_case(library, monkeypatch, capsys):
    real = cpu.paged_attention_cpu

    def thread_dependent(*args):  # one ulp up on more than one thread
        out = real(*args)
        return out if torch.get_num_threads() == 1 else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(cpu, "paged_attention_cpu", thread_dependent)
    case = kernel_sweep.Case(seed=209327, dtype="float32", block_size=32, kv_heads=2, head_dim=64, group=3)
    problems = kernel_sweep.check(case, [2])
    assert problems and "2 threads differ" in problems[0]
    assert "seed=209327" in str(case)
