import sys
from pathlib import Path

import pytest
import torch

# One thread per test process: the CI machine has two cores and servers spawned by tests need the other.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A two-layer random Llama (GQA 4/2, tied embeddings) with SmolLM2's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
