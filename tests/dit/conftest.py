from pathlib import Path

import pytest
import torch

from runtime.diffusion.tiny_pipelines import save_tiny_pipeline


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    """Tiny models on a shared 2-core machine: intra-op threads cost wall time and change no result here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory: pytest.TempPathFactory):
    """kind -> directory of a tiny random diffusers pipeline, built once per session on first use."""
    root = tmp_path_factory.mktemp("dit_pipelines")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = save_tiny_pipeline(kind, root / kind)
        return built[kind]

    return get
