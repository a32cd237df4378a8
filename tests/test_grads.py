"""Per-example gradients: the three strategies agree in float64, the loss is right, blocks are found."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradian.config import GradianConfig, load_config  # noqa: E402
from gradian.data import IGNORE_INDEX, dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.errors import ModelLoadError  # noqa: E402
from gradian.grads import (  # noqa: E402
    BlockProjector,
    capture_per_example_grads,
    collate,
    load_model_for_gradients,
    per_example_loss,
    wrap_peft_model,
)
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

ROWS = [
    {"prompt": "what is the capital of france ?", "completion": "paris"},
    {"prompt": "hello", "completion": "hello world you are a helpful assistant"},
    {"prompt": "say one two three", "completion": "four five"},
    {"messages": [{"role": "system", "content": "you are a helpful assistant"},
                  {"role": "user", "content": "translate to spanish hello"},
                  {"role": "assistant", "content": "hola"}]},
]


@pytest.fixture
def batch(chat_tokenizer):
    tokenized = tokenize_examples(dataset_from_rows(ROWS).examples, chat_tokenizer, 64)
    return collate(tokenized, chat_tokenizer.pad_token_id)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_hooks_loop_vmap_agree_in_float64(arch, reduction, batch):
    gm = wrap_peft_model(build_tiny_lora(arch, dtype=torch.float64))
    assert len(gm.blocks) == 14  # 2 layers x 7 sites
    got = {s: capture_per_example_grads(gm, batch, s, reduction) for s in ("hooks", "loop", "vmap")}
    for block in gm.blocks:
        ref = got["loop"][block.name]
        assert ref.shape == (len(batch), block.dim)
        for row in range(len(batch)):
            assert ref[row].norm() > 0
            for strategy in ("hooks", "vmap"):
                assert _rel(got[strategy][block.name][row], ref[row]) < 1e-10, (strategy, block.name, row)


def test_hooks_equal_autograd_of_each_row_on_the_weights(batch):
    """The hooked gradient of a row is the .grad a plain backward of that row's loss leaves."""
    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))
    hooks = capture_per_example_grads(gm, batch, "hooks")
    block = gm.blocks[3]
    for row in range(len(batch)):
        gm.model.zero_grad()
        one = batch.row(row)
        logits = gm.model(input_ids=one.input_ids, attention_mask=one.attention_mask).logits
        per_example_loss(logits, one.labels).sum().backward()
        manual = torch.cat([lin.weight.grad.flatten() for lin in block.linears])
        assert _rel(hooks[block.name][row], manual) < 1e-10
    gm.model.zero_grad()


def test_padding_does_not_change_a_rows_gradient(batch):
    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))
    together = capture_per_example_grads(gm, batch, "hooks")
    alone = capture_per_example_grads(gm, batch.row(0), "hooks")
    for name in together:
        assert _rel(together[name][0], alone[name][0]) < 1e-12


def test_per_example_loss_matches_cross_entropy_over_supervised_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float16)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [1, 2, 3, 4, 5]])
    mean = per_example_loss(logits, labels, "mean")
    summed = per_example_loss(logits, labels, "sum")
    assert mean.dtype == torch.float32  # upcast happened, after the gather
    ref = torch.nn.functional.cross_entropy(logits[1, :-1].float(), labels[1, 1:], reduction="none")
    assert torch.allclose(summed[1], ref.sum())
    assert torch.allclose(mean[1], ref.mean())
    ref0 = torch.nn.functional.cross_entropy(logits[0, 1:3].float(), labels[0, 2:4], reduction="none")
    assert torch.allclose(mean[0], ref0.mean())
    # a row without supervised tokens costs 0, not NaN
    empty = per_example_loss(logits, torch.full_like(labels, IGNORE_INDEX))
    assert torch.equal(empty, torch.zeros(2))


def test_only_selected_lora_weights_are_trainable():
    gm = wrap_peft_model(build_tiny_lora("llama"))
    trainable = {id(p) for p in gm.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for b in gm.blocks for p in b.parameters}
    assert not gm.model.training


def test_module_filter_and_matrix_granularity():
    config = load_config(overrides={"grads.module_filter": r"layers\.1\.mlp\.down_proj",
                                    "grads.block_granularity": "matrix"})
    gm = wrap_peft_model(build_tiny_lora("llama"), config)
    assert gm.block_names == ["model.layers.1.mlp.down_proj.lora_A", "model.layers.1.mlp.down_proj.lora_B"]
    assert gm.blocks[0].shapes == [(4, 64)] and gm.blocks[1].shapes == [(32, 4)]


def test_no_blocks_is_a_clear_error():
    config = load_config(overrides={"grads.module_filter": "no_such_module"})
    with pytest.raises(ModelLoadError, match="no LoRA blocks found.*no_such_module.*module_filter"):
        wrap_peft_model(build_tiny_lora("llama"), config)


def test_load_from_disk_gives_the_same_gradients(tiny_lora_dirs, batch):
    base, adapter = tiny_lora_dirs
    config = load_config(overrides={"dtype": "float64", "device": "cpu", "attn_implementation": "sdpa"})
    gm = load_model_for_gradients(str(base), str(adapter), config)
    assert len(gm.blocks) == 14 and gm.fingerprints["base"] and gm.fingerprints["adapter"]
    ref = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))
    a = capture_per_example_grads(gm, batch)
    b = capture_per_example_grads(ref, batch)
    for name in a:
        assert _rel(a[name], b[name]) < 1e-12


def test_adapter_dir_without_adapter_config(tmp_path, tiny_lora_dirs):
    base, _ = tiny_lora_dirs
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        load_model_for_gradients(str(base), str(tmp_path), GradianConfig())


def test_adapter_for_another_base_is_refused(tmp_path, tiny_lora_dirs):
    from tests.plugins.tiny_lora import build_tiny_base

    _, adapter = tiny_lora_dirs
    other = tmp_path / "other_base"
    build_tiny_base("llama", hidden_size=48, intermediate_size=96).save_pretrained(str(other))
    with pytest.raises(ModelLoadError, match="another base"):
        load_model_for_gradients(str(other), str(adapter), GradianConfig())


@pytest.mark.parametrize("kind", ["countsketch", "rademacher"])
def test_projection_preserves_inner_products_in_expectation(kind):
    torch.manual_seed(0)
    x = torch.randn(2, 4000, dtype=torch.float64)
    exact = (x[0] @ x[1]).item()
    estimates = []
    for seed in range(200):
        y = BlockProjector(kind, 256, seed).project("block", x)
        assert y.shape == (2, 256)
        estimates.append((y[0] @ y[1]).item())
    mean = sum(estimates) / len(estimates)
    spread = (sum((e - mean) ** 2 for e in estimates) / len(estimates)) ** 0.5
    assert abs(mean - exact) < 4 * spread / len(estimates) ** 0.5
    # deterministic per (seed, block name); narrow blocks pass through untouched
    p = BlockProjector(kind, 256, 7)
    assert torch.equal(p.project("a", x), BlockProjector(kind, 256, 7).project("a", x))
    assert not torch.equal(p.project("a", x), p.project("b", x))
    assert p.project("small", x[:, :100]) is not None and p.out_dim(100) == 100


def _reference_loss(logits, labels, reduction):
    """The loss as one ``F.cross_entropy`` over the gathered supervised rows (no chunks)."""
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    picked = logits[:, :-1][keep]
    upcast = torch.promote_types(picked.dtype, torch.float32)
    token = torch.nn.functional.cross_entropy(picked.to(upcast), shifted[keep], reduction="none")
    out = torch.zeros(labels.shape[0], dtype=upcast).index_add(0, keep.nonzero(as_tuple=True)[0], token)
    return out / keep.sum(dim=1).clamp(min=1).to(upcast) if reduction == "mean" else out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_is_the_same_number_in_float64(reduction):
    """Chunks of positions change no number: the same bits whatever the chunk, and the one-shot
    cross-entropy's value and gradient to 1e-12."""
    torch.manual_seed(0)
    logits = torch.randn(3, 11, 37, dtype=torch.float64) * 4
    labels = torch.randint(0, 37, (3, 11))
    labels[0, :5] = IGNORE_INDEX
    labels[2, 7:] = IGNORE_INDEX
    weights = torch.randn(3, dtype=torch.float64)
    ref_in = logits.clone().requires_grad_()
    ref = _reference_loss(ref_in, labels, reduction)
    (ref * weights).sum().backward()
    seen = []
    for chunk in (1, 3, 7, None):
        x = logits.clone().requires_grad_()
        loss = per_example_loss(x, labels, reduction, chunk_positions=chunk)
        (loss * weights).sum().backward()
        assert loss.dtype == torch.float64
        assert torch.allclose(loss, ref, rtol=1e-12, atol=0)
        assert torch.allclose(x.grad, ref_in.grad, rtol=1e-12, atol=1e-15)
        assert x.grad[:, -1].abs().max() == 0  # the last position predicts nothing
        seen.append((loss.detach(), x.grad))
    for loss, grad in seen[1:]:
        assert torch.equal(loss, seen[0][0]) and torch.equal(grad, seen[0][1])


def test_chunked_loss_upcasts_half_precision_logits_and_keeps_their_dtype_in_the_gradient():
    torch.manual_seed(1)
    logits = (torch.randn(2, 6, 50) * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 50, (2, 6))
    loss = per_example_loss(logits, labels, "sum", chunk_positions=4)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    ref = _reference_loss(logits.detach().float(), labels, "sum")
    assert torch.allclose(loss, ref, rtol=1e-6)


def test_bfloat16_model_gives_float32_gradients_close_to_a_float64_reference(batch):
    """A bfloat16 model's per-example gradients come out float32, computed in float32 from the
    model's own tensors, and agree with the float64 gradients of the same (rounded) weights.

    Tolerance: bfloat16 keeps 8 significant bits, a unit roundoff u = 2^-8 ~ 0.4%. Each
    activation and output gradient of this 2-layer model passes through a few dozen roundings
    (norms, projections, attention, MLP, forward and back); accumulated as a random walk that is
    ~sqrt(50) u ~ 3% of a row's gradient. The bound is 16 u = 6.25% on the whole row, and a
    cosine of 0.998; a float16 model (u = 2^-11) gets 8x less.
    """
    from gradian.grads import linear_inputs_and_output_grads

    for dtype, bound in ((torch.bfloat16, 16 * 2.0**-8), (torch.float16, 16 * 2.0**-11)):
        gm = wrap_peft_model(build_tiny_lora("llama").to(dtype))
        got = capture_per_example_grads(gm, batch, "hooks")
        ref = capture_per_example_grads(wrap_peft_model(build_tiny_lora("llama").to(dtype).to(torch.float64)), batch)
        assert all(g.dtype == torch.float32 for g in got.values())
        g_all = torch.cat([got[k] for k in ref], dim=1).double()
        r_all = torch.cat([ref[k] for k in ref], dim=1)
        rel = (g_all - r_all).norm(dim=1) / r_all.norm(dim=1)
        assert rel.max() < bound, (dtype, rel)
        assert torch.nn.functional.cosine_similarity(g_all, r_all).min() > 0.998
        # the product itself is float32 math on the model's half-precision x and g: equal to the
        # float64 product of the same tensors to float32 precision
        linears, io = linear_inputs_and_output_grads(gm, batch)
        block = gm.blocks[5]
        exact = torch.cat([sum(torch.einsum("bto,bti->boi", g.double(), x.double()) for x, g in io[id(lin)]).flatten(1)
                           for lin in block.linears], dim=1)
        assert _rel(got[block.name].double(), exact) < 1e-5


def _half_base_float32_adapter():
    """What ``PeftModel.from_pretrained`` gives on a bfloat16 base: the adapter kept in float32."""
    model = build_tiny_lora("llama")
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    return model


def test_bfloat16_base_with_a_float32_adapter(batch):
    """The mixed case PEFT loads by default: gradients in float32, within the bfloat16 bound of
    the float64 gradients of the same weights; the LoRA weights stay trainable and gain no .grad."""
    gm = wrap_peft_model(_half_base_float32_adapter())
    assert gm.dtype == torch.float32
    got = capture_per_example_grads(gm, batch, "hooks")
    ref = capture_per_example_grads(wrap_peft_model(_half_base_float32_adapter().to(torch.float64)), batch)
    g_all = torch.cat([got[k] for k in ref], dim=1).double()
    r_all = torch.cat([ref[k] for k in ref], dim=1)
    assert ((g_all - r_all).norm(dim=1) / r_all.norm(dim=1)).max() < 16 * 2.0**-8
    assert all(p.requires_grad and p.grad is None for b in gm.blocks for p in b.parameters)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_set_up_for_gradient_checkpointing_gives_the_same_gradients(batch, reentrant):
    """Gradient checkpointing (as a Trainer sets it up, with inputs made differentiable so the
    checkpointed layers have something to recompute) leaves the captured gradients as they are:
    the capture runs in eval mode, and starts its backward from the inputs already differentiable."""
    reference = capture_per_example_grads(wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64)), batch)
    model = build_tiny_lora("llama", dtype=torch.float64)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model.train()
    gm = wrap_peft_model(model)
    assert model.base_model.model.is_gradient_checkpointing and not model.training
    got = capture_per_example_grads(gm, batch)
    assert set(got) == set(reference)
    for name in reference:
        assert float(reference[name].abs().max()) > 0
        assert torch.equal(got[name], reference[name]), name
