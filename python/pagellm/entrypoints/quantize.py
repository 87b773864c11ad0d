"""`pagellm quantize --method awq --output DIR`: write a 4-bit AWQ checkpoint of a model (AutoAWQ's layout).

    pagellm quantize --method awq --output /tmp/smollm2-awq                # the default model, ~minutes on 2 cores
    pagellm quantize --method awq --model ./my-llama --output ./my-llama-awq --num-samples 128 --seq-len 512
    pagellm quantize --method awq --rounding gptq --output /tmp/smollm2-awq-gptq   # GPTQ's error-compensated rounding
    pagellm quantize --method awq --rounding gptq --group-search --true-sequential --output OUT   # +4.2 % at g32
    pagellm quantize --method awq --rounding gptq --group-search --refine-sweeps 2 --num-samples 128 \
        --group-size 32 --output OUT                                            # +3.25 % (session 17)
    pagellm quantize --method awq --group-size 32 --draws 3 --select draw --output OUT   # best of 3 by validation NLL
    pagellm quantize --method awq --group-size 32 --e2e-steps 24 --e2e-batch-size 2 --output OUT   # + scales tuned E2E

The command's defaults since session 18 are `--rounding gptq --group-search --refine-sweeps 2 --num-samples 128`
(`--rounding rtn --no-group-search --refine-sweeps 0 --num-samples 32` is session 15's recipe, `quantize_model_awq`'s
defaults): on the default model at group 32 word perplexity over bf16 +9.4 % (RTN) against +3.25 % (mean of 3
seeds at 128 x 256 tokens, +1.8 to +4.7 %; 385 s on 2 lightly loaded cores; benchmarks/README.md sessions 15-18).
Sizes suit a small model on a few CPU cores (32 samples x 256 tokens): with RTN the default model
(SmolLM2-135M, 30 layers) took 4 min 15 s on 2 shared cores (145 CPU-seconds, 1.7 GB peak RSS), about 5 s
of CPU per layer for the searches and 2 s per layer forward. AutoAWQ's own defaults, 128 x 512, make the
forwards 8x dearer (the searches cost the same: they work on Gram matrices). The group size defaults to the
largest of 128 / 64 / 32 that divides every linear's in_features (SmolLM2-135M's hidden size 576 takes 64).
`--rounding gptq` rounds each linear with GPTQ's error feedback (awq_gptq.py) after AWQ's scaling, in the
same AutoAWQ layout; it adds well under a second of CPU per layer here (0.1 s for a 1536 x 576 linear), and
on SmolLM2-135M brings word perplexity over bf16 from +16.7 % to +7.7 % (group 64; benchmarks/README.md session 15).
`--scale-search rounding|none` judges AWQ's per-channel scale by the configured rounding or drops it, and
`--gptq-damp` sets GPTQ's damping (benchmarks/README.md session 18: neither beat the defaults' perplexity
beyond the held-out text's noise). `--draws N` calibrates N times (seeds --seed, --seed + 1, ...) and writes the
calibration (`--select draw`) or the per-decoder-layer mix of them (`--select layer`, greedy) with the lowest NLL of
the rounded model on `--validation-samples` windows of calibration-side text none of the draws read (awq_select.py):
N times the calibration, plus N validation forwards (draw) or ~0.6 x (N - 1) x layers more (layer). On the default model
a whole draw chosen so was no better on the benchmark's held-out texts; the per-layer mix of 3 draws gave +2.30 %
against their mean +3.25 % in one run (benchmarks/README.md session 19), so it is off by default. `--e2e-steps N`
then trains the group scales (`--e2e-norms`: and the layer norms) end to end against the float model's next-token
distributions on the calibration windows, the integers fixed, early-stopped on `--validation-samples` windows
(awq_e2e.py; benchmarks/README.md session 20). Calibration text: calibration_data.py.
The result loads with `LLM(DIR)` (quantization_config says "awq") and with HF transformers' AWQ support.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

QUANTIZE_METHODS = ("awq",)
DEFAULT_NUM_SAMPLES = 32
# the command's: 128 x 256 tokens took the mean of 3 seeds from +3.97 % to +3.25 % (group 32, session 18), ~6.5 min
CLI_NUM_SAMPLES = 128
DEFAULT_SEQ_LEN = 256
DEFAULT_VALIDATION_SAMPLES = 32  # x seq_len tokens of validation text per candidate evaluation (--draws > 1)
DEFAULT_E2E_LR = 2e-4  # awq_e2e's Adam learning rate on relative changes (2e-3 raised the validation KL; session 20)
DEFAULT_E2E_BATCH = 2  # calibration windows per E2E step (4 x 256 tokens peaked at 4.9 GB RSS on the default model)


def check_method(method: str) -> str:
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; `pagellm quantize` methods: "
                         f"{', '.join(QUANTIZE_METHODS)}")
    return method


def quantize_model_awq(model: str | None, output_dir: str | Path, *, group_size: int | None = None,
                       num_samples: int = DEFAULT_NUM_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN, clip: bool = True,
                       dtype: str = "float16", seed: int = 0, overwrite: bool = False, rounding: str = "rtn",
                       group_search: bool = False, true_sequential: bool = False, refine_sweeps: int = 0,
                       scale_search: str = "rtn", gptq_damp: float = 0.01, draws: int = 1, select: str = "draw",
                       validation_samples: int = DEFAULT_VALIDATION_SAMPLES, e2e_steps: int = 0,
                       e2e_lr: float = DEFAULT_E2E_LR, e2e_batch_size: int = DEFAULT_E2E_BATCH,
                       e2e_norms: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """AWQ-calibrate `model` (an HF dir, a .gguf, or None for the default model) and write the checkpoint to
    `output_dir`. `draws` > 1: that many calibrations (seeds seed, seed + 1, ...), the one written chosen by
    the rounded model's NLL on `validation_samples` windows of calibration-side text none of them saw
    (`select` "draw": the best whole calibration; "layer": greedy per decoder layer; awq_select.py).
    `e2e_steps` > 0: then that many Adam steps (`e2e_lr`, `e2e_batch_size` windows each) on the group scales
    (and with `e2e_norms` the decoder layers' RMSNorm weights) against the float model's next-token
    distributions over the calibration windows, early-stopped on `validation_samples` windows (awq_e2e.py).
    Every argument is checked (ValueError / TypeError) before any work; returns the output directory."""
    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_calibrate import (
        ROUNDINGS, SCALE_SEARCHES, AWQCalibrationConfig, choose_group_size,
    )
    from pagellm.quantization.awq_export import AWQ_FLOAT_DTYPES, check_output_dir, write_awq_checkpoint
    from pagellm.quantization.awq_e2e import E2EConfig
    from pagellm.quantization.awq_select import SELECT_MODES

    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} not supported; allowed: {', '.join(ROUNDINGS)}")
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"scale_search {scale_search!r} not supported; allowed: {', '.join(SCALE_SEARCHES)}")
    if dtype not in AWQ_FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; allowed: {', '.join(AWQ_FLOAT_DTYPES)}")
    if not isinstance(refine_sweeps, int) or isinstance(refine_sweeps, bool) or refine_sweeps < 0:
        raise ValueError(f"refine_sweeps must be a non-negative integer, got {refine_sweeps!r}")
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2; got {num_samples}, {seq_len}")
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise ValueError(f"draws must be a positive integer, got {draws!r}")
    if select not in SELECT_MODES:
        raise ValueError(f"select {select!r} not supported; allowed: {', '.join(SELECT_MODES)}")
    if not isinstance(validation_samples, int) or isinstance(validation_samples, bool) or validation_samples < 1:
        raise ValueError(f"validation_samples must be a positive integer, got {validation_samples!r}")
    if not isinstance(e2e_steps, int) or isinstance(e2e_steps, bool) or e2e_steps < 0:
        raise ValueError(f"e2e_steps must be a non-negative integer, got {e2e_steps!r}")
    e2e = E2EConfig(e2e_steps, lr=e2e_lr, batch_size=e2e_batch_size, train_norms=e2e_norms, seed=seed) \
        if e2e_steps else None
    out = check_output_dir(output_dir, overwrite)
    files = open_model(model)
    if out.resolve() == Path(files.path).resolve():
        raise ValueError(f"output directory {out} is the model's own directory; choose another")
    if files.tokenizer is None:
        raise ValueError(f"{files.path}: no tokenizer files; calibration needs the model's tokenizer")
    config = AWQCalibrationConfig(group_size=choose_group_size(files.hf_config, group_size), clip=clip,
                                  rounding=rounding, group_search=group_search, true_sequential=true_sequential,
                                  refine_sweeps=refine_sweeps, scale_search=scale_search, gptq_damp=gptq_damp)
    say = progress or (lambda _msg: None)
    say(f"model {files.source} ({files.hf_config.num_hidden_layers} layers), group size {config.group_size}, "
        f"{num_samples} samples x {seq_len} tokens, clip search {'on' if clip else 'off'}, rounding {rounding}, "
        f"group search {'on' if group_search else 'off'}, true-sequential {'on' if true_sequential else 'off'}, "
        f"refine sweeps {refine_sweeps}, scale search {scale_search}, gptq damp {gptq_damp:g}"
        + (f", {draws} draws chosen by {select} on {validation_samples} validation samples" if draws > 1 else "")
        + (f", then {e2e_steps} E2E steps (lr {e2e_lr:g}, {e2e_batch_size} windows each"
           f"{', norms too' if e2e_norms else ''})" if e2e else ""))
    seeds = [seed + k for k in range(draws)]
    tensors, windows = calibrate_draws(str(files.path), files.tokenizer, config, num_samples, seq_len, seeds,
                                       AWQ_FLOAT_DTYPES[dtype], select, validation_samples, say)
    if e2e is not None:
        tensors = e2e_stage(str(files.path), files.tokenizer, tensors, windows, config.group_size, e2e,
                            validation_samples, seeds[0], say)
    return write_awq_checkpoint(tensors, files.path, out, config.group_size, dtype)


def e2e_stage(model_dir: str, tokenizer, tensors: dict, windows: list, group_size: int, e2e, num_validation: int,
              seed: int, say: Callable[[str], None]) -> dict:
    """awq_e2e's tuning of the calibrated `tensors` on the calibration `windows` ([(ids, TextWindow)]), early-stopped
    on `num_validation` windows outside all of them (the same ones a draw selection with this seed uses)."""
    from pagellm.quantization.awq_e2e import e2e_tune_from_dir
    from pagellm.quantization.calibration_data import validation_samples

    seq_len = len(windows[0][0])
    val = validation_samples(tokenizer, num_validation, seq_len, exclude=[w for _, w in windows], seed=seed)
    tuned, report = e2e_tune_from_dir(model_dir, tensors, group_size, [ids for ids, _ in windows], val, e2e, say)
    first, best = report["val"][0], next(v for v in report["val"] if v[0] == report["best_step"])
    say(f"e2e: kept step {best[0]} of {report['stopped_at']} (validation KL {first[1]:.5f} -> {best[1]:.5f}, "
        f"NLL {first[2]:.5f} -> {best[2]:.5f}) in {report['seconds']:.0f}s ({report['cpu_seconds']:.0f} CPU s)")
    return tuned


def calibrate_draws(model_dir: str, tokenizer, config, num_samples: int, seq_len: int, seeds: list[int], dtype,
                    select: str, num_validation: int, say: Callable[[str], None]) -> dict:
    """(tensors, every draw's calibration windows [(ids, TextWindow)]): one calibration per seed; with several,
    the one (or the per-layer mix) awq_select chooses. The float tensors are rounded to the checkpoint's `dtype`
    first, so the choice is made on what will be written."""
    from pagellm.quantization.awq_calibrate import calibrate_model, load_float_model
    from pagellm.quantization.awq_export import PACKED_SUFFIXES
    from pagellm.quantization.awq_select import select_calibration
    from pagellm.quantization.calibration_data import calibration_windows, validation_samples

    candidates, drawn_all = [], []
    for k, seed in enumerate(seeds):
        drawn = calibration_windows(tokenizer, num_samples, seq_len, seed)
        drawn_all += drawn
        if len(seeds) > 1:
            say(f"draw {k + 1}/{len(seeds)} (seed {seed})")
        float_model = load_float_model(model_dir)
        tensors = calibrate_model(float_model, [ids for ids, _ in drawn], config, progress=say)
        candidates.append({n: t if n.endswith(PACKED_SUFFIXES) else t.to(dtype) for n, t in tensors.items()})
    if len(seeds) == 1:
        return candidates[0], drawn_all
    start = time.perf_counter()
    val = validation_samples(tokenizer, num_validation, seq_len, exclude=[w for _, w in drawn_all], seed=seeds[0])
    tensors, report = select_calibration(float_model, candidates, val, config.group_size, select, progress=say)
    draws = ", ".join(f"{x:.5f} (SE vs best {se:.5f})" for x, se in zip(report["draw_nll"], report["draw_se_vs_best"]))
    say(f"chose {report.get('layers', report['best_draw'])} by validation NLL {report['nll']:.5f} (draws: {draws}) "
        f"in {time.perf_counter() - start:.0f}s")
    return tensors, drawn_all


def run(a: argparse.Namespace) -> int:
    check_method(a.method)
    start = time.perf_counter()
    out = quantize_model_awq(a.model, a.output, group_size=a.group_size, num_samples=a.num_samples,
                             seq_len=a.seq_len, clip=not a.no_clip, dtype=a.dtype, seed=a.seed,
                             overwrite=a.overwrite, rounding=a.rounding, group_search=a.group_search,
                             true_sequential=a.true_sequential, refine_sweeps=a.refine_sweeps,
                             scale_search=a.scale_search, gptq_damp=a.gptq_damp, draws=a.draws, select=a.select,
                             validation_samples=a.validation_samples, e2e_steps=a.e2e_steps, e2e_lr=a.e2e_lr,
                             e2e_batch_size=a.e2e_batch_size, e2e_norms=a.e2e_norms,
                             progress=lambda msg: print(f"[awq] {msg}", flush=True))
    print(f"[awq] wrote {out} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantize", help="write a quantized checkpoint (awq: 4-bit AWQ, AutoAWQ's layout)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, help=f"one of: {', '.join(QUANTIZE_METHODS)}")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True, help="output directory (must be empty or new unless --overwrite)")
    p.add_argument("--group-size", type=int, default=None,
                   help="inputs per quantization group (default: the largest of 128/64/32 that fits the model)")
    p.add_argument("--num-samples", type=int, default=CLI_NUM_SAMPLES, help="calibration samples (default 128)")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per calibration sample")
    p.add_argument("--no-clip", action="store_true", help="skip the weight-clipping search")
    p.add_argument("--rounding", default="gptq",
                   help="gptq (default): GPTQ's error-compensated rounding | rtn: round to nearest (AutoAWQ's); same "
                        "format")
    p.add_argument("--group-search", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each group's (scale, integer zero) by the linear's output error (replaces the clip "
                        "search; on by default, --no-group-search: min / max, or the clip search)")
    p.add_argument("--true-sequential", action="store_true",
                   help="round each linear for the inputs the already rounded linears before it give it")
    p.add_argument("--refine-sweeps", type=int, default=2,
                   help="after rounding, this many coordinate-descent sweeps over each linear's integers and group "
                        "scales on its output error (awq_refine.py; default 2, 0: none)")
    p.add_argument("--scale-search", default="rtn",
                   help="rtn: AWQ's scale grid judged by round-to-nearest (AutoAWQ) | rounding: s = 1 or a few low "
                        "alphas judged by the configured rounding | none: no AWQ scaling")
    p.add_argument("--gptq-damp", type=float, default=0.01,
                   help="GPTQ's damping: H + damp * mean(diag H) * I, in (0, 1) (default 0.01, GPTQ's)")
    p.add_argument("--draws", type=int, default=1,
                   help="calibrate this many times (seeds --seed, --seed + 1, ...) and write the one --select "
                        "chooses by the rounded model's NLL on calibration-side text none of them saw (default 1)")
    p.add_argument("--select", default="draw",
                   help="with --draws > 1: draw: the best whole calibration | layer: greedy per decoder layer "
                        "among the draws' layers (awq_select.py)")
    p.add_argument("--validation-samples", type=int, default=DEFAULT_VALIDATION_SAMPLES,
                   help=f"validation windows of --seq-len tokens for --draws > 1 and --e2e-steps "
                        f"(default {DEFAULT_VALIDATION_SAMPLES})")
    p.add_argument("--e2e-steps", type=int, default=0,
                   help="after calibration, this many Adam steps on the group scales against the float model's "
                        "next-token distributions over the calibration windows, early-stopped on "
                        "--validation-samples windows (awq_e2e.py; default 0: none)")
    p.add_argument("--e2e-lr", type=float, default=DEFAULT_E2E_LR,
                   help=f"the E2E stage's Adam learning rate on relative changes (default {DEFAULT_E2E_LR:g})")
    p.add_argument("--e2e-batch-size", type=int, default=DEFAULT_E2E_BATCH,
                   help=f"calibration windows per E2E step (default {DEFAULT_E2E_BATCH})")
    p.add_argument("--e2e-norms", action="store_true",
                   help="the E2E stage also trains the decoder layers' RMSNorm weights (AWQ's folded scales)")
    p.add_argument("--dtype", default="float16", help="dtype of the unquantized tensors: float16 | bfloat16 | float32")
    p.add_argument("--seed", type=int, default=0, help="calibration sample choice")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty output directory")
    p.set_defaults(func=run)
    return p
