"""`tessera.compile(exp)`: the Graph IR of an experiment as a JAX program.

`compile_experiment` runs the compiler's pipeline (`program_graph`), reads the spec's settings once into a
`CompileOptions` (tessera/lower/options.py) and makes a `Program`: the jitted functions (forward, loss, train
step, generate) over a flat parameter dict keyed by parameter path, and the traced model functions the step
builders compose. Its pieces live beside it: the train step in tessera/lower/train_step.py, parameter
initialisation in tessera/lower/param_init.py, the generation loop in tessera/lower/generation.py, the sharded
and deterministic steps in tessera/lower/shard/. Programs are cached on the hash of everything that changes them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tessera.ir.passes.numerics import fp8_ops_of
from tessera.ir.types import Graph
from tessera.lower.context import LowerCtx, jnp_dtype
from tessera.lower.generation import generation_fn
from tessera.lower.interpret import eval_region, init_state, stacked_layers
from tessera.lower.options import CompileOptions
from tessera.lower.reference import fp8_blocks, mxfp4
from tessera.lower.reference.losses import cross_entropy
from tessera.lower import fp8_delayed, param_init, storage, train_step as steps
from tessera.lower import sampling
from tessera.lower.train_step import TrainState

Params = dict[str, jax.Array]
__all__ = ["CompileOptions", "Program", "TrainState", "compile_experiment", "program_graph", "program_hash"]

storage_dtype = storage.storage_dtype  # the jax dtype of a plain parameter (packed ones: storage.abstract)


@dataclasses.dataclass
class Program:
    """A compiled experiment: jitted forward / loss / train_step / generate over flat params.

    `options` are the spec's settings the lowering reads (CompileOptions); `exp` is the experiment it was
    compiled from, kept for callers (a run's name, its spec), never read by the lowering."""

    options: CompileOptions
    graph: Graph
    ir_hash: str
    optimizer: optax.GradientTransformation | None = None
    lr_fn: Callable[[Any], jax.Array] | None = None
    plan: Any = None  # tessera.lower.shard.step.ShardPlan when the mesh spans more than one device
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)
    _report: dict | None = dataclasses.field(default=None, repr=False)  # kernel choices, while kernel_report traces
    last_key: Any = dataclasses.field(default=None, repr=False)  # the jitted function called last (lower)
    exp: Any = dataclasses.field(default=None, repr=False)

    def attach(self, optimizer=None, lr_fn=None) -> None:
        """Give the program the optimizer and learning-rate function a train step needs, where it has none (one
        built for inspection); those it has stay. Functions traced before are dropped: they read the old ones."""
        new_optimizer = self.optimizer is None and optimizer is not None
        new_lr = self.lr_fn is None and lr_fn is not None
        if new_optimizer:
            length = fp8_delayed.history_length(self.graph.attrs.get("fp8"))
            if length is not None:  # delayed fp8 scaling: amax histories in the train state
                from tessera.ir.passes.numerics import fp8_weights
                optimizer = fp8_delayed.carrying(optimizer, fp8_weights(self.graph), length)
            self.optimizer = optimizer
        if new_lr:
            self.lr_fn = lr_fn
        if new_optimizer or new_lr:
            self._cache.clear()

    @property
    def vocab(self) -> int:
        """Token ids run over 0 .. vocab - 1: the size of the last axis of the model's output (its logits)."""
        return int(self.graph.outputs[0].type.dims[-1].size)

    @property
    def deterministic(self) -> bool:
        """Whether cross-device reductions run in a fixed, mesh-independent order (the manifest records it)."""
        return self.options.deterministic

    @property
    def canonical_objective(self) -> bool:
        """Whether the model's loss entries train on canonical shards of a batch of samples (deterministic mode
        on batched data, burgers pairs: shard/deterministic.py), the way a language model's cross-entropy does;
        collocation points (PINNs) keep one objective over all their points, on one device."""
        return bool(self.graph.losses) and self.deterministic and self.options.batched_data

    @property
    def collectives(self) -> list[str]:
        """The collectives this program's lowerings use on its mesh (empty on one device)."""
        if self.plan is None:
            return []
        if self.deterministic:
            return ["all_gather(params)", "all_to_all(grads) + fixed-tree sum + all_gather (ordered_sum)",
                    "each device updates its blocks (L-BFGS: all_gather(optimizer state), whole tensors)"]
        return self.plan.collectives(self.options.pipeline_schedule)

    def parallel_report(self) -> dict:
        """What the manifest records about distribution: mesh, determinism and the collectives used."""
        return {"mesh": {a: n for a, n in self.options.mesh_axes.items() if n > 1} or {"devices": 1},
                "deterministic": self.deterministic, "collectives": self.collectives}

    def numerics_report(self) -> dict:
        """What the manifest records about numerics: compute and accumulation types, loss scaling, and per
        parameter path its storage type, compute type and the rule that set it (ir/passes/numerics.py)."""
        from tessera.ir.passes.numerics import resolved_policy
        return resolved_policy(self.graph, self.options.numerics)

    def deterministic_executor(self):
        """The deterministic executor (canonical batch shards: shard/deterministic.py's `Deterministic`, with its
        loss, train step and forward) on this program's mesh, one device included."""
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
            self._cache["held"] = storage.held_types(self.options, self.graph)
        return self._cache["held"]

    def stacked(self) -> dict[str, int]:
        """{path: n} of the parameters a `repeat` holds stacked on a leading layer axis of n."""
        if "stacked" not in self._cache:
            self._cache["stacked"] = stacked_layers(self.graph.body, self.param_shapes())
        return self._cache["stacked"]

    def padding(self) -> dict[str, dict[str, int]]:
        """{path: {dim: held size}} of the params held larger than the IR says (checkpoints record it)."""
        if "padding" not in self._cache:
            self._cache["padding"] = storage.padding(self.options, self.graph)
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

    def shardings(self, params: Params | None = None) -> dict | None:
        """Each parameter's NamedSharding on the mesh in `params`' layout (see `param_specs`); None on one device."""
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
            return param_init.init_split(self, jnp.asarray(seed, jnp.uint32), on_layer)
        return param_init.init_each(self, seed, self.shardings())

    def init_fn(self) -> Callable:
        """seed (uint32) -> params: `init`'s values as one traced function, not jitted (for jax.eval_shape and
        whole-program jits; `init` itself draws each parameter by a shared small program: param_init.py)."""
        return functools.partial(param_init.init_params, self)

    def load_weights(self, directory, *, split_layers: bool = False) -> Params:
        """Parameters from a Hugging Face checkpoint directory (config.json + safetensors).

        Read one tensor at a time and placed on the device as read, so the host holds one tensor; with
        split_layers each stacked parameter comes as the list of its layers (see `init`)."""
        from tessera.lower.weights import load_hf_weights

        shapes = self.param_shapes()
        packed = {path for path, held in shapes.items() if isinstance(held, mxfp4.MXFP4)}
        blocks = {path for path, held in shapes.items() if isinstance(held, fp8_blocks.FP8Blocks)}  # read in fp32
        params = load_hf_weights(directory, family=self.options.model_file.stem,
                                 args=dict(self.options.model_args), model=self.options.model_file, packed=packed,
                                 split_layers=split_layers,
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
        specs = self.shardings(out)
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
        kw.setdefault("fp8_ops", fp8_ops_of(self.graph.attrs))
        # a model with loss entries differentiates small stacks two and three times over (PDE residuals, then the
        # parameters): XLA runs the scan unrolled, 4.5x faster a Kovasznay step on the CPU than as a loop
        kw.setdefault("scan_unroll", bool(self.graph.losses))
        kw.setdefault("unroll_layers", not self.graph.losses)  # a language model's layers: interpret._unrolls_stacked
        kw.setdefault("param_types", {path: p.type for path, p in self.graph.params.items()})
        if self.options.canonical_tp > 1 and kw.get("mode", "train") == "train":  # deterministic tp's chunks, all
            kw.setdefault("tensor", (self.options.canonical_tp, ()))           # of them here (a mesh's step: its own)
        if self.options.canonical_ep > 1 and kw.get("mode", "train") == "train":  # deterministic ep's, likewise
            q = self.options.canonical_ep
            kw.setdefault("experts", (0, q, q, ()))
        return LowerCtx(kernels=self.options.kernels, backend=jax.default_backend(),
                        deterministic=self.options.deterministic, **kw)

    def logits(self, params, tokens, mode: str = "train", *, shard=None, aux=None, param_use=None,
               layer_remat=None, tensor=None, experts=None, unroll: bool = False):
        """Logits [batch, seq, vocab] of int32 tokens [batch, seq], traced under `mode` ("train", "forward");
        `shard`: inside shard_map, the ShardEnv the lowerings see local blocks by; `aux`: a dict the
        lowerings add step counters to; `param_use`: {path: fn} applied to a parameter where an op reads it
        (deterministic mode's per-layer gathers); `layer_remat`: the checkpoint policy of a repeat's layers where
        the spec's remat is none (LowerCtx.layer_remat); `tensor`: deterministic tp's chunks on a tp mesh
        (LowerCtx.tensor; by default all of them where the spec sets parallel.canonical_tp); `unroll`: the repeat's
        layers unrolled over parameters split into their layers (LowerCtx.unroll)."""
        ctx = self.lower_ctx(mode=mode, shard=shard, aux=aux, param_use=param_use, layer_remat=layer_remat,
                             unroll=unroll,
                             **({"tensor": tensor} if tensor is not None else {}),
                             **({"experts": experts} if experts is not None else {}))
        (logits,), _ = eval_region(self.graph.body, [tokens], params, ctx, remat=self.options.remat)
        return logits

    def forward_fn(self, mode: str = "forward"):
        """(params, tokens) -> logits over the program's whole mesh (sharded where it has a plan; a scientific
        model's on every device with whole params)."""
        if self.plan is None:
            return lambda p, t: self.logits(p, t, mode)
        if self.graph.losses:
            return self.deterministic_executor().forward
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
        weights = self.options.loss_weights
        total = sum(float(weights.get(name, 1.0)) * value for name, value in terms.items())
        return total, terms

    def loss_fn(self) -> Callable:
        """(params, batch) -> the mean loss: what `loss` jits, traced and not jitted (the weighted objective of
        a model with loss entries; the canonical-shard loss in deterministic mode; the sharded loss on a mesh)."""
        return self._loss

    def _loss(self, params, batch):
        if self.graph.losses and not self.canonical_objective:
            return self.objective(params, batch)[0]
        if self.deterministic:
            return self.deterministic_executor().loss(params, batch)
        if self.plan is not None:
            from tessera.lower.shard.step import sharded_loss
            return sharded_loss(self, self.plan)(params, batch)
        logits = self.logits(params, batch["tokens"])
        return cross_entropy(logits, batch["targets"], mask=batch.get("mask"))

    def loss(self, params: Params, batch: dict) -> jax.Array:
        """Mean next-token cross-entropy; batch = {tokens, targets, mask} each [batch, seq]."""
        return self._jit("loss", self._make_loss)(params, batch)

    def _make_loss(self):
        return jax.jit(self.loss_fn())

    eval_loss = loss

    # ---- training ------------------------------------------------------------------------------
    def init_train_state(self, params: Params) -> TrainState:
        """Step 0 with fresh optimizer state (tessera/lower/train_step.py)."""
        return steps.init_train_state(self, params)

    def train_step(self, state: TrainState, batch: dict):
        """One optimizer step over the batch (gradient accumulation over task.microbatches).

        `state` is consumed: its buffers are donated to the new state (parameters and optimizer moments
        are held once, not twice, across the step), so pass each call the state the last one returned."""
        return self._jit("train_step", self._make_train_step)(state, self.global_batch(batch))

    def train_step_fn(self) -> Callable:
        """(state, batch) -> (state, metrics): what `train_step` jits, traced and not jitted
        (tessera.lower.train_step.train_step)."""
        return functools.partial(steps.train_step, self)

    def _make_train_step(self):
        return jax.jit(self.train_step_fn(), donate_argnums=0)

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
        mesh it is sharded for `params` as held (stacked or split layers; arrays or their shapes)
        (tessera/lower/generation.py)."""
        return generation_fn(self, params, batch, capacity, rule, stop_tokens)

    # ---- accounting ----------------------------------------------------------------------------
    def kernel_report(self) -> dict[str, str]:
        """The implementation each attention and MoE op takes on this backend at the task's shapes."""
        sizes, report, decoding = dict(self.options.task_sizes), {}, {}
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
            return eval_region(body, [t], p, self.lower_ctx(mode="decode", positions=pos, position_start=jnp.int32(0),
                                                            report=decoding), state)[0]

        from tessera.ir.cost import shape_at
        from tessera.lower.context import jnp_dtype

        arg = body.args[0]  # the model's input as it declares it: token ids, or points and fields
        x = sds(shape_at(arg.type, sizes), jnp_dtype(arg.type.dtype))
        with jax.default_matmul_precision(self.matmul_precision):
            jax.eval_shape(forward, params, x)
            if not self.graph.losses:  # a language model's decoding step (loss-entry models do not generate)
                jax.eval_shape(decode, params, sds((b, 1), jnp.int32))
        for label, choice in decoding.items():  # a decoding step may choose otherwise: its own entries
            report[label if label.endswith("(decode)") else label + " (decode)"] = choice
        return report

    def flops_per_token(self) -> dict[str, float]:
        """Forward and training-step FLOPs per token, counted from the Graph IR at the task's shapes."""
        from tessera.ir.cost import token_flops

        return token_flops(self.graph, dict(self.options.task_sizes), self.options.remat)

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


def _with_precision(fn, precision: str):
    """fn called (and so traced) under `jax.default_matmul_precision(precision)`."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return call


_PROGRAMS: dict[str, Program] = {}


def program_hash(options: CompileOptions, graph: Graph) -> str:
    """Hash of everything that changes the compiled program: the graph and the spec's program fields
    (`CompileOptions.program_fields`)."""
    from tessera.ir.printer import print_graph

    text = print_graph(graph) + "\n" + repr(list(options.program_fields))
    return hashlib.sha256(text.encode()).hexdigest()


def program_graph(exp) -> Graph:
    """The graph a program runs: the compiler's one pipeline (`tessera.ir.passes.PIPELINE`: verify,
    canonicalize, decompose, fuse, numerics, shard) over the elaborated model, after the spec's checks:
    what `tessera check` passes and `tessera ir --after shard` prints. Parameters are placed by its shard
    annotations."""
    from tessera.ir.check import check_experiment

    return check_experiment(exp)


def compile_experiment(exp, optimizer=None, lr_fn=None) -> Program:
    """Build, check and lower the experiment's graph; cached on the program hash. A cached program built without an
    optimizer or a learning-rate function (`tessera plan` inspects one, then compiles its train step) takes the
    ones a later call gives: a train step cannot have been built without them. The spec is read here, once, into
    the program's CompileOptions; everything below reads those."""
    graph = program_graph(exp)
    options = CompileOptions.of(exp)
    if graph.attrs.get("compute") == "f64" or any(p.type.dtype == "f64" for p in graph.params.values()):
        jax.config.update("jax_enable_x64", True)  # f64 arrays exist only with x64 on (a process-wide setting)
    h = program_hash(options, graph)
    if h not in _PROGRAMS:
        storage.check_packed(options, graph)  # packed params: an inference task, groups that fit the shape and mesh
        plan = None
        if options.mesh_size > 1:
            from tessera.lower.shard.step import make_plan
            plan = make_plan(options, graph)  # mesh errors are the user's: raised before anything compiles
        _PROGRAMS[h] = Program(options, graph, ir_hash=hashlib.sha256(str(graph).encode()).hexdigest(),
                               plan=plan, exp=exp)
    prog = _PROGRAMS[h]
    prog.attach(optimizer, lr_fn)
    return prog
