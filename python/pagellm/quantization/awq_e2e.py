"""End-to-end tuning of an AWQ checkpoint's float parameters against the float model (`pagellm quantize --e2e-steps N`).

Why: every layer-local objective the calibration minimizes (each linear's output error) was pushed in sessions
15-19 and did not predict perplexity (benchmarks/README.md sessions 18-19). This stage optimizes what the
benchmark measures: after calibration has fixed every integer (`qweight`, `qzeros`), the continuous parameters
the AutoAWQ format keeps are trained end to end, as EfficientQAT's E2E-QP stage and PEQA do:
 - every quantized linear's group scales s [out, in / group] (W = (q - z) * s stays the format's function),
 - optionally (`train_norms`) the decoder layers' RMSNorm weights, which AWQ's per-channel scales were folded into,
by Adam on the KL divergence from the float teacher's next-token distribution to the quantized student's, over
the calibration windows, in batches of `batch_size` windows; every `eval_every` steps the student's KL (and NLL)
on validation windows (`calibration_data.validation_samples`: calibration-side text overlapping no calibration
window) is measured, and the parameters with the lowest validation KL so far (the untuned ones included) are
written; `patience` evaluations without a new best stop early. Each parameter is trained as a relative change
(s = s0 * (1 + d), d from 0), so one learning rate suits every layer's scale magnitudes.

Memory: the student keeps q - z as int8 and recomputes W in the backward (`_FrozenCodeLinearFn`), so neither the
float weights nor their gradients are stored; beside the float32 teacher the logits and the 30 layers' saved
activations dominate: 4 x 256-token batches peaked at 4.9 GB RSS on the default model, so 2 windows per step is the
default. Cost there: ~20 CPU s per 4 x 256 tokens (teacher forward ~5, student forward ~6, backward + Adam ~9).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from pagellm.quantization.awq_calibrate import LAYER_LINEARS, load_float_model
from pagellm.quantization.awq_export import PACKED_SUFFIXES
from pagellm.quantization.awq_format import unpack_awq_int4

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")  # the norms AWQ folds its scales into


@dataclass(frozen=True)
class E2EConfig:
    steps: int  # optimizer steps (each over batch_size calibration windows)
    lr: float = 2e-4  # Adam's, on the relative changes d (s = s0 * (1 + d)); 2e-3 raised the validation KL
    batch_size: int = 2  # calibration windows per step
    eval_every: int = 8  # steps between validation evaluations
    patience: int = 4  # evaluations without a new best validation KL before stopping
    train_norms: bool = False  # also the decoder layers' RMSNorm weights
    seed: int = 0  # the order the windows are visited in

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "patience", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"E2E {name} must be an integer, got {value!r}")
        if self.steps < 1 or self.batch_size < 1 or self.eval_every < 1 or self.patience < 1:
            raise ValueError(f"E2E steps, batch_size, eval_every and patience must be >= 1; got {self.steps}, "
                             f"{self.batch_size}, {self.eval_every}, {self.patience}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < 1:
            raise ValueError(f"E2E lr must be in (0, 1), got {self.lr!r}")


class _FrozenCodeLinearFn(torch.autograd.Function):
    """y = x W^T with W = codes * s per group; the backward recomputes W instead of saving it."""

    @staticmethod
    def forward(ctx, x, codes, scales, group_size):
        ctx.save_for_backward(x, codes, scales)
        ctx.group_size = group_size
        return nn.functional.linear(x, _weight(codes, scales, group_size))

    @staticmethod
    def backward(ctx, grad_out):
        x, codes, scales = ctx.saved_tensors
        out_features, in_features = codes.shape
        grad_x = grad_scales = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ _weight(codes, scales, ctx.group_size)
        if ctx.needs_input_grad[2]:
            grad_w = grad_out.reshape(-1, out_features).t() @ x.reshape(-1, in_features)
            grad_scales = (grad_w.view(out_features, -1, ctx.group_size)
                           * codes.view(out_features, -1, ctx.group_size).to(grad_w.dtype)).sum(-1)
        return grad_x, None, grad_scales, None


def _weight(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = codes.shape
    w = codes.view(out_features, -1, group_size).to(scales.dtype) * scales.unsqueeze(-1)
    return w.view(out_features, in_features)


class FrozenCodeLinear(nn.Module):
    """An AWQ linear with its integers fixed: codes = q - z (int8 [out, in]), trainable relative change
    `delta` of the group scales s0 (float32 [out, in / group])."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        q = unpack_awq_int4(qweight, "qweight").t().to(torch.int8)  # [out, in]
        z = unpack_awq_int4(qzeros, "qzeros").t().to(torch.int8)  # [out, in / group]
        self.group_size = group_size
        self.register_buffer("codes", (q - z.repeat_interleave(group_size, dim=1)).contiguous())
        self.register_buffer("base_scales", scales.to(torch.float32).t().contiguous())
        self.delta = nn.Parameter(torch.zeros_like(self.base_scales))
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))

    def scales(self) -> torch.Tensor:
        return self.base_scales * (1 + self.delta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _FrozenCodeLinearFn.apply(x, self.codes, self.scales(), self.group_size)
        return y if self.bias is None else y + self.bias


class _Relative(nn.Module):
    """A parametrization w = w0 * (1 + d), trained from d = 0."""

    def __init__(self, base: torch.Tensor):
        super().__init__()
        self.register_buffer("base", base.detach().clone())

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        return self.base * (1 + d)

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(w)


def build_student(teacher: nn.Module, tensors: dict[str, torch.Tensor], group_size: int,
                  train_norms: bool = False) -> tuple[nn.Module, list[nn.Parameter]]:
    """A float32 copy of `teacher` (an HF CausalLM) computing the AWQ checkpoint `tensors` (its float tensors
    loaded, every decoder linear a `FrozenCodeLinear`), everything frozen but the trainable parameters returned."""
    student = copy.deepcopy(teacher)
    floats = {n: t.to(torch.float32) for n, t in tensors.items() if not n.endswith(PACKED_SUFFIXES)}
    result = student.load_state_dict(floats, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"checkpoint tensors the model does not have: {result.unexpected_keys[:4]}")
    student.requires_grad_(False)
    trainable = []
    for i, layer in enumerate(student.model.layers):
        prefix = f"model.layers.{i}."
        for name in LAYER_LINEARS:
            if prefix + name + ".qweight" not in tensors:
                raise ValueError(f"checkpoint has no AWQ tensors for {prefix + name}")
            module = FrozenCodeLinear(*(tensors[prefix + name + s] for s in PACKED_SUFFIXES), group_size,
                                      bias=tensors.get(prefix + name + ".bias"))
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent), child, module)
            trainable.append(module.delta)
        if train_norms:
            for name in LAYER_NORMS:
                norm = layer.get_submodule(name)
                parametrize.register_parametrization(norm, "weight", _Relative(norm.weight))
                original = norm.parametrizations.weight.original
                original.requires_grad_(True)
                trainable.append(original)
    return student, trainable


def tuned_tensors(student: nn.Module, tensors: dict[str, torch.Tensor], train_norms: bool) -> dict[str, torch.Tensor]:
    """`tensors` with the student's scales (and norms) in their stored dtypes; the integers are the same objects."""
    out = dict(tensors)
    for i, layer in enumerate(student.model.layers):
        prefix = f"model.layers.{i}."
        with torch.no_grad():
            for name in LAYER_LINEARS:
                key = prefix + name + ".scales"
                out[key] = layer.get_submodule(name).scales().t().to(tensors[key].dtype).contiguous()
            if train_norms:
                for name in LAYER_NORMS:
                    key = prefix + name + ".weight"
                    out[key] = layer.get_submodule(name).weight.to(tensors[key].dtype).contiguous()
    return out


def kl_to_teacher(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) of next-token distributions; logits [..., vocab]."""
    vocab = teacher_logits.shape[-1]
    t = torch.log_softmax(teacher_logits.reshape(-1, vocab), dim=-1)
    s = torch.log_softmax(student_logits.reshape(-1, vocab), dim=-1)
    return nn.functional.kl_div(s, t, reduction="batchmean", log_target=True)


def evaluate(teacher: nn.Module, student: nn.Module, ids: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """(mean KL to the teacher over every position, the student's mean next-token NLL) on ids [S, L]."""
    kl_sum, nll_sum = 0.0, 0.0
    with torch.no_grad():
        for lo in range(0, ids.shape[0], batch_size):
            chunk = ids[lo:lo + batch_size]
            t_logits, s_logits = teacher(chunk).logits, student(chunk).logits
            kl_sum += float(kl_to_teacher(t_logits, s_logits)) * chunk.numel()
            nll = nn.functional.cross_entropy(s_logits[:, :-1].transpose(1, 2), chunk[:, 1:], reduction="sum")
            nll_sum += float(nll)
    return kl_sum / ids.numel(), nll_sum / (ids.shape[0] * (ids.shape[1] - 1))


def e2e_tune(teacher: nn.Module, tensors: dict[str, torch.Tensor], group_size: int,
             train_samples: list[list[int]], val_samples: list[list[int]], config: E2EConfig,
             progress: Callable[[str], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Tune the AWQ checkpoint `tensors` (module doc) against `teacher` (the float HF CausalLM it was calibrated
    from, float32, unchanged). Returns (the tensors with the best validation KL's scales / norms, a report:
    "train_kl" per step, "val" [(step, KL, NLL)], "best_step" (0: untuned), "stopped_at", "seconds",
    "cpu_seconds")."""
    if not train_samples or not val_samples:
        raise ValueError("E2E tuning needs calibration and validation samples")
    say = progress or (lambda _msg: None)
    start, cpu_start = time.perf_counter(), time.process_time()
    teacher.eval().requires_grad_(False)
    student, trainable = build_student(teacher, tensors, group_size, config.train_norms)
    student.eval()
    train, val = torch.tensor(train_samples, dtype=torch.long), torch.tensor(val_samples, dtype=torch.long)
    optimizer = torch.optim.Adam(trainable, lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    order: list[int] = []
    kl, nll = evaluate(teacher, student, val, config.batch_size)
    report = {"train_kl": [], "val": [(0, kl, nll)], "best_step": 0}
    best_kl, best_state, stale = kl, [p.detach().clone() for p in trainable], 0
    say(f"e2e step 0: validation KL {kl:.5f}, NLL {nll:.5f}")
    step = 0
    for step in range(1, config.steps + 1):
        while len(order) < config.batch_size:
            order += torch.randperm(train.shape[0], generator=generator).tolist()
        batch, order = train[order[:config.batch_size]], order[config.batch_size:]
        with torch.no_grad():
            t_logits = teacher(batch).logits
        loss = kl_to_teacher(t_logits, student(batch).logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        report["train_kl"].append(float(loss.detach()))
        if not math.isfinite(report["train_kl"][-1]):
            raise FloatingPointError(f"E2E tuning diverged at step {step} (loss {report['train_kl'][-1]}); lower the lr")
        if step % config.eval_every and step != config.steps:
            continue
        kl, nll = evaluate(teacher, student, val, config.batch_size)
        report["val"].append((step, kl, nll))
        if kl < best_kl:
            best_kl, best_state, stale, report["best_step"] = kl, [p.detach().clone() for p in trainable], 0, step
        else:
            stale += 1
        say(f"e2e step {step}: train KL {sum(report['train_kl'][-config.eval_every:]) / config.eval_every:.5f}, "
            f"validation KL {kl:.5f}, NLL {nll:.5f} ({time.perf_counter() - start:.0f}s)")
        if stale >= config.patience:
            break
    with torch.no_grad():
        for p, best in zip(trainable, best_state):
            p.copy_(best)
    report.update(stopped_at=step, seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start)
    return tuned_tensors(student, tensors, config.train_norms), report


def e2e_tune_from_dir(model_dir: str, tensors: dict[str, torch.Tensor], group_size: int,
                      train_samples: list[list[int]], val_samples: list[list[int]], config: E2EConfig,
                      progress: Callable[[str], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """`e2e_tune` with the teacher loaded from the float model's HF directory."""
    return e2e_tune(load_float_model(model_dir), tensors, group_size, train_samples, val_samples, config, progress)
