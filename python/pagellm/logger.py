"""The package logger: `pagellm` namespace, INFO to stderr unless the app configured logging."""

import logging
import os


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("pagellm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("PAGELLM_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)
