#!/usr/bin/env python
"""Per scaling group / linear of some decoder layers of the default model, the held-out output error of the final
rounding (GPTQ + group search + 2 refinement sweeps) for several AWQ scale choices, or for several GPTQ dampings.

    python benchmarks/bench_awq_scale_heldout.py --layers 0,3,14,25 --threads 1           # scale choices
    python benchmarks/bench_awq_scale_heldout.py --layers 3,14 --damps 0.01,0.03,0.1,0.3 --threads 1

Inputs are the float model's (no rounding upstream): Gram matrices from --num-samples x 256 calibration tokens
(seed 0) and 16 x 256 others (seed 777). Scale choices: s = 1 (no scaling), AutoAWQ's RTN-judged grid search
(`search_scale`, what `--scale-search rtn` folds), and alpha 0.25 / 0.5 (duo scaling); the printed numbers are
the group's summed held-out error over s = 1's. Dampings (`--damps`, s = 1): each linear's error over the first
damping's. A lower local error did not mean a lower perplexity here (benchmarks/README.md session 18).
"""

from __future__ import annotations

import argparse

import common as C
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="3")
    ap.add_argument("--damps", default=None, help="comma-separated GPTQ dampings (instead of the scale choices)")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    C.setup_threads(args.threads)
    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_calibrate import (
        CAPTURED_INPUTS, INPUT_OWNER, LAYER_LINEARS, LayerRunner, load_float_model, scaling_groups,
    )
    from pagellm.quantization.awq_gptq import gptq_quantize
    from pagellm.quantization.awq_refine import output_objective, refine_rounding
    from pagellm.quantization.awq_search import activation_scales, search_scale, weight_scales
    from pagellm.quantization.calibration_data import calibration_samples

    G, layers = args.group_size, {int(x) for x in args.layers.split(",")}

    def final_error(w, h_cal, h_held, damp=0.01):
        q = gptq_quantize(w, h_cal, G, group_search=True, damp=damp)
        return output_objective(w, *refine_rounding(w, *q, h_cal, G, sweeps=2), h_held, G)

    files = open_model(None)
    model = load_float_model(str(files.path))
    runner = LayerRunner(model.model.rotary_emb, 256, 8)
    with torch.no_grad():
        hidden = [model.model.embed_tokens(torch.tensor(calibration_samples(files.tokenizer, n, 256, seed)))
                  for n, seed in ((args.num_samples, 0), (16, 777))]
        for i, layer in enumerate(model.model.layers[:max(layers) + 1]):
            outs = [runner.forward(layer, h, CAPTURED_INPUTS if i in layers else ()) for h in hidden]
            if i in layers and args.damps:
                (_, cal), (_, held) = outs
                damps = [float(x) for x in args.damps.split(",")]
                for name in LAYER_LINEARS:
                    w, owner = layer.get_submodule(name).weight.data, INPUT_OWNER[name]
                    errs = [final_error(w, cal[owner].gram, held[owner].gram, d) for d in damps]
                    print(f"layer {i} {name}: " + ", ".join(f"damp {d:g}: {e / errs[0]:.3f}"
                                                            for d, e in zip(damps, errs)), flush=True)
            elif i in layers:
                (_, cal), (_, held) = outs
                for group in scaling_groups(layer):
                    st, sh = cal[INPUT_OWNER[group.linears[0]]], held[INPUT_OWNER[group.linears[0]]]
                    ws = [layer.get_submodule(n).weight.data.float() for n in group.linears]
                    mean_abs, w_mean = st.abs_sum / st.num_tokens, weight_scales(ws, G)
                    choices = {"s = 1": torch.ones_like(mean_abs), "RTN-judged": search_scale(st, ws, G)[0],
                               "alpha 0.25": activation_scales(mean_abs, 0.25, w_mean),
                               "alpha 0.5": activation_scales(mean_abs, 0.5, w_mean)}
                    errs = {k: sum(final_error(w * s, st.scaled(s).gram, sh.scaled(s).gram) for w in ws)
                            for k, s in choices.items()}
                    print(f"layer {i} {group.prev} -> {', '.join(group.linears)}: " +
                          ", ".join(f"{k}: {v / errs['s = 1']:.3f}" for k, v in errs.items()), flush=True)
            hidden = [h for h, _ in outs]


if __name__ == "__main__":
    main()
