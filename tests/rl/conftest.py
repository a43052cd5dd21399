import pytest
import torch

from tests.rl.common import tiny_pipelines  # noqa: F401  (the session fixture)


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    """Tiny models on a shared 2-core machine: intra-op threads cost wall time and change no result here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
