"""Task batching on sequence models: few-shot text classification, one MAML meta-iteration
batched (``fm.adapt_tasks``) against a Python loop over the tasks (``fm.adapt``).

Each task is 5-way with 5 support and 5 query sequences per class (25 + 25 sequences of 32
tokens, vocabulary 1000), padded: every sequence has a random length from 16 to 32 and an
``attention_mask``. Models, built from configs (dropout off, so that the implementations
can be compared): BERT-small, GPT-2-small and Llama-small (2 layers, hidden 128, 4 heads,
``"sdpa"`` attention), an ``nn.TransformerEncoder`` classifier of the same size
(``encoder``), one ``nn.MultiheadAttention`` layer returning its weights (``mha``), and
embedding + LSTM / GRU classifiers (hidden 128; ``lstm-packed`` and
``gru-packed`` pack the sequences by their lengths, which differ within and across tasks). One inner SGD
step, first and second order. "batched" runs all tasks in one vmapped computation
(``task_chunk=None``); "default" as a user gets it, a fresh model with the default
``task_chunk="auto"``, whose chunk is a rule of the shapes ("default chose": its choice; the
calls and seconds columns, from when the default measured, read 0); "tuned" with the fastest
chunk ``fm.tune_task_chunk`` measured on the workload, passed as ``task_chunk`` (its cost is
printed). Each query pass runs on its inner loop's chunk (``task_chunk=result.chunk``).
Medians of ``--repeats`` meta-iterations, the implementations interleaved in one process,
each round in a rotated order. "agree": the meta-gradients are within 1% of
each tensor's largest entry (float32; exactness is tested in float64 by
tests/batching/test_task_intercept.py and tests/batching/test_task_recurrent.py). Then the peak memory of the
loop and of the batched run: the most tensor memory allocated at once above the start of the
meta-iteration, from the allocation events of ``torch.profiler`` (a fresh process each).
Those are the bytes the tensors take, whatever the C allocator does with them: the resident
set, measured here before, undercounted the loop, whose many small tensors glibc served
from memory the warm-up had left in its heap (a GRU's first-order loop read 19 MiB that
way, 59 MiB counted by allocations; 4,500 tensors of 12.8 KB, 55 MiB, grew the resident set
by 34 MiB even with glibc's mmap threshold at 4 KiB).

    python benchmarks/speed/sequence_tasks.py [--tasks 4 16 32] [--models bert gpt2 llama encoder mha lstm gru lstm-packed gru-packed]
        [--orders second first] [--repeats 3] [--threads N] [--no-tune] [--skip-memory]
        [--skip-timing] [--memory-tasks 16] [--keep-freed-memory]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import funcmeta as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
import _common

WAYS, SHOTS, QUERIES, LENGTH, VOCAB, HIDDEN, LR = 5, 5, 5, 32, 1000, 128, 0.1


class RecurrentClassifier(nn.Module):
    """Embedding, LSTM or GRU, and a head on the last real token's output; with ``packed``,
    the sequences packed by their lengths and the head on the final state."""

    def __init__(self, kind: str, packed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(HIDDEN, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, WAYS)
        self.packed = packed

    def forward(self, input_ids, attention_mask):
        if self.packed:
            lengths = attention_mask.sum(1)
            x = pack_padded_sequence(
                self.embed(input_ids), lengths, batch_first=True, enforce_sorted=False
            )
            state = self.rnn(x)[1]
            return self.head((state[0] if isinstance(state, tuple) else state)[-1])
        out, _ = self.rnn(self.embed(input_ids))
        last = attention_mask.sum(1) - 1  # the last real token of each sequence
        return self.head(out[torch.arange(out.shape[0]), last])


class EncoderClassifier(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` (2 layers, hidden 128, 4 heads, padding masked by
    ``src_key_padding_mask``) and a head on the mean of the real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 4, 4 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, WAYS)

    def forward(self, input_ids, attention_mask):
        out = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(out.dtype)
        return self.head((out * keep).sum(1) / keep.sum(1))


class AttentionClassifier(nn.Module):
    """Embedding, one ``nn.MultiheadAttention`` (hidden 128, 4 heads, sequence-first, called
    as a user often calls it: on a transposed view, with its default ``need_weights=True``,
    the weights averaged over the heads) and a head on the attention-weighted mean of the
    outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, 4)
        self.head = nn.Linear(HIDDEN, WAYS)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids).transpose(0, 1)  # (L, N, E)
        out, weights = self.attn(x, x, x, key_padding_mask=attention_mask == 0)
        pooled = (weights.mean(1).unsqueeze(-1) * out.transpose(0, 1)).sum(1)
        return self.head(pooled)


def build(name: str) -> nn.Module:
    if name == "encoder":
        return EncoderClassifier()
    if name == "mha":
        return AttentionClassifier()
    if name in ("lstm", "gru", "lstm-packed", "gru-packed"):
        return RecurrentClassifier(name[:4].rstrip("-"), packed=name.endswith("packed"))
    import transformers as tr

    common = dict(num_labels=WAYS, pad_token_id=0, attn_implementation="sdpa")
    if name == "bert":
        cfg = tr.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=4 * HIDDEN,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        return tr.BertForSequenceClassification(cfg)
    if name == "gpt2":
        cfg = tr.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
        return tr.GPT2ForSequenceClassification(cfg)
    cfg = tr.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        **common,
    )
    return tr.LlamaForSequenceClassification(cfg)


def episodes(tasks: int, seed: int = 0) -> tuple[tuple, tuple]:
    """Support and query sets: ``({"input_ids", "attention_mask"}, labels)``, task axis first."""
    g = torch.Generator().manual_seed(seed)

    def one(per_class: int) -> tuple:
        n = WAYS * per_class
        ids = torch.randint(1, VOCAB, (tasks, n, LENGTH), generator=g)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (tasks, n), generator=g)
        mask = (torch.arange(LENGTH) < lengths[..., None]).long()
        mask[:, 0, -1] = 0  # padding in every task
        labels = torch.arange(WAYS).repeat_interleave(per_class).repeat(tasks, 1)
        return {"input_ids": ids * mask, "attention_mask": mask}, labels

    return one(SHOTS), one(QUERIES)


def loss_fn(out, labels):
    return F.cross_entropy(getattr(out, "logits", out), labels)


def loop_meta(fmodel, support, query, first_order: bool):
    opt, total = fm.optim.sgd(lr=LR), 0.0
    for t in range(support[1].shape[0]):
        s = ({k: v[t] for k, v in support[0].items()}, support[1][t])
        q = {k: v[t] for k, v in query[0].items()}
        r = fm.adapt(fmodel, fmodel.params, loss_fn, s, opt, steps=1, first_order=first_order)
        total = total + loss_fn(fmodel(r.params, **q), query[1][t])
    return total


def batched_meta(fmodel, support, query, first_order: bool, task_chunk="auto"):
    opt = fm.optim.sgd(lr=LR)
    r = fm.adapt_tasks(
        fmodel,
        fmodel.params,
        loss_fn,
        support,
        opt,
        steps=1,
        first_order=first_order,
        task_chunk=task_chunk,
    )
    return fm.task_losses(fmodel, r.params, loss_fn, query, task_chunk=r.chunk)[0].sum()


DEVICE = [torch.device("cpu")]  # --device


def on_device(batch: tuple) -> tuple:
    inputs, labels = batch
    device = DEVICE[0]
    return {k: v.to(device) for k, v in inputs.items()}, labels.to(device)


def memory_worker(name: str, impl: str, tasks: int, first_order: bool) -> None:
    torch.manual_seed(0)
    fmodel = fm.functional_model(build(name))
    support, query = episodes(tasks)
    meta = loop_meta if impl == "loop" else functools.partial(batched_meta, task_chunk=None)
    params = list(fmodel.params.values())
    torch.autograd.grad(meta(fmodel, support, query, first_order), params, allow_unused=True)
    with (
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof,
        torch.profiler.record_function("measured"),
    ):
        torch.autograd.grad(meta(fmodel, support, query, first_order), params, allow_unused=True)
    print(json.dumps({"peak": _common.peak_allocated(prof, "measured")}))


def peak_memory(name: str, impl: str, tasks: int, first_order: bool, threads: int) -> float:
    """MiB, in a fresh process (see the module docstring)."""
    command = [
        sys.executable,
        __file__,
        "--threads",
        str(threads),
        "--memory-worker",
        name,
        impl,
        str(tasks),
        str(int(first_order)),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"] / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--device", default="cpu", help="cuda: time on the GPU (no memory)")
    parser.add_argument(
        "--models",
        nargs="+",
        default=[
            "bert",
            "gpt2",
            "llama",
            "encoder",
            "mha",
            "lstm",
            "gru",
            "lstm-packed",
            "gru-packed",
        ],
    )
    parser.add_argument("--orders", nargs="+", default=["second", "first"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="intra-op threads (default: every core; these models keep them busy)",
    )
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--memory-tasks", type=int, default=16)
    parser.add_argument("--memory-worker", nargs=4, default=None, help=argparse.SUPPRESS)
    _common.add_allocator_option(parser, False, _common.ALLOCATOR_WHY)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*once per task.*")
    if args.memory_worker:
        name, impl, tasks, first = args.memory_worker
        memory_worker(name, impl, int(tasks), bool(int(first)))
        return
    DEVICE[0] = torch.device(args.device)
    allocator = _common.use_allocator(args)
    where = (
        f"GPU: {torch.cuda.get_device_name()}"
        if DEVICE[0].type == "cuda"
        else f"CPU: {platform.processor() or platform.machine()}, {args.threads} threads"
    )
    print(f"{where}, torch {torch.__version__}, Python {platform.python_version()}; {allocator}")
    print(
        "model  order   T  agree  loop ms  batched ms  default ms          default chose  tuned ms  chunk"
        "  loop/batched  loop/default  loop/tuned  batched"
    )
    for name in [] if args.skip_timing else args.models:
        for order in args.orders:
            first = order == "first"
            for tasks in args.tasks:
                torch.manual_seed(0)
                net = build(name).to(DEVICE[0])
                support, query = (on_device(b) for b in episodes(tasks))
                plain = fm.functional_model(net)
                # each implementation's model and the task_chunk of its calls
                impls: dict[str, tuple[fm.FunctionalModel, Any]] = {
                    "loop": (plain, None),
                    "batched": (fm.functional_model(net), None),
                    "default": (fm.functional_model(net), "auto"),
                }
                tune_s, chunk = None, "-"
                if not args.no_tune:
                    tuned = fm.functional_model(net)
                    start = time.perf_counter()
                    times = fm.tune_task_chunk(
                        tuned,
                        tuned.params,
                        loss_fn,
                        support,
                        fm.optim.sgd(lr=LR),
                        steps=1,
                        query=query,
                        repeats=2,
                        first_order=first,
                    )
                    tune_s = time.perf_counter() - start
                    best = min(times, key=times.__getitem__)
                    tuned_chunk = None if best >= tasks else best
                    chunk = tuned_chunk or "all"
                    impls["tuned"] = (tuned, tuned_chunk)
                params = list(net.parameters())
                calls = {
                    k: functools.partial(loop_meta, m, support, query, first)
                    if k == "loop"
                    else functools.partial(batched_meta, m, support, query, first, c)
                    for k, (m, c) in impls.items()
                }
                timings = {
                    k: functools.partial(_common.timed_grad, c, params, DEVICE[0], True)
                    for k, c in calls.items()
                }
                # warm-up, and the gradients to compare
                grads = {k: timing()[1] for k, timing in timings.items()}
                tuning = _common.until_chosen(timings["default"], impls["default"][0])
                med = _common.medians(_common.rounds(timings, args.repeats))
                ok = all(_common.agree(grads[k], grads["loop"]) for k in impls)
                mode = "per task" if impls["batched"][0].per_task else "batched"
                tuned_ms = f"{med['tuned']:9.1f}" if "tuned" in med else "        -"
                tuned_ratio = (
                    f"{med['loop'] / med['tuned']:10.2f}" if "tuned" in med else "         -"
                )
                choice = _common.default_choice(impls["default"][0], tuning, med["default"])
                print(
                    f"{name:6} {order:6} {tasks:3}  {'yes' if ok else 'NO ':5} {med['loop']:8.1f} "
                    f"{med['batched']:11.1f} {med['default']:11.1f} {choice:>22} "
                    f"{tuned_ms} {chunk!s:>6} "
                    f"{med['loop'] / med['batched']:13.2f} {med['loop'] / med['default']:13.2f} "
                    f"{tuned_ratio}  {mode}"
                    + (f"  (tuning took {tune_s:.1f} s)" if tune_s else ""),
                    flush=True,
                )
    if args.skip_memory or DEVICE[0].type == "cuda":
        return
    print(f"\npeak memory, T = {args.memory_tasks}, MiB above the start of the meta-iteration")
    print("model  order   loop  batched  batched/loop")
    for name in args.models:
        for order in args.orders:
            first = order == "first"
            loop_mib = peak_memory(name, "loop", args.memory_tasks, first, args.threads)
            batched_mib = peak_memory(name, "batched", args.memory_tasks, first, args.threads)
            print(
                f"{name:6} {order:6} {loop_mib:6.1f} {batched_mib:8.1f} {batched_mib / loop_mib:13.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
