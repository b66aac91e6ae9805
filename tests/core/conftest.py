import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Core tests run many tiny ops: one thread is faster and immune to a busy machine's oversubscription."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
