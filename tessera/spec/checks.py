"""Checks that span sections (mesh vs model sizes, batch vs mesh, token ids vs vocab), run after schema validation.

Each check is a small named function `(exp) -> problems`, a problem being (key path, message, hint);
`CHECKS` lists them all and every problem found is reported at once.
"""

from __future__ import annotations

from typing import Callable, Iterator

from tessera.spec.schema import Experiment
from tessera.spec.tasks import BenchTask, ForwardTask, GenerateTask, TrainTask

Problem = tuple[tuple, str, "str | None"]

# model argument -> the logical axis its size is split along
ARG_AXES = {"heads": "heads", "kv_heads": "kv_heads", "experts": "experts", "d_ff": "mlp", "vocab": "vocab",
            "d_model": "embed"}


def shards(exp: Experiment, logical: str) -> tuple[int, str]:
    """How many ways `logical` is split on exp's mesh, and the mesh axes doing it ("tp", "dp*fsdp")."""
    rule = exp.parallel.rules.get(logical)
    axes = [] if rule is None else [rule] if isinstance(rule, str) else list(rule)
    n = 1
    for axis in axes:
        n *= getattr(exp.mesh, axis)
    return n, "*".join(axes)


def _divisors(n: int, limit: int = 3) -> str:
    found = [d for d in range(2, n + 1) if n % d == 0][:limit]
    return ", ".join(map(str, found)) if found else "1"


def _int_arg(exp: Experiment, name: str) -> int | None:
    value = exp.model.args.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_model_dims_divide(exp: Experiment) -> Iterator[Problem]:
    """Every sharded model dimension splits evenly over its mesh axes."""
    for arg, logical in ARG_AXES.items():
        size, (n, axes) = _int_arg(exp, arg), shards(exp, logical)
        if size is not None and n > 1 and size % n:
            yield (("model", "args", arg), f"{axes}={n} does not divide {arg}={size} "
                   f"(parallel.rules maps `{logical}` to {axes})",
                   f"use a mesh whose {axes} divides {size} (e.g. {_divisors(size)}), "
                   f"or map `{logical}` to null in parallel.rules")
    layers = _int_arg(exp, "layers")
    if layers is not None and layers % exp.mesh.pp:
        yield (("model", "args", "layers"), f"pp={exp.mesh.pp} pipeline stages do not divide layers={layers}",
               f"use pp among {_divisors(layers)}")


def check_gqa(exp: Experiment) -> Iterator[Problem]:
    """Grouped-query attention needs heads to be a multiple of kv_heads."""
    heads, kv = _int_arg(exp, "heads"), _int_arg(exp, "kv_heads")
    if heads and kv and heads % kv:
        yield (("model", "args", "kv_heads"), f"kv_heads={kv} does not divide heads={heads}",
               f"use one of {_divisors(heads, 5)}")


def check_batch_splits(exp: Experiment) -> Iterator[Problem]:
    """The batch splits into accumulation microbatches, pipeline microbatches and data-parallel shards."""
    task = exp.task
    if not isinstance(task, (TrainTask, BenchTask)):
        return
    per_step = task.batch
    if isinstance(task, TrainTask):
        if task.batch % task.microbatches:
            yield (("task", "batch"), f"batch={task.batch} does not split into microbatches={task.microbatches}",
                   f"use a batch that is a multiple of {task.microbatches}")
            return
        per_step = task.batch // task.microbatches
    n, axes = shards(exp, "batch")
    pipe = exp.parallel.pipeline.microbatches if exp.mesh.pp > 1 else 1
    if per_step % (n * pipe):
        parts = [f"{axes}={n}"] if n > 1 else []
        parts += [f"pipeline microbatches={pipe}"] if pipe > 1 else []
        yield (("task", "batch"), f"{per_step} sequences per microbatch do not split over {' and '.join(parts)}",
               f"use a batch that is a multiple of {n * pipe * (task.batch // per_step)}")


def check_seq_splits(exp: Experiment) -> Iterator[Problem]:
    """The sequence splits over the mesh axes `seq` maps to."""
    task = exp.task
    n, axes = shards(exp, "seq")
    if isinstance(task, (TrainTask, BenchTask)) and n > 1 and task.seq_len % n:
        yield (("task", "seq_len"), f"{axes}={n} does not divide seq_len={task.seq_len}",
               f"use a seq_len that is a multiple of {n}")


def _token_lists(exp: Experiment) -> Iterator[tuple[tuple, list[int]]]:
    task = exp.task
    if isinstance(task, GenerateTask):
        for i, p in enumerate(task.prompts):
            if isinstance(p, list):
                yield ("task", "prompts", i), p
        yield ("task", "stop_tokens"), task.stop_tokens
    elif isinstance(task, ForwardTask) and task.tokens:
        for i, row in enumerate(task.tokens):
            yield ("task", "tokens", i), row
    elif isinstance(task, TrainTask) and task.sample and isinstance(task.sample.prompt, list):
        yield ("task", "sample", "prompt"), task.sample.prompt


def check_token_ids(exp: Experiment) -> Iterator[Problem]:
    """Token ids written in the spec are below the model's vocab."""
    vocab = _int_arg(exp, "vocab")
    if vocab is None:
        return
    for path, ids in _token_lists(exp):
        for j, tok in enumerate(ids):
            if tok >= vocab:
                yield (path + (j,), f"token id {tok} is outside the vocabulary (vocab={vocab})",
                       f"use ids 0..{vocab - 1}")


def check_text_needs_tokenizer(exp: Experiment) -> Iterator[Problem]:
    """String prompts need the bytes tokenizer, and it needs a vocab of at least 256."""
    task, vocab = exp.task, _int_arg(exp, "vocab")
    texts: list[tuple] = []
    if isinstance(task, GenerateTask):
        texts = [("task", "prompts", i) for i, p in enumerate(task.prompts) if isinstance(p, str)]
        if task.tokenizer == "none":
            for path in texts:
                yield path, "a text prompt needs `tokenizer: bytes`", "give token ids, or set task.tokenizer: bytes"
            return
    elif isinstance(task, TrainTask) and task.sample and isinstance(task.sample.prompt, str):
        texts = [("task", "sample", "prompt")]
    if texts and vocab is not None and vocab < 256:
        yield texts[0], f"text is encoded as bytes (ids 0-255) but vocab={vocab}", "give token ids instead"


CHECKS: tuple[Callable[[Experiment], Iterator[Problem]], ...] = (
    check_model_dims_divide, check_gqa, check_batch_splits, check_seq_splits, check_token_ids,
    check_text_needs_tokenizer,
)


def run_checks(exp: Experiment) -> list[Problem]:
    """Every problem every check finds."""
    return [problem for check in CHECKS for problem in check(exp)]
