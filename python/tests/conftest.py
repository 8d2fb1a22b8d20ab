import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
