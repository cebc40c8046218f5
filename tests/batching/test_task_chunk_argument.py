"""The chunk of tasks is an argument of each task-batched call (``task_chunk=``), never a
setting of the model: ``fm.adapt_tasks`` takes ``"auto"``, ``"tune"``, ``None`` or a number
and returns the chunk it took (``result.chunk``, a ``fm.TaskChunk``); ``fm.task_losses`` and
``fm.apply_tasks`` take ``"auto"`` (the rule on their own inputs), ``None``, a number or an
inner loop's ``result.chunk``; the recipes and ``fm.evaluate`` hand the inner loop's chunk to
their query pass; and one call's chunk never reaches another call."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import chunks_run
from torch import nn

import funcmeta as fm
from funcmeta._src.batching.chunks import candidate_chunks, rule_chunk

DTYPE = torch.float64
TASKS = 8


def sinusoid(tasks: int = TASKS, query: int = 7):
    """Seeded float64 sinusoid tasks (5 support and ``query`` query examples each) and a small
    MLP for them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    b = fm.data.Sinusoid().sample(
        tasks, 5, query, generator=torch.Generator().manual_seed(1), dtype=DTYPE
    )
    return net.to(DTYPE), b


def loop_meta_gradients(fmodel, b, steps=2, lr=0.1):
    """Second-order MAML, a per-task loop of ``fm.adapt``: the meta-gradients."""
    total = 0.0
    for t in range(b.x_support.shape[0]):
        r = fm.adapt(
            fmodel,
            fmodel.params,
            F.mse_loss,
            (b.x_support[t], b.y_support[t]),
            fm.optim.sgd(lr=lr),
            steps=steps,
        )
        assert r.chunk is None  # fm.adapt runs one task: no chunk
        total = total + F.mse_loss(fmodel(r.params, b.x_query[t]), b.y_query[t])
    loss = total / b.x_support.shape[0]
    return torch.autograd.grad(loss, list(fmodel.params.values()))


# --- (1) no chunk on the model --------------------------------------------------------------


@pytest.mark.parametrize("value", [4, None, "auto", "tune"])
def test_functional_model_takes_no_task_chunk_and_says_where_it_went(value):
    with pytest.raises(TypeError) as info:
        fm.functional_model(nn.Linear(1, 1), task_chunk=value)
    said = str(info.value)
    assert f"adapt_tasks(..., task_chunk={value!r})" in said
    assert "task_chunk=result.chunk" in said


def test_the_model_keeps_no_chunk():
    fmodel = fm.functional_model(nn.Linear(1, 1))
    with pytest.raises(AttributeError):
        fmodel.task_chunk  # noqa: B018
    with pytest.raises(AttributeError):
        fmodel.chunk_now  # noqa: B018
    assert not hasattr(fmodel.executor, "task_chunk")
    assert not hasattr(fmodel.executor, "chunk_now")
    # the reports stay
    assert fmodel.task_chunk_choices == {}
    assert fmodel.per_task is None and fmodel.per_task_layers == {}


def test_task_chunk_is_public_and_prints_its_chunk():
    from funcmeta._src.core.types import TaskChunk as FromTypes
    from funcmeta._src.module.task_protocol import TaskChunk as FromProtocol

    assert fm.TaskChunk is FromTypes is FromProtocol
    assert "TaskChunk" in fm.__all__
    assert repr(fm.TaskChunk(4)) == "TaskChunk(4)" and fm.TaskChunk(4).chunk == 4
    assert repr(fm.TaskChunk(None)) == "TaskChunk(None)" and fm.TaskChunk(None).chunk is None
    assert fm.AdaptResult._fields[-1] == "chunk"


# --- (2) the chunk taken, and the loop's results --------------------------------------------


@pytest.mark.parametrize("task_chunk", [2, None, "auto", 1, 3, TASKS, 100])
def test_every_chunk_gives_the_loops_meta_gradients_and_says_what_it_took(task_chunk, monkeypatch):
    """8 sinusoid tasks in float64, second order: adapt_tasks on each chunk, its query pass
    on ``result.chunk``, against a per-task loop of fm.adapt; ``result.chunk`` is the chunk
    given, or the rule's for ``"auto"``, and every vmapped run took it."""
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    seen = chunks_run(monkeypatch)
    r = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        F.mse_loss,
        b.support,
        fm.optim.sgd(lr=0.1),
        steps=2,
        task_chunk=task_chunk,
    )
    assert isinstance(r.chunk, fm.TaskChunk)
    if task_chunk == "auto":
        parameters = sum(p.numel() for p in net.parameters())
        want = rule_chunk(TASKS, inputs_per_task=5, parameters=parameters, device="cpu")
        assert fmodel.task_chunk_choices == {
            f"{TASKS} tasks, inputs ({TASKS}, 5, 1), cpu": {
                "chunk": want,
                "parameters": parameters,
                "inputs_per_task": 5,
            }
        }
    else:
        want = task_chunk
        assert fmodel.task_chunk_choices == {}  # a pinned chunk: nothing chosen
    assert r.chunk.chunk == want
    losses = fm.task_losses(fmodel, r.params, F.mse_loss, b.query, task_chunk=r.chunk).losses
    assert seen == [want] * 3  # two inner steps, then the query pass on the loop's chunk
    assert losses.shape == (TASKS,)
    ours = torch.autograd.grad(losses.mean(), list(fmodel.params.values()))
    for g, w in zip(ours, loop_meta_gradients(fmodel, b), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_pass_takes_a_number_none_or_a_task_chunk_with_the_same_results(monkeypatch):
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    r = fm.adapt_tasks(
        fmodel, fmodel.params, F.mse_loss, b.support, fm.optim.sgd(lr=0.1), steps=1, task_chunk=2
    )
    seen = chunks_run(monkeypatch)
    outs = {}
    for task_chunk in (None, 1, 3, r.chunk, fm.TaskChunk(4), "auto"):
        seen.clear()
        out, _ = fm.apply_tasks(fmodel, r.params, b.x_query, task_chunk=task_chunk)
        losses = fm.task_losses(fmodel, r.params, F.mse_loss, b.query, task_chunk=task_chunk)
        want = task_chunk.chunk if isinstance(task_chunk, fm.TaskChunk) else task_chunk
        assert seen == [None if want == "auto" else want] * 2  # the rule: an MLP at once
        outs[repr(task_chunk)] = (out, losses.losses)
    first = outs["None"]
    for out, losses in outs.values():
        torch.testing.assert_close(out, first[0], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(losses, first[1], rtol=1e-13, atol=1e-15)


# --- (3) what each call refuses -------------------------------------------------------------


def test_tune_is_for_inner_loops_and_a_pass_is_told_to_take_result_chunk():
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    with pytest.raises(ValueError, match=r'fm\.task_losses takes no task_chunk="tune"') as info:
        fm.task_losses(fmodel, fmodel.params, F.mse_loss, b.query, task_chunk="tune")
    assert "task_chunk=result.chunk" in str(info.value)
    with pytest.raises(ValueError, match=r'fm\.apply_tasks takes no task_chunk="tune"') as info:
        fm.apply_tasks(fmodel, fmodel.params, b.x_query, task_chunk="tune")
    assert "task_chunk=result.chunk" in str(info.value)
    # an inner loop takes it
    r = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        F.mse_loss,
        b.support,
        fm.optim.sgd(lr=0.1),
        steps=1,
        task_chunk="tune",
    )
    assert isinstance(r.chunk, fm.TaskChunk)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "fast", True, False, "Auto", [2]])
def test_bad_chunks_are_refused_by_every_call(bad):
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.1)
    with pytest.raises(ValueError, match=r"fm\.adapt_tasks: task_chunk must be"):
        fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, opt, steps=1, task_chunk=bad)
    with pytest.raises(ValueError, match=r"fm\.task_losses: task_chunk must be"):
        fm.task_losses(fmodel, fmodel.params, F.mse_loss, b.query, task_chunk=bad)
    with pytest.raises(ValueError, match=r"fm\.apply_tasks: task_chunk must be"):
        fm.apply_tasks(fmodel, fmodel.params, b.x_query, task_chunk=bad)
    with pytest.raises(ValueError, match="task_chunk must be"):
        fm.recipes.maml(
            fmodel, fmodel.params, F.mse_loss, b.support, b.query, steps=1, lr=0.1, task_chunk=bad
        )


def test_an_inner_loop_takes_no_task_chunk_object():
    """A TaskChunk is what a pass that follows an inner loop takes; an inner loop chooses its
    own chunk from "auto", "tune", None or a number."""
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    with pytest.raises(ValueError, match=r"fm\.adapt_tasks: task_chunk must be"):
        fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.mse_loss,
            b.support,
            fm.optim.sgd(lr=0.1),
            steps=1,
            task_chunk=fm.TaskChunk(2),
        )


# --- (4) one call's chunk never reaches another ---------------------------------------------


def test_a_pass_under_auto_takes_the_rule_on_its_own_inputs_not_the_latest_inner_loop(
    monkeypatch,
):
    """adapt_tasks with task_chunk=1, then task_losses and apply_tasks with the default: the
    passes run all 8 tasks at once (the rule, on their own inputs, for a small MLP) and the
    rule's choice for the pass is reported. Following the latest inner loop, as the model's
    setting once made them, they ran one task at a time."""
    net, b = sinusoid(query=7)
    fmodel = fm.functional_model(net)
    seen = chunks_run(monkeypatch)
    r = fm.adapt_tasks(
        fmodel, fmodel.params, F.mse_loss, b.support, fm.optim.sgd(lr=0.1), steps=1, task_chunk=1
    )
    assert r.chunk.chunk == 1 and seen == [1]
    assert fmodel.task_chunk_choices == {}
    seen.clear()
    losses = fm.task_losses(fmodel, r.params, F.mse_loss, b.query).losses
    out, _ = fm.apply_tasks(fmodel, r.params, b.x_query)
    assert seen == [None, None]
    label = f"{TASKS} tasks, inputs ({TASKS}, 7, 1), cpu"  # the query's shapes, not the support's
    assert fmodel.task_chunk_choices[label]["chunk"] is None
    assert fmodel.task_chunk_choices[label]["inputs_per_task"] == 7
    # the same values as on the inner loop's chunk
    seen.clear()
    on_loop = fm.task_losses(fmodel, r.params, F.mse_loss, b.query, task_chunk=r.chunk).losses
    out_on_loop, _ = fm.apply_tasks(fmodel, r.params, b.x_query, task_chunk=r.chunk)
    assert seen == [1, 1]
    torch.testing.assert_close(losses, on_loop, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(out, out_on_loop, rtol=1e-13, atol=1e-15)


def test_a_pass_under_auto_chunks_by_its_own_shapes_after_an_all_at_once_loop(monkeypatch):
    """The other way round: conv4 on 16 tasks of 5 images, the inner loop all at once; the
    query pass under "auto" takes the rule's 4 for its own inputs (docs/tasks.md)."""
    torch.manual_seed(0)
    fmodel = fm.functional_model(fm.models.conv4(5))
    support = (torch.randn(16, 5, 1, 28, 28), torch.arange(5).repeat(16, 1))
    seen = chunks_run(monkeypatch)
    with torch.no_grad():
        r = fm.adapt_tasks(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            support,
            fm.optim.sgd(lr=0.1),
            steps=1,
            task_chunk=None,
        )
        assert r.chunk.chunk is None and seen == [None]
        seen.clear()
        fm.apply_tasks(fmodel, r.params, support[0], buffers=r.buffers)
    assert seen == [4]


def test_a_pass_follows_the_inner_loop_it_is_given_not_the_latest(monkeypatch):
    """Two inner loops of one model on chunks 2 and 4, then the first one's query pass with
    its result.chunk: chunk 2, though the latest loop took 4."""
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    opt = fm.optim.sgd(lr=0.1)
    seen = chunks_run(monkeypatch)
    first = fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, b.support, opt, steps=1, task_chunk=2)
    second = fm.adapt_tasks(
        fmodel, fmodel.params, F.mse_loss, b.support, opt, steps=1, task_chunk=4
    )
    assert (first.chunk.chunk, second.chunk.chunk) == (2, 4) and seen == [2, 4]
    seen.clear()
    fm.task_losses(fmodel, first.params, F.mse_loss, b.query, task_chunk=first.chunk)
    fm.task_losses(fmodel, second.params, F.mse_loss, b.query, task_chunk=second.chunk)
    fm.task_losses(fmodel, first.params, F.mse_loss, b.query, task_chunk=first.chunk)
    assert seen == [2, 4, 2]


def test_two_models_interleaved_keep_their_own_chunks(monkeypatch):
    """Two models, one tuned and one pinned to 2, their calls interleaved: each call runs on
    its own chunk, the pinned model's report stays empty, and both give the loop's
    meta-gradients (float64)."""
    net, b = sinusoid()
    tuned, pinned = fm.functional_model(net), fm.functional_model(net)
    seen = chunks_run(monkeypatch)
    for _ in range(9):
        seen.clear()
        a = fm.recipes.maml(
            tuned, tuned.params, F.mse_loss, b.support, b.query, steps=1, lr=0.1, task_chunk="tune"
        )
        p = fm.recipes.maml(
            pinned, pinned.params, F.mse_loss, b.support, b.query, steps=1, lr=0.1, task_chunk=2
        )
        # one inner step and the query pass each, on each call's own chunk
        assert seen == [a.adapted.chunk.chunk] * 2 + [2, 2]
        ga = torch.autograd.grad(a.loss, list(tuned.params.values()))
        gp = torch.autograd.grad(p.loss, list(pinned.params.values()))
        for x, y in zip(ga, gp, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-13)
    assert pinned.task_chunk_choices == {} and pinned.executor.tuner.kinds == {}
    (choice,) = tuned.task_chunk_choices.values()
    assert set(choice["seconds"]) == set(candidate_chunks(TASKS))


# --- (5) "tune" through a recipe ------------------------------------------------------------


@pytest.mark.parametrize("first_order", [False, True])
def test_maml_under_tune_measures_every_candidate_with_the_all_at_once_results(
    first_order, monkeypatch
):
    """fm.recipes.maml with task_chunk="tune" over enough meta-iterations (the warm-up, each
    candidate twice, the choice): every iteration's meta-gradients are task_chunk=None's
    (float64), the query pass runs on the inner loop's chunk (its time counted with the
    trial), and the choice reports seconds for every candidate."""
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    seen = chunks_run(monkeypatch)
    taken = []
    for _ in range(10):
        seen.clear()
        out = fm.recipes.maml(
            fmodel,
            fmodel.params,
            F.mse_loss,
            b.support,
            b.query,
            steps=2,
            lr=0.1,
            first_order=first_order,
            task_chunk="tune",
        )
        taken.append(out.adapted.chunk.chunk)
        assert seen == [taken[-1]] * 3
        grads = torch.autograd.grad(out.loss, list(fmodel.params.values()))
        ref = fm.recipes.maml(
            fmodel,
            fmodel.params,
            F.mse_loss,
            b.support,
            b.query,
            steps=2,
            lr=0.1,
            first_order=first_order,
            task_chunk=None,
        )
        want = torch.autograd.grad(ref.loss, list(fmodel.params.values()))
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    candidates = candidate_chunks(TASKS)
    assert candidates == [None, 1, 4]
    assert taken[:7] == [None, None, 1, 4, 4, 1, None]  # the warm-up, then each twice
    (label,) = fmodel.task_chunk_choices
    assert label.startswith(f"{TASKS} tasks, 2 steps, batch ({TASKS}, 5, 1), ({TASKS}, 5, 1)")
    choice = fmodel.task_chunk_choices[label]
    assert set(choice["seconds"]) == set(candidates)
    assert all(s > 0 for s in choice["seconds"].values())
    assert choice["chunk"] == min(choice["seconds"], key=choice["seconds"].get)
    assert taken[7:] == [choice["chunk"]] * 3
    # the measured trials counted their query pass with them
    (kind,) = fmodel.executor.tuner.kinds.values()
    assert all(len(times) == 2 for times in kind.measured.values())


# --- the recipes and fm.evaluate hand the chunk on ------------------------------------------


def _recipes(fmodel, b):
    """Each recipe on ``b``, as ``name -> call(task_chunk)``."""
    params, support, query = fmodel.params, b.support, b.query
    rates = fm.recipes.metasgd_rates(fmodel.params).to(DTYPE)
    weights = fm.recipes.mamlpp_step_weights(2, epoch=0, msl_epochs=4).to(DTYPE)
    per_step = fm.hyper.per_layer(fmodel.params, 0.1, steps=2).to(DTYPE)
    return {
        "maml": lambda c: fm.recipes.maml(
            fmodel, params, F.mse_loss, support, query, steps=2, lr=0.1, task_chunk=c
        ),
        "fomaml": lambda c: fm.recipes.fomaml(
            fmodel, params, F.mse_loss, support, query, steps=2, lr=0.1, task_chunk=c
        ),
        "metasgd": lambda c: fm.recipes.metasgd(
            fmodel, params, F.mse_loss, support, query, steps=2, lr=rates, task_chunk=c
        ),
        "anil": lambda c: fm.recipes.anil(
            fmodel, params, F.mse_loss, support, query, steps=2, lr=0.1, trainable="4", task_chunk=c
        ),
        "mamlpp": lambda c: fm.recipes.mamlpp(
            fmodel,
            params,
            F.mse_loss,
            support,
            query,
            steps=2,
            lr=per_step,
            step_weights=weights,
            task_chunk=c,
        ),
        "reptile": lambda c: fm.recipes.reptile(
            fmodel, params, F.mse_loss, support, query, steps=2, lr=0.1, task_chunk=c
        ),
        "imaml": lambda c: fm.recipes.imaml(
            fmodel, params, F.mse_loss, support, query, steps=2, lr=0.1, lam=1.0, task_chunk=c
        ),
    }


@pytest.mark.parametrize(
    "name", ["maml", "fomaml", "metasgd", "anil", "mamlpp", "reptile", "imaml"]
)
def test_each_recipe_runs_its_query_pass_on_the_inner_loops_chunk(name, monkeypatch):
    """With task_chunk=3, every vmapped run of the recipe (the inner steps and the passes
    after them) takes chunks of 3, where "auto" on these shapes runs all tasks at once; the
    loss is task_chunk=None's."""
    net, b = sinusoid()
    fmodel = fm.functional_model(net)
    call = _recipes(fmodel, b)[name]
    seen = chunks_run(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # iMAML's note on a loose solve
        ours = call(3)
        assert seen and set(seen) == {3}, seen
        seen.clear()
        auto = call("auto")
        assert seen and set(seen) == {None}, seen
        theirs = call(None)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(auto.loss, theirs.loss, rtol=1e-12, atol=1e-14)
    if ours.adapted is not None:
        assert ours.adapted.chunk.chunk == 3


@pytest.mark.parametrize("name", ["protonet", "r2d2"])
def test_the_embedding_recipes_run_their_pass_on_the_chunk_given(name, monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 8)).to(DTYPE)
    fmodel = fm.functional_model(net)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, 3, 4, generator=g, dtype=DTYPE)
    y = torch.arange(4).repeat(6, 2)
    support, query = (x[:, :4], y[:, :4]), (x[:, 4:], y[:, 4:])
    extra = {"head": fm.heads.RidgeHead()} if name == "r2d2" else {}
    recipe = getattr(fm.recipes, name)
    seen = chunks_run(monkeypatch)
    results = {}
    for task_chunk in (2, None):
        seen.clear()
        results[task_chunk] = recipe(
            fmodel, fmodel.params, F.cross_entropy, support, query, task_chunk=task_chunk, **extra
        )
        assert seen == [task_chunk]
    torch.testing.assert_close(results[2].loss, results[None].loss, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match='takes no task_chunk="tune"'):
        recipe(fmodel, fmodel.params, F.cross_entropy, support, query, task_chunk="tune", **extra)


def test_evaluate_runs_its_batches_on_the_chunk_given(monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 5)).to(DTYPE)
    fmodel = fm.functional_model(net)
    images = torch.randn(60, 6, dtype=DTYPE)
    episodes = fm.data.Episodes(
        images, torch.arange(10).repeat_interleave(6), ways=5, shots=1, query=2
    )
    opt = fm.optim.sgd(lr=0.1)
    seen = chunks_run(monkeypatch)
    scores = {}
    for task_chunk in (2, None, "tune"):
        seen.clear()
        scores[task_chunk] = fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            opt,
            steps=2,
            num_episodes=8,
            batch_tasks=4,
            task_chunk=task_chunk,
        )
        if task_chunk != "tune":  # 2 batches of 4: 2 inner steps and the query pass each
            assert seen == [task_chunk] * 6
    for task_chunk in (2, "tune"):
        assert scores[task_chunk].accuracy == scores[None].accuracy
        assert torch.equal(scores[task_chunk].per_episode, scores[None].per_episode)


def test_setting_the_old_attribute_raises_its_pointer_instead_of_doing_nothing():
    fmodel = fm.functional_model(nn.Linear(1, 1))
    for name in ("task_chunk", "chunk_now"):
        with pytest.raises(AttributeError, match=r"task_chunk=|result\.chunk") as info:
            setattr(fmodel, name, 4)
        assert "CHANGELOG.md" in str(info.value)
        assert name not in vars(fmodel)
    fmodel.note = "mine"  # other attributes are set as before
    assert fmodel.note == "mine"


@pytest.mark.parametrize("name", ["protonet", "r2d2"])
def test_a_recipe_without_an_inner_loop_says_it_has_none_to_measure(name):
    fmodel = fm.functional_model(nn.Sequential(nn.Flatten(), nn.Linear(12, 8)))
    x, y = torch.randn(2, 8, 3, 4), torch.arange(4).repeat(2, 2)
    extra = {"head": fm.heads.RidgeHead()} if name == "r2d2" else {}
    with pytest.raises(ValueError, match="no inner loop to measure") as info:
        getattr(fm.recipes, name)(
            fmodel, fmodel.params, F.cross_entropy, (x, y), (x, y), task_chunk="tune", **extra
        )
    assert "result.chunk" not in str(info.value)


@pytest.mark.parametrize("bad", [0, "fast"])
def test_evaluate_checks_its_chunk_before_any_episode_even_one_task_at_a_time(bad):
    fmodel = fm.functional_model(nn.Sequential(nn.Flatten(), nn.Linear(6, 5)))
    episodes = fm.data.Episodes(
        torch.randn(60, 6), torch.arange(10).repeat_interleave(6), ways=5, shots=1, query=2
    )
    with pytest.raises(ValueError, match=r"fm\.evaluate: task_chunk must be"):
        fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            fm.optim.sgd(lr=0.1),
            steps=1,
            num_episodes=2,
            batch_tasks=1,
            task_chunk=bad,
        )
    with pytest.raises(ValueError, match="no inner loop to measure"):
        fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            method="prototypes",
            num_episodes=2,
            task_chunk="tune",
        )


@pytest.mark.parametrize("task_chunk", [2, None])
def test_the_compiled_steps_plain_path_runs_on_the_steps_chunk(task_chunk, monkeypatch):
    net, b = sinusoid(tasks=4)
    fmodel = fm.functional_model(net)
    step = fm.compile_meta_step(
        fmodel, F.mse_loss, fm.optim.sgd(lr=0.1), steps=2, compile=False, task_chunk=task_chunk
    )
    seen = chunks_run(monkeypatch)
    step(b.support, b.query)
    assert seen == [task_chunk] * 3  # two inner steps and the query pass
