"""The `task:` section: a union keyed by `kind` (train, generate, forward, bench), each with its own fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from tessera.spec.fields import FilePath, Prompt, Section, TokenIds, fail

SYNTHETIC_TASKS = ("copy", "reverse", "sort", "add")


class Optimizer(Section):
    """The optimizer (optax) and its hyper-parameters."""

    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="adamw | adam | sgd")
    lr: float = Field(3e-4, gt=0, description="peak learning rate (the schedule scales it)")
    b1: float = Field(0.9, ge=0, lt=1, description="first-moment decay (adam, adamw)")
    b2: float = Field(0.95, ge=0, lt=1, description="second-moment decay (adam, adamw)")
    eps: float = Field(1e-8, gt=0, description="added to the denominator (adam, adamw)")
    momentum: float = Field(0.0, ge=0, lt=1, description="momentum (sgd); 0 disables it")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (adamw, sgd)")
    clip_norm: float | None = Field(1.0, gt=0, description="clip gradients to this global norm; null disables")


class Schedule(Section):
    """How the learning rate moves from step 0 to the last step."""

    kind: Literal["warmup_cosine", "constant", "linear"] = Field(
        "warmup_cosine", description="warmup_cosine | constant | linear (linear decays to min_lr_ratio * lr)")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 to lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of lr")


class SyntheticData(Section):
    """Generated `question SEP answer` sequences for a toy task; needs no files."""

    kind: Literal["synthetic"] = Field("synthetic", description="synthetic (the default when `kind` is omitted)")
    task: Literal["copy", "reverse", "sort", "add"] = Field(
        "copy", description="copy | reverse | sort | add (running sum modulo the alphabet size)")
    seed: int = Field(0, ge=0, description="seed of the data stream (independent of the model seed)")


class TokenData(Section):
    """Training sequences cut from a file of token ids."""

    kind: Literal["tokens"] = Field(description="tokens")
    path: FilePath = Field(description="a token file: .npy (1-D integer array) or .bin; "
                                       "relative paths resolve against the spec file")
    seed: int = Field(0, ge=0, description="seed of the order in which windows are drawn")


def _data_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("kind", "synthetic")
    return getattr(value, "kind", None)


Data = Annotated[Union[Annotated[SyntheticData, Tag("synthetic")], Annotated[TokenData, Tag("tokens")]],
                 Discriminator(_data_kind)]


class Sample(Section):
    """A greedy sample printed after training, to see what the model learned."""

    prompt: Prompt = Field(description="text (bytes tokenizer) or a list of token ids")
    max_new_tokens: int = Field(32, ge=1, description="tokens to generate after the prompt")


class TrainTask(Section):
    """Train the model from its initial parameters (or a checkpoint) for a number of steps."""

    kind: Literal["train"] = Field(description="train")
    seed: int = Field(0, ge=0, description="seed of parameter initialisation and dropout-free randomness")
    steps: int = Field(200, ge=1, description="optimizer steps")
    batch: int = Field(8, ge=1, description="global batch: sequences per optimizer step")
    microbatches: int = Field(1, ge=1, description="gradient accumulation: the batch is split into this many")
    seq_len: int = Field(128, ge=1, description="tokens per training sequence")
    optimizer: Optimizer = Field(default_factory=Optimizer, description="the optimizer")
    schedule: Schedule = Field(default_factory=Schedule, description="the learning-rate schedule")
    data: Data = Field(default_factory=SyntheticData, description="where training sequences come from")
    eval_every: int = Field(0, ge=0, description="evaluate every this many steps; 0 only at the end")
    eval_batches: int = Field(4, ge=1, description="batches per evaluation")
    log_every: int = Field(10, ge=1, description="log metrics every this many steps")
    sample: Sample | None = Field(None, description="generate a sample after training; null for none")


class Sampling(Section):
    """How the next token is chosen from the logits."""

    temperature: float = Field(0.0, ge=0, description="softmax temperature; 0 is greedy (argmax)")
    top_k: int = Field(0, ge=0, description="keep only the k most likely tokens; 0 keeps all")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the smallest set with this mass")


class GenerateTask(Section):
    """Continue each prompt with up to `max_new_tokens` tokens (KV-cached decoding)."""

    kind: Literal["generate"] = Field(description="generate")
    seed: int = Field(0, ge=0, description="seed of parameter initialisation (without --weights) and sampling")
    prompts: list[Prompt] = Field(min_length=1, description="the prompts: strings or lists of token ids")
    tokenizer: Literal["bytes", "none"] = Field(
        "bytes", description="bytes: a string prompt is its UTF-8 bytes (ids 0-255); none: prompts are token ids")
    max_new_tokens: int = Field(64, ge=1, description="tokens to generate per prompt")
    sampling: Sampling = Field(default_factory=Sampling, description="temperature, top_k, top_p")
    stop_tokens: list[int] = Field(default_factory=list, description="stop a sequence at any of these ids")


class ForwardTask(Section):
    """Run one forward pass and save the logits [batch, seq, vocab]."""

    kind: Literal["forward"] = Field(description="forward")
    seed: int = Field(0, ge=0, description="seed of parameter initialisation (without --weights)")
    tokens: list[TokenIds] | None = Field(None, description="the batch: rows of token ids, all the same length")
    tokens_file: FilePath | None = Field(None, description="a .npy file of int token ids [batch, seq] instead")
    out: str = Field("logits.npy", description="file (in the run directory) the logits are written to")

    @model_validator(mode="after")
    def _one_source(self) -> "ForwardTask":
        if (self.tokens is None) == (self.tokens_file is None):
            raise fail("forward_tokens", "give exactly one of `tokens` and `tokens_file`")
        if self.tokens is not None:
            for i, row in enumerate(self.tokens):
                if len(row) != len(self.tokens[0]):
                    raise fail("forward_tokens", f"every row must have {len(self.tokens[0])} tokens "
                               f"like the first; this one has {len(row)}", at=("tokens", i))
        return self


BENCH_PHASES = ("compile", "forward", "train_step", "decode")


class BenchTask(Section):
    """Time compilation, forward, a training step and decoding on random tokens."""

    kind: Literal["bench"] = Field(description="bench")
    seed: int = Field(0, ge=0, description="seed of parameters and inputs")
    batch: int = Field(1, ge=1, description="sequences per call")
    seq_len: int = Field(128, ge=1, description="tokens per sequence (prefill length for decode)")
    warmup: int = Field(2, ge=0, description="untimed calls before timing")
    iters: int = Field(10, ge=1, description="timed calls; the report gives the median and spread")
    decode_tokens: int = Field(32, ge=1, description="tokens generated when timing decode")
    what: list[Literal["compile", "forward", "train_step", "decode"]] = Field(
        default_factory=lambda: list(BENCH_PHASES), min_length=1,
        description="which phases to time: compile | forward | train_step | decode")

    @model_validator(mode="after")
    def _distinct(self) -> "BenchTask":
        for i, phase in enumerate(self.what):
            if phase in self.what[:i]:
                raise fail("bench_what", f"`{phase}` is listed twice", at=("what", i))
        return self


Task = Annotated[Union[TrainTask, GenerateTask, ForwardTask, BenchTask], Field(discriminator="kind")]
TASK_KINDS = ("train", "generate", "forward", "bench")


def trains(task) -> bool:
    """Whether the task runs a training step (and so holds gradients and optimizer state): `train`, or a
    `bench` that times `train_step`."""
    return task.kind == "train" or (task.kind == "bench" and "train_step" in getattr(task, "what", ()))
