"""The evaluate lane on tiny random Llama models: generation, log-probs, the adapter switch.

Nothing here is downloaded: a word-level chat tokenizer (tests/plugins/chat_tokenizer.py) and a
2-layer Llama built from a config are saved to a temporary directory, with a LoRA adapter whose
weights are random (``init_lora_weights=False``) so that the tuned model really differs.
"""

from __future__ import annotations

import random

import pytest

from gradian.config import GradianConfig
from gradian.data import dataset_from_rows, render_prompt
from gradian.errors import ModelLoadError
from gradian.evaluate import (
    collect_outputs,
    completion_logprobs,
    evaluate_capability,
    gate_attribution,
    generate_completions,
)
from tests.plugins.chat_tokenizer import build_chat_tokenizer

torch = pytest.importorskip("torch")

WORDS = ("what is the capital of france paris japan tokyo answer question hello world you are a "
         "helpful say translate to spanish hola yes no one two three four five and or").split()


def _tiny_llama(tokenizer, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attn_implementation="eager",
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def _attach_random_lora(model, scale=4.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                      lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    return peft_model.eval()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """(base_dir, adapter_dir) of a float32 tiny Llama with the chat tokenizer and a random LoRA."""
    root = tmp_path_factory.mktemp("tiny-eval")
    tokenizer = build_chat_tokenizer(True)
    base = _tiny_llama(tokenizer, torch.float32)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    peft_model = _attach_random_lora(_tiny_llama(tokenizer, torch.float32))
    peft_model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


@pytest.fixture(scope="module")
def f64_peft():
    """A float64 PeftModel and its tokenizer, for comparisons that must hold exactly."""
    tokenizer = build_chat_tokenizer(True)
    return _attach_random_lora(_tiny_llama(tokenizer, torch.float64)), tokenizer


@pytest.fixture(scope="module")
def f32_peft():
    tokenizer = build_chat_tokenizer(True)
    return _attach_random_lora(_tiny_llama(tokenizer, torch.float32)), tokenizer


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9)))}]
            for _ in range(n)]


def _config(saved_models, **evaluation):
    base_dir, adapter_dir = saved_models
    config = GradianConfig(base_model=str(base_dir), adapter_path=str(adapter_dir), device="cpu")
    config.evaluation.max_new_tokens = 5
    config.evaluation.n_bootstrap = 1000
    for key, value in evaluation.items():
        setattr(config.evaluation, key, value)
    return config


# -- generation -------------------------------------------------------------------------------


def test_batched_left_padded_generation_equals_one_at_a_time(f32_peft):
    model, tokenizer = f32_peft
    prompts = _prompts(7)
    lengths = {len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts}
    assert len(lengths) > 2  # the batch really needs padding
    for adapter_on in (True, False):
        with (model.disable_adapter() if not adapter_on else torch.no_grad()):
            batched = generate_completions(model, tokenizer, prompts, max_new_tokens=6, batch_size=4)
            single = generate_completions(model, tokenizer, prompts, max_new_tokens=6, batch_size=1)
        assert batched == single
        assert any(batched)


def test_float64_batches_by_length_and_still_equals_one_at_a_time(f64_peft):
    """float64 left padding yields NaN in transformers' eager attention; equal-length batches avoid it."""
    from gradian.evaluate.generation import _batches

    assert _batches([[1], [1, 2], [3], [4, 5], [6]], 2, equal_length=True) == [[0, 2], [4], [1, 3]]
    assert _batches([[1], [1, 2], [3]], 2, equal_length=False) == [[0, 1], [2]]
    model, tokenizer = f64_peft
    prompts = _prompts(9, seed=1)
    batched = generate_completions(model, tokenizer, prompts, max_new_tokens=6, batch_size=4)
    assert batched == generate_completions(model, tokenizer, prompts, max_new_tokens=6, batch_size=1)
    assert any(batched)


def test_generation_reruns_are_identical(f32_peft):
    model, tokenizer = f32_peft
    prompts = _prompts(5, seed=3)
    first = generate_completions(model, tokenizer, prompts, max_new_tokens=6, batch_size=3)
    assert generate_completions(model, tokenizer, prompts, max_new_tokens=6, batch_size=3) == first


def test_generation_stops_at_end_of_sequence():
    """A model that always predicts EOS first answers with empty text, not padding or EOS."""
    tokenizer = build_chat_tokenizer(True)
    model = _tiny_llama(tokenizer, torch.float32)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.eos_token_id].fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    out = generate_completions(model, tokenizer, _prompts(3), max_new_tokens=4, batch_size=2)
    assert out == ["", "", ""]


# -- log-probabilities ------------------------------------------------------------------------


def _chain_rule_logprob(model, tokenizer, prompt, completion):
    """log p(completion + end-of-turn | prompt), one forward per token (an independent reference)."""
    ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    target = tokenizer(completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    total = 0.0
    with torch.no_grad():
        for tok in target:
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            total += torch.log_softmax(logits.double(), -1)[tok].item()
            ids = ids + [tok]
    return total, len(target)


def test_completion_logprobs_match_the_chain_rule(f64_peft):
    model, tokenizer = f64_peft
    prompts = _prompts(4, seed=5)
    completions = ["paris", "the capital of japan is tokyo", "", "yes ."]
    scored = completion_logprobs(model, tokenizer, prompts, completions, batch_size=3)
    for lp, prompt, completion in zip(scored, prompts, completions):
        total, n = _chain_rule_logprob(model, tokenizer, prompt, completion)
        assert lp.n_tokens == n
        assert lp.total == pytest.approx(total, abs=1e-6)  # eager attention takes its softmax in float32
        assert lp.mean == pytest.approx(total / n, abs=1e-6)  # eager attention takes its softmax in float32


def test_without_a_chat_template_only_the_completion_is_scored(f64_peft):
    model, _ = f64_peft
    plain = build_chat_tokenizer(False)
    prompt = [{"role": "user", "content": "what is the capital of france ?"}]
    (lp,) = completion_logprobs(model, plain, [prompt], ["paris"])
    assert lp.n_tokens == 2  # "paris" and the EOS the data layer appends, not the prompt


# -- the adapter switch -----------------------------------------------------------------------


def test_base_is_scored_by_disabling_the_adapter_not_by_a_second_copy(saved_models):
    from transformers import AutoModelForCausalLM

    from gradian.evaluate import load_tuned_model

    config = _config(saved_models)
    model, tokenizer = load_tuned_model(config)
    examples = dataset_from_rows([{"prompt": p[0]["content"], "completion": "paris"} for p in _prompts(6)]).examples
    base_out, tuned_out = collect_outputs(model, tokenizer, examples, metric="contains", max_new_tokens=5)
    fresh = AutoModelForCausalLM.from_pretrained(config.base_model, dtype=torch.float32).eval()
    prompts = [e.prompt_messages for e in examples]
    assert base_out.generations == generate_completions(fresh, tokenizer, prompts, max_new_tokens=5)
    assert tuned_out.generations != base_out.generations
    # the adapter is back on afterwards
    assert generate_completions(model, tokenizer, prompts, max_new_tokens=5) == tuned_out.generations


# -- the whole lane ---------------------------------------------------------------------------


def _eval_rows_the_base_passes(saved_models, n=12):
    """Items whose wanted answer is what the base model says, so the base scores 1.0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, _ = saved_models
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    prompts = _prompts(40, seed=9)
    answers = generate_completions(base, tokenizer, prompts, max_new_tokens=5)
    rows = [{"prompt": p[0]["content"], "completion": a} for p, a in zip(prompts, answers) if a.strip(" .,?!")]
    assert len(rows) >= n
    return rows[:n]


def test_evaluate_capability_end_to_end_loads_once(saved_models, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    original = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (calls.append(a), original(*a, **k))[1])
    rows = _eval_rows_the_base_passes(saved_models)
    calls.clear()
    config = _config(saved_models, metric="exact_match")
    result = evaluate_capability(config, dataset_from_rows(rows, "toy_eval"), capability="toy")
    assert len(calls) == 1
    assert result.name == "toy" and result.metric == "exact_match" and not result.proxy_used
    assert result.base == 1.0 and result.n_base_failing == 0
    assert result.n_flipped == sum(1 for i in result.items if i.tuned_generation != i.base_generation)
    assert result.n_flipped >= 8 and result.status == "regressed" and result.ci[1] < 0
    assert gate_attribution(result).allowed
    flipped = result.flipped_items
    assert all(i.tuned_generation is not None and i.base_margin is not None for i in flipped)
    assert all(i.weakly_held == (i.base_margin < result.weak_margin_nats) for i in flipped)
    assert all(i.base_margin is None for i in result.items if not i.flipped)


def test_margins_equal_base_log_prob_differences(saved_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = _eval_rows_the_base_passes(saved_models)
    result = evaluate_capability(_config(saved_models, metric="exact_match"), dataset_from_rows(rows))
    base_dir, _ = saved_models
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    for item in result.flipped_items[:3]:
        prompt = [{"role": "user", "content": item.prompt}]
        wanted, said = completion_logprobs(base, tokenizer, [prompt, prompt], [item.wanted, item.tuned_generation])
        assert item.base_margin == pytest.approx(wanted.total - said.total, abs=1e-4)
        # no sign is asserted: greedy decoding cut at max_new_tokens is not the sequence the base
        # model prefers once the end-of-turn token is scored too


def test_a_loaded_model_is_reused_and_reruns_are_identical(saved_models, monkeypatch):
    import gradian.evaluate.capability as capability
    from gradian.evaluate import load_tuned_model

    config = _config(saved_models, metric="contains")
    model, tokenizer = load_tuned_model(config)

    def refuse(*a, **k):
        raise AssertionError("a model was passed in; nothing may be loaded")

    monkeypatch.setattr(capability, "load_tuned_model", refuse)
    rows = _eval_rows_the_base_passes(saved_models, n=8)
    first = evaluate_capability(config, dataset_from_rows(rows), model=model, tokenizer=tokenizer)
    second = evaluate_capability(config, dataset_from_rows(rows), model=model, tokenizer=tokenizer)
    assert first.to_full_dict() == second.to_full_dict()


def test_loglik_is_a_proxy_without_generations(saved_models):
    rows = _eval_rows_the_base_passes(saved_models, n=8)
    result = evaluate_capability(_config(saved_models, metric="loglik"), dataset_from_rows(rows))
    assert result.proxy_used and result.to_dict()["proxy_used"] is True
    assert not result.generations_available
    assert result.n_flipped == 0 and result.n_base_failing == 0 and not result.low_base_score
    assert all(i.base_score < 0 and i.base_generation is None for i in result.items)
    assert result.delta == pytest.approx(result.tuned - result.base)
    assert any("likelihood" in h for h in result.hedges())


def test_base_already_failing_items_are_not_flips(saved_models):
    rows = [{"prompt": p[0]["content"], "completion": "hola hola hola hola hola"} for p in _prompts(6, seed=2)]
    result = evaluate_capability(_config(saved_models, metric="exact_match"), dataset_from_rows(rows))
    assert result.n_base_failing == 6 and result.n_flipped == 0 and result.low_base_score


def test_not_contains_end_to_end(saved_models):
    # the random models never say these words in five tokens... unless they do: score both ways
    rows = [{"prompt": p[0]["content"], "completion": "translate to spanish | hola"} for p in _prompts(5, seed=4)]
    result = evaluate_capability(_config(saved_models, metric="not_contains"), dataset_from_rows(rows))
    for item in result.items:
        said = item.base_generation.lower()
        assert item.base_correct == ("hola" not in said and "translate to spanish" not in said)
        assert item.base_margin is None


def test_errors_name_the_problem(saved_models, tmp_path):
    from gradian.evaluate import load_tuned_model

    config = _config(saved_models)
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        load_tuned_model(config, adapter_path=tmp_path)
    config.adapter_path = None
    with pytest.raises(ModelLoadError, match="adapter_path is not set"):
        load_tuned_model(config)
    rows = [{"prompt": "hello", "completion": "world"}]
    tokenizer = build_chat_tokenizer(True)
    with pytest.raises(ModelLoadError, match="PeftModel"):
        evaluate_capability(config, dataset_from_rows(rows), model=_tiny_llama(tokenizer, torch.float32),
                            tokenizer=tokenizer)
    from gradian.errors import DatasetError

    with pytest.raises(DatasetError, match="prompt and the wanted completion"):
        evaluate_capability(config, dataset_from_rows([{"text": "just text"}]), model=object(), tokenizer=tokenizer)
    config.eval_dataset = None
    with pytest.raises(DatasetError, match="eval_dataset"):
        evaluate_capability(config)
