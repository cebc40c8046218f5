"""Omniglot one-shot classification on the official benchmark, every recipe, on a CPU budget.

Meta-trains conv4 (64 filters) with each recipe on the union of Omniglot's two minimal
background splits (242 distinct characters; 90-degree rotations as extra classes), holding out
some characters, then evaluates:

(a) the 20 official within-alphabet 20-way one-shot runs (``all_runs.zip``): error % with a
    95% interval over the runs, beside the dataset's Modified Hausdorff Distance baseline,
    recomputed here from the same images;
(b) 600 seeded 5-way 1-shot and 600 20-way 1-shot episodes of the held-out characters.

On the way it records a learning curve: every ``--curve-every`` seconds of meta-training
(the clock stops meanwhile), the held-out accuracy on a fixed seeded set of 5-way and 20-way
episodes (``--curve-episodes`` of each), so a reader sees whether a method is still climbing
when its budget ends.

Each method trains with its settings for a few minutes of a CPU (``BUDGET`` below: the
published ones scaled to the budget, and the zeroing trick for the methods with a head);
``--settings published`` gives each method's own published settings (``PUBLISHED``, with the
paper and section each comes from), ``--settings shared`` one shared set for every recipe
(the options below), and ``--set RECIPE.KEY=VALUE`` changes one of them.

    python examples/omniglot.py --data data/omniglot --download            # every recipe
    python examples/omniglot.py --recipes maml protonet --budget 120
    python examples/omniglot.py --recipes maml --settings published --set maml.zero_head=True
    python examples/omniglot.py --data ../shared/data/omniglot --budget 20 --eval-episodes 50
    python examples/omniglot.py --data ../shared/data/omniglot --recipes maml --budget 20 --eval-episodes 50
    python examples/omniglot.py --combine maml.json protonet.json --plot both.png  # no training

``--download`` fetches the three official files the run reads (the two minimal background
splits and ``all_runs.zip``) into ``--data``, each checked against its sha256; without them
(and without ``--download``) the script stops with one message that names the files, where
they are published and ``--download``, and exits with status 1.

Running time on a CPU, measured on this project's 2-core AMD EPYC shared with other jobs
(2026-11-26; load average about 5: an idle machine is faster): the run ``--data
../shared/data/omniglot --recipes maml --budget 20 --eval-episodes 50`` took 281 s (20 s of
training, 24 s of evaluation; the rest reads the data, computes the baseline on the runs and
scores the learning curve's points). The default run, every recipe at 240 s, took 72 minutes
on 2 idle AMD EPYC cores (2026-11-24, docs/fewshot.md).

MAML-family models get a 20-way head (the official runs are 20-way); on 5-way episodes they
are adapted and scored on its first 5 outputs (``fm.evaluate`` does this). Prototypical
Networks and R2D2 (a closed-form ridge-regression head) use the same conv4 without a head.
``--budget`` is the meta-training time of each recipe in seconds; evaluation comes on top.
Results go to ``--out`` (JSON) and a plot (errors on the runs, and the learning curves).
It is also the shared Omniglot example module: ``benchmarks/peers/omniglot_peers.py`` runs
MAML, ANIL and Meta-SGD here against higher, TorchOpt and learn2learn, and the tests import it.
What it offers them: :func:`parser` (the options), :func:`prepare` (the data, held-out split and
official runs), :class:`Recipe` (a recipe with its settings and outer optimizer),
:func:`training_episodes`, :class:`Trainer` and :func:`meta_train` (training on a clock, with the
learning curve), :func:`curve_sets`, :func:`evaluate_recipe`, :func:`save_results` and
:func:`read_results`. The Omniglot files themselves are read by ``funcmeta.data``
(:func:`funcmeta.data.load_omniglot`, :func:`funcmeta.data.download_omniglot`).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from _threads import add_threads_option, available_cores, use_threads

import funcmeta as fm

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

RECIPES = ("maml", "fomaml", "metasgd", "anil", "reptile", "mamlpp", "imaml", "protonet", "r2d2")
EMBEDDINGS = ("protonet", "r2d2")  # no inner loop, no classifier layer
COMPILED = ("maml", "fomaml", "metasgd", "anil")  # what --compiled runs as one graph
MHD_STATED = 0.388  # the dataset's own demo, demo_classification.py


SPLITS = ["background_small1", "background_small2"]  # the minimal background splits


def no_data(folder: Path, missing: dict[str, str], why: str, downloading: bool) -> str:
    """The message of a run without its files: which ones, where to put them, and how."""
    files = "\n".join(f"  {name}  ({address})" for name, address in missing.items())
    by_hand = f"download them yourself into {folder} (the zip archives as published, or unpacked)."
    how = (
        by_hand[0].upper() + by_hand[1:]
        if downloading
        else f"Rerun with --download to fetch them there (each checked against its sha256), or {by_hand}"
    )
    return f"{why}\nThis script reads these official Omniglot files from --data {folder}:\n{files}\n{how}"


def check_data(args: argparse.Namespace) -> None:
    """Stop with one message, not a traceback, when ``--data`` lacks a file the run reads
    and ``--download`` is not given."""
    missing = fm.data.missing_omniglot_files(args.data, SPLITS, runs=True)
    if missing and not args.download:
        raise SystemExit(no_data(args.data, missing, f"no Omniglot data in {args.data}.", False))


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The union of the two minimal background splits, one class per distinct character
    (Greek and Latin are in both, drawing for drawing: they come once)."""
    return fm.data.load_omniglot(args.data, SPLITS, size=28, download=args.download)


def split_characters(
    images: torch.Tensor, labels: torch.Tensor, held_out: int, seed: int
) -> tuple[fm.data.Episodes, tuple[torch.Tensor, torch.Tensor]]:
    """Meta-training classes (each kept character in 4 rotations) and the held-out characters."""
    train, test = fm.data.split_classes(
        labels,
        [len(labels.unique()) - held_out, held_out],
        generator=torch.Generator().manual_seed(seed),
    )
    keep = torch.isin(labels, torch.tensor(train))
    x, y = images[keep], labels[keep]
    remap = {c: i for i, c in enumerate(train)}
    y = torch.tensor([remap[c] for c in y.tolist()])
    turns = [torch.rot90(x, k, dims=(2, 3)) for k in range(4)]
    x_rot, y_rot = torch.cat(turns), torch.cat([y + k * len(train) for k in range(4)])
    held = torch.isin(labels, torch.tensor(test))
    return (x_rot, y_rot), (images[held], labels[held])


# Each method's own settings for 20-way 1-shot Omniglot (the official runs are 20-way), as
# published; ``--settings shared`` gives every recipe the one shared set instead.
PUBLISHED: dict[str, dict] = {
    # Finn et al. (2017), section 5.2: 20-way, 5 steps at 0.1 in training and test,
    # meta-batch 16, Adam at 1e-3; one query per class (their code's K query examples)
    "maml": dict(steps=5, inner_lr=0.1, meta_batch=16),
    # the same, first order (Finn et al. 2017, section 5.2)
    "fomaml": dict(steps=5, inner_lr=0.1, meta_batch=16),
    # Raghu et al. (2020) follow MAML's settings, adapting the head alone
    "anil": dict(steps=5, inner_lr=0.1, meta_batch=16),
    # Li et al. (2017): one step with per-element rates from U[0.005, 0.1]; MAML's rest
    "metasgd": dict(steps=1, meta_batch=16, rates=(0.005, 0.1)),
    # Antoniou et al. (2019), the authors' 20-way 1-shot configuration: 5 steps, per-layer
    # per-step rates from 0.1, meta-batch 16, multi-step loss over the first 8% of training,
    # second order from the start, meta lr cosine-annealed from 1e-3 to 1e-5
    "mamlpp": dict(
        steps=5,
        inner_lr=0.1,
        meta_batch=16,
        msl_fraction=0.08,
        first_order_fraction=0.0,
        cosine_to=1e-5,
    ),
    # Rajeswaran et al. (2019), the authors' command for 1-shot Omniglot: 16 steps at 0.1,
    # lambda 2, 5 CG steps, meta-batch 32
    "imaml": dict(steps=16, inner_lr=0.1, lam=2.0, cg_steps=5, meta_batch=32),
    # Nichol et al. (2018), the authors' command for 1-shot 20-way Omniglot: 9 examples per
    # class, 12 inner Adam steps (beta1 = 0, lr 4.6e-4) on 15 at a time, meta-batch 3,
    # outer step 1 annealed linearly to 0; tested with 97 steps (on 10 at a time there; here on
    # the whole support set: fm.evaluate takes full batches)
    "reptile": dict(
        steps=12,
        inner_lr=4.6e-4,
        inner_adam=True,
        inner_batch=15,
        train_shots=9,
        meta_batch=3,
        eps=1.0,
        eps_final=0.0,
        test_steps=97,
    ),
    # Snell et al. (2017), section 3.2: 60-way training episodes with 5 queries per class,
    # one episode per iteration, Adam at 1e-3 halved every 2000 episodes
    "protonet": dict(ways=60, query=5, meta_batch=1, halve_every=2000),
    # Bertinetto et al. (2019) publish their own 4-block network: the shared set here
    "r2d2": dict(),
}


# Each method's settings for a few minutes of a CPU (``--settings budget``, the default; the
# table in docs/fewshot.md): the published ones were made for tens of thousands of
# meta-iterations on a GPU, and at 240 s MAML makes 45 of them and iMAML 12. Changed from the
# published settings, for every method with a head, after a sweep at this budget (in
# docs/fewshot.md): the zeroing trick (Kao et al. 2022: the head starts every inner loop
# at zero), an outer Adam step of 3e-3 and 4 tasks per meta-batch; and each method's own
# changes, below. ProtoNets keep theirs.
HEADED = dict(meta_batch=4, meta_lr=3e-3, zero_head=True)  # common to the methods with a head
BUDGET: dict[str, dict] = {
    # one step at 0.4 instead of 5 at 0.1 (5 steps cost five times as much per iteration)
    "maml": dict(HEADED, steps=1, inner_lr=0.4),
    "fomaml": dict(HEADED, steps=5, inner_lr=0.1),
    "anil": dict(HEADED, steps=1, inner_lr=0.4),
    "metasgd": dict(HEADED, steps=1, rates=(0.1, 0.4)),
    # MAML++'s per-layer per-step rates and cosine annealing, on MAML's budget settings
    "mamlpp": dict(
        HEADED,
        steps=1,
        inner_lr=0.4,
        msl_fraction=0.08,
        first_order_fraction=0.0,
        cosine_to=1e-5,
    ),
    # 5 proximal steps at 0.1 with lambda 0.5 instead of 16 with lambda 2, 2 CG steps, and 5
    # queries per class: iMAML's query pass is a single gradient, cheap beside its inner loop
    # and its solve, and a meta-batch of 2 or one query per class did worse. Tested with 15
    # steps: its meta-gradient is that of the proximal problem's minimum, which 5 steps only
    # approach; 15 at test cost nothing in training and gained 5.7 points on 5-way
    "imaml": dict(HEADED, steps=5, inner_lr=0.1, lam=0.5, cg_steps=2, query=5, test_steps=15),
    # 5 SGD steps at 0.1 on batches of 20 drawn from 5 examples per class (each step a new
    # batch, as Reptile needs), and its update theta - phi fed to Adam at 3e-3, as Nichol et
    # al. (2018) suggest, instead of SGD with a step of 1 annealed to 0; tested
    # with the same 5 steps. The published settings with the zeroing trick were no better
    "reptile": dict(HEADED, steps=5, inner_lr=0.1, train_shots=5, inner_batch=20, outer="adam"),
    "protonet": PUBLISHED["protonet"],
    "r2d2": dict(),
}


# Every key a recipe's settings may have (``--set`` refuses others).
SETTING_KEYS = frozenset(
    [
        "cg_steps",
        "cosine_to",
        "damping",
        "eps",
        "eps_final",
        "first_order_fraction",
        "halve_every",
        "inner_adam",
        "inner_batch",
        "inner_lr",
        "lam",
        "lam_damping",
        "meta_batch",
        "meta_lr",
        "msl_fraction",
        "outer",
        "query",
        "rates",
        "steps",
        "test_steps",
        "train_shots",
        "ways",
        "zero_head",
    ]
)


def setting(text: str) -> tuple[str, str, object]:
    """One ``--set RECIPE.KEY=VALUE``: the value is a Python literal (``0.2``, ``True``,
    ``(0.1, 0.4)``, ``"adam"``; a bare word is a string); ``None`` drops the recipe's own value
    (the shared one applies, or none)."""
    target, eq, raw = text.partition("=")
    name, dot, key = target.partition(".")
    if not eq or not dot:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RECIPE.KEY=VALUE")
    if name not in RECIPES:
        raise argparse.ArgumentTypeError(f"{text!r}: no recipe {name!r} (one of {RECIPES})")
    if key not in SETTING_KEYS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: no setting {key!r} (one of {', '.join(sorted(SETTING_KEYS))})"
        )
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return name, key, value


def settings(name: str, args: argparse.Namespace) -> dict:
    """One recipe's settings: the shared ones (from the command line), overridden by its
    budget ones (the default) or its published ones (``--settings published``; ``--settings
    shared`` keeps the shared ones), then by ``--set``."""
    shared = {
        "steps": {
            "fomaml": args.fomaml_steps,
            "reptile": args.reptile_steps,
            "imaml": args.imaml_steps,
        }.get(name, args.steps),
        "inner_lr": args.inner_lr,
        "meta_batch": args.meta_batch,
        "meta_lr": args.meta_lr,
        "ways": args.ways,
        "query": args.query,
        "lam": args.imaml_lam,
        "eps": args.reptile_eps,
        "rates": (0.1, 0.4),
    }
    own = {"budget": BUDGET, "published": PUBLISHED}.get(args.settings, {}).get(name, {})
    cfg = {**shared, **own}
    for recipe, key, value in getattr(args, "set", None) or []:
        if recipe != name:
            continue
        if value is not None:
            cfg[key] = value
        elif key in shared:
            cfg[key] = shared[key]
        else:
            cfg.pop(key, None)
    return cfg


class Recipe:
    """One recipe's model, learnable extras, outer optimizer, outer loss and evaluation."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = self.method = name  # name: the label; method: the recipe
        self.args = args
        self.cfg = cfg = settings(name, args)
        head = None if name in EMBEDDINGS else args.ways
        self.net = fm.models.conv4_omniglot(head, hidden=args.hidden)
        self.fmodel = fm.functional_model(self.net)
        params = self.fmodel.params
        self.rates = None
        if name == "metasgd":
            self.rates = fm.recipes.metasgd_rates(
                params, *cfg["rates"], generator=torch.Generator().manual_seed(args.seed)
            )
        elif name == "mamlpp":
            self.rates = fm.hyper.per_layer(params, cfg["inner_lr"], steps=cfg["steps"])
        extra = list(self.rates.parameters()) if self.rates is not None else []
        # R2D2's ridge-regression head, with its learnable regulariser, scale and bias
        self.ridge = fm.heads.RidgeHead(lam=1.0, scale=5.0) if name == "r2d2" else None
        if self.ridge is not None:
            extra = list(self.ridge.parameters())
        if cfg.get("outer", "sgd") not in ("sgd", "adam") or ("outer" in cfg and name != "reptile"):
            raise ValueError(
                f"{name}: outer={cfg['outer']!r}: only reptile has a choice of outer "
                "optimizer, 'sgd' (its step eps) or 'adam' (at meta_lr)"
            )
        if cfg.get("zero_head") and name in EMBEDDINGS:
            raise ValueError(f"{name}: zero_head: it has no head (it classifies by embeddings)")
        if name == "reptile" and cfg.get("outer") != "adam":  # theta += eps (phi - theta)
            self.outer = torch.optim.SGD(self.net.parameters(), lr=cfg["eps"])
        else:
            self.outer = torch.optim.Adam([*self.net.parameters(), *extra], lr=cfg["meta_lr"])
        self.steps = cfg["steps"]
        self.zero_head()
        self.episode_rng = torch.Generator().manual_seed(args.seed + 1)
        self.residuals: list[float] = []
        self.curvature_stops = 0
        self.warnings = 0
        self.compiled = self.compile() if args.compiled else None

    def compile(self) -> fm.MetaStep | None:
        """The meta-iteration as one compiled graph (``fm.compile_meta_step``) for the
        recipes it covers: MAML, FOMAML, Meta-SGD and ANIL with their SGD inner loop (the
        same meta-gradients as the recipe); ``None`` for the others, which run as before."""
        if self.method not in COMPILED or self.cfg.get("inner_adam"):
            return None
        return fm.compile_meta_step(
            self.fmodel,
            F.cross_entropy,
            self.inner_opt(),
            steps=self.steps,
            hyper=[] if self.rates is None else [self.rates],
            first_order=self.method == "fomaml",
            trainable="head" if self.method == "anil" else None,
            task_chunk="auto" if self.args.task_chunk is None else self.args.task_chunk,
        )

    def zero_head(self) -> None:
        """The zeroing trick (Kao et al. 2022, "MAML is a Noisy Contrastive Learner in
        Classification"): with ``zero_head`` set, the head starts every inner loop
        at zero, so no learned class order has to be unlearned on tasks whose labels are drawn
        afresh each time. Called at the start and after each outer step."""
        if self.cfg.get("zero_head") and self.method not in EMBEDDINGS:
            with torch.no_grad():
                for p in self.net.head.parameters():
                    p.zero_()

    def schedule(self, progress: float, episodes: int) -> None:
        """The outer step size at ``progress`` (0 to 1) of the budget: Reptile's linear
        annealing, MAML++'s cosine annealing, ProtoNets' halving."""
        cfg, group = self.cfg, self.outer.param_groups[0]
        if "eps_final" in cfg:
            group["lr"] = cfg["eps"] + (cfg["eps_final"] - cfg["eps"]) * progress
        elif "cosine_to" in cfg:
            low, high = cfg["cosine_to"], cfg["meta_lr"]
            group["lr"] = low + 0.5 * (high - low) * (1 + math.cos(math.pi * progress))
        elif "halve_every" in cfg:
            group["lr"] = cfg["meta_lr"] * 0.5 ** (episodes // cfg["halve_every"])

    def inner_opt(self) -> fm.optim.GradientTransformation:
        cfg = self.cfg
        if cfg.get("inner_adam"):
            return fm.optim.adam(lr=cfg["inner_lr"], betas=(0.0, 0.999))
        sgd = fm.optim.sgd(lr=cfg["inner_lr"] if self.rates is None else self.rates)
        if self.method == "imaml":
            anchor = {k: v.detach() for k, v in self.fmodel.params.items()}
            return fm.optim.chain(fm.optim.add_proximal(cfg["lam"], anchor), sgd)
        return sgd

    def loss(self, batch: fm.data.EpisodeBatch, progress: float) -> fm.recipes.RecipeResult:
        cfg, fmodel = self.cfg, self.fmodel
        args = (fmodel, self.fmodel.params, F.cross_entropy, batch.support, batch.query)
        if self.method == "protonet":
            return fm.recipes.protonet(*args)
        if self.method == "r2d2":
            return fm.recipes.r2d2(*args, head=self.ridge)
        own: dict = {"steps": self.steps}
        if self.method == "reptile":
            own["opt"] = self.inner_opt()
            if "inner_batch" in cfg:
                own["inner_batch"] = cfg["inner_batch"]
                own["generator"] = self.episode_rng
        else:
            own["lr"] = cfg["inner_lr"] if self.rates is None else self.rates
        if self.method == "anil":
            own["trainable"] = "head"
        elif self.method == "imaml":
            own["lam"] = cfg["lam"]
            own["cg_steps"] = cfg.get("cg_steps", 5)
            for key in ("damping", "lam_damping"):  # default: the authors' damped system
                if key in cfg:
                    own[key] = cfg[key]
        elif self.method == "mamlpp":
            epoch = int(100 * progress)  # a hundred "epochs" over the budget
            msl = max(1, round(100 * cfg.get("msl_fraction", 0.3)))
            own["step_weights"] = fm.recipes.mamlpp_step_weights(self.steps, epoch, msl_epochs=msl)
            own["first_order"] = epoch < round(100 * cfg.get("first_order_fraction", 0.3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", fm.recipes.ConvergenceWarning)
            out = getattr(fm.recipes, self.method)(*args, **own)
        self.warnings += len(caught)
        if isinstance(out, fm.recipes.ImamlResult):
            self.residuals.append(out.residual.max().item())
            self.curvature_stops += int(out.curvature_stop.sum())
        return out

    def test_steps(self) -> int:
        return self.cfg.get("test_steps", self.steps)

    def evaluate(
        self, episodes: fm.data.Episodes | fm.data.EpisodeBatch, n: int, seed: int | None = None
    ) -> fm.Evaluation:
        fmodel = self.fmodel
        seed = self.args.seed if seed is None else seed
        if self.method in EMBEDDINGS:
            return fm.evaluate(
                fmodel,
                fmodel.params,
                F.cross_entropy,
                episodes,
                method="prototypes" if self.ridge is None else self.ridge,
                num_episodes=n,
                seed=seed,
            )
        own = {"trainable": "head"} if self.method == "anil" else {}
        return fm.evaluate(
            fmodel,
            fmodel.params,
            F.cross_entropy,
            episodes,
            self.inner_opt(),
            steps=self.test_steps(),
            num_episodes=n,
            seed=seed,
            **own,
        )


def training_episodes(recipe: Recipe, x: torch.Tensor, y: torch.Tensor) -> fm.data.Episodes:
    """The recipe's meta-training episodes: its ways, shots (Reptile trains on more) and
    queries per class."""
    cfg = recipe.cfg
    return fm.data.Episodes(
        x, y, ways=cfg["ways"], shots=cfg.get("train_shots", 1), query=cfg["query"]
    )


class Trainer:
    """One recipe's meta-training, an iteration at a time, on its own clock: ``step()`` until
    ``done`` (the budget is spent, or ``--iterations``), then ``finish()`` for the log.

    Every ``args.curve_every`` seconds of training, and at the end, the recipe is scored on
    each of ``curve_sets`` (the same seeded episodes every time); its clock stops meanwhile,
    so the budget is training time alone. Several trainers stepped in turn share whatever the
    machine does meanwhile (``benchmarks/peers/omniglot_peers.py``)."""

    def __init__(
        self,
        recipe: Recipe,
        episodes: fm.data.Episodes,
        args: argparse.Namespace,
        curve_sets: dict[str, fm.data.Episodes] | None = None,
        *,
        progress: bool = True,
    ) -> None:
        self.recipe, self.episodes, self.args = recipe, episodes, args
        self.curve_sets = curve_sets or {}
        self.rng = torch.Generator().manual_seed(args.seed)
        self.bar = None
        if progress and tqdm is not None and not args.no_progress and sys.stderr.isatty():
            self.bar = tqdm(total=round(args.budget), desc=recipe.name, unit="s", leave=False)
        self.progress = progress and not args.no_progress
        self.trained = 0.0  # seconds of training so far
        self.last_print = self.last_curve = 0.0
        self.iteration = 0
        self.losses: list[float] = []
        self.accuracies: list[float] = []
        self.curve: list[dict] = []
        if self.curve_sets:
            self.score()

    @property
    def done(self) -> bool:
        return self.iteration >= self.args.iterations or self.trained >= self.args.budget

    def score(self) -> None:
        point = {"seconds": round(self.trained, 2), "iterations": self.iteration}
        for label, eps in self.curve_sets.items():
            point[label] = self.recipe.evaluate(
                eps, self.args.curve_episodes, seed=self.args.seed + 7
            ).accuracy
        self.curve.append(point)

    def step(self) -> None:
        """One meta-iteration, timed; a curve point when one is due."""
        recipe, args = self.recipe, self.args
        start = time.perf_counter()
        batch = self.episodes.sample(recipe.cfg["meta_batch"], generator=self.rng)
        recipe.schedule(self.trained / args.budget, self.iteration * recipe.cfg["meta_batch"])
        if recipe.compiled is not None:  # the step adds the meta-gradients to .grad
            recipe.outer.zero_grad()
            loss = recipe.compiled(batch.support, batch.query)
            recipe.outer.step()
            recipe.zero_head()
            self.losses.append(loss.item())
        else:
            out = recipe.loss(batch, self.trained / args.budget)
            recipe.outer.zero_grad()
            out.loss.backward()
            recipe.outer.step()
            recipe.zero_head()
            loss = out.query_loss if out.query_loss is not None else out.loss
            self.losses.append(loss.item())
            if out.logits is not None:
                accuracy = (out.logits.argmax(-1) == batch.y_query).float().mean().item()
                self.accuracies.append(accuracy)
        self.iteration += 1
        self.trained += time.perf_counter() - start
        losses = self.losses[-20:]
        if self.bar is not None:
            self.bar.update(round(self.trained) - self.bar.n)
            self.bar.set_postfix(it=self.iteration, loss=f"{sum(losses) / len(losses):.3f}")
        elif self.progress and self.trained - self.last_print > 30:
            print(
                f"  {recipe.name}: {self.trained:.0f} s, {self.iteration} iterations, "
                f"loss {self.losses[-1]:.3f}"
            )
            self.last_print = self.trained
        if self.curve_sets and self.trained - self.last_curve >= args.curve_every:
            self.score()
            self.last_curve = self.trained

    def finish(self) -> dict:
        """The last curve point (unless just taken) and the log."""
        if self.curve_sets and (not self.curve or self.curve[-1]["iterations"] != self.iteration):
            self.score()
        if self.bar is not None:
            self.bar.close()
        tail, acc = self.losses[-50:], self.accuracies[-50:]
        return {
            "iterations": self.iteration,
            "train_seconds": self.trained,
            "final_loss": sum(tail) / max(len(tail), 1),
            "train_query_accuracy": sum(acc) / len(acc) if acc else None,  # None: --compiled
            "curve": self.curve,
        }


def meta_train(
    recipe: Recipe,
    episodes: fm.data.Episodes,
    args: argparse.Namespace,
    curve_sets: dict[str, fm.data.Episodes] | None = None,
) -> dict:
    """Meta-train until the budget is spent (or ``--iterations``); returns the log (a
    :class:`Trainer` run to the end)."""
    trainer = Trainer(recipe, episodes, args, curve_sets)
    while not trainer.done:
        trainer.step()
    return trainer.finish()


def modified_hausdorff_error(runs_root: Path) -> float:
    """The dataset's baseline on the official runs: nearest training image by the Modified
    Hausdorff Distance between inked pixels, each set of points centred on its mean."""
    runs = fm.data.load_omniglot_runs(runs_root, size=105)

    def points(image: torch.Tensor) -> torch.Tensor:
        p = (image[0] > 0.5).nonzero().double()
        return p - p.mean(0)

    errors = []
    for r in range(runs.x_support.shape[0]):
        train = [points(x) for x in runs.x_support[r]]
        wrong = 0
        for q, answer in zip(runs.x_query[r], runs.y_query[r].tolist(), strict=True):
            pq = points(q)
            cost = []
            for pt in train:
                d = torch.cdist(pq, pt)
                cost.append(max(d.min(1).values.mean().item(), d.min(0).values.mean().item()))
            wrong += int(min(range(len(cost)), key=cost.__getitem__) != answer)
        errors.append(wrong / len(runs.y_query[r]))
    return sum(errors) / len(errors)


def plot(results: dict, mhd: float, path: Path) -> None:
    """Two panels: each recipe's error on the official runs, and its held-out accuracy
    against seconds of meta-training (the learning curves)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[examples])")
        return
    names = list(results)
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.2))
    err = [100 * results[n]["official_runs"]["error"] for n in names]
    ci = [100 * results[n]["official_runs"]["ci95"] for n in names]
    bars.bar(names, err, yerr=ci, capsize=3, color="tab:blue", alpha=0.8)
    bars.axhline(100 * mhd, color="tab:red", ls="--", label=f"MHD baseline ({100 * mhd:.1f}%)")
    bars.set_ylabel("error on the 20 official runs (%)")
    bars.set_title("official one-shot runs, 20-way (95% interval)")
    bars.tick_params(axis="x", rotation=45)
    bars.legend(loc="upper left", fontsize=8)
    bars.grid(axis="y", alpha=0.3)
    for i, n in enumerate(names):
        curve = results[n].get("curve") or []
        if not curve:
            continue
        t = [c["seconds"] for c in curve]
        color = f"C{i % 10}"
        curves.plot(t, [100 * c["5-way"] for c in curve], "-o", ms=3, color=color, label=n)
        curves.plot(t, [100 * c["20-way"] for c in curve], "--", color=color)
    curves.set_xlabel("seconds of meta-training")
    curves.set_ylabel("held-out 1-shot accuracy (%)")
    curves.set_title("learning curves: 5-way solid, 20-way dashed")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7, ncol=2, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def prepare(args: argparse.Namespace) -> dict:
    """The data, the held-out episode sets, the official runs and the baseline."""
    torch.manual_seed(args.seed)
    check_data(args)
    missing = fm.data.missing_omniglot_files(args.data, SPLITS, runs=True)
    try:
        images, labels, names = load_data(args)
        runs = fm.data.load_omniglot_runs(args.data, download=args.download)
    except OSError as e:  # a download that failed (the network, a timeout)
        raise SystemExit(no_data(args.data, missing, str(e), args.download)) from None
    (x_train, y_train), (x_held, y_held) = split_characters(
        images, labels, args.held_out, args.seed
    )
    mhd = modified_hausdorff_error(args.data)
    print(
        f"{len(names)} characters: {len(names) - args.held_out} for meta-training "
        f"(x4 rotations: {len(y_train.unique())} classes), {args.held_out} held out; "
        f"MHD baseline on the official runs: {100 * mhd:.2f}% error (stated: {100 * MHD_STATED:.1f}%)"
    )
    return {
        "train": (x_train, y_train),
        "held5": fm.data.Episodes(x_held, y_held, ways=5, shots=1, query=5),
        "held20": fm.data.Episodes(x_held, y_held, ways=20, shots=1, query=5),
        "runs": runs,
        "mhd": mhd,
    }


def curve_sets(data: dict, args: argparse.Namespace) -> dict[str, fm.data.Episodes] | None:
    """The held-out episode sets of the learning curves (none with ``--curve-episodes 0``)."""
    return {"5-way": data["held5"], "20-way": data["held20"]} if args.curve_episodes > 0 else None


def run_recipe(recipe: Recipe, data: dict, args: argparse.Namespace) -> dict:
    """Meta-train one recipe (with its learning curve), then evaluate it in full."""
    episodes = training_episodes(recipe, *data["train"])
    return evaluate_recipe(
        recipe, meta_train(recipe, episodes, args, curve_sets(data, args)), data, args
    )


def evaluate_recipe(recipe: Recipe, log: dict, data: dict, args: argparse.Namespace) -> dict:
    """Score a meta-trained recipe on the official runs and the held-out episodes; ``log``
    (its training log) with the results added."""
    start = time.perf_counter()
    official = recipe.evaluate(data["runs"], 20)
    five = recipe.evaluate(data["held5"], args.eval_episodes)
    twenty = recipe.evaluate(data["held20"], args.eval_episodes)
    log["eval_seconds"] = time.perf_counter() - start
    log["inner_steps"] = 0 if recipe.method in EMBEDDINGS else recipe.steps
    log["settings"] = {k: v for k, v in recipe.cfg.items() if not isinstance(v, tuple)}
    log["official_runs"] = {"error": official.error, "ci95": official.ci95}
    log["5way_1shot"] = {"accuracy": five.accuracy, "ci95": five.ci95}
    log["20way_1shot"] = {"accuracy": twenty.accuracy, "ci95": twenty.ci95}
    if recipe.residuals:
        r = sorted(recipe.residuals)
        log["cg_residual"] = {"median": r[len(r) // 2], "max": r[-1]}
        log["convergence_warnings"] = recipe.warnings
        log["curvature_stops"] = recipe.curvature_stops
    print(
        f"{recipe.name:9s} {log['iterations']:5d} it in {log['train_seconds']:4.0f} s | official "
        f"runs error {100 * official.error:5.1f}% ± {100 * official.ci95:4.1f} | 5-way "
        f"{100 * five.accuracy:5.1f}% ± {100 * five.ci95:3.1f} | 20-way "
        f"{100 * twenty.accuracy:5.1f}% ± {100 * twenty.ci95:3.1f} | eval {log['eval_seconds']:.0f} s"
        + (f" | CG residual max {log['cg_residual']['max']:.1e}" if recipe.residuals else "")
    )
    return log


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--data",
        type=Path,
        default=Path("data/omniglot"),
        help="folder with the official files images_background_small1.zip, "
        "images_background_small2.zip and all_runs.zip (as published or unpacked)",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="fetch the files missing from --data from the dataset's repository "
        f"({fm.data.OMNIGLOT_URL}), each checked against its sha256",
    )
    p.add_argument(
        "--recipes", nargs="+", choices=RECIPES, default=list(RECIPES), help="the recipes to run"
    )
    p.add_argument(
        "--settings",
        choices=("budget", "published", "shared"),
        default="budget",
        help="each method's settings for a few minutes of a CPU (BUDGET in this file), its "
        "published ones (PUBLISHED: made for tens of thousands of iterations), or the shared "
        "set given by the options below for every recipe",
    )
    p.add_argument(
        "--set",
        type=setting,
        action="append",
        metavar="RECIPE.KEY=VALUE",
        help="change one setting of one recipe on top of --settings (repeatable), e.g. "
        "--set maml.inner_lr=0.2 --set maml.zero_head=False; None drops a recipe's own value",
    )
    p.add_argument("--budget", type=float, default=240, help="meta-training seconds per recipe")
    p.add_argument(
        "--iterations", type=int, default=10**9, help="meta-iterations per recipe at most"
    )
    p.add_argument("--hidden", type=int, default=64, help="conv4's filters per layer")
    p.add_argument("--ways", type=int, default=20, help="ways in meta-training episodes")
    p.add_argument("--query", type=int, default=1, help="query examples per class in training")
    p.add_argument("--meta-batch", type=int, default=4, help="tasks per meta-iteration")
    p.add_argument(
        "--steps", type=int, default=1, help="inner steps, training and test (second order)"
    )
    p.add_argument("--fomaml-steps", type=int, default=5, help="FOMAML's inner steps")
    p.add_argument("--reptile-steps", type=int, default=5, help="Reptile's inner steps")
    p.add_argument("--imaml-steps", type=int, default=5, help="iMAML's proximal inner steps")
    p.add_argument("--inner-lr", type=float, default=0.4, help="inner SGD step size")
    p.add_argument("--meta-lr", type=float, default=1e-3, help="outer Adam step size")
    p.add_argument(
        "--reptile-eps", type=float, default=1.0, help="Reptile's outer step (SGD on theta - phi)"
    )
    p.add_argument("--imaml-lam", type=float, default=0.5, help="iMAML's proximal weight lambda")
    p.add_argument("--held-out", type=int, default=42, help="characters kept for evaluation (b)")
    p.add_argument(
        "--eval-episodes", type=int, default=600, help="held-out episodes per way in evaluation (b)"
    )
    p.add_argument(
        "--curve-every", type=float, default=30, help="seconds of training between curve points"
    )
    p.add_argument(
        "--curve-episodes",
        type=int,
        default=100,
        help="seeded held-out episodes per curve point and way (0: no curve)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split, models and episodes")
    p.add_argument(
        "--out", type=Path, default=Path("examples/out/omniglot.json"), help="results (JSON)"
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("examples/out/omniglot.png"),
        help="plot of the errors and the learning curves",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar, nor the line printed every 30 s of training in its place "
        "(where stderr is not a terminal or tqdm is missing)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="meta-train MAML, FOMAML, Meta-SGD and ANIL with fm.compile_meta_step: each "
        "compiles once (tens of seconds to minutes), then runs faster; pays for budgets of "
        "a few minutes (benchmarks/RESULTS.md)",
    )
    p.add_argument(
        "--task-chunk",
        type=int,
        default=None,
        help="with --compiled: tasks per graph call (default: fm.compile_meta_step's 'auto', "
        "1 on a CPU for conv4, all tasks on a GPU)",
    )
    p.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="no training: the results of earlier runs (their --out files, e.g. recipes run in "
        "parallel processes) in one --out file and one --plot",
    )
    add_threads_option(
        p,
        available_cores(),
        "the cores available: convolutions on 28x28 images gain from every core",
    )
    return p


def save_results(results: dict, data: dict, args: argparse.Namespace) -> dict:
    """Write the results and the settings to ``args.out`` (JSON) and plot them."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "mhd_error": data["mhd"],
        "settings": {k: str(v) for k, v in vars(args).items()},
        "recipes": results,
    }
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"results: {args.out}")
    plot(results, data["mhd"], args.plot)
    return summary


def read_results(paths: list[Path], option: str) -> list[dict]:
    """The results files of earlier runs (their ``--out``), each checked: readable, a results
    file of this script, every recipe in it evaluated, all on the same data (the same MHD
    baseline). A file that fails is refused by name (``option``: the flag it came with)."""
    summaries: list[dict] = []
    for path in paths:
        try:
            summary = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SystemExit(f"{option} {path}: cannot read it: {e}") from e
        if not (
            isinstance(summary, dict)
            and isinstance(summary.get("recipes"), dict)
            and isinstance(summary.get("mhd_error"), float)
        ):
            raise SystemExit(f"{option} {path}: not a results file of this script")
        if summaries and summary["mhd_error"] != summaries[0]["mhd_error"]:
            raise SystemExit(
                f"{option} {path}: another dataset (MHD baseline {summary['mhd_error']} "
                f"against {summaries[0]['mhd_error']})"
            )
        for name, result in summary["recipes"].items():
            if not isinstance(result, dict) or not isinstance(result.get("official_runs"), dict):
                raise SystemExit(f"{option} {path}: {name!r} has no results")
        summaries.append(summary)
    return summaries


def combine(args: argparse.Namespace) -> dict:
    """The results of earlier runs (``--combine``) in one file and one plot. The runs must be
    on the same data (the same MHD baseline) and name each recipe once."""
    results: dict = {}
    summaries = read_results(args.combine, "--combine")
    for path, summary in zip(args.combine, summaries, strict=True):
        for name, result in summary["recipes"].items():
            if name in results:
                raise SystemExit(f"--combine {path}: {name!r} is already in an earlier file")
            results[name] = result
    return save_results(results, {"mhd": summaries[0]["mhd_error"]}, args)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.combine:
        return combine(args)
    use_threads(args)
    data = prepare(args)
    results: dict = {}
    for name in args.recipes:
        torch.manual_seed(args.seed)
        results[name] = run_recipe(Recipe(name, args), data, args)
    summary = save_results(results, data, args)
    if not all(math.isfinite(r["final_loss"]) for r in results.values()):
        raise SystemExit("a recipe's meta-training loss is not finite")
    return summary


if __name__ == "__main__":
    main()
