"""A data-parallel replica's process entry: `python -m pagellm.entrypoints.dp_replica`.

The serve arguments arrive pickled on stdin from `dp_serve.start_replicas` (a trusted parent); the replica is
then a plain `pagellm serve` on its internal port. A module of its own so that serve.py -> dp_serve.py stays
one-way (serve hands off to dp_serve; only this entry point calls serve back).
"""

from __future__ import annotations

import pickle
import sys


def main() -> int:
    args = pickle.loads(sys.stdin.buffer.read())
    from pagellm.entrypoints.serve import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
