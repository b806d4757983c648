import pytest
import torch

from fastforward.tiny import tiny_model


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run several times faster on one thread than on two busy ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random llama (fp32) with a mask token and peaked predictions (no near-ties)."""
    model = tiny_model(seed=0, init_std=0.5)
    model.add_mask_token()
    return model


@pytest.fixture(scope="module")
def prompts(tiny):
    texts = ["def add(a, b):", "Tom has 3 apples", "The quick brown fox jumps over", "0"]
    return [tiny.encode_prompt(t) for t in texts]
