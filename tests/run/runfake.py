"""A tiny pure-JAX language model behind the Program protocol, and Experiment-like specs, for run/ tests.

Run as a script it trains one spec into a run directory (used by the kill-and-resume tests):
    python runfake.py SPEC.json OUT [--resume] [--step-sleep S] [--hang-save STEP]
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import sys
import time
import types
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from tessera.run.optim import build_optimizer, current_lr


def _ns(obj):
    if isinstance(obj, dict):
        return types.SimpleNamespace(**{k: _ns(v) for k, v in obj.items()})
    return obj


class FakeExperiment:
    """The parts of tessera.spec's Experiment that run/ reads, over a plain dict."""

    def __init__(self, spec: dict):
        self._spec = copy.deepcopy(spec)
        for key, value in self._spec.items():
            setattr(self, key, _ns(value) if key != "model" else types.SimpleNamespace(**value))
        self.spec_hash = hashlib.sha256(json.dumps(self._spec, sort_keys=True).encode()).hexdigest()

    def resolved(self) -> dict:
        return copy.deepcopy(self._spec)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self._spec, sort_keys=False)

    def span(self, key):
        return None

    @classmethod
    def from_file(cls, path) -> "FakeExperiment":
        return cls(yaml.safe_load(Path(path).read_text()))


def train_spec(**task) -> dict:
    """A train spec the fake model learns in a few seconds (copy task, vocab 20)."""
    spec = {"name": "fake", "model": {"file": "fake.tsl", "args": {"vocab": 20, "d_model": 64}},
            "task": {"kind": "train", "seed": 0, "steps": 60, "batch": 16, "microbatches": 2, "seq_len": 16,
                     "optimizer": {"name": "adamw", "lr": 1e-2, "b1": 0.9, "b2": 0.99, "eps": 1e-8,
                                   "weight_decay": 0.01, "clip_norm": 1.0},
                     "schedule": {"kind": "warmup_cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
                     "data": {"kind": "synthetic", "task": "copy", "seed": 1},
                     "eval_every": 20, "eval_batches": 2, "log_every": 10,
                     "sample": None},
            "checkpoint": {"dir": "ckpt", "every": 20, "keep": 2}}
    spec["task"].update(task)
    return spec


class TrainState(NamedTuple):
    step: jax.Array
    params: dict
    opt_state: optax.OptState


class FakeProgram:
    """One-layer causal attention + MLP over learned positions; implements the Program protocol."""

    MAX_LEN = 64

    def __init__(self, exp, step_sleep: float = 0.0, poison_after: int | None = None):
        self.exp = exp
        args = exp.model.args
        self.vocab, self.d = int(args["vocab"]), int(args["d_model"])
        self.ir_hash = hashlib.sha256(f"fake:{self.vocab}:{self.d}".encode()).hexdigest()
        self.step_sleep, self.poison_after = step_sleep, poison_after  # poison: NaN into mlp/up after that step
        if exp.task.kind in ("train", "bench"):
            self.optimizer = build_optimizer(exp)
            self.microbatches = int(getattr(exp.task, "microbatches", 1))
            self._train_step = jax.jit(self._step)
        self.forward = jax.jit(self._forward)
        self.loss = jax.jit(self._loss)
        self.eval_loss = self.loss

    def init(self, seed: int, *, split_layers: bool = False) -> dict:  # no stacked layers: nothing to split
        shapes = {"embed/table": (self.vocab, self.d), "pos/table": (self.MAX_LEN, self.d),
                  "attention/q": (self.d, self.d), "attention/k": (self.d, self.d), "attention/v": (self.d, self.d),
                  "attention/o": (self.d, self.d), "mlp/up": (self.d, 4 * self.d), "mlp/down": (4 * self.d, self.d),
                  "unembed/weight": (self.d, self.vocab)}
        rng = np.random.default_rng(seed)  # numpy: nothing to compile
        params = {n: jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[0])) for n, s in sorted(shapes.items())}
        params["norm/scale"] = jnp.ones((self.d,), jnp.float32)
        return params

    def __hash__(self):
        return id(self)

    def load_weights(self, directory, *, split_layers: bool = False) -> dict:
        data = np.load(Path(directory) / "params.npz")
        return {k: jnp.asarray(data[k]) for k in data.files}

    def _forward(self, p, tokens):
        b, s = tokens.shape
        x = p["embed/table"][tokens] + p["pos/table"][:s]  # [B, S, D]
        q, k, v = x @ p["attention/q"], x @ p["attention/k"], x @ p["attention/v"]
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(self.d)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
        x = x + jax.nn.softmax(scores, -1) @ v @ p["attention/o"]
        x = x + jax.nn.gelu(x @ p["mlp/up"]) @ p["mlp/down"]
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["norm/scale"]
        return x @ p["unembed/weight"]  # [B, S, V]

    def _loss(self, p, batch):
        logits = self._forward(p, batch["tokens"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    def init_train_state(self, params) -> TrainState:
        return self._init_train_state(params)

    @functools.partial(jax.jit, static_argnums=0)
    def _init_train_state(self, params) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

    def _step(self, state: TrainState, batch):
        m = self.microbatches
        micro = jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), batch)

        def acc(carry, mb):  # sum losses and grads over microbatches, in a fixed order
            loss, grads = jax.value_and_grad(self._loss)(state.params, mb)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(acc, zero, micro)
        grads = jax.tree.map(lambda g: g / m, grads)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss / m, "grad_norm": optax.tree.norm(grads), "lr": current_lr(opt_state)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def train_step(self, state, batch):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        state, metrics = self._train_step(state, batch)
        if self.poison_after is not None and int(state.step) == self.poison_after:
            params = {**state.params, "mlp/up": state.params["mlp/up"].at[0, 0].set(jnp.nan)}
            state = state._replace(params=params)
        return state, metrics

    def generate(self, params, prompts, *, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                 stop_tokens=(), seed=0, prompt_lengths=None, capacity=None):
        prompts = jnp.asarray(prompts, jnp.int32)
        b, p = prompts.shape
        lengths = jnp.full((b,), p, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32)
        return self._generate(params, prompts, lengths, jnp.uint32(seed), max_new_tokens, float(temperature),
                              top_k or None)

    @functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
    def _generate(self, params, prompts, lengths, seed, max_new, temperature, top_k):
        b, p = prompts.shape
        rows = jnp.arange(b)
        buf = jnp.zeros((b, p + max_new), jnp.int32).at[:, :p].set(prompts)

        def body(t, buf):  # recompute the whole prefix each token: tiny, and obviously right
            pos = lengths + t
            logits = self._forward(params, buf)[rows, pos - 1]  # [B, V]
            if temperature > 0:
                logits = logits / temperature
                if top_k:
                    kth = jnp.sort(logits, -1)[:, -top_k][:, None]
                    logits = jnp.where(logits < kth, -jnp.inf, logits)
                tok = jax.random.categorical(jax.random.fold_in(jax.random.key(seed), t), logits)
            else:
                tok = jnp.argmax(logits, -1)
            return buf.at[rows, pos].set(tok.astype(jnp.int32))

        buf = jax.lax.fori_loop(0, max_new, body, buf)
        new = jnp.take_along_axis(buf, lengths[:, None] + jnp.arange(max_new)[None], axis=1)
        return jnp.concatenate([prompts, new], axis=1)

    def flops_per_token(self) -> dict:
        dense = 2 * (4 * self.d * self.d + 8 * self.d * self.d + self.d * self.vocab)
        return {"forward": float(dense), "train_step": float(3 * dense)}


_PROGRAMS: dict[str, FakeProgram] = {}


def cached_program(exp) -> FakeProgram:
    """One FakeProgram per distinct model and optimizer (as tessera caches its programs): fewer compiles."""
    spec = exp.resolved()
    task = spec["task"]
    key = json.dumps([spec["model"], task["kind"]] + [task.get(k) for k in ("optimizer", "schedule", "steps",
                                                                           "microbatches")], sort_keys=True)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = FakeProgram(exp)
    return _PROGRAMS[key]


def main(argv) -> int:
    from tessera.run.main import run_experiment

    spec, out = json.loads(Path(argv[0]).read_text()), argv[1]
    step_sleep = float(argv[argv.index("--step-sleep") + 1]) if "--step-sleep" in argv else 0.0
    if "--hang-save" in argv:
        _hang_in_save(int(argv[argv.index("--hang-save") + 1]), Path(out + ".saving"))
    if "--cache" in argv:  # a compilation cache shared by the test's processes
        jax.config.update("jax_compilation_cache_dir", argv[argv.index("--cache") + 1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    exp = FakeExperiment(spec)
    result = run_experiment(exp, out=out, resume="--resume" in argv, tensorboard=False,
                            compile_fn=lambda e: FakeProgram(e, step_sleep))
    return result.exit_code


def _hang_in_save(step: int, marker: Path) -> None:
    """Stall the rename that completes checkpoint `step`, after its files are written, so a test can kill us there;
    `marker` (a file beside OUT) appears once we are stalled. A file, not a line on stdout: another thread's log
    line could share the line and hide it."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *a, **k):
        if self.get_final().name == str(step):
            tmp = marker.with_name(marker.name + ".tmp")
            tmp.write_text(str(self.get()))
            tmp.replace(marker)
            time.sleep(600)
        return await original(self, *a, **k)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
