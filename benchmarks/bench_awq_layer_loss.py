#!/usr/bin/env python
"""Where AWQ's perplexity loss sits: the held-out NLL increase of the calibrated float model when only some of its
linears take their rounded weights (every decoder layer alone, every projection kind alone).

    python benchmarks/bench_awq_layer_loss.py --group-size 32 --rounding gptq --group-search --threads 1
    python benchmarks/bench_awq_layer_loss.py --num-samples 16 --tokens 1024      # a quicker, noisier look

Calibrates in process (`calibrate_model`, the options of `pagellm quantize --method awq`) and records every
linear's weight just before rounding (AWQ's scales already folded in), so "none rounded" is the float model
(folding does not change its function) and "all rounded" is the checkpoint. Each subset's delta is measured
with everything else float; the deltas need not add up to the whole (the errors interact).
Text: bench_quant_ppl's held-out Ecclesiastes, --tokens tokens in windows of --window (no overlap).
Deltas in milli-nats per token; "share": the delta over the all-rounded delta.
"""

from __future__ import annotations

import argparse
import time

import common as C
import torch

LINEAR_KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def calibrate_recording(model: str | None, args) -> tuple[object, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(the calibrated HF float32 model, {HF linear name: (folded float weight, rounded weight)})."""
    import pagellm.quantization.awq_calibrate as cal
    from pagellm.model_loader import open_model
    from pagellm.quantization.awq_format import dequantize_awq
    from pagellm.quantization.calibration_data import calibration_samples

    files = open_model(model)
    config = cal.AWQCalibrationConfig(group_size=cal.choose_group_size(files.hf_config, args.group_size),
                                      rounding=args.rounding, group_search=args.group_search,
                                      true_sequential=args.true_sequential,
                                      **({"refine_sweeps": args.refine_sweeps} if args.refine_sweeps else {}))
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = cal.quantize_linear

    def recording(w, stats, cfg, clip):
        packed = original(w, stats, cfg, clip)
        recorded.append((w.detach().clone(), dequantize_awq(*packed, cfg.group_size)))
        return packed

    cal.quantize_linear = recording
    try:
        hf = cal.load_float_model(str(files.path))
        samples = calibration_samples(files.tokenizer, args.num_samples, args.seq_len, 0)
        t = time.perf_counter()
        cal.calibrate_model(hf, samples, config)
        print(f"[calibrate] {config} in {time.perf_counter() - t:.0f}s", flush=True)
    finally:
        cal.quantize_linear = original
    stages = cal.SEQUENTIAL_STAGES if config.true_sequential else cal.ONE_STAGE
    order = [n for _, linears in stages for n in linears]  # the order calibrate_layer rounds a layer's linears
    names = [f"model.layers.{i}.{n}" for i in range(len(hf.model.layers)) for n in order]
    return hf, dict(zip(names, recorded, strict=True))


def nll(hf, windows: list[torch.Tensor]) -> float:
    total, n = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = hf(ids.unsqueeze(0)).logits[0, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
            n += ids.numel() - 1
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the default model)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--rounding", default="gptq")
    ap.add_argument("--group-search", action="store_true")
    ap.add_argument("--true-sequential", action="store_true")
    ap.add_argument("--refine-sweeps", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    C.setup_threads(args.threads)
    from bench_quant_ppl import held_out_text

    from pagellm.model_loader import open_model

    tok = open_model(args.model).tokenizer
    text, source = held_out_text(4000)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:args.tokens])
    windows = list(ids.split(args.window))
    hf, weights = calibrate_recording(args.model, args)

    def run_with(rounded: set[str]) -> float:
        with torch.no_grad():
            for name, (w_float, w_rounded) in weights.items():
                hf.get_submodule(name).weight.copy_(w_rounded if name in rounded else w_float)
        return nll(hf, windows)

    t0 = time.perf_counter()
    base, full = run_with(set()), run_with(set(weights))
    total = full - base
    subsets = [(f"layer {i}", {n for n in weights if n.startswith(f"model.layers.{i}.")})
               for i in range(len(hf.model.layers))]
    subsets += [(kind.split(".")[1], {n for n in weights if n.endswith("." + kind)}) for kind in LINEAR_KINDS]
    rows = [["all", f"{total * 1e3:.2f}", "100 %"]]
    for label, names in subsets:
        d = run_with(names) - base
        rows.append([label, f"{d * 1e3:.2f}", f"{d / total * 100:.1f} %"])
        print(rows[-1], flush=True)
    head = (f"## AWQ loss by subset ({source}, {ids.numel()} tokens; float {base:.4f} nats/token, all rounded "
            f"{full:.4f}; {args.num_samples} x {args.seq_len} calibration tokens, group {args.group_size}, "
            f"rounding {args.rounding}, group search {args.group_search}, true-sequential {args.true_sequential}, "
            f"refine sweeps {args.refine_sweeps}; {time.perf_counter() - t0:.0f}s)\n\n")
    md = head + C.md_table(["linears rounded", "mNLL / token", "share of all"], rows)
    print("\n" + md, flush=True)
    C.save_results(f"awq_layer_loss_{args.tag or 'run'}", md, {"args": vars(args), "rows": rows,
                                                               "float_nll": base, "rounded_nll": full})


if __name__ == "__main__":
    main()
