"""layers/moe.py: `select_experts` against transformers' routers (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), the
routing checks, and `FusedMoE` loading / forward against the pure-torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from pagellm.layers.moe import FusedMoE, check_routing, moe_activation_for, select_experts
from pagellm.ops.moe_reference import fused_moe as fused_moe_reference
from pagellm.quantization.int8 import Int8Config

T, H = 64, 32


def _router(router_cls, config, seed: int):
    torch.manual_seed(seed)
    router = router_cls(config).eval()
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0.0, 0.3)
    return router


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id, so routers that return top-k unsorted compare exactly."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _assert_same_routing(hf_router, ours: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(x)
    weights, ids = ours
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    hw, hi = _by_expert(hf_weights.float(), hf_ids)
    ow, oi = _by_expert(weights, ids)
    assert torch.equal(oi, hi)
    assert torch.equal(ow, hw)  # same fp32 ops in the same order: bit-identical


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (6, 1), (4, 4)])
def test_mixtral_router(num_experts, top_k):
    config = tf.MixtralConfig(hidden_size=H, num_local_experts=num_experts, num_experts_per_tok=top_k)
    router = _router(tf.models.mixtral.modeling_mixtral.MixtralTopKRouter, config, seed=num_experts)
    x = torch.randn(T, H)
    logits = F.linear(x, router.weight)
    _assert_same_routing(router, select_experts(logits, top_k, renormalize=True), x)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_router(family, norm_topk_prob):
    if family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
        router_cls = tf.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter
    else:
        config = tf.Qwen3MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
        router_cls = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter
    router = _router(router_cls, config, seed=int(norm_topk_prob))
    x = torch.randn(T, H)
    logits = F.linear(x, router.weight)
    _assert_same_routing(router, select_experts(logits, 4, renormalize=norm_topk_prob), x)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router(topk_method):
    config = tf.DeepseekV2Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                 topk_method=topk_method, routed_scaling_factor=2.5)
    router = _router(tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter, config, seed=7)
    x = torch.randn(T, H)
    logits = F.linear(x.float(), router.weight.float())
    groups = dict(num_expert_group=4, topk_group=2, group_scoring="max") if topk_method != "greedy" else {}
    ours = select_experts(logits, 4, renormalize=False, routed_scaling_factor=2.5, **groups)
    _assert_same_routing(router, ours, x)
    if groups:  # the group limit changes the choice for some tokens (else this test would not test it)
        assert not torch.equal(_by_expert(*ours)[1], _by_expert(*select_experts(logits, 4, renormalize=False))[1])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_router(norm_topk_prob):
    config = tf.DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                 norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    router = _router(tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter, config, seed=11)
    x = torch.randn(T, H)
    logits = F.linear(x.float(), router.weight.float())
    bias = router.e_score_correction_bias
    ours = select_experts(logits, 4, scoring="sigmoid", renormalize=norm_topk_prob, num_expert_group=4, topk_group=2,
                          group_scoring="top2_sum", correction_bias=bias, routed_scaling_factor=2.5)
    _assert_same_routing(router, ours, x)
    # the bias chooses experts but never weights them: weights are the unbiased sigmoid scores
    unbiased = torch.sigmoid(logits).gather(1, ours[1].long()) * 2.5
    if not norm_topk_prob:
        assert torch.equal(ours[0], unbiased)


def test_check_routing_errors():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 .*num_local_experts=4"):
        check_routing(4, 5, num_experts_field="num_local_experts")
    with pytest.raises(ValueError, match="scoring.*'relu'.*softmax, sigmoid"):
        check_routing(4, 2, scoring="relu")
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        check_routing(16, 2, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="topk_group=5"):
        check_routing(16, 2, num_expert_group=4, topk_group=5)
    with pytest.raises(ValueError, match="needs both n_group and topk_group"):
        check_routing(16, 2, num_expert_group=4)
    with pytest.raises(ValueError, match="exceeds the 4 experts"):
        check_routing(16, 6, num_expert_group=4, topk_group=1)
    with pytest.raises(ValueError, match="group scoring 'mean'"):
        check_routing(16, 2, group_scoring="mean")
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        moe_activation_for("relu")
    check_routing(16, 4, scoring="sigmoid", num_expert_group=4, topk_group=2, group_scoring="top2_sum")


# ---- FusedMoE ------------------------------------------------------------------------------------
def _random_experts(E: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(E, inter, H, generator=g), torch.randn(E, inter, H, generator=g)
    down = torch.randn(E, H, inter, generator=g)
    return gate, up, down


def test_fused_moe_loads_per_expert_and_stacked():
    E, inter = 4, 24
    gate, up, down = _random_experts(E, inter)
    per_expert = FusedMoE(E, H, inter, dtype=torch.float32)
    for e in range(E):
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, up[e], e, "up")
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, gate[e], e, "gate")
        per_expert.w2_weight.weight_loader(per_expert.w2_weight, down[e], e, "down")
    stacked = FusedMoE(E, H, inter, dtype=torch.float32)
    stacked.w13_weight.weight_loader(stacked.w13_weight, torch.cat([gate, up], dim=1))
    stacked.w2_weight.weight_loader(stacked.w2_weight, down)
    assert torch.equal(per_expert.w13_weight, stacked.w13_weight) and torch.equal(per_expert.w2_weight, down)
    assert torch.equal(per_expert.w13_weight[:, :inter], gate)


def test_fused_moe_loader_errors():
    moe = FusedMoE(4, H, 24, dtype=torch.float32)
    w13, w2 = moe.w13_weight, moe.w2_weight
    with pytest.raises(ValueError, match=r"shard 'down' does not load into this parameter; allowed: \['gate', 'up'\]"):
        w13.weight_loader(w13, torch.zeros(H, 24), 0, "down")
    with pytest.raises(ValueError, match="expert id 4 out of range"):
        w2.weight_loader(w2, torch.zeros(H, 24), 4, "down")
    with pytest.raises(ValueError, match=r"expected \(24, 32\), got \(32, 24\)"):
        w13.weight_loader(w13, torch.zeros(H, 24), 1, "gate")
    with pytest.raises(ValueError, match="activation 'relu'"):
        FusedMoE(4, H, 24, activation="relu")


def test_fused_moe_refuses_quantized_experts():
    match = r"model.layers.0.mlp.experts: quantized MoE experts .*'int8'.*Int8LinearMethod"
    with pytest.raises(ValueError, match=match):
        FusedMoE(4, H, 24, quant_config=Int8Config.from_config({}), prefix="model.layers.0.mlp.experts")


@pytest.mark.parametrize("dtype,activation", [(torch.float32, "silu"), (torch.float32, "gelu_tanh"),
                                              (torch.bfloat16, "silu")])
def test_fused_moe_forward_matches_reference(dtype, activation):
    E, inter, k = 6, 24, 2
    gate, up, down = _random_experts(E, inter, seed=3)
    moe = FusedMoE(E, H, inter, activation=activation, dtype=dtype)
    moe.w13_weight.weight_loader(moe.w13_weight, torch.cat([gate, up], dim=1) * 0.1)
    moe.w2_weight.weight_loader(moe.w2_weight, down * 0.1)
    x = torch.randn(37, H).to(dtype)
    weights, ids = select_experts(torch.randn(37, E), k, renormalize=True)
    with torch.no_grad():
        out = moe(x, weights, ids)
    ref = fused_moe_reference(x, moe.w13_weight, moe.w2_weight, weights, ids, activation)
    assert out.dtype == dtype and out.shape == (37, H)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # and the reference is the per-token definition
    t, y = 5, torch.zeros(H)
    for j in range(k):
        e = int(ids[t, j])
        h = moe.w13_weight[e].float() @ x[t].float()
        act = F.silu(h[:inter]) if activation == "silu" else F.gelu(h[:inter], approximate="tanh")
        y += weights[t, j] * (moe.w2_weight[e].float() @ (act * h[inter:]))
    torch.testing.assert_close(ref[t].float(), y, atol=tol, rtol=tol)


@pytest.mark.parametrize("schema", [
    "fused_moe(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation) -> Tensor",
    "fused_moe(Tensor(a!) out, Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "str activation) -> ()",
])
def test_fused_moe_caller_takes_either_schema(schema):
    """FusedMoE calls the compiled op whichever way its schema returns the output (here: the reference behind it)."""
    from pagellm.layers.moe import fused_moe_caller

    namespace = f"pagellm_test_moe_{'out' if 'a!' in schema else 'ret'}"
    lib = torch.library.Library(namespace, "DEF")
    lib.define(schema)
    if "a!" in schema:
        def impl(out, *args):
            out.copy_(fused_moe_reference(*args))
    else:
        def impl(*args):
            return fused_moe_reference(*args)
    lib.impl("fused_moe", impl, "CPU")
    E, inter = 4, 24
    gate, up, down = _random_experts(E, inter, seed=5)
    w13, x = torch.cat([gate, up], dim=1) * 0.1, torch.randn(9, H)
    weights, ids = select_experts(torch.randn(9, E), 2, renormalize=False)
    call = fused_moe_caller(getattr(torch.ops, namespace).fused_moe.default)
    out = call(x, w13, down * 0.1, weights, ids, "silu")
    assert torch.equal(out, fused_moe_reference(x, w13, down * 0.1, weights, ids, "silu"))


def test_reference_experts_refuse_step_graph_capture():
    """The reference's op sequence depends on the routing, so recording it for replay must fail loudly
    (the step then runs eagerly) rather than replay one step's expert choice forever."""
    from pagellm.step_graph.recorder import CaptureError, StepRecorder

    moe = FusedMoE(4, H, 24, dtype=torch.float32)
    moe._compiled = None  # the pure-torch path, as without the compiled op
    with torch.no_grad():
        moe.w13_weight.normal_()
        moe.w2_weight.normal_()
    x = torch.randn(3, H)
    weights, ids = select_experts(torch.randn(3, 4), 2, renormalize=True)
    params = {id(moe.w13_weight), id(moe.w2_weight)}
    with pytest.raises(CaptureError, match="Python value"):
        with StepRecorder([x, weights, ids], lambda t: id(t) in params), torch.no_grad():
            moe(x, weights, ids)
