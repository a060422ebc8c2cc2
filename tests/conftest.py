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
