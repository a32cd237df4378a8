"""Exact metagradients through a replayed LoRA fine-tune (gradian.replay, docs/replay.md).

Everything runs in float64 on a tiny random Llama with LoRA on q_proj and v_proj. Its RMSNorm is
patched to stay in float64: the stock one computes in float32, whose rounding (~1e-8 of the
loss) is larger than a central difference with h = 1e-5 can tolerate.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.errors import ConfigError  # noqa: E402
from gradian.grads.loss import collate, per_example_loss  # noqa: E402
from gradian.replay import Recipe, metagradient, replay  # noqa: E402
from gradian.replay.unrolled import ReplayedModel, row_losses  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

TRAIN = [
    {"prompt": "what is the capital of france ?", "completion": "paris"},
    {"prompt": "hello", "completion": "hello world"},
    {"prompt": "say one two three", "completion": "four five"},
    {"prompt": "capital of spain ?", "completion": "madrid"},
]
QUERY = [{"prompt": "what is the capital of spain ?", "completion": "madrid"}]
BATCHES = [[0, 1], [2, 3], [1, 2], [0, 3]]
H = 1e-5
FD_RTOL = 1e-4


def _norm_in_float64(self, h):
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def setup(chat_tokenizer):
    model = build_tiny_lora("llama", dtype=torch.float64, target_modules=["q_proj", "v_proj"])
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_norm_in_float64, module)
    rows = tokenize_examples(dataset_from_rows(TRAIN).examples, chat_tokenizer, 64)
    query = collate(tokenize_examples(dataset_from_rows(QUERY).examples, chat_tokenizer, 64),
                    chat_tokenizer.pad_token_id)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    init = {n: p.detach().clone() for n, p in lora.items()}
    return types.SimpleNamespace(model=model, rows=rows, query=query, lora=lora, init=init,
                                 pad=chat_tokenizer.pad_token_id)


def _measure(s):
    def measure(m):
        logits = m(input_ids=s.query.input_ids, attention_mask=s.query.attention_mask).logits
        return per_example_loss(logits, s.query.labels).mean()
    return measure


def _ones(n=len(TRAIN)):
    return torch.ones(n, dtype=torch.float64)


def _replayed_measure(s, weights, recipe, batches=BATCHES):
    final = replay(s.model, s.lora, s.rows, batches, weights, recipe, pad_id=s.pad)
    with torch.no_grad():
        return _measure(s)(ReplayedModel(s.model, final)).item()


RECIPES = {
    "sgd": Recipe([0.05] * 4, "sgd"),
    "sgd-clipped": Recipe([0.05, 0.1, 0.05, 0.02], "sgd", weight_decay=0.01, max_grad_norm=0.1),
    "adamw-clipped": Recipe([1e-2, 2e-2, 1e-2, 5e-3], "adamw", weight_decay=0.1, max_grad_norm=0.5),
}


@pytest.mark.parametrize("case", list(RECIPES))
def test_metagradient_equals_central_differences_of_whole_replays(setup, case):
    recipe = RECIPES[case]
    got = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup), pad_id=setup.pad)
    assert got.value == pytest.approx(_replayed_measure(setup, _ones(), recipe), rel=1e-12)
    if recipe.max_grad_norm:
        unclipped = Recipe(recipe.schedule, recipe.optimizer, weight_decay=recipe.weight_decay)
        assert abs(_replayed_measure(setup, _ones(), unclipped) - got.value) > 1e-6  # the clip binds
    errors = []
    for i in range(3):
        step = torch.zeros(len(TRAIN), dtype=torch.float64)
        step[i] = H
        fd = (_replayed_measure(setup, _ones() + step, recipe) - _replayed_measure(setup, _ones() - step, recipe)) / (2 * H)
        errors.append(abs(got.grad[i].item() - fd) / abs(fd))
    print(f"{case}: FD relative errors {['%.1e' % e for e in errors]}")
    assert max(errors) < FD_RTOL, errors
    # the model's own tensors were never written
    for n, p in setup.lora.items():
        assert torch.equal(p.detach(), setup.init[n])


def _torch_run(setup, recipe, loss):
    """The LoRA tensors after a plain loop of ``torch.optim.AdamW`` and ``clip_grad_norm_`` over
    ``BATCHES``, each step's loss ``loss(logits, labels)``."""
    params = [p.detach().clone().requires_grad_(True) for p in setup.lora.values()]
    opt = torch.optim.AdamW(params, lr=1.0, betas=recipe.betas, eps=recipe.eps, weight_decay=recipe.weight_decay)
    for t, step in enumerate(BATCHES):
        for group in opt.param_groups:
            group["lr"] = recipe.schedule[t]
        batch = collate([setup.rows[r] for r in step], setup.pad)
        out = ReplayedModel(setup.model, dict(zip(setup.lora, params)))(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        opt.zero_grad()
        loss(out.logits, batch.labels).backward()
        torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm)
        opt.step()
    return params


def test_replay_with_unit_weights_is_the_torch_optimizers_run(setup):
    """All ones reproduces a plain training loop with torch.optim.AdamW and clip_grad_norm_."""
    recipe = RECIPES["adamw-clipped"]
    params = _torch_run(setup, recipe, lambda logits, labels: per_example_loss(logits, labels).mean())
    final = replay(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, pad_id=setup.pad)
    for name, p in zip(setup.lora, params):
        assert torch.allclose(final[name], p.detach(), rtol=0, atol=1e-12), name
        assert not torch.equal(final[name], setup.init[name])


def test_token_mean_replay_is_the_trainers_loss(setup):
    """``reduction="tokens"``: one mean over every supervised token of the step, as the HF Trainer
    computes a batch's loss (cross-entropy summed, divided by the batch's supervised tokens)."""
    recipe = dataclasses.replace(RECIPES["adamw-clipped"], reduction="tokens")

    def token_mean(logits, labels):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)

    params = _torch_run(setup, recipe, token_mean)
    final = replay(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, pad_id=setup.pad)
    by_rows = replay(setup.model, setup.lora, setup.rows, BATCHES, _ones(), RECIPES["adamw-clipped"], pad_id=setup.pad)
    for name, p in zip(setup.lora, params):
        assert torch.allclose(final[name], p.detach(), rtol=0, atol=1e-12), name
    assert any(not torch.allclose(final[n], by_rows[n], rtol=0, atol=1e-9) for n in final)


@pytest.mark.parametrize("case", list(RECIPES))
@pytest.mark.parametrize("every", [1, 3, 100])
def test_the_step_by_step_sweep_equals_the_whole_graph(setup, case, every):
    """Segments of 1, 3 (one of 3 and one of 1 for 4 steps) and all steps: the same metagradient
    as walking the whole unrolled graph back at once, and the same replayed run."""
    recipe = RECIPES[case]
    whole = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                         pad_id=setup.pad)
    ticks = []
    swept = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                         pad_id=setup.pad, checkpoint_every=every, progress=lambda done, total: ticks.append((done, total)))
    assert swept.value == pytest.approx(whole.value, rel=1e-13)
    assert torch.allclose(swept.grad, whole.grad, rtol=1e-10, atol=1e-14)
    for name in whole.params:
        assert torch.allclose(swept.params[name], whole.params[name], rtol=0, atol=1e-13)
    steps = len(BATCHES)
    recomputed = sum(min(every, steps - first) - 1 for first in range(0, steps, every))
    assert ticks[-1] == (2 * steps + recomputed, 2 * steps + recomputed)
    assert [d for d, _ in ticks] == list(range(1, len(ticks) + 1))


@pytest.mark.parametrize("case", list(RECIPES))
def test_retraining_without_a_row_moves_the_measurement_against_its_metagradient(setup, case):
    """The sign against a retrain without a row (its weight 0, the same order): dropping the row
    with the largest metagradient changes the query loss less than dropping the one with the
    smallest, each in the direction opposite to its metagradient. Without clipping a plain SGD run
    is nearly linear in the weights, and every row's change is its metagradient with the sign
    turned; a binding clip makes a whole row's removal nonlinear."""
    recipe = RECIPES[case]
    result = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                          pad_id=setup.pad, checkpoint_every=2)
    base = _replayed_measure(setup, _ones(), recipe)
    changes = []
    for row in range(len(TRAIN)):
        without = _ones()
        without[row] = 0.0
        changes.append(_replayed_measure(setup, without, recipe) - base)
    grad = result.grad.tolist()
    worst, best = int(np.argmax(grad)), int(np.argmin(grad))
    assert changes[worst] < changes[best]
    for row in (worst, best):
        assert np.sign(changes[row]) == -np.sign(grad[row])
    if case == "sgd":
        assert changes == pytest.approx([-g for g in grad], rel=0.15)


def test_a_horizon_sweeps_back_through_the_last_steps_only(setup):
    """horizon=H: the weights act in the last H steps; a row seen only before them gets 0, and
    horizon=every step is the whole metagradient."""
    recipe = RECIPES["adamw-clipped"]
    full = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                        pad_id=setup.pad, checkpoint_every=3, horizon=len(BATCHES))
    whole = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                         pad_id=setup.pad)
    assert torch.allclose(full.grad, whole.grad, rtol=1e-10, atol=1e-14)
    last = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                        pad_id=setup.pad, checkpoint_every=3, horizon=1)
    # the last step holds rows 0 and 3; rows 1 and 2 were trained on only before it
    assert float(last.grad[1]) == 0.0 and float(last.grad[2]) == 0.0
    assert float(last.grad[0]) != 0.0 and float(last.grad[3]) != 0.0
    assert last.value == pytest.approx(whole.value, rel=1e-13)
    with pytest.raises(ConfigError, match="horizon"):
        metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                     pad_id=setup.pad, horizon=2)
    with pytest.raises(ConfigError, match="horizon"):
        metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                     pad_id=setup.pad, checkpoint_every=2, horizon=0)


def test_a_replay_over_a_horizon_is_the_run_that_metagradient_differentiates(setup):
    """``replay(horizon=H)`` weighs rows in the last H steps only: its central differences are the
    metagradient over the same horizon (float64), a row seen only before the window does not move
    it, and all-ones weights give the whole run's value."""
    recipe = RECIPES["adamw-clipped"]
    got = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                       pad_id=setup.pad, checkpoint_every=2, horizon=2)

    def measured(weights):
        final = replay(setup.model, setup.lora, setup.rows, BATCHES, weights, recipe, pad_id=setup.pad, horizon=2)
        with torch.no_grad():
            return _measure(setup)(ReplayedModel(setup.model, final)).item()

    assert measured(_ones()) == pytest.approx(got.value, rel=1e-12)
    for i in range(len(TRAIN)):
        step = torch.zeros(len(TRAIN), dtype=torch.float64)
        step[i] = H
        fd = (measured(_ones() + step) - measured(_ones() - step)) / (2 * H)
        assert got.grad[i].item() == pytest.approx(fd, rel=FD_RTOL, abs=1e-12)
    # the last two steps hold rows 1, 2 (step 3) and 0, 3 (step 4): every row is in the window, so
    # a horizon of 1 step leaves rows 1 and 2 out of it
    dropped = _ones()
    dropped[1] = 0.0
    assert measured(dropped) != measured(_ones())
    last_only = replay(setup.model, setup.lora, setup.rows, BATCHES, dropped, recipe, pad_id=setup.pad, horizon=1)
    whole = replay(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, pad_id=setup.pad)
    assert all(torch.equal(last_only[n], whole[n]) for n in whole)
    with pytest.raises(ConfigError, match="horizon"):
        replay(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, pad_id=setup.pad, horizon=0)


def _scale_held_replay(setup, weights, recipe, held=None):
    """An AdamW run written out by hand in which each step's second moment and clipping factor
    are ``held[t]`` (recorded from this loop when ``held`` is None, then returned): the function
    whose derivative ``scaling="held"`` is. Returns ``(measurement, held)``."""
    params = [p.detach().clone() for p in setup.lora.values()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    record = []
    b1, b2 = recipe.betas
    for t, step in enumerate(BATCHES):
        lr = recipe.schedule[t]
        theta = [p.requires_grad_(True) for p in params]
        batch = collate([setup.rows[r] for r in step], setup.pad)
        logits = ReplayedModel(setup.model, dict(zip(setup.lora, theta)))(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss = (weights[list(step)] * row_losses(logits, batch.labels)).sum() / len(step)
        grads = [g.detach() for g in torch.autograd.grad(loss, theta)]
        if held is None:
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            coef = torch.clamp(recipe.max_grad_norm / (norm + 1e-6), max=1.0)
            v = [b2 * vi + (1 - b2) * (g * coef) ** 2 for vi, g in zip(v, grads)]
            record.append((coef, v))
        else:
            coef, v = held[t]
        grads = [g * coef for g in grads]
        m = [b1 * mi + (1 - b1) * g for mi, g in zip(m, grads)]
        params = [(p.detach() * (1 - lr * recipe.weight_decay)
                   - (lr / (1 - b1 ** (t + 1))) * mi / (vi.sqrt() / (1 - b2 ** (t + 1)) ** 0.5 + recipe.eps))
                  for p, mi, vi in zip(params, m, v)]
    with torch.no_grad():
        value = _measure(setup)(ReplayedModel(setup.model, dict(zip(setup.lora, params)))).item()
    return value, (held if held is not None else record)


def test_held_scaling_is_the_derivative_of_the_run_with_its_step_sizes_fixed(setup):
    """``scaling="held"`` equals central differences of a run whose AdamW second moments and
    clipping factors are the unweighted run's (1e-4 relative, float64); the replayed run is the
    same as under ``exact`` and the derivative is not; both sweeps agree; under SGD without
    clipping there is nothing to hold and the two coincide."""
    recipe = RECIPES["adamw-clipped"]
    got = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                       pad_id=setup.pad, scaling="held")
    value, held = _scale_held_replay(setup, _ones(), recipe)
    assert got.value == pytest.approx(value, rel=1e-12)
    assert any(float(coef) < 1.0 for coef, _ in held)  # the clip binds, so holding its factor is tested too
    errors = []
    for i in range(3):
        step = torch.zeros(len(TRAIN), dtype=torch.float64)
        step[i] = H
        fd = (_scale_held_replay(setup, _ones() + step, recipe, held)[0]
              - _scale_held_replay(setup, _ones() - step, recipe, held)[0]) / (2 * H)
        errors.append(abs(got.grad[i].item() - fd) / abs(fd))
    print(f"held: FD relative errors {['%.1e' % e for e in errors]}")
    assert max(errors) < FD_RTOL, errors
    exact = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                         pad_id=setup.pad)
    assert exact.value == got.value
    assert not torch.allclose(exact.grad, got.grad, rtol=1e-3, atol=0)
    swept = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                         pad_id=setup.pad, scaling="held", checkpoint_every=3)
    assert torch.allclose(swept.grad, got.grad, rtol=1e-10, atol=1e-14)
    sgd = RECIPES["sgd"]
    assert torch.allclose(metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), sgd, _measure(setup),
                                       pad_id=setup.pad, scaling="held").grad,
                          metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), sgd, _measure(setup),
                                       pad_id=setup.pad).grad, rtol=1e-12, atol=0)
    with pytest.raises(ConfigError, match="scaling"):
        metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup),
                     pad_id=setup.pad, scaling="frozen")


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_bad_checkpoint_interval_is_refused(setup, every):
    with pytest.raises(ConfigError, match="checkpoint_every"):
        metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), RECIPES["sgd"], _measure(setup),
                     pad_id=setup.pad, checkpoint_every=every)


def test_row_losses_equal_the_projects_per_example_loss(setup):
    batch = collate(setup.rows, setup.pad)
    with torch.no_grad():
        logits = setup.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.allclose(row_losses(logits, batch.labels), per_example_loss(logits, batch.labels), rtol=1e-13, atol=0)


def test_two_runs_give_bit_identical_metagradients(setup):
    recipe = RECIPES["adamw-clipped"]
    a = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup), pad_id=setup.pad)
    b = metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), recipe, _measure(setup), pad_id=setup.pad)
    assert a.value == b.value
    assert torch.equal(a.grad, b.grad)
    assert a.grad.abs().min() > 0


def test_one_sgd_step_is_minus_lr_times_query_gradient_dot_row_gradient(setup):
    """theta_1 = theta_0 - (lr / B) sum_i w_i g_i(theta_0), so dM/dw_i = -(lr / B) grad M(theta_1) . g_i(theta_0).

    A row whose up-weighting lowers the query loss has a negative metagradient: the sign of the
    influence convention (row helps the query <=> negative d query loss / d weight).
    """
    lr, step = 0.1, [0, 1, 3]
    recipe = Recipe([lr], "sgd")
    got = metagradient(setup.model, setup.lora, setup.rows, [step], _ones(), recipe, _measure(setup), pad_id=setup.pad)
    names = list(setup.lora)
    theta0 = [setup.init[n].clone().requires_grad_(True) for n in names]
    row_grads = {}
    for i in step:
        one = collate([setup.rows[i]], setup.pad)
        out = ReplayedModel(setup.model, dict(zip(names, theta0)))(input_ids=one.input_ids, attention_mask=one.attention_mask)
        row_grads[i] = torch.autograd.grad(row_losses(out.logits, one.labels).sum(), theta0)
    theta1 = [(p - (lr / len(step)) * sum(row_grads[i][k] for i in step)).detach().requires_grad_(True)
              for k, p in enumerate(theta0)]
    q_grad = torch.autograd.grad(_measure(setup)(ReplayedModel(setup.model, dict(zip(names, theta1)))), theta1)
    for i in range(len(TRAIN)):
        expect = 0.0 if i not in step else -(lr / len(step)) * sum((a * b).sum() for a, b in zip(q_grad, row_grads[i])).item()
        assert got.grad[i].item() == pytest.approx(expect, rel=1e-9, abs=1e-15), i
    assert got.grad[2].item() == 0.0  # a row the run never saw has no effect


@pytest.mark.parametrize("change, message", [
    (dict(weights=torch.ones(3, dtype=torch.float64)), "3 entries for 4 training rows"),
    (dict(weights=torch.ones(4, dtype=torch.long)), "1-D floating tensor"),
    (dict(recipe=Recipe([0.1] * 4, "adam")), "optimizer must be one of"),
    (dict(recipe=Recipe([0.1] * 3, "sgd")), "3 learning rates for 4 steps"),
    (dict(recipe=Recipe([0.1] * 4, "adamw", betas=(0.9, 1.0))), "betas"),
    (dict(recipe=Recipe([0.1] * 4, "sgd", max_grad_norm=-1.0)), "max_grad_norm"),
    (dict(batches=[[0, 1], [2, 7], [1], [0]]), "batches[1] holds row 7"),
    (dict(batches=[[0, 1], [], [1], [0]]), "batches[1] is empty"),
    (dict(lora={"nope.weight": torch.zeros(1)}), "'nope.weight'"),
])
def test_bad_input_is_refused_naming_it(setup, change, message):
    args = dict(weights=_ones(), recipe=RECIPES["sgd"], batches=BATCHES, lora=setup.lora)
    args.update(change)
    with pytest.raises(ConfigError) as err:
        metagradient(setup.model, args["lora"], setup.rows, args["batches"], args["weights"], args["recipe"],
                     _measure(setup), pad_id=setup.pad)
    assert message in str(err.value)


def test_a_model_in_training_mode_or_training_other_tensors_is_refused(setup):
    part = dict(list(setup.lora.items())[:2])
    with pytest.raises(ConfigError, match="outside lora_params"):
        metagradient(setup.model, part, setup.rows, BATCHES, _ones(), RECIPES["sgd"], _measure(setup), pad_id=setup.pad)
    setup.model.train()
    try:
        with pytest.raises(ConfigError, match="eval mode"):
            metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), RECIPES["sgd"], _measure(setup),
                         pad_id=setup.pad)
    finally:
        setup.model.eval()


class _Stop(Exception):
    pass


def _stopping_at(tick):
    def progress(done, total):
        if done == tick:
            raise _Stop(f"stopped at {done} of {total}")
    return progress


def _counting_steps(monkeypatch):
    from gradian.replay import unrolled

    calls = []
    step = unrolled._Steps.step

    def counted(self_, t, state, w, *, create_graph):
        calls.append((t, create_graph))
        return step(self_, t, state, w, create_graph=create_graph)

    monkeypatch.setattr(unrolled._Steps, "step", counted)
    return calls


LONG = BATCHES * 3  # 12 steps: kept states before steps 0, 3, 6 and 9 with checkpoint_every=3


@pytest.mark.parametrize("tick, resumed", [(5, "resumed the forward replay at step 3 of 12"),
                                           (22, "resumed after 1 of the sweep's 4 segments")])
def test_states_on_disk_resume_an_interrupted_replay_bit_for_bit(setup, tmp_path, monkeypatch, tick, resumed):
    """The forward replay writes its kept states and the sweep its adjoint after every segment: a
    replay stopped in the forward replay (tick 5) or in the sweep (tick 22: 12 forward, then the
    last segment's 2 recomputed and 3 differentiated steps, then the next one's) gives, resumed,
    exactly the in-memory metagradient, without making again what it wrote; a third run reads the
    finished replay back and the states are gone."""
    from gradian.replay.states import ReplayStates

    recipe = dataclasses.replace(RECIPES["adamw-clipped"], schedule=list(RECIPES["adamw-clipped"].schedule) * 3)
    args = (setup.model, setup.lora, setup.rows, LONG, _ones(), recipe, _measure(setup))
    memory = metagradient(*args, pad_id=setup.pad, checkpoint_every=3)
    folder = tmp_path / "replay"
    with pytest.raises(_Stop):
        metagradient(*args, pad_id=setup.pad, checkpoint_every=3, states=ReplayStates(folder),
                     progress=_stopping_at(tick))
    calls = _counting_steps(monkeypatch)
    ticks = []
    again = metagradient(*args, pad_id=setup.pad, checkpoint_every=3, states=ReplayStates(folder),
                         progress=lambda done, total: ticks.append((done, total)))
    assert again.resumed == resumed
    assert again.value == memory.value and torch.equal(again.grad, memory.grad)
    for name in memory.params:
        assert torch.equal(again.params[name], memory.params[name])
    assert ticks[-1] == (32, 32) and ticks[0][0] == (4 if tick == 5 else 18)
    if tick == 5:  # forward from step 3; every segment swept: 2 recomputed + 3 differentiated each
        assert sum(1 for _, g in calls if not g) == 9 + 4 * 2 and sum(1 for _, g in calls if g) == 12
    else:  # no forward step; three segments left to sweep
        assert sum(1 for _, g in calls if not g) == 3 * 2 and sum(1 for _, g in calls if g) == 9
    assert sorted(p.name for p in folder.iterdir()) == ["progress.json", "result.pt"]
    calls.clear()
    done = metagradient(*args, pad_id=setup.pad, checkpoint_every=3, states=ReplayStates(folder))
    assert done.resumed == "reused" and not calls
    assert done.value == memory.value and torch.equal(done.grad, memory.grad)


def test_a_damaged_state_is_recomputed_and_changes_nothing(setup, tmp_path):
    """A kept state whose bytes no longer match its checksum is recomputed from the one before it;
    the metagradient is the in-memory one."""
    from gradian.replay.states import ReplayStates

    recipe = dataclasses.replace(RECIPES["sgd-clipped"], schedule=list(RECIPES["sgd-clipped"].schedule) * 3)
    args = (setup.model, setup.lora, setup.rows, LONG, _ones(), recipe, _measure(setup))
    memory = metagradient(*args, pad_id=setup.pad, checkpoint_every=3)
    folder = tmp_path / "replay"
    with pytest.raises(_Stop):  # stopped in the sweep's second segment: the states before steps 3 and 6 are left
        metagradient(*args, pad_id=setup.pad, checkpoint_every=3, states=ReplayStates(folder),
                     progress=_stopping_at(20))
    damaged = folder / "state-00000003.pt"
    damaged.write_bytes(damaged.read_bytes()[:-7] + b"garbage")
    states = ReplayStates(folder)
    again = metagradient(*args, pad_id=setup.pad, checkpoint_every=3, states=states)
    assert torch.equal(again.grad, memory.grad) and again.value == memory.value
    assert any("state-00000003.pt does not match its checksum" in r for r in states.repaired)


def test_states_on_disk_need_the_step_by_step_sweep(setup, tmp_path):
    from gradian.replay.states import ReplayStates

    with pytest.raises(ConfigError, match="checkpoint_every"):
        metagradient(setup.model, setup.lora, setup.rows, BATCHES, _ones(), RECIPES["sgd"], _measure(setup),
                     pad_id=setup.pad, states=ReplayStates(tmp_path / "r"))


def _state_after(setup, recipe, batches, steps):
    """The LoRA tensors and AdamW moments after the first ``steps`` of a plain replay."""
    from gradian.replay.unrolled import _detached, _initial_state, _Steps

    names, state = _initial_state(setup.lora)
    run = _Steps(setup.model, names, setup.rows, batches, recipe, setup.pad)
    for t in range(steps):
        state = _detached(run.step(t, state, _ones(), create_graph=False))
    theta, m, v = state
    return dict(zip(names, theta)), dict(zip(names, m)), dict(zip(names, v))


@pytest.mark.parametrize("every", [None, 2])
def test_a_replay_started_from_a_kept_state_is_the_whole_replay_over_its_window(setup, tmp_path, every):
    """Started after step 6 of 12 from the state the run had there (tensors and AdamW moments), the
    replay ends where the whole replay ends, and its metagradient over the last 6 steps is the
    whole replay's with horizon 6, in memory, on disk and with the whole graph."""
    from gradian.replay import ReplayStart
    from gradian.replay.states import ReplayStates

    recipe = dataclasses.replace(RECIPES["adamw-clipped"], schedule=list(RECIPES["adamw-clipped"].schedule) * 3)
    theta, m, v = _state_after(setup, recipe, LONG, 6)
    start = ReplayStart(step=6, m=m, v=v)
    whole = metagradient(setup.model, setup.lora, setup.rows, LONG, _ones(), recipe, _measure(setup),
                         pad_id=setup.pad, checkpoint_every=3, horizon=6)
    kw = {"checkpoint_every": every, "horizon": 6} if every else {}
    started = metagradient(setup.model, theta, setup.rows, LONG, _ones(), recipe, _measure(setup),
                           pad_id=setup.pad, start=start, **kw)
    assert started.value == pytest.approx(whole.value, rel=1e-12)
    assert torch.allclose(started.grad, whole.grad, rtol=1e-9, atol=1e-14)
    assert float(started.grad.abs().sum()) > 0
    final = replay(setup.model, theta, setup.rows, LONG, _ones(), recipe, pad_id=setup.pad, start=start)
    for name in whole.params:
        assert torch.allclose(final[name], whole.params[name], rtol=0, atol=1e-12)
    if every:
        on_disk = metagradient(setup.model, theta, setup.rows, LONG, _ones(), recipe, _measure(setup),
                               pad_id=setup.pad, start=start, states=ReplayStates(tmp_path / "r"), **kw)
        assert torch.equal(on_disk.grad, started.grad)


def test_a_start_is_refused_when_it_cannot_be_the_run(setup):
    """A horizon reaching back before the start, a step outside the run, or moments missing or of
    another shape are refused, naming what is wrong."""
    from gradian.replay import ReplayStart

    recipe = dataclasses.replace(RECIPES["adamw-clipped"], schedule=list(RECIPES["adamw-clipped"].schedule) * 3)
    theta, m, v = _state_after(setup, recipe, LONG, 6)
    args = (setup.model, theta, setup.rows, LONG, _ones(), recipe, _measure(setup))
    with pytest.raises(ConfigError, match="reaches back before the start"):
        metagradient(*args, pad_id=setup.pad, checkpoint_every=3, horizon=7, start=ReplayStart(6, m, v))
    with pytest.raises(ConfigError, match="start step"):
        metagradient(*args, pad_id=setup.pad, checkpoint_every=3, start=ReplayStart(12, m, v))
    name = next(iter(m))
    with pytest.raises(ConfigError, match=f"AdamW's v for {name}"):
        metagradient(*args, pad_id=setup.pad, checkpoint_every=3,
                     start=ReplayStart(6, m, {**v, name: v[name][:1]}))
