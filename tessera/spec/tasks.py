"""The `task:` section: a union keyed by `kind` (train, generate, forward, bench), each with its own fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from tessera.spec.fields import FilePath, Prompt, Section, TokenIds, fail

SYNTHETIC_TASKS = ("copy", "reverse", "sort", "add")


class Optimizer(Section):
    """The optimizer (optax) and its hyper-parameters."""

    name: Literal["adamw", "adam", "sgd", "lbfgs"] = Field(
        "adamw", description="adamw | adam | sgd | lbfgs (optax.lbfgs with its zoom line search; lr, schedule and "
        "clipping do not apply)")
    lr: float = Field(3e-4, gt=0, description="peak learning rate (the schedule scales it)")
    b1: float = Field(0.9, ge=0, lt=1, description="first-moment decay (adam, adamw)")
    b2: float = Field(0.95, ge=0, lt=1, description="second-moment decay (adam, adamw)")
    eps: float = Field(1e-8, gt=0, description="added to the denominator (adam, adamw)")
    momentum: float = Field(0.0, ge=0, lt=1, description="momentum (sgd); 0 disables it")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (adamw, sgd)")
    clip_norm: float | None = Field(1.0, gt=0, description="clip gradients to this global norm; null disables")
    lbfgs_after: int | None = Field(None, ge=0, description="switch to L-BFGS after this many steps of `name` "
                                    "(Adam then L-BFGS, the usual PINN recipe); null: never")
    lbfgs_memory: int = Field(20, ge=1, description="L-BFGS history: how many past (step, gradient change) pairs")


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


class PointSet(Section):
    """One named set of collocation points, drawn afresh every `resample_every` steps."""

    where: Literal["interior", "boundary", "initial"] = Field(
        description="interior: inside the box; boundary: on its faces (the time coordinate's excluded); "
                    "initial: the slice where the time coordinate is at its lower bound")
    n: int = Field(ge=1, description="points per draw")
    method: Literal["uniform", "sobol", "latin"] = Field(
        "sobol", description="uniform (independent draws) | sobol (scrambled Sobol sequence) | latin (Latin hypercube)")
    target: Literal["none", "exact"] = Field(
        "none", description="exact: the batch also holds `<name>_target`, the exact solution at the points "
                            "(Dirichlet boundary or initial values)")


class Exact(Section):
    """A closed-form solution the points' targets and the error metrics come from."""

    kind: Literal["kovasznay", "taylor_green"] = Field(
        description="kovasznay: steady 2-D Navier-Stokes at Reynolds number `re` (x, y); taylor_green: the decaying "
                    "2-D Taylor-Green vortex at viscosity `nu` (x, y, t)")
    re: float = Field(20.0, gt=0, description="Reynolds number (kovasznay)")
    nu: float = Field(0.01, gt=0, description="kinematic viscosity (taylor_green)")


class CollocationData(Section):
    """Collocation points in a box, for models that name their own loss terms (`loss` entries): a pure function
    of (seed, step // resample_every)."""

    kind: Literal["collocation"] = Field(description="collocation")
    seed: int = Field(0, ge=0, description="seed of the point draws")
    domain: dict[str, list[float]] = Field(
        description="the box: coordinate name -> [low, high], in the order of the model input's coordinate dim")
    time: str | None = Field(None, description="the coordinate that is time (needed by `where: initial`)")
    sets: dict[str, PointSet] = Field(min_length=1, description="point sets by name; each loss input of that "
                                      "name (or `<name>_target`) receives it")
    resample_every: int = Field(0, ge=0, description="draw new points every this many steps; 0: draw once")
    exact: Exact | None = Field(None, description="the exact solution: targets, and rel_l2_u/v/p in the metrics")
    eval_points: int = Field(4096, ge=1, description="held-out uniform interior points the errors are measured on")

    @model_validator(mode="after")
    def _consistent(self) -> "CollocationData":
        for name, (lo_hi) in self.domain.items():
            if len(lo_hi) != 2 or not lo_hi[0] < lo_hi[1]:
                raise fail("domain", f"coordinate `{name}` needs [low, high] with low < high, got {lo_hi}",
                           at=("domain", name))
        if self.time is not None and self.time not in self.domain:
            raise fail("domain", f"time coordinate `{self.time}` is not in the domain ({', '.join(self.domain)})",
                       at=("time",))
        for name, s in self.sets.items():
            if s.where == "initial" and self.time is None:
                raise fail("point_set", "`where: initial` needs `time:` to name the time coordinate",
                           at=("sets", name, "where"))
            if s.target == "exact" and self.exact is None:
                raise fail("point_set", "`target: exact` needs an `exact:` solution", at=("sets", name, "target"))
        return self


class BurgersData(Section):
    """Input/solution pairs of 1-D viscous Burgers made by the project's solver (tessera/run/pde.py): initial
    conditions u0 and solutions u1 at t = 1, both [pairs, resolution]; loss inputs `u0` and `u1` receive them."""

    kind: Literal["burgers"] = Field(description="burgers")
    seed: int = Field(0, ge=0, description="seed of the initial conditions (pair i is a function of seed and i)")
    train: int = Field(1000, ge=1, description="training pairs (an epoch), shuffled per epoch")
    eval: int = Field(200, ge=1, description="held-out pairs, after the training ones: eval_loss and eval_rel_l2")
    resolution: int = Field(64, ge=1, description="points per function, a divisor of the solver's 1024")

    @model_validator(mode="after")
    def _divides(self) -> "BurgersData":
        if 1024 % self.resolution:
            raise fail("burgers", f"resolution {self.resolution} must divide the solver's 1024 points",
                       at=("resolution",))
        return self


SUDOKU_CELLS = 81
SUDOKU_MAX_BLANKS = 60  # the generator's cap; greedy blanking reaches 58 in about 0.7 s a puzzle, 60 rarely


def _blank_count(value, field: str):
    """An int of 0..SUDOKU_MAX_BLANKS, or [low, high] of two with low <= high."""
    def check(n, at):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= SUDOKU_MAX_BLANKS:
            raise fail("sudoku_blanks", f"blanks are a whole number of cells from 0 to {SUDOKU_MAX_BLANKS}, got "
                       f"`{n}`", at=at)

    if isinstance(value, list):
        if len(value) != 2:
            raise fail("sudoku_blanks", f"a range of blanks is [low, high], got {len(value)} numbers", at=(field,))
        check(value[0], (field, 0))
        check(value[1], (field, 1))
        if value[0] > value[1]:
            raise fail("sudoku_blanks", f"[low, high] needs low <= high, got {value}", at=(field,))
    elif value is not None:
        check(value, (field,))


class SudokuData(Section):
    """9x9 Sudoku puzzles with exactly one solution (tessera/run/sudoku.py): tokens are a puzzle's 81 cells in
    row-major order (0 = blank, 1-9 = digits), targets the solution's 81 digits, every cell counted in the loss.
    Evaluations report eval_exact (the fraction of held-out puzzles whose every cell is right, a cell's digit being
    the argmax of its logits over ids 1-9) and eval_cell_acc (the fraction of held-out blank cells right)."""

    kind: Literal["sudoku"] = Field(description="sudoku")
    seed: int = Field(0, ge=0, description="seed of the puzzles (puzzle i is a function of seed and i)")
    train: int = Field(10000, ge=1, description="training puzzles (an epoch), shuffled per epoch")
    eval: int = Field(1000, ge=1, description="held-out puzzles, after the training ones: eval_loss, eval_exact "
                      "and eval_cell_acc")
    blanks: int | list[int] = Field(20, description="empty cells per puzzle: a number, or [low, high] (inclusive), "
                                    "drawn uniformly per puzzle")
    eval_blanks: int | list[int] | None = Field(None, description="empty cells of the held-out puzzles, as "
                                                "`blanks`; null: the same as `blanks`")
    augment: bool = Field(True, description="give each training puzzle a random symmetry per batch: digits "
                          "relabelled; bands, rows within a band, stacks and columns within a stack permuted; "
                          "transposed or not (each keeps exactly one solution)")

    @model_validator(mode="after")
    def _counts(self) -> "SudokuData":
        _blank_count(self.blanks, "blanks")
        _blank_count(self.eval_blanks, "eval_blanks")
        return self


def _data_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("kind", "synthetic")
    return getattr(value, "kind", None)


Data = Annotated[Union[Annotated[SyntheticData, Tag("synthetic")], Annotated[TokenData, Tag("tokens")],
                       Annotated[CollocationData, Tag("collocation")], Annotated[BurgersData, Tag("burgers")],
                       Annotated[SudokuData, Tag("sudoku")]],
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
    loss_weights: dict[str, float] = Field(
        default_factory=dict, description="weight of each loss term the model names (`loss` entries); terms left "
        "out weigh 1. Models without loss entries train on next-token cross-entropy and take none")
    eval_every: int = Field(0, ge=0, description="evaluate every this many steps; 0 only at the end")
    eval_batches: int = Field(4, ge=1, description="batches per evaluation")
    log_every: int = Field(10, ge=1, description="log metrics every this many steps")
    sample: Sample | None = Field(None, description="generate a sample after training; null for none")

    @model_validator(mode="after")
    def _puzzle_length(self) -> "TrainTask":
        if self.data.kind == "sudoku" and self.seq_len != SUDOKU_CELLS:
            raise fail("sudoku_seq_len", f"a Sudoku puzzle is {SUDOKU_CELLS} tokens, but seq_len is {self.seq_len}",
                       at=("seq_len",), hint=f"set seq_len: {SUDOKU_CELLS}")
        return self


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
