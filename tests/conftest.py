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
def drafter(fixture_model):
    """The fixture model's DSpark drafter, made once (its FP8 head built once)."""
    from dsv41_mlx.runtime.drafter import Drafter

    return Drafter(fixture_model)


@pytest.fixture(scope="session")
def golden():
    return load_file(FIXTURE / "golden.safetensors")


@pytest.fixture(scope="session")
def intermediates():
    return load_file(FIXTURE / "golden_intermediates.safetensors")


@pytest.fixture
def runner(fixture_model):
    """The fixture model's runner with this machine's options (the CPU's: none)."""
    from dsv41_mlx.runtime.runner import Runner

    with Runner(fixture_model) as runner:
        yield runner


@pytest.fixture
def padded_runner(fixture_model):
    """The fixture model run in the GPU's row-invariant mode (every decode and verify forward
    padded to 8 rows, per-row window gathers)."""
    from dsv41_mlx.runtime.options import Options
    from dsv41_mlx.runtime.runner import Runner

    with Runner(fixture_model, Options(decode_rows=8)) as runner:
        yield runner
