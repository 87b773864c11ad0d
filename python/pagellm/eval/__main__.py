"""`python -m pagellm.eval` / `pagellm-eval`: lm-eval's own CLI with the "pagellm" model type registered.

    pagellm-eval --model pagellm --model_args pretrained=DIR,dtype=float32 --tasks hellaswag --batch_size 16
"""

from __future__ import annotations

import sys


def main() -> None:
    from pagellm.eval import register_lm_eval_model

    if not register_lm_eval_model():
        sys.exit("pagellm-eval needs lm-eval: pip install 'pagellm[eval]'")
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
