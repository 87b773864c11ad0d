"""Evaluation with EleutherAI's lm-evaluation-harness (`pip install pagellm[eval]`).

    import pagellm.eval                      # registers the "pagellm" model type with lm-eval
    lm_eval.simple_evaluate(model="pagellm", model_args="pretrained=DIR,dtype=float32", tasks=[...])

    pagellm-eval --model pagellm --model_args pretrained=DIR,dtype=float32 --tasks ...   # lm_eval's CLI
    python -m pagellm.eval ...                                                           # the same

lm-eval 0.4.x finds models only in its own `MODEL_MAPPING` or through `register_model` in the running
process (no entry-point plugins), so the launcher registers the model type, then runs lm_eval's CLI.
Importing this package registers a lazy placeholder: pagellm.eval.lm_eval_model (and the engine) is only
imported when lm-eval asks for the "pagellm" model.
"""

from __future__ import annotations

MODEL_NAME = "pagellm"
MODEL_TARGET = "pagellm.eval.lm_eval_model:PagellmLM"


def register_lm_eval_model() -> bool:
    """Register "pagellm" in lm-eval's model registry; False when lm-eval is not installed."""
    try:
        from lm_eval.api.registry import model_registry
    except ImportError:
        return False
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)
    return True


register_lm_eval_model()

__all__ = ["MODEL_NAME", "register_lm_eval_model"]
