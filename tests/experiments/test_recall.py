"""The recall studies' model, task and training loop (linattn.experiments.recall, .mqar)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from linattn.experiments import mqar, recall
from linattn.data import IGNORE_INDEX, multi_query_associative_recall, recall_vocab


def _cell(**kw):
    base = dict(mixer="linear", feature_map=None, key_dim=8, vocab_size=65, task="mqar",
                train_sizes=[2, 4], test_sizes=[2, 4], steps=6, lr=3e-3, batch=8, seed=0, eval_examples=16)
    return {**base, **kw}


@pytest.mark.parametrize("name", list(mqar.MODELS))
def test_every_study_model_runs_and_reports_its_state(name):
    options = {k: v for k, v in mqar.MODELS[name].items() if k != "family"}
    c = _cell(**options)
    out = recall.train_and_evaluate(c, checkpoints=(3,))
    assert len(out["accuracy"]) == 2 and all(0 <= a <= 1 for a in out["accuracy"])
    assert not out["diverged"] and math.isfinite(out["final_loss"]) and set(out["at_step"]) == {"3"}
    D, Dv = c["key_dim"], 16
    M = recall.feature_count(c.get("feature_map"), D)
    if c["mixer"].startswith("softmax"):
        assert out["state_floats"] == 3 * 4 * (D + Dv)                  # the KV cache at the largest test size
    elif c["mixer"] == "linear" and c.get("normalize", True):
        assert out["state_floats"] == M * (Dv + 1)
    else:
        assert out["state_floats"] == M * Dv
    assert ("gate" in out) == (c["mixer"] == "gla")


def test_training_is_deterministic_and_a_checkpoint_is_a_shorter_run():
    """The schedule does not depend on the budget: the model after s of S steps is the model of an s-step run."""
    long = recall.train_and_evaluate(_cell(steps=8, feature_map="elu+1"), checkpoints=(4,))
    short = recall.train_and_evaluate(_cell(steps=4, feature_map="elu+1"))
    again = recall.train_and_evaluate(_cell(steps=8, feature_map="elu+1"), checkpoints=(4,))
    assert long == again
    assert long["at_step"]["4"] == short["accuracy"]


def test_keys_read_the_previous_token_and_rope_softmax_sees_relative_positions():
    model = recall.build_model(_cell(mixer="softmax_rope", feature_map=None))
    x, _ = multi_query_associative_recall(2, 4, vocab_size=65, generator=torch.Generator().manual_seed(0))
    q, k, v, x_prev = model.qkv(x)
    emb = model.embed(x)
    torch.testing.assert_close(k[:, 0, 1:], model.W_k(emb[:, :-1]))    # key at t from token t - 1
    assert torch.equal(k[:, 0, 0], torch.zeros_like(k[:, 0, 0]))
    assert model(x).shape == (2, 12, 65)


def test_feature_map_of_the_update_rules_is_refused():
    with pytest.raises(ValueError, match="feature_map is for mixer='linear' only"):
        recall.RecallModel("delta", 65, feature_map="elu+1")
    with pytest.raises(ValueError, match="mixer must be one of"):
        recall.RecallModel("mamba", 65)


def test_reassigned_key_recall_answers_with_the_latest_value():
    g = torch.Generator().manual_seed(3)
    x, y = recall.reassigned_key_recall(50, 20, num_keys=4, vocab_size=65, generator=g)
    keys, values = recall_vocab(65)
    assert x.shape == y.shape == (50, 44)
    for b in range(50):
        latest = {}
        for w in range(20):
            k_, v_ = x[b, 2 * w].item(), x[b, 2 * w + 1].item()
            assert k_ in keys and v_ in values
            latest[k_] = v_
        assert len(latest) == 4                                            # every key written at least once
        for t in range(40, 44):
            assert y[b, t].item() == latest[x[b, t].item()]
    assert (y[:, :40] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="num_writes must be >= num_keys"):
        recall.reassigned_key_recall(2, 3, num_keys=4)


def test_gla_gate_summary_and_mqar_grid():
    model = recall.build_model(_cell(mixer="gla", feature_map=None))
    summary = recall.gate_summary(model, _cell(mixer="gla", feature_map=None))
    assert 0 < summary["q10"] <= summary["median"] <= summary["q90"] < 1
    cells = mqar.grid()
    extra = sum(len(lrs) * (len(mqar.SEEDS) if name in mqar.SEEDED else 1) for name, lrs in mqar.EXTRA_LRS.items())
    assert len(cells) == len(mqar.MODELS) * 3 + 2 * len(mqar.SEEDED) * 3 + extra == 165
    assert len({(c["name"], c["lr"], c["seed"]) for c in cells}) == len(cells)          # no cell twice
    assert {c["vocab_size"] for c in cells} == {513} and len(recall_vocab(513)[0]) == 4 * max(mqar.SIZES)
    rows = [dict(cell=c, result=dict(accuracy=[c["lr"]] * 5, state_floats=1)) for c in cells if c["name"] == "softmax"]
    assert mqar.best(rows)["softmax"]["best_lr"] == max(mqar.LRS)


def test_reassign_grid_and_one_cell():
    from linattn.experiments import reassign
    cells = reassign.grid()
    assert len(cells) == len(reassign.MODELS) * 3 * 3 and {c["task"] for c in cells} == {"reassign"}
    c = dict(cells[1], steps=3, checkpoints=[], eval_examples=8, name="softmax + RoPE", mixer="softmax_rope")
    out = reassign.run_cell(c)
    assert len(out["accuracy"]) == len(reassign.SIZES) and out["state_floats"] == (2 * 64 + 8) * 32


def test_charlm_grid_and_one_short_run():
    from linattn.experiments import charlm
    cells = charlm.grid()
    assert len(cells) == 2 * 3 * 3 * 4 + 2 * 2 * 3 + 2 * 2 * 3 == 96               # + 2000 steps at 2e-2, 3e-2
    out = charlm.run_cell(dict(attention="linear", lr=1e-2, seed=0, steps=2))
    assert len(out["per_position"]) == 128 and out["parameters"] == 111_936 and not out["diverged"]
    rows = [dict(cell=dict(attention="linear", lr=lr, seed=s, steps=2), result=dict(val_loss=lr + s))
            for lr in (1e-2, 3e-3) for s in (0, 1)]
    (summary,) = charlm.summarise(rows)["best"]
    assert summary["best_lr"] == 3e-3 and summary["n_seeds"] == 2 and summary["min"] == 3e-3
