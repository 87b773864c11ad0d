#!/usr/bin/env python
"""The E2E stage of `pagellm quantize --e2e-steps N` (awq_e2e.py) on an existing AWQ checkpoint, with its trajectory.

    python benchmarks/bench_awq_e2e.py --checkpoint /tmp/awq-s0 --output /tmp/awq-s0-e2e --seed 0 --num-samples 32
    python benchmarks/bench_awq_e2e.py --checkpoint CK --output OUT --seed 1 --steps 96 --lr 5e-4 --norms

`--checkpoint` must be a `pagellm quantize --method awq` directory of `--model` (default: the default model)
calibrated with `--seed`, `--num-samples`, `--seq-len` (and `--draws`): the same calibration windows are drawn
again, and the validation windows outside them, so OUT is what `pagellm quantize ... --e2e-steps N` writes in one
go (the stage reads only the checkpoint's tensors and the windows). Prints the validation KL / NLL every
`--eval-every` steps, writes OUT (same dtype as the checkpoint) and results/awq_e2e_<tag>.{md,json}; score OUT
with `bench_quant_ppl.py --methods bf16,dir=CK,dir=OUT`.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import common as C
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="an AWQ directory written by pagellm quantize")
    ap.add_argument("--output", required=True, help="where the tuned checkpoint goes (new or empty)")
    ap.add_argument("--model", default=None, help="the float model it was calibrated from (default: the default)")
    ap.add_argument("--seed", type=int, default=0, help="the calibration's --seed")
    ap.add_argument("--num-samples", type=int, default=128, help="the calibration's --num-samples")
    ap.add_argument("--seq-len", type=int, default=256, help="the calibration's --seq-len")
    ap.add_argument("--draws", type=int, default=1, help="the calibration's --draws (its windows are all used)")
    ap.add_argument("--validation-samples", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--patience", type=int, default=4)
    ap.add_argument("--norms", action="store_true", help="also train the decoder layers' RMSNorm weights")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    C.setup_threads(args.threads)

    from safetensors.torch import load_file

    from pagellm.entrypoints.quantize import e2e_stage
    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_e2e import E2EConfig
    from pagellm.quantization.awq_export import check_output_dir, write_awq_checkpoint
    from pagellm.quantization.calibration_data import calibration_windows

    config = E2EConfig(args.steps, lr=args.lr, batch_size=args.batch_size, eval_every=args.eval_every,
                       patience=args.patience, train_norms=args.norms, seed=args.seed)
    out = check_output_dir(args.output, overwrite=False)
    ck = Path(args.checkpoint)
    ck_config = json.loads((ck / "config.json").read_text())
    group = ck_config["quantization_config"]["group_size"]
    dtype = ck_config.get("dtype", "float16")
    tensors = load_file(str(ck / "model.safetensors"))
    files = open_model(args.model)
    windows = [w for k in range(args.draws)
               for w in calibration_windows(files.tokenizer, args.num_samples, args.seq_len, args.seed + k)]
    lines: list[str] = []

    def say(msg: str) -> None:
        print(f"[e2e] {msg}", flush=True)
        lines.append(msg)

    load_start = C.loadavg()[0]
    reports = []
    import pagellm.quantization.awq_e2e as e2e

    original = e2e.e2e_tune

    def recording(*a, **kw):  # keep the report e2e_stage summarizes
        tuned, report = original(*a, **kw)
        reports.append(report)
        return tuned, report

    e2e.e2e_tune = recording
    try:
        tuned = e2e_stage(str(files.path), files.tokenizer, tensors, windows, group, config,
                          args.validation_samples, args.seed, say)
    finally:
        e2e.e2e_tune = original
    write_awq_checkpoint(tuned, files.path, out, group, dtype)
    report = reports[0]
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rows = [[step, f"{kl:.5f}", f"{nll:.5f}"] for step, kl, nll in report["val"]]
    md = (f"# AWQ E2E stage: {ck} -> {out}\n\n{vars(args)}\n\nload {load_start:.1f} at the start, "
          f"{C.loadavg()[0]:.1f} at the end; {report['seconds']:.0f} s wall, {report['cpu_seconds']:.0f} CPU s, "
          f"peak RSS {rss_gb:.2f} GB; kept step {report['best_step']} of {report['stopped_at']}\n\n"
          + C.md_table(["step", "validation KL", "validation NLL"], rows) + "\n")
    print(md)
    C.save_results(f"awq_e2e_{args.tag or time.strftime('%Y%m%d-%H%M%S')}", md,
                   {"args": vars(args), "report": report, "peak_rss_gb": rss_gb, "log": lines,
                    "env": C.env_info()})


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
