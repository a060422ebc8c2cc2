from pathlib import Path

import pytest
from safetensors.numpy import load_file

FIXTURE = Path(__file__).parent / "fixtures" / "reference-v41-tiny"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return FIXTURE


@pytest.fixture(scope="session")
def fixture_model():
    from dsv41_mlx import load

    model, _ = load(FIXTURE)
    return model


@pytest.fixture(scope="session")
def golden():
    return load_file(FIXTURE / "golden.safetensors")


@pytest.fixture(scope="session")
def intermediates():
    return load_file(FIXTURE / "golden_intermediates.safetensors")


@pytest.fixture
def padded_model(fixture_model):
    """The fixture model in the GPU's row-invariant mode (every decode padded to 8 rows,
    per-row window gathers), restored afterwards."""
    fixture_model.decode_rows = 8
    yield fixture_model
    fixture_model.decode_rows = None
