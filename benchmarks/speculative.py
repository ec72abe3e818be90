"""Speculative decoding (n-gram proposals) on a copying workload: tokens per second with and without it, one stream at
a time and --concurrency streams at once, on the embedded SmolLM2-135M-Instruct, greedy.

    python -m fastgen.benchmarks.speculative --repeats 3 --json benchmarks/results/speculative/NAME.json
    python -m fastgen.benchmarks.speculative --tiny   # seconds: proves the script runs, measures nothing

The workload (built here, deterministically, from benchmarks/data/corpus.txt's passages): chat requests that ask the
model to repeat a passage word for word, to repeat it with one word replaced, and to quote its first sentences, in
turn. Passages are taken in order, request i from passage i (wrapping around).

Each level runs its requests in rounds of `streams` at once (1: one request at a time; 16: sixteen submitted
together, the round ending when the last finishes), all of a level's requests per repeat. Two pipelines, one
speculating (--speculative-config, default ngram k = 4, lookup 2..4) and one not, load the same model with the same
settings and no prefix cache (a repeat must not be served from an earlier one's blocks); each warms up on a short
request first. Repeats are fixed before the run and interleaved (plain then speculative, the order swapped every
repeat); medians and the ratio of medians are reported, with every repeat's seconds, the tokens generated, the
acceptance rate (accepted / proposed tokens), accepted tokens per verified decode, and whether the two systems
generated the same tokens (float32 greedy: they must; bfloat16 may differ where logits nearly tie). --json writes it
all with the command, commit, date and machine."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..replica import pipeline
from ..replica.request import SamplingParams
from .provenance import run_info

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def passages() -> list[str]:
    return [p.strip() for p in CORPUS.read_text().split("\n\n") if p.strip()]


def copying_prompts(n: int, words: int | None = None) -> list[list[dict]]:
    """n chat prompts over the corpus's passages, cut to their first `words` words when given: repeat it, repeat it
    with an edit, quote its start."""
    texts = passages()
    prompts = []
    for i in range(n):
        text = texts[i % len(texts)]
        text = " ".join(text.split()[:words]) if words else text
        kind = i % 3
        if kind == 0:
            ask = f"Repeat the following passage word for word.\n\n{text}"
        elif kind == 1:
            word = max(text.split(), key=len).strip(".,;:")
            ask = f"Repeat the following passage, replacing the word '{word}' with 'XYZ' everywhere.\n\n{text}"
        else:
            ask = f"Quote the first three sentences of this passage exactly, in quotation marks.\n\n{text}"
        prompts.append([{"role": "user", "content": ask}])
    return prompts


def run_level(pipe, prompts, streams: int, max_new: int) -> dict:
    """Runs prompts in rounds of `streams` at once: seconds, tokens, the outputs' token ids, speculation counts."""
    engine = pipe.engine
    outputs, proposed, accepted, verified = [], 0, 0, 0
    start = time.perf_counter()
    for r in range(0, len(prompts), streams):
        ids = [f"b{r}-{i}" for i in range(len(prompts[r : r + streams]))]
        for rid, prompt in zip(ids, prompts[r : r + streams]):
            engine.add_request(rid, prompt, SamplingParams(max_new_tokens=max_new))
        done = {}
        while engine.has_unfinished():
            result = engine.step()
            s = result.stats
            if s is not None:
                proposed, accepted, verified = (
                    proposed + s.spec_draft_tokens,
                    accepted + s.spec_accepted_tokens,
                    verified + s.spec_drafts,
                )
            done.update({o.request_id: o.token_ids for o in result.outputs if o.finished})
        outputs += [done[rid] for rid in ids]
    seconds = time.perf_counter() - start
    tokens = sum(map(len, outputs))
    return dict(
        seconds=seconds, tokens=tokens, outputs=outputs, proposed=proposed, accepted=accepted, verified=verified
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: as the pipeline loads it)")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="streams at once, per level")
    parser.add_argument("--requests", type=int, default=16, help="requests per level and repeat")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--words", type=int, default=None, help="cut passages to this many words")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tiny", action="store_true", help="2 requests of 8 tokens, 1 repeat: a smoke run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.tiny:
        args.requests, args.max_new_tokens, args.repeats, args.words = 2, 8, 1, 30
        args.concurrency = [1, 2]
    torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, max_batch_tokens=args.max_batch_tokens, prefix_caching=False, progress=False)
    systems = {
        "plain": pipeline(args.model, **common),
        "speculative": pipeline(args.model, speculative_config=args.speculative_config, **common),
    }
    prompts = copying_prompts(args.requests, args.words)
    for pipe in systems.values():
        pipe(["Hello"], max_new_tokens=2)  # warm-up
    levels = {}
    for streams in args.concurrency:
        runs = {name: [] for name in systems}
        for repeat in range(args.repeats):
            order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
            for name in order:
                runs[name].append(run_level(systems[name], prompts, streams, args.max_new_tokens))
        levels[streams] = summarize(runs)
    report = dict(
        **run_info("speculative", argv),
        model=args.model,
        dtype=str(next(systems["plain"].engine.runner.model.parameters()).dtype).removeprefix("torch."),
        speculative_config=json.loads(args.speculative_config),
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        levels={str(k): v for k, v in levels.items()},
    )
    print_summary(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rs in runs.items():
        rates = [r["tokens"] / r["seconds"] for r in rs]
        proposed, accepted, verified = (sum(r[k] for r in rs) for k in ("proposed", "accepted", "verified"))
        out[name] = dict(
            seconds=[r["seconds"] for r in rs],
            tokens=[r["tokens"] for r in rs],
            tokens_per_s=rates,
            median_tokens_per_s=statistics.median(rates),
            proposed=proposed,
            accepted=accepted,
            acceptance_rate=accepted / proposed if proposed else None,
            accepted_per_verify=accepted / verified if verified else None,
        )
    out["speedup"] = out["speculative"]["median_tokens_per_s"] / out["plain"]["median_tokens_per_s"]
    out["same_tokens"] = all(a["outputs"] == b["outputs"] for a, b in zip(runs["plain"], runs["speculative"]))
    return out


def print_summary(report: dict) -> None:
    print(
        f"{report['model']} {report['dtype']}, {report['requests']} requests x {report['max_new_tokens']} tokens, "
        f"{report['repeats']} repeats, {report['threads']} threads"
    )
    print(f"{'streams':>7} {'plain tok/s':>12} {'spec tok/s':>12} {'ratio':>8} {'accept':>7} {'per verify':>10} same")
    for streams, level in report["levels"].items():
        plain, spec = level["plain"], level["speculative"]
        rate = spec["acceptance_rate"]
        per = spec["accepted_per_verify"]
        print(
            f"{streams:>7} {plain['median_tokens_per_s']:>12.1f} {spec['median_tokens_per_s']:>12.1f} "
            f"{level['speedup']:>7.2f}x {'-' if rate is None else f'{rate:.2f}':>7} "
            f"{'-' if per is None else f'{per:.2f}':>10} {level['same_tokens']}"
        )


if __name__ == "__main__":
    main()
