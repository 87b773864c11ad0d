import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the default-model (SmolLM2-135M) parity test; deselect with -m 'not slow'")
