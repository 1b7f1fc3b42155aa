"""`tessera.compile(exp)`: the Graph IR of an experiment as a JAX program.

The program owns the jitted functions (forward, loss, train step, generate) over a flat parameter
dict keyed by parameter path. Programs are cached on the hash of everything that changes them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tessera.ir.types import Graph
from tessera.lower.context import LowerCtx, jnp_dtype
from tessera.lower.generation import generate_tokens
from tessera.lower.interpret import eval_region, init_state, split_layers, stacked_layers
from tessera.lower.reference import fp8_blocks, mxfp4
from tessera.lower.reference.losses import cross_entropy
from tessera.lower import fp8_delayed, loss_scale, storage
from tessera.lower import sampling

Params = dict[str, jax.Array]


class TrainState(NamedTuple):
    """What a training step carries: the step count, parameters and optimizer state."""

    step: jax.Array
    params: Params
    opt_state: Any


storage_dtype = storage.storage_dtype  # the jax dtype of a plain parameter (packed ones: storage.abstract)


@dataclasses.dataclass
class Program:
    """A compiled experiment: jitted forward / loss / train_step / generate over flat params."""

    exp: Any
    graph: Graph
    ir_hash: str
    optimizer: optax.GradientTransformation | None = None
    lr_fn: Callable[[Any], jax.Array] | None = None
    plan: Any = None  # tessera.lower.shard.step.ShardPlan when the mesh spans more than one device
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)
    _report: dict | None = dataclasses.field(default=None, repr=False)  # kernel choices, while kernel_report traces
    last_key: Any = dataclasses.field(default=None, repr=False)  # the jitted function called last (lower)

    @property
    def vocab(self) -> int:
        """Token ids run over 0 .. vocab - 1: the size of the last axis of the model's output (its logits)."""
        return int(self.graph.outputs[0].type.dims[-1].size)

    @property
    def deterministic(self) -> bool:
        """Whether cross-device reductions run in a fixed, mesh-independent order (the manifest records it)."""
        return bool(self.exp.parallel.deterministic)

    @property
    def canonical_objective(self) -> bool:
        """Whether the model's loss entries train on canonical shards of a batch of samples (deterministic mode
        on batched data, burgers pairs: shard/deterministic.py), the way a language model's cross-entropy does;
        collocation points (PINNs) keep one objective over all their points, on one device."""
        from tessera.ir.check_objectives import batched_data

        return bool(self.graph.losses) and self.deterministic and batched_data(self.exp)

    @property
    def collectives(self) -> list[str]:
        """The collectives this program's lowerings use on its mesh (empty on one device)."""
        if self.plan is None:
            return []
        if self.deterministic:
            return ["all_gather(params, optimizer state)", "all_gather(per-shard loss and grads) + fixed-tree sum"]
        return self.plan.collectives(self.exp.parallel.pipeline.schedule)

    def parallel_report(self) -> dict:
        """What the manifest records about distribution: mesh, determinism and the collectives used."""
        return {"mesh": {a: n for a, n in self.exp.mesh.axes.items() if n > 1} or {"devices": 1},
                "deterministic": self.deterministic, "collectives": self.collectives}

    def numerics_report(self) -> dict:
        """What the manifest records about numerics: compute and accumulation types, loss scaling, and per
        parameter path its storage type, compute type and the rule that set it (ir/passes/numerics.py)."""
        from tessera.ir.passes.numerics import resolved_policy
        return resolved_policy(self.graph, self.exp.numerics)

    def _det(self):
        """The deterministic executor (canonical batch shards) on this program's mesh, one device included."""
        if "det" not in self._cache:
            from jax.sharding import Mesh, PartitionSpec as P
            from tessera.lower.shard.deterministic import Deterministic

            if self.plan is not None:
                self._cache["det"] = Deterministic(self, self.plan.mesh, self.plan.param_specs)
            else:
                mesh = Mesh(np.asarray(jax.devices()[:1]).reshape((1,)), ("dp",))
                self._cache["det"] = Deterministic(self, mesh, {k: P() for k in self.graph.params})
        return self._cache["det"]

    # ---- parameters ----------------------------------------------------------------------------
    def param_shapes(self, split_layers: bool = False) -> dict[str, Any]:
        """What each parameter is held as, by path: a ShapeDtypeStruct, or MXFP4 / FP8Blocks of two for packed types.

        Shapes are the held ones: a moe's d_ff padded for packed experts on this mesh (storage.padding).
        split_layers: a parameter a `repeat` stacks as the list of its n layers' ShapeDtypeStructs."""
        shapes = {path: storage.abstract(tuple(d.size for d in t.dims), t.dtype)
                  for path, t in self.held_types().items()}
        if not split_layers:
            return shapes
        layer = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
        return {path: [jax.tree.map(layer, v)] * self.stacked()[path] if path in self.stacked() else v
                for path, v in shapes.items()}

    def held_types(self) -> dict[str, Any]:
        """Each parameter's TensorType as held (the IR's, with storage.padding applied)."""
        if "held" not in self._cache:
            self._cache["held"] = storage.held_types(self.exp, self.graph)
        return self._cache["held"]

    def stacked(self) -> dict[str, int]:
        """{path: n} of the parameters a `repeat` holds stacked on a leading layer axis of n."""
        if "stacked" not in self._cache:
            self._cache["stacked"] = stacked_layers(self.graph.body, self.param_shapes())
        return self._cache["stacked"]

    def padding(self) -> dict[str, dict[str, int]]:
        """{path: {dim: held size}} of the params held larger than the IR says (checkpoints record it)."""
        if "padding" not in self._cache:
            self._cache["padding"] = storage.padding(self.exp, self.graph)
        return self._cache["padding"]

    def param_specs(self, params: Params | None = None) -> dict:
        """Each parameter's PartitionSpec on the mesh, matching `params`' layout: a split parameter (a list of
        its layers) gets one spec per layer, the stacked spec without its layer axis. None on one device."""
        if self.plan is None:
            return None
        from jax.sharding import PartitionSpec as P

        specs = dict(self.plan.param_specs)
        for path, value in (params or {}).items():
            if isinstance(value, list):
                specs[path] = [P(*tuple(specs[path])[1:])] * len(value)
        return specs

    def _shardings(self, params: Params | None = None) -> dict | None:
        from jax.sharding import NamedSharding

        specs = self.param_specs(params)
        return None if specs is None else jax.tree.map(lambda s: NamedSharding(self.plan.mesh, s), specs,
                                                       is_leaf=lambda s: not isinstance(s, (dict, list)))

    def init(self, seed: int = 0, *, split_layers: bool = False, on_layer: Callable[[int], None] | None = None
             ) -> Params:
        """Fresh parameters from each one's initializer; a parameter's values depend only on (seed, path), and
        a stacked parameter's layer i only on (seed, path, i).

        split_layers: each stacked parameter as the list of its layers, made one layer at a time (one small
        program called per layer), so the peak is the parameters plus one layer's draw: what generation
        wants (it holds one copy of the weights only when they come split). `on_layer(i)` is called after
        layer i is made. Values are bitwise those of the stacked form."""
        if split_layers:
            return self._init_split(jnp.asarray(seed, jnp.uint32), on_layer)
        return self._jit("init", lambda: jax.jit(self._init, out_shardings=self._shardings()))(
            jnp.asarray(seed, jnp.uint32))

    def _init(self, seed):
        key, stacked = jax.random.key(seed), self.stacked()
        params = {}
        for path in self.param_shapes():
            if path in stacked:  # one layer at a time: a whole stacked draw in fp32 would sit in memory
                layers = jnp.arange(stacked[path], dtype=jnp.uint32)
                params[path] = jax.lax.map(lambda i, path=path: self._init_param(key, path, i), layers)
            else:
                params[path] = self._init_param(key, path)
        return params

    def _init_param(self, key, path: str, layer=None):
        """One parameter's initial value at its held shape, or (layer) layer `layer` of a stacked one."""
        p, held = self.graph.params[path], self.param_shapes()[path]
        key = jax.random.fold_in(key, zlib.crc32(path.encode()))
        true, shape = tuple(d.size for d in p.type.dims), tuple(held.shape)  # drawn at the IR's shape, then padded
        if layer is not None:
            key, true, shape = jax.random.fold_in(key, layer), true[1:], shape[1:]
        if isinstance(held, fp8_blocks.FP8Blocks):  # the plain fp32 draw, quantised (held at its own shape)
            return fp8_blocks.quantize(_init_array(p.init, key, true, jnp.float32), held.block)
        if isinstance(held, mxfp4.MXFP4):
            return storage.resize(_init_packed(p.init, key, true), shape)
        return storage.resize(_init_array(p.init, key, true, held.dtype), shape)

    def _init_split(self, seed, on_layer) -> Params:
        stacked, shapes = self.stacked(), self.param_shapes()
        specs = self._shardings(self.param_shapes(split_layers=True))
        pick = lambda paths: None if specs is None else {p: specs[p] for p in paths}  # noqa: E731
        shared = [p for p in shapes if p not in stacked]
        make = jax.jit(lambda s: {p: self._init_param(jax.random.key(s), p) for p in shared},
                       out_shardings=pick(shared))
        params = dict(make(seed))
        for n in sorted(set(stacked.values())):
            paths = [p for p, m in stacked.items() if m == n]
            layer_specs = None if specs is None else {p: specs[p][0] for p in paths}
            one = jax.jit(lambda s, i, paths=paths: {p: self._init_param(jax.random.key(s), p, i) for p in paths},
                          out_shardings=layer_specs)
            for p in paths:
                params[p] = []
            for i in range(n):
                made = one(seed, jnp.asarray(i, jnp.uint32))
                for p in paths:
                    params[p].append(made[p])
                del made
                if on_layer is not None:
                    on_layer(i)
        return {p: params[p] for p in shapes}

    def load_weights(self, directory, *, split_layers: bool = False) -> Params:
        """Parameters from a Hugging Face checkpoint directory (config.json + safetensors).

        Read one tensor at a time and placed on the device as read, so the host holds one tensor; with
        split_layers each stacked parameter comes as the list of its layers (see `init`)."""
        from tessera.lower.weights import load_hf_weights

        shapes = self.param_shapes()
        packed = {path for path, held in shapes.items() if isinstance(held, mxfp4.MXFP4)}
        blocks = {path for path, held in shapes.items() if isinstance(held, fp8_blocks.FP8Blocks)}  # read in fp32
        params = load_hf_weights(directory, family=self.exp.model.file.stem, args=dict(self.exp.model.args),
                                 model=self.exp.model.file, packed=packed, split_layers=split_layers,
                                 dtypes=lambda path: None if path in packed else
                                 jnp.float32 if path in blocks else shapes[path].dtype)
        missing = sorted(set(shapes) - set(params))
        if missing:
            raise ValueError(f"checkpoint lacks parameters {missing}")
        cast = lambda a, want: storage.to_held(a, want.dtype)  # noqa: E731  (tree.map: same leaves, any shapes)

        def held(value, want):  # padded after loading, so packed bytes stay as stored
            if isinstance(want, fp8_blocks.FP8Blocks):  # dense fp32/bf16 weights through init's quantiser
                return fp8_blocks.quantize(value, want.block)
            return storage.resize(jax.tree.map(cast, value, want), tuple(want.shape))

        target = self.param_shapes(split_layers=split_layers)
        out = {}
        for path in shapes:
            value = params.pop(path)  # each loaded array freed as soon as its held form exists
            out[path] = [held(v, w) for v, w in zip(value, target[path])] if isinstance(value, list) \
                else held(value, target[path])
        specs = self._shardings(out)
        return out if specs is None else jax.device_put(out, specs)

    # ---- forward and loss ----------------------------------------------------------------------
    # The model functions: traced, not jitted, for the step builders (shard/step.py, shard/deterministic.py,
    # shard/pipeline_1f1b.py) and `tessera plan` to compose; the jitted entry points follow each.
    def lower_ctx(self, **kw) -> LowerCtx:
        """The context this program's lowerings get (its kernel policy, backend, determinism) with `kw`
        (mode, shard, positions, aux, ...)."""
        kw.setdefault("report", self._report)
        kw.setdefault("accum_dtype", jnp_dtype(self.graph.attrs.get("accum", "f32")))
        kw.setdefault("fp8", self.graph.attrs.get("fp8"))
        # a model with loss entries differentiates small stacks two and three times over (PDE residuals, then the
        # parameters): XLA runs the scan unrolled, 4.5x faster a Kovasznay step on the CPU than as a loop
        kw.setdefault("scan_unroll", bool(self.graph.losses))
        kw.setdefault("param_types", {path: p.type for path, p in self.graph.params.items()})
        return LowerCtx(kernels=self.exp.kernels, backend=jax.default_backend(),
                        deterministic=self.exp.parallel.deterministic, **kw)

    def logits(self, params, tokens, mode: str = "train", *, shard=None, aux=None):
        """Logits [batch, seq, vocab] of int32 tokens [batch, seq], traced under `mode` ("train", "forward");
        `shard`: inside shard_map, the ShardEnv the lowerings see local blocks by; `aux`: a dict the
        lowerings add step counters to."""
        ctx = self.lower_ctx(mode=mode, shard=shard, aux=aux)
        (logits,), _ = eval_region(self.graph.body, [tokens], params, ctx, remat=self.exp.parallel.remat)
        return logits

    def forward_fn(self, mode: str = "forward"):
        """(params, tokens) -> logits over the program's whole mesh (sharded where it has a plan; a scientific
        model's on every device with whole params)."""
        if self.plan is None:
            return lambda p, t: self.logits(p, t, mode)
        if self.graph.losses:
            return self._det().forward
        from tessera.lower.shard.step import sharded_forward
        return sharded_forward(self, self.plan, mode)

    def forward(self, params: Params, tokens) -> jax.Array:
        """Logits [batch, seq, vocab] for int32 tokens [batch, seq]; for a model of float inputs (a PINN's
        points [N, d]) its output ([N, 3]: u, v, p), the input cast to the model's input type."""
        dtype = jnp_dtype(self.graph.inputs[0].type.dtype)
        return self._jit("forward", self._make_forward)(params, jnp.asarray(tokens, dtype))

    def _make_forward(self):
        return jax.jit(self.forward_fn("forward"))

    # ---- named loss terms (models with `loss` entries) ----------------------------------------------
    def loss_terms(self, params, batch: dict) -> dict[str, jax.Array]:
        """Each loss term the model names, unweighted: its `loss` entries run on the batch's inputs by name."""
        ctx = self.lower_ctx(mode="train")
        terms = {}
        for loss in self.graph.losses:
            args = [jnp.asarray(batch[a.name], jnp_dtype(a.type.dtype)) for a in loss.region.args]
            values, _ = eval_region(loss.region, args, params, ctx)
            terms.update(zip(loss.terms, values))
        return terms

    def objective(self, params, batch: dict):
        """(Σ weight · term, {term: value}) with task.loss_weights (a term left out weighs 1)."""
        terms = self.loss_terms(params, batch)
        weights = getattr(self.exp.task, "loss_weights", None) or {}
        total = sum(float(weights.get(name, 1.0)) * value for name, value in terms.items())
        return total, terms

    def _objective_step(self, state: TrainState, batch):
        """One step on the weighted terms; the optimizer may be L-BFGS, which re-evaluates the objective in its
        line search (`value_fn`). The line search ends on the point that becomes the next step's params, having
        taken the objective's value and gradient there: an L-BFGS step after the first reuses them (optax's
        `value_and_grad_from_state`) instead of differentiating the objective again, and evaluates the terms
        forward only, for the metrics. That halves an L-BFGS step whose search accepts its first trial. Only where
        the step's batch is the last step's (`_same_batch`): collocation points of one draw."""
        stored = _linesearch_state(state.opt_state)
        same = self._same_batch(state.step)
        if stored is None or same is False:
            (loss, terms), grads = jax.value_and_grad(self.objective, has_aux=True)(state.params, batch)
        else:
            def fresh(params):
                return jax.value_and_grad(self.objective, has_aux=True)(params, batch)

            def reuse(params):
                return (stored.value, self.loss_terms(params, batch)), stored.grad

            (loss, terms), grads = jax.lax.cond(jnp.isfinite(stored.value) & same, reuse, fresh, state.params)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params, value=loss, grad=grads,
                                                       value_fn=lambda p: self.objective(p, batch)[0])
            params = optax.apply_updates(state.params, updates)
            params = jax.tree.map(lambda new, old: new.astype(old.dtype), params, state.params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **terms}
        if self.lr_fn is not None:
            metrics["lr"] = self.lr_fn(opt_state)
        return TrainState(state.step + 1, params, opt_state), metrics

    def _same_batch(self, step):
        """Whether the train task feeds data step `step` the batch it fed step `step - 1` (what the trainer passes
        `train_step`): collocation points drawn once, or within one draw of `resample_every` steps (a traced
        bool); False for data that changes every step."""
        data = getattr(self.exp.task, "data", None)
        if getattr(data, "kind", None) != "collocation":
            return False
        every = int(getattr(data, "resample_every", 0) or 0)
        return jnp.asarray(True) if every == 0 else step % every != 0

    def _loss(self, params, batch):
        if self.graph.losses and not self.canonical_objective:
            return self.objective(params, batch)[0]
        if self.deterministic:
            return self._det().loss(params, batch)
        if self.plan is not None:
            from tessera.lower.shard.step import sharded_loss
            return sharded_loss(self, self.plan)(params, batch)
        logits = self.logits(params, batch["tokens"])
        return cross_entropy(logits, batch["targets"], mask=batch.get("mask"))

    def loss(self, params: Params, batch: dict) -> jax.Array:
        """Mean next-token cross-entropy; batch = {tokens, targets, mask} each [batch, seq]."""
        return self._jit("loss", self._make_loss)(params, batch)

    def _make_loss(self):
        return jax.jit(self._loss)

    eval_loss = loss

    # ---- training ------------------------------------------------------------------------------
    def init_train_state(self, params: Params) -> TrainState:
        """Step 0 with fresh optimizer state."""
        if self.optimizer is None:
            raise ValueError("this program was compiled without an optimizer (task is not `train`)")
        state = TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))
        if self.graph.losses:  # L-BFGS's state may hold one buffer twice (each leaf its own, to be donated), and
            # weakly typed scalars the step returns strongly typed (a second compile of the step): neither
            state = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.asarray(x).dtype, copy=True), state)
        return jax.tree.map(self._on_mesh, state)

    def _on_mesh(self, x):
        """A scalar of the train state (the step, the optimizer's counts and hyperparameters) replicated
        on the mesh, where the train step returns it: left on one device, it gave the first step an input
        placement no later step has, and every sharded run compiled its train step twice (13 s each
        for the tests' tiny GPT-OSS on 8 CPU devices). On one device the deterministic step runs on a
        one-device mesh and returns every array placed on it: the whole state goes there, or the second
        step compiled again (the tests' tiny Llama: half the CPU time of a 5-step fixture). Tracers
        (`tessera plan`'s abstract state) pass."""
        if isinstance(x, jax.core.Tracer) or not hasattr(x, "ndim"):
            return x
        from jax.sharding import NamedSharding, PartitionSpec as P
        if self.plan is None:
            if self.deterministic and not (self.graph.losses and not self.canonical_objective):
                return jax.device_put(x, NamedSharding(self._det().mesh, P()))
            return x
        if getattr(x, "ndim", None) != 0:
            return x
        return jax.device_put(x, NamedSharding(self.plan.mesh, P()))

    def _loss_and_counts(self, params, batch):
        """(loss, {counter: int32 scalar}): the fast sharded loss also returns the step's counters (moe_dropped)."""
        if self.plan is not None and not self.deterministic:
            from tessera.lower.shard.step import sharded_loss
            return sharded_loss(self, self.plan, counted=True)(params, batch)
        return self._loss(params, batch), {}

    def _counters(self, counts: dict) -> dict:
        """Metrics from per-microbatch counters: moe_dropped iff parallel.expert_capacity is set (0 where none drop)."""
        if self.exp.parallel.expert_capacity is None:
            return {}
        return {"moe_dropped": jnp.sum(counts.get("moe_dropped", jnp.zeros((), jnp.int32)))}

    def _train_step(self, state: TrainState, batch):
        if self.graph.losses and not self.canonical_objective:
            return self._objective_step(state, batch)
        if self.deterministic:  # dropless: the whole model per canonical shard
            state, metrics = self._det().train_step(state, batch)
            return state, {**metrics, **self._counters({})}
        m = int(getattr(self.exp.task, "microbatches", 1) or 1)
        ls = loss_scale.state_of(state.opt_state)  # None unless the loss is scaled (lower/loss_scale.py)
        history = fp8_delayed.history_of(state.opt_state)  # delayed fp8 scaling's amax histories (fp8_delayed.py)

        def scaled(params, batch):
            loss, counts = self._loss_and_counts(params, batch)
            return (loss if ls is None else loss * ls.scale), counts

        grad_fn = jax.value_and_grad(scaled, has_aux=True)
        inputs = fp8_delayed.merged(state.params, history)  # the histories beside the params: their "gradients" are
        # the step's amaxes
        if m == 1:  # no accumulator: the gradients are the backward pass's own buffers
            (loss, counts), grads = grad_fn(inputs, batch)
            grads, amaxes = fp8_delayed.split(grads, history)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # as the accumulator holds them
            counts = jax.tree.map(lambda c: c[None], counts)
        else:
            micro = jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), batch)

            def accumulate(carry, mb):  # microbatches summed in a fixed order (amaxes: their max)
                (loss, counts), grads = grad_fn(inputs, mb)
                grads, amaxes = fp8_delayed.split(grads, history)
                return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads),
                        jax.tree.map(jnp.maximum, carry[2], amaxes)), counts

            zero = (jnp.zeros((), jnp.float32),
                    jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
                    None if history is None else jax.tree.map(jnp.zeros_like, history))
            (loss, grads, amaxes), counts = jax.lax.scan(accumulate, zero, micro)
            grads = jax.tree.map(lambda g: g / m, grads)
        if ls is not None:  # unscaled in fp32; a non-finite one makes the optimizer skip the step
            loss = loss / ls.scale
            grads = jax.tree.map(lambda g: g / ls.scale, grads)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            params = jax.tree.map(lambda new, old: new.astype(old.dtype), params, state.params)
        opt_state = fp8_delayed.pushed(opt_state, amaxes)
        metrics = {"loss": loss / m, "grad_norm": optax.tree.norm(grads), **self._counters(counts),
                   **loss_scale.metrics(opt_state)}
        if self.lr_fn is not None:
            metrics["lr"] = self.lr_fn(opt_state)
        return TrainState(state.step + 1, params, opt_state), metrics

    def train_step(self, state: TrainState, batch: dict):
        """One optimizer step over the batch (gradient accumulation over task.microbatches).

        `state` is consumed: its buffers are donated to the new state (parameters and optimizer moments
        are held once, not twice, across the step), so pass each call the state the last one returned."""
        return self._jit("train_step", self._make_train_step)(state, self.global_batch(batch))

    def _make_train_step(self):
        return jax.jit(self._train_step, donate_argnums=0)

    def global_batch(self, batch: dict) -> dict:
        """With several processes, every process passes the same host batch: make it one global array."""
        if self.plan is None or jax.process_count() == 1:
            return batch
        from jax.sharding import NamedSharding, PartitionSpec as P
        return jax.device_put(batch, NamedSharding(self.plan.mesh, P()))

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, params: Params, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, stop_tokens=(), seed: int = 0,
                 prompt_lengths=None, capacity: int | None = None) -> jax.Array:
        """Prompts [B, P] followed by max_new_tokens new tokens (greedy unless temperature > 0), KV-cached.

        One compiled program serves every max_new_tokens up to `capacity` (default max_new_tokens): its caches
        hold P + capacity tokens and it decodes as many as it is asked, so a caller timing a one-token call
        (the first token's latency) and a full one compiles once."""
        prompts = jnp.asarray(prompts, jnp.int32)
        if prompt_lengths is not None and len(set(np.asarray(prompt_lengths).tolist())) > 1:
            raise ValueError("prompts of different lengths must be generated in separate batches")
        if max_new_tokens <= 0:
            return prompts
        capacity = max(int(capacity or 0), int(max_new_tokens))
        rule = sampling.SamplingRule(temperature=float(temperature), top_k=top_k, top_p=top_p)
        split = any(isinstance(v, list) for v in params.values())
        stop = tuple(int(t) for t in stop_tokens)
        key = ("generate", capacity, rule, stop, prompts.shape[0], split)
        fn = self._jit(key, lambda: jax.jit(self.generate_fn(params, prompts.shape[0], capacity, rule, stop)))
        out = fn(params, prompts, jnp.asarray(seed, jnp.uint32), jnp.asarray(max_new_tokens, jnp.int32))
        return out if max_new_tokens == capacity else out[:, :prompts.shape[1] + max_new_tokens]

    def generate_fn(self, params: Params, batch: int, capacity: int, rule: sampling.SamplingRule,
                    stop_tokens: tuple[int, ...] = ()):
        """(params, prompts [batch, P], seed, max_new) -> tokens [batch, P + capacity]: the generation program
        `generate` jits, unjitted; it decodes max_new <= capacity tokens (the slots after them are 0). On a
        mesh it is sharded for `params` as held (stacked or split layers; arrays or their shapes)."""
        def run(p, x, s, n, shard=None):
            ctx = functools.partial(self.lower_ctx, shard=shard, unroll=True)
            return generate_tokens(self.graph.body, ctx, p, x, s, n, capacity, rule, stop_tokens, shard)

        if self.plan is None:
            return run
        from tessera.lower.shard.step import sharded_generate
        return sharded_generate(self.plan, run, batch, self.param_specs(params))

    # ---- accounting ----------------------------------------------------------------------------
    def kernel_report(self) -> dict[str, str]:
        """The implementation each attention and MoE op takes on this backend at the task's shapes."""
        from tessera.ir.cost import task_dims

        sizes, report, decoding = task_dims(self.exp), {}, {}
        b, s = sizes["batch"], sizes["seq"]
        params, sds = self.param_shapes(), jax.ShapeDtypeStruct
        body = self.graph.body

        def forward(p, t):
            if self.plan is not None and not self.deterministic:  # the sharded step chooses under shard_map
                from tessera.lower.shard.step import sharded_forward
                self._report = report
                try:
                    return sharded_forward(self, self.plan, "forward")(p, t)
                finally:
                    self._report = None
            return eval_region(body, [t], p, self.lower_ctx(mode="forward", report=report))[0]

        def decode(p, t):
            state = init_state(body, self.lower_ctx(mode="prefill"), b, s)
            pos = jnp.zeros((b, 1), jnp.int32)
            return eval_region(body, [t], p, self.lower_ctx(mode="decode", positions=pos, report=decoding), state)[0]

        with jax.default_matmul_precision(self.matmul_precision):
            jax.eval_shape(forward, params, sds((b, s), jnp.int32))
            jax.eval_shape(decode, params, sds((b, 1), jnp.int32))
        for label, choice in decoding.items():  # a decoding step may choose otherwise: its own entries
            report[label if label.endswith("(decode)") else label + " (decode)"] = choice
        return report

    def flops_per_token(self) -> dict[str, float]:
        """Forward and training-step FLOPs per token, counted from the Graph IR at the task's shapes."""
        from tessera.ir.cost import flops_per_token

        return flops_per_token(self.graph, self.exp)

    def _jit(self, key, make):
        if key not in self._cache:
            self._cache[key] = _with_precision(make(), self.matmul_precision)
        self.last_key = key
        return self._cache[key]

    def lower(self, key, *args) -> jax.stages.Lowered:
        """The jitted function `key` (`last_key`: the one called last) lowered for these arguments; its
        `.compile()` after a call with the same arguments is JAX's cached executable (no compile). "forward",
        "loss" and "train_step" may be lowered before any call (`tessera plan` compiles the train step for
        abstract arguments); a generation program once `generate` has made it for its sampling settings."""
        makers = {"forward": self._make_forward, "loss": self._make_loss, "train_step": self._make_train_step}
        if key in makers:
            self._jit(key, makers[key])
        elif key not in self._cache:
            raise KeyError(f"no jitted function {key!r}: lower one of {sorted(makers)}, or a generation "
                           f"program after `generate` made it (made so far: {list(self._cache)})")
        fn = self._cache[key].__wrapped__
        with jax.default_matmul_precision(self.matmul_precision):
            return fn.lower(*args)

    @property
    def matmul_precision(self) -> str:
        """fp32 compute means fp32 matmuls (not TF32 or bf16 passes, GPUs' default); else the backend's default."""
        return "highest" if self.graph.attrs.get("compute", "f32") in ("f32", "f64") else "default"


def _init_array(init, key, shape, dtype):
    """One parameter's initial value: normal(0, std) drawn in fp32, ones or zeros."""
    if init.kind == "normal":
        return storage.to_held(jax.random.normal(key, shape, jnp.float32) * init.std, dtype)
    return (jnp.ones if init.kind == "ones" else jnp.zeros)(shape, dtype)


def _init_packed(init, key, shape):
    """A packed (MXFP4) parameter's initial value, drawn in fp32 and quantised one [K, N] matrix at a time
    (each leading index i folded into the key): quantising reduces over groups, so a whole draw would sit
    in memory in fp32 (one 120b layer's 128 experts: 8.5 GB)."""
    if len(shape) < 3:
        return mxfp4.quantize(_init_array(init, key, shape, jnp.float32))
    one = lambda i: _init_packed(init, jax.random.fold_in(key, i), shape[1:])  # noqa: E731
    return jax.lax.map(one, jnp.arange(shape[0], dtype=jnp.uint32))


def _with_precision(fn, precision: str):
    """fn called (and so traced) under `jax.default_matmul_precision(precision)`."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return call


_PROGRAMS: dict[str, Program] = {}


def program_hash(exp, graph: Graph) -> str:
    """Hash of everything that changes the compiled program: the graph and the spec's program fields."""
    from tessera.ir.printer import print_graph

    spec = exp.resolved()
    relevant = {k: spec.get(k) for k in ("model", "mesh", "parallel", "numerics", "kernels")}
    relevant["task"] = {k: v for k, v in spec.get("task", {}).items()
                        if k in ("kind", "optimizer", "schedule", "microbatches", "steps", "loss_weights")}  # steps: the schedule
    text = print_graph(graph) + "\n" + repr(sorted(_flatten(relevant).items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = repr(v)
    return out


def program_graph(exp) -> Graph:
    """The graph a program runs: the compiler's one pipeline (`tessera.ir.passes.PIPELINE`: verify,
    canonicalize, decompose, fuse, numerics, shard) over the elaborated model, after the spec's checks:
    what `tessera check` passes and `tessera ir --after shard` prints. Parameters are placed by its shard
    annotations."""
    from tessera.ir.check import check_experiment

    return check_experiment(exp)


def _linesearch_state(opt_state):
    """The zoom line search's state inside an L-BFGS optimizer state (its value and gradient at the params it
    accepted: +inf before L-BFGS's first step), or None for an optimizer without one."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByZoomLinesearchState))
             if isinstance(s, optax.ScaleByZoomLinesearchState)]
    return found[0] if len(found) == 1 else None


def compile_experiment(exp, optimizer=None, lr_fn=None) -> Program:
    """Build, check and lower the experiment's graph; cached on the program hash."""
    graph = program_graph(exp)
    if graph.attrs.get("compute") == "f64" or any(p.type.dtype == "f64" for p in graph.params.values()):
        jax.config.update("jax_enable_x64", True)  # f64 arrays exist only with x64 on (a process-wide setting)
    h = program_hash(exp, graph)
    if h not in _PROGRAMS:
        storage.check_packed(exp, graph)  # packed params: an inference task, groups that fit the shape and mesh
        plan = None
        if exp.mesh.size > 1:
            from tessera.lower.shard.step import make_plan
            plan = make_plan(exp, graph)  # mesh errors are the user's: raised before anything compiles
        length = fp8_delayed.history_length(graph.attrs.get("fp8"))
        if optimizer is not None and length is not None:  # delayed fp8 scaling: amax histories in the train state
            from tessera.ir.passes.numerics import fp8_weights
            optimizer = fp8_delayed.carrying(optimizer, fp8_weights(graph), length)
        _PROGRAMS[h] = Program(exp, graph, ir_hash=hashlib.sha256(str(graph).encode()).hexdigest(),
                               optimizer=optimizer, lr_fn=lr_fn, plan=plan)
    return _PROGRAMS[h]
