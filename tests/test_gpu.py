"""The CUDA path: device placement, dtypes, exactness against a CPU float64 reference, and
run-to-run determinism. ``pytest -m gpu`` selects this group; without a visible CUDA device every
test here is skipped (the CPU suite covers the same code on the CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradian.config import load_config  # noqa: E402
from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.grads import capture_per_example_grads, collate, load_model_for_gradients, wrap_peft_model  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible")]

ROWS = [{"prompt": "what is the capital of france", "completion": "paris"},
        {"prompt": "hello there", "completion": "hello world one two three"},
        {"prompt": "say one two three", "completion": "four five"}]


@pytest.fixture
def batch(chat_tokenizer):
    return collate(tokenize_examples(dataset_from_rows(ROWS).examples, chat_tokenizer, 64), chat_tokenizer.pad_token_id)


def _to(batch, device):
    return type(batch)(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(batch).items()})


def test_auto_device_and_dtype_put_the_model_on_cuda_in_bfloat16(tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    gm = load_model_for_gradients(str(base), str(adapter), load_config())
    weights = {p.device.type for p in gm.model.parameters()}
    assert weights == {"cuda"}
    base_dtypes = {p.dtype for n, p in gm.model.named_parameters() if "lora_" not in n}
    assert base_dtypes == ({torch.bfloat16} if torch.cuda.is_bf16_supported() else {torch.float32})


def test_cuda_capture_matches_the_cpu_float64_gradients_of_the_same_weights(batch):
    """float32 on CUDA (TF32 off) against float64 on the CPU: within float32 roundoff."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = capture_per_example_grads(wrap_peft_model(build_tiny_lora("llama").cuda()), _to(batch, "cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    ref = capture_per_example_grads(wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64)), batch)
    for name in ref:
        g, r = got[name].double().cpu(), ref[name]
        assert got[name].device.type == "cuda" and got[name].dtype == torch.float32
        assert ((g - r).norm(dim=1) / r.norm(dim=1)).max() < 1e-4, name


def test_two_cuda_captures_are_bit_identical(batch):
    gm = wrap_peft_model(build_tiny_lora("llama").to("cuda", torch.bfloat16))
    cuda_batch = _to(batch, "cuda")
    first = capture_per_example_grads(gm, cuda_batch)
    second = capture_per_example_grads(gm, cuda_batch)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(v.dtype == torch.float32 for v in first.values())  # float32 math on a bfloat16 model


def test_an_index_built_on_cuda_scores_like_the_cpu_one(tmp_path, tiny_lora_dirs, chat_tokenizer):
    import numpy as np

    from gradian.config import EngineConfig
    from gradian.engines import score
    from gradian.index import GradientIndex

    base, adapter = tiny_lora_dirs
    dataset = dataset_from_rows(ROWS * 4)
    indexes = {}
    for device in ("cuda", "cpu"):
        cfg = load_config(overrides={"device": device, "dtype": "float32", "cache_dir": str(tmp_path / device),
                                     "grads.chunk_size": 4})
        gm = load_model_for_gradients(str(base), str(adapter), cfg)
        indexes[device] = GradientIndex.build(gm, chat_tokenizer, dataset, cfg)
    query = {name: indexes["cpu"].block(name)[0] for name in indexes["cpu"].block_names}
    engine = EngineConfig(name="datainf")
    on_cuda = score(indexes["cuda"], query, engine).scores
    on_cpu = score(indexes["cpu"], query, engine).scores
    np.testing.assert_allclose(on_cuda, on_cpu, rtol=1e-3, atol=1e-6 * float(np.abs(on_cpu).max()))


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantized_base_lands_on_cuda_and_its_hooks_equal_the_loop(tmp_path_factory, chat_tokenizer, batch,
                                                                     quantization):
    """``quantization`` on CUDA: bitsandbytes places the packed base on the device while loading
    (no later move), the adapter follows it, and the hooks still equal the one-row loop."""
    pytest.importorskip("bitsandbytes")
    from tests.plugins.tiny_lora import save_tiny_lora

    base, adapter = save_tiny_lora(tmp_path_factory.mktemp("quantized-gpu"), tokenizer=chat_tokenizer,
                                   hidden_size=128, intermediate_size=256)
    cfg = load_config(overrides={"device": "cuda", "dtype": "float32", "quantization": quantization})
    gm = load_model_for_gradients(str(base), str(adapter), cfg)
    assert {p.device.type for p in gm.model.parameters()} == {"cuda"}
    cuda_batch = _to(batch, "cuda")
    hooks = capture_per_example_grads(gm, cuda_batch, "hooks")
    loop = capture_per_example_grads(gm, cuda_batch, "loop")
    for name, ref in loop.items():
        assert ((hooks[name] - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1e-3, name
