#!/usr/bin/env python
"""Does `--refine-sweeps` generalize? Per linear of some decoder layers of the default model: the output error on
held-out tokens of GPTQ + group search, then of its refinement (`awq_refine.refine_rounding`) at several dampings.

    python benchmarks/bench_awq_refine_heldout.py --layers 3 --damps 0.01,0.05,0.2,1 --threads 1
    python benchmarks/bench_awq_refine_heldout.py --layers 3,14 --sweeps 8 --damps 0.2

Inputs are the float model's (no AWQ scaling, no rounding upstream): each linear's Gram matrix from
--num-samples x 256 calibration tokens (seed 0) and from --held-out-samples x 256 others (seed 777); the
printed ratio is the refined rounding's held-out error sum e H e^T over GPTQ + group search's.
"""

from __future__ import annotations

import argparse

import common as C
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--layers", default="3")
    ap.add_argument("--damps", default="0.01,0.05,0.2,1")
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--held-out-samples", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    C.setup_threads(args.threads)
    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_calibrate import (
        CAPTURED_INPUTS, INPUT_OWNER, LAYER_LINEARS, LayerRunner, load_float_model,
    )
    from pagellm.quantization.awq_gptq import gptq_quantize
    from pagellm.quantization.awq_refine import output_objective, refine_rounding
    from pagellm.quantization.calibration_data import calibration_samples

    G, layers = args.group_size, {int(x) for x in args.layers.split(",")}
    damps = [float(x) for x in args.damps.split(",")]
    files = open_model(None)
    model = load_float_model(str(files.path))
    runner = LayerRunner(model.model.rotary_emb, 256, 8)
    with torch.no_grad():
        hidden = [model.model.embed_tokens(torch.tensor(calibration_samples(files.tokenizer, n, 256, seed)))
                  for n, seed in ((args.num_samples, 0), (args.held_out_samples, 777))]
        for i, layer in enumerate(model.model.layers[:max(layers) + 1]):
            outs = [runner.forward(layer, h, CAPTURED_INPUTS if i in layers else ()) for h in hidden]
            if i in layers:
                (_, calib), (_, held_out) = outs
                for name in LAYER_LINEARS:
                    w = layer.get_submodule(name).weight.data
                    h_cal, h_held = calib[INPUT_OWNER[name]].gram, held_out[INPUT_OWNER[name]].gram
                    start = gptq_quantize(w, h_cal, G, group_search=True)
                    base = output_objective(w, *start, h_held, G)
                    cells = []
                    for d in damps:
                        refined = refine_rounding(w, *start, h_cal, G, sweeps=args.sweeps, damp=d)
                        cells.append(f"damp {d:g}: {output_objective(w, *refined, h_held, G) / base:.3f}")
                    print(f"layer {i} {name} (in {w.shape[1]}): held-out error vs GPTQ + search, "
                          f"{args.sweeps} sweeps: " + ", ".join(cells), flush=True)
            hidden = [h for h, _ in outs]


if __name__ == "__main__":
    main()
