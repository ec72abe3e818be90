"""Sampler cost per step on this machine: the whole batch drawn at once (replica/sampler.py), over SmolLM2's
vocabulary, for temperature alone, with top-k and top-p, and with the OpenAI options on top (presence, frequency and
repetition penalties over a 1000-token context, min-p, logprobs with 5 alternatives), at a few batch sizes.

    python -m fastgen.benchmarks.sampler [--threads 1] [--repeats 5]

Prints a markdown table of medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastgen.kernels.dense import argmax
from fastgen.replica.sampler import SamplingRow, sample

VOCAB = 49152


def median_ms(rows: list[SamplingRow], repeats: int) -> float:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0))
    sample(logits.clone(), rows, argmax)  # warm-up
    times = []
    for _ in range(repeats):
        batch = logits.clone()
        start = time.perf_counter()
        sample(batch, rows, argmax)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def openai_row(i: int) -> SamplingRow:
    """A row with every option of the OpenAI API that costs the sampler work, 200 tokens into a 1000-token context."""
    context = torch.randint(0, VOCAB, (1000,), generator=torch.Generator().manual_seed(i)).tolist()
    return SamplingRow(
        0.7,
        0.9,
        50,
        1000 + i,
        1000,
        [],
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        output_ids=context[800:],
        context_ids=context,
        logprobs=5,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        "| rows | temperature 0.7 ms | + top-k 50, top-p 0.9 ms | + penalties, min-p, logprobs ms | greedy ms |\n"
        "|---|---|---|---|---|"
    )
    for n in (1, 8, 64):
        plain = [SamplingRow(0.7, 1.0, 0, 1000 + i, 100 + i, []) for i in range(n)]
        nucleus = [SamplingRow(0.7, 0.9, 50, 1000 + i, 100 + i, []) for i in range(n)]
        greedy = [SamplingRow(0.0, 1.0, 0, 1000 + i, 100 + i, []) for i in range(n)]
        openai = [openai_row(i) for i in range(n)]
        times = [median_ms(rows, args.repeats) for rows in (plain, nucleus, openai, greedy)]
        print(f"| {n} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
