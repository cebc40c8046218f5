"""Calls a type checker must reject: ``make lint`` runs mypy on this file and fails unless
mypy reports, for each call after a ``# expect:`` comment, an error with that text
(``scripts/check_type_errors.py``). It is never run: each call would also fail at run time,
with an error naming the option."""

import torch
import torch.nn.functional as F

import funcmeta as fm

fmodel = fm.functional_model(torch.nn.Linear(1, 1))
batch = (torch.randn(4, 1), torch.randn(4, 1))
tasks = (torch.randn(2, 4, 1), torch.randn(2, 4, 1))
sgd = fm.optim.sgd(lr=0.1)

# expect: Unexpected keyword argument "first_ordr" for "adapt"
fm.adapt(fmodel, fmodel.params, F.mse_loss, batch, sgd, steps=1, first_ordr=True)
# expect: Argument "truncate" to "adapt_tasks" has incompatible type "str"
fm.adapt_tasks(fmodel, fmodel.params, F.mse_loss, tasks, sgd, steps=1, truncate="1")
# expect: Unexpected keyword argument "checkpoint_step" for "maml"
fm.recipes.maml(fmodel, fmodel.params, F.mse_loss, batch, batch, steps=1, checkpoint_step=True)
# expect: Unexpected keyword argument "first_order" for "fomaml"
fm.recipes.fomaml(fmodel, fmodel.params, F.mse_loss, batch, batch, steps=1, first_order=False)
# expect: Unexpected keyword argument "allow_unsed" for "compile_meta_step"
fm.compile_meta_step(fmodel, F.mse_loss, sgd, steps=1, allow_unsed=True)
# expect: Unexpected keyword argument "trainabel" for "tune_task_chunk"
fm.tune_task_chunk(fmodel, fmodel.params, F.mse_loss, tasks, sgd, steps=1, trainabel=["weight"])
# expect: Unexpected keyword argument "first_ordr" for "evaluate"
fm.evaluate(fmodel, fmodel.params, fm.data.Sinusoid(), sgd, steps=1, first_ordr=True)
