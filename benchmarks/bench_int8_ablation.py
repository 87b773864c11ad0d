#!/usr/bin/env python
"""Where LLM.int8() loses perplexity on the default model: one ablation per row, in plain torch.

    python benchmarks/bench_int8_ablation.py --max-words 1500 --groups main       # knobs of the method
    python benchmarks/bench_int8_ablation.py --max-words 1500 --groups proj,layer  # which linears cost most
    python benchmarks/bench_int8_ablation.py --max-words 5000 --groups scheme      # absmax vs zero-point vs blocks
    python benchmarks/bench_int8_ablation.py --max-words 4000 --groups weights,block   # weight scale rules, groups
    python benchmarks/bench_int8_ablation.py --max-words 1000 --groups wproj,wlayer   # where int8 weights cost

HF transformers' LlamaForCausalLM of the default model (bf16, or --dtype float32) with every decoder linear
replaced by `FakeInt8Linear`: LLM.int8() as `pagellm.ops.reference.int8_linear` computes it (row-absmax int8
weights, row-absmax int8 activations, outlier columns of x over the whole batch in float), with switches:
  on          False: the float linear (fp32 product rounded to the model dtype)
  threshold   the outlier threshold (0: none)
  outliers    "batch": columns where any token exceeds the threshold (the op, bitsandbytes);
              "row": only the elements over the threshold, per token
  act_quant   False: activations stay float (weight-only int8)
  weight_quant False: weights stay float (activation-only int8)
  weight_rule how each weight row's scale is chosen: "absmax" (the op's loader), "mse" (the clip r * absmax of
              least squared rounding error, r from 1 down to 0.6), "awmse" (the same error weighted per input
              column by the mean x^2 of `pagellm quantize`'s calibration text, --calib-samples x 512 tokens)
  scheme      how a token's activations become int8: "absmax" (symmetric, s = absmax / 127: bitsandbytes),
              "zeropoint" (asymmetric, s = (max - min) / 255 over a range widened to hold 0, integer zero point
              z = round(-min / s), q = clamp(round(x / s) + z, 0, 255): the paper's zero-point vector-wise),
              "block32" / "block64" (absmax per block of 32 / 64 elements of K, one scale each)
The LM head and the embedding stay float, as in bitsandbytes' default and in `Int8Config`.
Word perplexity as bench_quant_ppl.py (same text, windows of 512 re-reading 128), windows batched 4 per
forward (~2048 tokens: the engine's max_num_batched_tokens, so the outlier columns are chosen over as many
tokens as in the engine). Prints one row per ablation: word ppl and its change vs the float model.
"""

from __future__ import annotations

import argparse
import math
import time

import bench_quant_ppl as B
import torch
from torch import nn

DEFAULTS = dict(on=True, threshold=6.0, outliers="batch", act_quant=True, weight_quant=True, scheme="absmax",
                weight_rule="absmax")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FakeInt8Linear(nn.Module):
    """LLM.int8() of one nn.Linear (no bias: Llama), in fp32, with the switches of the module doc."""

    def __init__(self, linear: nn.Linear, **switches) -> None:
        from pagellm.quantization.int8 import dequantize_weight_rows, quantize_weight_rows

        super().__init__()
        self.weight = linear.weight.detach().float()
        self.weight_dq = {"absmax": dequantize_weight_rows(*quantize_weight_rows(self.weight))}
        self.x_sq, self.x_count = None, 0  # sum of x^2 per input column over calibration tokens (record mode)
        self.switches = dict(DEFAULTS)
        self.switches.update(switches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sw = self.switches
        xf = x.reshape(-1, x.shape[-1]).float()
        if not sw["on"]:
            if sw.get("record"):
                sq = xf.square().sum(0)
                self.x_sq = sq if self.x_sq is None else self.x_sq + sq
                self.x_count += xf.shape[0]
            return (xf @ self.weight.t()).to(x.dtype).reshape(*x.shape[:-1], -1)
        w = self.dequantized(sw["weight_rule"]) if sw["weight_quant"] else self.weight
        if sw["threshold"] <= 0:
            outlier = torch.zeros_like(xf, dtype=torch.bool)
        elif sw["outliers"] == "batch":
            outlier = (xf.abs().amax(dim=0) > sw["threshold"]).expand_as(xf)
        else:
            outlier = xf.abs() > sw["threshold"]
        x_in = torch.where(outlier, 0.0, xf)
        if sw["act_quant"]:
            x_in = fake_quantize_rows(x_in, sw["scheme"])
        y = x_in @ w.t() + torch.where(outlier, xf, 0.0) @ w.t()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def dequantized(self, rule: str) -> torch.Tensor:
        """The weight int8-quantized per output row by `rule` ("absmax", "mse": clip search on the rounding
        error, "awmse": the same weighted by the calibration text's mean x^2 per input column), dequantized."""
        if rule not in self.weight_dq:
            cw = None if rule == "mse" else self.x_sq / max(1, self.x_count)
            scale = clip_search_scales(self.weight, cw)
            q = torch.round(self.weight / scale[:, None]).clamp_(-127, 127)
            self.weight_dq[rule] = q * scale[:, None]
        return self.weight_dq[rule]


def clip_search_scales(w: torch.Tensor, col_weight: torch.Tensor | None, num_ratios: int = 20,
                       min_ratio: float = 0.6) -> torch.Tensor:
    """Per row, the int8 scale r * absmax / 127 (r on a grid from 1 down to min_ratio) of least squared rounding
    error, each input column's error weighted by col_weight (None: unweighted)."""
    absmax = w.abs().amax(dim=1)
    best, best_err = absmax / 127.0, None
    for i in range(num_ratios):
        s = absmax * (1.0 - (1.0 - min_ratio) * i / (num_ratios - 1)) / 127.0
        err = (torch.round(w / s[:, None]).clamp_(-127, 127) * s[:, None] - w).square_()
        e = (err if col_weight is None else err * col_weight[None, :]).sum(dim=1)
        if best_err is not None:
            better = e < best_err
            best, e = torch.where(better, s, best), torch.where(better, e, best_err)
        best_err = e
    return best


def fake_quantize_rows(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [M, K] float32 quantized to int8 per token (or per block of K) by `scheme` and dequantized."""
    if scheme == "zeropoint":
        lo = x.amin(dim=1, keepdim=True).clamp(max=0.0)
        hi = x.amax(dim=1, keepdim=True).clamp(min=0.0)
        inv = torch.where(hi > lo, 255.0 / (hi - lo), 0.0)
        z = torch.round(-lo * inv)
        q = (torch.round(x * inv) + z).clamp(0, 255)
        return (q - z) * ((hi - lo) / 255.0)
    if scheme.startswith("block"):
        size = int(scheme[len("block"):])
        pad = (-x.shape[1]) % size
        xb = torch.nn.functional.pad(x, (0, pad)).reshape(x.shape[0], -1, size)
        return fake_quantize_rows(xb.reshape(-1, size), "absmax").reshape(x.shape[0], -1)[:, :x.shape[1]]
    if scheme != "absmax":
        raise ValueError(f"unknown scheme {scheme!r}")
    absmax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(absmax > 0, 127.0 / absmax, 0.0)
    return torch.round(x * inv).clamp(-127, 127) * (absmax / 127.0)


def wrap_linears(model) -> dict[tuple[int, str], FakeInt8Linear]:
    """Every decoder linear of an HF Llama replaced by a FakeInt8Linear, by (layer index, projection)."""
    fakes = {}
    for i, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            parent = layer.self_attn if name in PROJECTIONS[:4] else layer.mlp
            fakes[(i, name)] = FakeInt8Linear(getattr(parent, name))
            setattr(parent, name, fakes[(i, name)])
    return fakes


def score_windows(token_ids: list[int], window: int, context: int) -> list[tuple[list[int], int]]:
    """(window tokens, index of the first scored one): every token after the first scored once."""
    out, stride = [], window - context
    for start in range(1, len(token_ids), stride):
        lo = max(0, start - context)
        out.append((token_ids[lo:start + stride], start - lo))
    return out


@torch.no_grad()
def word_perplexity(model, windows, num_words: int, per_batch: int = 4) -> float:
    nll, i = 0.0, 0
    while i < len(windows):
        batch = [windows[i]]
        i += 1
        while i < len(windows) and len(batch) < per_batch and len(windows[i][0]) == len(batch[0][0]):
            batch.append(windows[i])
            i += 1
        logprobs = torch.log_softmax(model(torch.tensor([b[0] for b in batch])).logits.float(), -1)
        for row, (tokens, first) in enumerate(batch):
            pos = torch.arange(first, len(tokens))
            nll -= logprobs[row, pos - 1, torch.tensor(tokens)[pos]].sum().item()
    return math.exp(nll / num_words)


def ablations(group: str, fakes: dict) -> list[tuple[str, dict[tuple[int, str], dict]]]:
    """(label, switches per linear) for one group of rows."""
    every = lambda **sw: {k: sw for k in fakes}  # noqa: E731
    layers = sorted({i for i, _ in fakes})
    if group == "main":
        return [("float", every(on=False)), ("int8, threshold 6 (the op)", every()),
                ("weights int8 only", every(act_quant=False)), ("activations int8 only", every(weight_quant=False)),
                ("threshold 6, per-row outliers", every(outliers="row"))] + [
                (f"threshold {t:g}", every(threshold=t)) for t in (0.0, 2.0, 3.0, 4.0, 8.0)]
    if group == "proj":
        return [(f"only {p} int8", {k: dict(on=k[1] == p) for k in fakes}) for p in PROJECTIONS]
    if group == "layer":
        return [(f"only layer {i} int8", {k: dict(on=k[0] == i) for k in fakes}) for i in layers]
    if group == "scheme":
        rows = [(t, scheme) for t in (6.0, 0.0, 4.0) for scheme in ("absmax", "zeropoint")] + [(6.0, "block64")]
        return [(f"{scheme}, " + (f"threshold {t:g}" if t else "no outliers"), every(scheme=scheme, threshold=t))
                for t, scheme in rows] + [("weights int8 only", every(act_quant=False))]
    if group == "weights":
        return [(f"weights int8 only, {r}", every(act_quant=False, weight_rule=r)) for r in ("absmax", "mse", "awmse")]
    if group == "wproj":
        return [(f"weights int8 only, only {p}", {k: dict(act_quant=False, on=k[1] == p) for k in fakes})
                for p in PROJECTIONS]
    if group == "wlayer":
        return [(f"weights int8 only, only layer {i}", {k: dict(act_quant=False, on=k[0] == i) for k in fakes})
                for i in layers]
    if group == "block":
        return [(f"{s}, threshold {t:g}, weights {r}", every(scheme=s, threshold=t, weight_rule=r))
                for s, t, r in (("block64", 6.0, "absmax"), ("block64", 6.0, "awmse"), ("block64", 0.0, "absmax"),
                                ("block128", 6.0, "absmax"))]
    raise ValueError(f"unknown group {group!r}; allowed: main, proj, layer, scheme, weights, wproj, wlayer, block")


@torch.no_grad()
def calibrate(model, tok, num_samples: int) -> None:
    """The float model over `pagellm quantize`'s calibration text (never the scored excerpt), recording the
    per-column mean x^2 of every decoder linear's input."""
    from pagellm.quantization.calibration_data import calibration_samples

    for sample in calibration_samples(tok, num_samples, 512, seed=0):
        model(torch.tensor([sample]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-words", type=int, default=1500)
    ap.add_argument("--groups", default="main", help="comma-separated: main, proj, layer, scheme")
    ap.add_argument("--calib-samples", type=int, default=32, help="x 512 tokens of calibration_data (awmse)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagellm.model_loader import open_model

    path = open_model(None).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(path)
    text, source = B.held_out_text(args.max_words)
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    windows, words = score_windows(ids, 512, 128), len(text.split())
    fakes = wrap_linears(model)
    for sw in fakes.values():
        sw.switches["on"] = False
        sw.switches["record"] = True
    calibrate(model, tok, args.calib_samples)
    for sw in fakes.values():
        sw.switches["record"] = False
    base = word_perplexity(model, windows, words)
    print(f"{source}, {words} words, {args.dtype}; float model: word ppl {base:.3f}\n")
    print("| ablation | word ppl | vs float |\n|---|---:|---:|")
    for group in args.groups.split(","):
        for label, per_linear in ablations(group, fakes):
            for key, fake in fakes.items():
                fake.switches = dict(DEFAULTS)
                fake.switches.update(per_linear[key])
            t = time.perf_counter()
            ppl = word_perplexity(model, windows, words)
            print(f"| {label} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f} % |  <!-- {time.perf_counter() - t:.0f} s -->",
                  flush=True)


if __name__ == "__main__":
    main()
