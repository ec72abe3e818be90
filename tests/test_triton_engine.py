"""The engine on the Triton kernels (run by Triton's interpreter on CPU) gives the same greedy tokens as on
the torch kernels. A subprocess, so TRITON_INTERPRET=1 is set before triton is first imported."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # the Triton interpreter on CPU

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    import torch
    torch.set_num_threads(1)
    from fastgen.replica import pipeline
    rng = random.Random(3)
    # Five prompts: decode-only steps of five sequences pad to the bucket of eight.
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 23, 40, 3)]
    result = {}
    for backend, eager in (("torch", False), ("triton", False), ("triton", True)):
        # Budget 16 with 8-token blocks: prompt chunks start mid-block and decodes share passes with them.
        pipe = pipeline(sys.argv[1], dtype="float32", kernels=backend, max_batch_tokens=16, block_size=8,
                        max_seqs=8, enforce_eager=eager, progress=False)
        assert pipe.engine.runner.model.layers[0].self_attn.kernels.name == backend
        # Triton's kernels are graph-safe: decode-only steps take the padded static-buffer path of CUDA graphs
        # (without capture on CPU) unless eager is enforced.
        assert (pipe.engine.runner.graphs is not None) == (backend == "triton" and not eager)
        result[f"{backend}{'-eager' if eager else ''}"] = [
            o.token_ids for o in pipe(prompts, max_new_tokens=6, min_new_tokens=6)
        ]
    print(json.dumps(result))
    """
)


def test_triton_backend_matches_torch_backend(tiny_model_dir):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert result["triton-eager"] == result["torch"]
