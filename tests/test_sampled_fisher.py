"""The sampled ("true") Fisher of EK-FAC against computations written out here.

- factors and eigenvalues: a plain loop, one unpadded example at a time, draws each label from the
  model's softmax with the uniforms the project's generator gives, backpropagates that example's
  summed loss alone, and forms ``x x^T`` / ``g g^T`` from explicit module hooks and the corrected
  eigenvalues from autograd's weight gradients; the project's padded batches must give the same
  numbers (float64, relative 1e-8);
- the expectation: averaged over many draws, the sampled-label gradient outer product is the
  model's Fisher ``sum_t J_t^T (diag p_t - p_t p_t^T) J_t``, summed exactly over a tiny
  vocabulary, within the Monte Carlo error of the number of draws;
- the YAML boolean ``engine.fisher: true`` reads as ``sampled``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradian.config import EngineConfig, GradsConfig
from gradian.engines import FitContext, InMemoryGradients, get_engine
from gradian.errors import ConfigError

SEED, DRAWS, BATCH = 7, 2, 3


def _tiny(vocab_size=None, layers=2, sites=("q_proj", "down_proj")):
    import torch

    from gradian.grads import wrap_peft_model
    from tests.plugins.tiny_lora import build_tiny_lora

    extra = {} if vocab_size is None else {"vocab_size": vocab_size}
    return wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64, target_modules=list(sites),
                                           num_hidden_layers=layers, **extra))


def _chat_rows():
    from gradian.data import dataset_from_rows, tokenize_examples
    from tests.plugins.chat_tokenizer import build_chat_tokenizer

    tok = build_chat_tokenizer()
    rows = [{"prompt": p, "completion": c} for p, c in [
        ("what is the capital of france ?", "paris"), ("what is the capital of japan ?", "tokyo is the capital"),
        ("say hello", "hello world"), ("count to three", "one two three"), ("is it raining ?", "no"),
        ("what is the capital of france ?", "rome"), ("name a colour", "blue and green and red")]]
    return tok, tokenize_examples(dataset_from_rows(rows).examples, tok, 64)


def _passes(gm, tokenized, pad_id, batch_size):
    from gradian.grads.collectors import ModelPasses

    grads_config = GradsConfig(batch_size=batch_size)  # loss_reduction: mean, which the sampled Fisher overrides
    return ModelPasses(gm, tokenized, pad_id, grads_config), grads_config


def _loop_sampled(gm, tokenized, seed, draws, batch_size):
    """Per draw and example: ``(x x^T sums, g g^T sums, tokens, weight gradients)`` per LoRA matrix,
    one unpadded example and one backward at a time."""
    import torch

    from gradian.grads.collectors import fisher_generator

    linears = {f"{b.name}#{j}": lin for b in gm.blocks for j, lin in enumerate(b.linears)}
    weights = {key: lin.weight for key, lin in linears.items()}
    xx = {k: 0.0 for k in linears}
    gg = {k: 0.0 for k in linears}
    tokens = 0
    per_example = {k: [] for k in linears}  # one [out, in] gradient per (draw, example)
    for draw in range(draws):
        for offset in range(0, len(tokenized), batch_size):
            rows = tokenized[offset: offset + batch_size]
            supervised = [sum(1 for label in t.labels[1:] if label != -100) for t in rows]
            # the project's uniforms for this batch, one per supervised position, rows in order
            u = torch.rand(sum(supervised), generator=fisher_generator(seed, draw, offset), dtype=torch.float64).numpy()
            start = 0
            for t, n in zip(rows, supervised):
                mine, start = u[start: start + n], start + n
                seen: dict[str, list] = {k: [] for k in linears}
                handles = []

                def hook(key):
                    def forward(module, inputs, output):
                        seen[key].append([inputs[0].detach()[0], None])
                        output.register_hook(lambda g, entry=seen[key][-1]: entry.__setitem__(1, g.detach()[0]))
                    return forward

                for key, lin in linears.items():
                    handles.append(lin.register_forward_hook(hook(key)))
                try:
                    ids = torch.tensor([t.input_ids])
                    logits = gm.model(input_ids=ids).logits[0]
                    logp = torch.log_softmax(logits, dim=-1)
                    loss = logits.new_zeros(())
                    k = 0
                    for pos in range(1, len(t.labels)):
                        if t.labels[pos] == -100:
                            continue
                        cdf = np.cumsum(np.exp(logp[pos - 1].detach().numpy()))
                        label = min(int(np.searchsorted(cdf, mine[k], side="right")), cdf.size - 1)
                        k += 1
                        loss = loss - logp[pos - 1, label]  # summed over the row's sampled tokens
                    grads = torch.autograd.grad(loss, list(weights.values()))
                finally:
                    for handle in handles:
                        handle.remove()
                for key, g_w in zip(weights, grads):
                    per_example[key].append(g_w.numpy())
                    for x, g in seen[key]:
                        xx[key] = xx[key] + (x.T @ x).numpy()
                        gg[key] = gg[key] + (g.T @ g).numpy()
                tokens += len(t.input_ids)
    return xx, gg, tokens, {k: np.stack(v) for k, v in per_example.items()}


def test_sampled_factors_and_eigenvalues_equal_a_plain_per_example_loop():
    gm = _tiny()
    tok, tokenized = _chat_rows()
    passes, grads_config = _passes(gm, tokenized, tok.pad_token_id, BATCH)
    xx, gg, tokens, per_example = _loop_sampled(gm, tokenized, SEED, DRAWS, BATCH)
    n_lin = len(passes.layers)
    # the factor pass, draw by draw, against the loop's hooked sums
    got_xx = {k: 0.0 for k in xx}
    got_gg = {k: 0.0 for k in gg}
    got_tokens = 0
    for draw in range(DRAWS):
        for key, (a, s, n, rows) in passes.factor_totals(SEED, draw).items():
            got_xx[key], got_gg[key] = got_xx[key] + a, got_gg[key] + s
            got_tokens += n
            assert rows == len(tokenized)
    assert got_tokens == tokens * n_lin
    for key in xx:
        np.testing.assert_allclose(got_xx[key], xx[key], rtol=1e-8, atol=1e-12 * np.abs(xx[key]).max())
        np.testing.assert_allclose(got_gg[key], gg[key], rtol=1e-8, atol=1e-12 * np.abs(gg[key]).max())
    # the fits: K-FAC's eigenvalues s_o a_i, EK-FAC's the mean squared gradient in that basis
    config = dict(fisher="sampled", fisher_seed=SEED, fisher_samples=DRAWS)
    context = FitContext(passes=passes, grads=grads_config)
    stored = {b.name: np.zeros((len(tokenized), b.dim)) for b in gm.blocks}  # not read under the sampled Fisher
    ekfac = get_engine("ekfac").fit(InMemoryGradients(stored), EngineConfig(name="ekfac", **config), context)
    kfac = get_engine("kfac").fit(InMemoryGradients(stored), EngineConfig(name="kfac", **config), context)
    assert ekfac.meta["eigenvalues_from"] == "second pass"
    n = DRAWS * len(tokenized)
    for key in xx:
        a_values, q_a = np.linalg.eigh(xx[key] / tokens)  # tokens of every draw
        s_values, q_s = np.linalg.eigh(gg[key] / n)
        want_kfac = np.outer(np.clip(s_values, 0, None), np.clip(a_values, 0, None))
        np.testing.assert_allclose(kfac.arrays[f"{key}.eigenvalues"], want_kfac, rtol=1e-8, atol=1e-12 * want_kfac.max())
        rotated = q_s.T @ per_example[key] @ q_a
        want = (rotated ** 2).sum(axis=0) / n
        np.testing.assert_allclose(ekfac.arrays[f"{key}.eigenvalues"], want, rtol=1e-8, atol=1e-12 * want.max())


def test_the_padded_batches_draw_what_one_row_alone_draws():
    import torch

    from gradian.grads import collate
    from gradian.grads.collectors import fisher_generator, sample_labels

    gm = _tiny()
    tok, tokenized = _chat_rows()
    batch = collate(tokenized[:BATCH], tok.pad_token_id)
    logits = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    drawn = sample_labels(logits, batch.labels, fisher_generator(SEED, 0, 0))
    keep = batch.labels != -100
    assert torch.equal(drawn[~keep], batch.labels[~keep])  # prompt and padding untouched
    assert not torch.equal(drawn[keep], batch.labels[keep])  # the training labels are not what is drawn
    # a wider batch of the same rows (more padding) consumes the same uniforms: the same labels
    wider = collate(tokenized[:BATCH] + tokenized[BATCH:BATCH + 1], tok.pad_token_id)
    wide_logits = gm.model(input_ids=wider.input_ids[:BATCH], attention_mask=wider.attention_mask[:BATCH]).logits
    wide = sample_labels(wide_logits, wider.labels[:BATCH], fisher_generator(SEED, 0, 0))
    width = batch.labels.shape[1]
    assert torch.equal(wide[:, :width], drawn) and (wide[:, width:] == -100).all()


def _exact_fisher(gm, tokenized):
    """``sum_rows sum_t J_t^T (diag p_t - p_t p_t^T) J_t`` over the LoRA weights, J row by row."""
    import torch

    weights = [p for b in gm.blocks for p in b.parameters]
    total = None
    for t in tokenized:
        logits = gm.model(input_ids=torch.tensor([t.input_ids])).logits[0]
        for pos in range(1, len(t.labels)):
            if t.labels[pos] == -100:
                continue
            z = logits[pos - 1]
            rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(z[v], weights, retain_graph=True)])
                    for v in range(z.numel())]
            jac = torch.stack(rows).numpy()  # [vocab, params]
            p = torch.softmax(z.detach(), dim=-1).numpy()
            part = jac.T @ (np.diag(p) - np.outer(p, p)) @ jac
            total = part if total is None else total + part
    return total


def test_averaged_over_draws_the_sampled_outer_product_is_the_exact_fisher():
    import torch

    from gradian.data import TokenizedExample

    vocab = 8
    gm = _tiny(vocab_size=vocab, layers=1, sites=("q_proj",))
    gen = torch.Generator().manual_seed(0)
    tokenized = []
    for i, (length, prompt) in enumerate([(6, 2), (4, 1), (7, 4)]):
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        labels = [-100] * prompt + ids[prompt:]
        tokenized.append(TokenizedExample(str(i), ids, labels, length, prompt, length - prompt, 0, False, False, 0, False))
    passes, _ = _passes(gm, tokenized, 0, len(tokenized))
    exact = _exact_fisher(gm, tokenized)
    keys = [layer["key"] for layer in passes.layers]

    def outer(per_layer, scale=None):  # sum over rows of vec(G_b) vec(G_b)^T, vec over every LoRA matrix
        flat = np.concatenate([per_layer[key].reshape(per_layer[key].shape[0], -1) for key in keys], axis=1)
        flat = flat if scale is None else flat * scale[:, None]
        return flat.T @ flat

    draws = 200
    per_draw = [next(passes.layer_gradients(SEED, draw))[1] for draw in range(draws)]
    samples = np.stack([outer(g) for g in per_draw])
    mean = samples.mean(axis=0)
    # the whole matrix: E ||mean - F||^2 = the entries' variances summed / draws (estimated from the draws)
    tolerance = 4.0 * np.sqrt(((samples - mean) ** 2).sum() / (draws - 1) / draws)
    assert np.linalg.norm(mean - exact) <= tolerance, (np.linalg.norm(mean - exact), tolerance)
    # sharper: the trace and v^T F v along random directions, each within 4 standard errors
    directions = np.random.default_rng(1).normal(size=(exact.shape[0], 8))
    want = np.concatenate([[np.trace(exact)], np.einsum("pm,pq,qm->m", directions, exact, directions)])
    quad = np.stack([np.concatenate([[np.trace(x)], np.einsum("pm,pq,qm->m", directions, x, directions)])
                     for x in samples])
    error = quad.std(axis=0, ddof=1) / np.sqrt(draws)
    assert (np.abs(quad.mean(axis=0) - want) <= 4 * error).all(), (quad.mean(axis=0), want, error)
    # the check tells the losses apart: the same draws under a per-row mean loss (each row's
    # gradient divided by its supervised tokens) average to something far outside it
    per_row = 1.0 / np.array([sum(1 for label in t.labels[1:] if label != -100) for t in tokenized], dtype=float)
    row_mean = np.stack([outer(g, per_row) for g in per_draw])
    quad_mean = np.stack([np.concatenate([[np.trace(x)], np.einsum("pm,pq,qm->m", directions, x, directions)])
                          for x in row_mean])
    assert (np.abs(quad_mean.mean(axis=0) - want) > 4 * error).all()


@pytest.mark.parametrize("written", ["true", "True", "sampled"])
def test_a_bare_yaml_true_is_the_sampled_fisher(tmp_path, written):
    from gradian.config import load_config

    config = tmp_path / "gradian.yaml"
    config.write_text(f"engine:\n  name: ekfac\n  fisher: {written}\n")
    loaded = load_config(config)
    assert loaded.engine.fisher == "sampled"
    assert get_engine("ekfac").settings(loaded.engine)["fisher"] == "sampled"


def test_a_boolean_fisher_given_to_the_engine_directly_is_read_and_false_is_refused():
    assert get_engine("ekfac").settings(EngineConfig(name="ekfac", fisher=True))["fisher"] == "sampled"
    with pytest.raises(ConfigError, match=r"engine\.fisher 'False' is not one of empirical, sampled"):
        get_engine("ekfac").settings(EngineConfig(name="ekfac", fisher=False))


def test_a_yaml_false_is_refused_naming_the_key(tmp_path):
    from gradian.config import load_config

    config = tmp_path / "gradian.yaml"
    config.write_text("engine:\n  fisher: false\n")
    with pytest.raises(ConfigError, match=r"gradian\.yaml:2: 'engine\.fisher' is 'False'; it must be one of empirical, sampled"):
        load_config(config)
