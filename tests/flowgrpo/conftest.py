import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    """These tests run many tiny ops; on a shared 2-core machine intra-op threading costs several times the wall
    time (measured ~5x). Results do not depend on it: every reference in these tests is computed in-process."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory: pytest.TempPathFactory):
    """tiny case name -> directory of a tiny random diffusers pipeline, built once per session on first use."""
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flowgrpo_pipelines")
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = save_tiny_pipeline(name, root / name)
        return built[name]

    return get
