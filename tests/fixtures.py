"""Fixtures shared by the tests; the repository's conftest.py loads this module as a plugin."""

from pathlib import Path

import pytest
import torch

from fastgen.testing import make_tiny_model

# One thread per test process: the CI machine has two cores and servers spawned by tests need the other.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A two-layer random Llama (GQA 4/2, tied embeddings) with SmolLM2's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
