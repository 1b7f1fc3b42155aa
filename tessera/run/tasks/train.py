"""The `train` task: optimizer steps over a data source, with eval, checkpoints and exact resume.

Step numbering: the record with `step = n` describes the n-th optimizer step (1-based), which
consumed data batch n-1; a checkpoint at step n holds the state after n steps and resumes with
batch n. Losses stay on the device between flushes (every `log_every` steps) so the host does
not stall the accelerator each step; every step's numbers are still recorded.
"""

from __future__ import annotations

import math
import signal
import time
from typing import Any

import jax
import numpy as np

from tessera.diagnostics import RunError
from tessera.run.checkpoint import Checkpoints, DamagedCheckpoint, check_compatible
from tessera.spec.files import file_records
from tessera.run.context import Interrupt, RunContext
from tessera.run.data import STREAM_EVAL, SyntheticSource, build_source
from tessera.run.manifest import now, params_checksum
from tessera.run.progress import Progress



def _params(state) -> dict:
    return state["params"] if isinstance(state, dict) else state.params


def _to_float(x) -> float:
    return float(np.asarray(x))


def first_nonfinite(tree: dict[str, Any]) -> str | None:
    """The first path (sorted order) whose tensor holds a NaN or Inf, or None."""
    for path in sorted(tree):
        arr = np.asarray(tree[path])
        if arr.dtype.kind in "fc" and not np.isfinite(arr.astype(np.float32)).all():
            return path
    return None


class Trainer:
    """Runs one train task inside a RunContext."""

    def __init__(self, ctx: RunContext):
        self.ctx, self.exp, self.prog, self.task = ctx, ctx.exp, ctx.prog, ctx.exp.task
        vocab = self.prog.vocab
        self.source = build_source(self.task, vocab, base_dir=ctx.spec_dir)
        ck = getattr(self.exp, "checkpoint", None)
        self.every = int(getattr(ck, "every", 0) or 0)
        self.ckpts = Checkpoints(ctx.resolve(getattr(ck, "dir", None) or "ckpt"), getattr(ck, "keep", None))
        self.steps = int(self.task.steps)
        self.log_every = max(int(getattr(self.task, "log_every", 0) or 10), 1)
        self.eval_every = int(getattr(self.task, "eval_every", 0) or 0)
        self.records: list[dict] = []
        self.pending: list[tuple[int, dict]] = []  # (step, device metrics) not yet on the host
        # throughput: tokens a step, or for a model fitted to fields (collocation points, data pairs) samples a step
        self.rate_name, self.per_step = _throughput(self.exp)
        self._skipped_total = 0  # loss scaling's skipped steps so far (lower/loss_scale.py), as last recorded

    def start(self) -> int:
        """Initialise, or restore the latest compatible checkpoint; returns the first data step to run."""
        state = self.prog.init_train_state(self.ctx.initial_params())
        latest = self.ckpts.latest_step() if self.ctx.resume else None
        if latest is None:
            self.state = state
            self.ctx.metrics.truncate_after(0)  # a directory reused without a checkpoint starts over
            return 0
        try:
            meta = self.ckpts.read_meta(latest)
            check_compatible(self.exp, meta["spec"], self.exp.resolved(), self.ckpts.directory / str(latest),
                             meta.get("files"))
            self.state, meta = self.ckpts.restore(latest, state)
        except DamagedCheckpoint as exc:
            raise RunError(self._damaged(latest, exc)) from None
        self.records = list(meta["metrics"])
        self._skipped_total = next((r["skipped_steps"] for r in reversed(self.records) if "skipped_steps" in r), 0)
        self.ctx.metrics.truncate_after(latest)
        self.ctx.manifest.record["resumed"].append({"from_step": latest, "at": now()})
        self.ctx.say(f"resuming from checkpoint at step {latest} in {self.ckpts.directory}")
        return int(meta["data_step"])

    def _damaged(self, step: int, exc: DamagedCheckpoint) -> str:
        """What to say of a checkpoint that cannot be restored, and which one to continue from instead."""
        where = self.ckpts.directory / str(step)
        older = [s for s in self.ckpts.all_steps() if s < step]
        if older:
            aside = self.ckpts.directory.parent / f"damaged-checkpoint-{step}"  # outside: orbax cleans its own dir
            offer = (f"older checkpoints: {', '.join(map(str, sorted(older)))}; to continue from step {max(older)}, "
                     f"move the damaged one aside (mv {where} {aside}) and run again with --resume")
        else:
            offer = "no older checkpoint is kept here; remove it to start over"
        return f"checkpoint at step {step} in {self.ckpts.directory} is damaged: {exc}; {offer}"

    def flush(self, eval_loss: float | None = None, extra: dict | None = None) -> list[dict]:
        """Bring pending metrics to the host, stop on a non-finite loss, record them (eval loss on the last)."""
        if not self.pending:
            return []
        host = jax.device_get([m for _, m in self.pending])
        new = [{"step": s, **{k: _to_float(v) for k, v in m.items()}} for (s, _), m in zip(self.pending, host)]
        self.pending = []
        for rec in new:
            # a loss-scaled step whose gradients overflowed was skipped (skipped_steps went up): its grad_norm is
            # not finite by design, and nothing was applied
            skipped = rec.get("skipped_steps", 0) > self._skipped_total
            self._skipped_total = rec.get("skipped_steps", self._skipped_total)
            bad = [k for k in ("loss", "grad_norm") if k in rec and not math.isfinite(rec[k])
                   and not (skipped and k == "grad_norm")]
            if bad:
                self._fail_nonfinite(rec, bad[0])
        if eval_loss is not None:
            new[-1]["eval_loss"] = eval_loss
        new[-1].update(extra or {})
        self.records.extend(new)
        self.ctx.metrics.append(new)  # every record, at once; the manifest follows unless that costs too much
        self.ctx.manifest.update(metrics=self.records, lazy=True)
        return new

    def _fail_nonfinite(self, rec: dict, key: str) -> None:
        step, kept = rec["step"], self.ckpts.latest_step()
        culprit = self.diagnose(step)
        msg = (f"{key} became {rec[key]} at step {step}; first non-finite tensor: {culprit}; "
               + (f"last good checkpoint: step {kept} in {self.ckpts.directory}" if kept is not None
                  else "no checkpoint was saved before it"))
        raise RunError(msg)

    def diagnose(self, step: int, budget: int = 1000) -> str:
        """Name the first non-finite tensor going into `step`: a parameter, else a gradient, else the loss.

        The state before `step` is rebuilt from the last checkpoint (or the start) by re-running the
        steps in between, which are deterministic; beyond `budget` steps only the loss is named.
        """
        kept = self.ckpts.latest_step()
        begin = kept if kept is not None else 0
        if step - 1 - begin > budget:
            return "loss (too many steps since the last checkpoint to locate the tensor)"
        state = self.prog.init_train_state(self.ctx.initial_params())
        if kept is not None:
            state, _ = self.ckpts.restore(kept, state)
        for n in range(begin, step - 1):
            state, _ = self.prog.train_step(state, self.source.batch(n))
        params = _params(state)
        bad = first_nonfinite(params)
        if bad is not None:
            return f"parameter `{bad}`"
        batch = self.source.batch(step - 1)
        try:
            grads = jax.grad(self.prog.loss)(params, batch)
        except ValueError:  # a loss JAX cannot differentiate from outside (deterministic mode's opaque loops on a
            # mesh): the step itself, whose update carries a non-finite gradient into the parameters
            bad = first_nonfinite(_params(self.prog.train_step(state, batch)[0]))
            return (f"the update of `{bad}` (its gradient, or the optimizer's state)" if bad is not None
                    else "loss (parameters finite; the step's gradients could not be inspected one by one)")
        bad = first_nonfinite(grads)
        return f"gradient of `{bad}`" if bad is not None else "loss (parameters and gradients are finite)"

    def evaluate(self) -> float:
        """Mean eval loss over `eval_batches` batches of the eval stream (the same ones every time)."""
        n = max(int(getattr(self.task, "eval_batches", 0) or 1), 1)
        params = _params(self.state)
        losses = [self.prog.eval_loss(params, self.source.batch(i, STREAM_EVAL)) for i in range(n)]
        return float(np.mean([_to_float(x) for x in jax.device_get(losses)], dtype=np.float64))

    def errors(self) -> dict:
        """Errors against the data's exact solution on its held-out points (rel_l2_u/v/p), when it names one."""
        errors = getattr(self.source, "errors", None)
        if errors is None:
            return {}
        params = _params(self.state)
        return errors(lambda pts: self.prog.forward(params, pts))

    def save(self, step: int) -> None:
        """Checkpoint the state after `step` steps with everything needed to continue exactly."""
        meta = {"step": step, "data_step": step, "seed": int(self.task.seed), "spec": self.exp.resolved(),
                "spec_hash": self.exp.spec_hash, "files": file_records(self.exp.resolved()), "metrics": self.records}
        self.ckpts.save(step, self.state, meta)
        self.ctx.manifest.flush()  # a checkpoint and the manifest's metrics agree up to `step`

    def loop(self, start: int, progress: Progress) -> bool:
        """Run steps start..steps-1; returns False if interrupted (after checkpointing)."""
        t0, last = time.perf_counter(), start
        for n in range(start, self.steps):
            if self.ctx.interrupt is not None and self.ctx.interrupt.requested:
                self.flush()
                self.save(n)
                return False
            self.state, m = self.prog.train_step(self.state, self.source.batch(n))
            done = n + 1
            self.pending.append((done, m))
            evaluate = done == self.steps or (self.eval_every and done % self.eval_every == 0)
            checkpoint = self.every and done % self.every == 0
            if done % self.log_every == 0 or done == self.steps or evaluate or checkpoint:
                jax.block_until_ready(m)  # the rate counts the training steps only, not the evaluation below
                rate = (done - last) * self.per_step / max(time.perf_counter() - t0, 1e-9)
                new = self.flush(self.evaluate() if evaluate else None, self.errors() if evaluate else None)
                t0, last = time.perf_counter(), done
                progress.update(done, {**new[-1], self.rate_name[0]: rate})
                self.ctx.manifest.record[self.rate_name[1]] = rate
            if checkpoint:
                self.save(done)
        return True

    def sample(self) -> None:
        """Greedy samples after training (task.sample; null: none): its prompt, and a synthetic task's eval question."""
        records = []
        spec = getattr(self.task, "sample", None)
        if spec is None:
            return
        if spec.prompt:
            text = isinstance(spec.prompt, str)
            rec = self._generate(list(spec.prompt.encode("utf-8")) if text else list(spec.prompt),
                                 int(spec.max_new_tokens))
            if text:  # the byte tokenizer's ids are the text's UTF-8 bytes
                rec["text"] = bytes(t for t in rec["output"] if t < 256).decode("utf-8", "replace")
            records.append(rec)
        if isinstance(self.source, SyntheticSource):
            prompt, expected = (list(map(int, a)) for a in self.source.example())
            rec = self._generate(prompt, len(expected))
            rec.update(expected=expected, correct=sum(map(int.__eq__, rec["output"], expected)) / len(expected))
            records.append(rec)
        for rec in records:
            line = f"sample: {rec['prompt']} -> {rec['output']}"
            if "text" in rec:
                line += f" {rec['text']!r}"
            if "expected" in rec:
                line += f" (expected {rec['expected']}: {rec['correct']:.0%} right)"
            self.ctx.say(line)
        if records:
            self.ctx.manifest.update(samples=records)

    def _generate(self, prompt: list[int], n: int) -> dict:
        out = self.prog.generate(_params(self.state), np.asarray([prompt], np.int32), max_new_tokens=n)
        return {"prompt": prompt, "output": [int(t) for t in np.asarray(out)[0, len(prompt):]]}


def run(ctx: RunContext) -> int:
    """Train as exp.task says; checkpoints every N steps and at the end; returns the exit code."""
    tr = Trainer(ctx)
    try:
        start = tr.start()
        ctx.manifest.update(data_fingerprint=tr.source.fingerprint, metrics=tr.records,
                            checkpoint_dir=str(tr.ckpts.directory))
        if isinstance(tr.source, SyntheticSource):
            ctx.manifest.update(chance_loss=tr.source.chance_loss())
        _say_pipeline(ctx, tr.state)
        with Interrupt() as ctx.interrupt, Progress(tr.steps, start, stream=ctx.stream) as progress:
            finished = tr.loop(start, progress)  # Ctrl-C only sets a flag here: the loop checkpoints, then stops
        if not finished:
            tr.ckpts.wait()
            step = tr.ckpts.latest_step()
            ctx.manifest.finish("interrupted", params_checksum=params_checksum(_params(tr.state)))
            ctx.say(f"interrupted ({ctx.interrupt.name}): checkpoint at step {step} in {tr.ckpts.directory}; "
                    f"continue with --resume --out {ctx.run_dir}")
            return 128 + (ctx.interrupt.signum or signal.SIGINT)  # the shell's code for death by that signal
        tr.save(tr.steps)
        tr.ckpts.wait()
        ctx.manifest.update(params_checksum=params_checksum(_params(tr.state)))
        tr.sample()
        return 0
    finally:
        tr.ckpts.close()


def _say_pipeline(ctx: RunContext, state) -> None:
    """Deterministic training on a pp mesh: say (and record as `pipeline`) whether the stages split the layers'
    compute (tessera/lower/shard/det_pipeline.py) or pp acts as a data axis, and why."""
    prog = ctx.prog
    if not getattr(prog, "deterministic", False) or getattr(prog, "plan", None) is None or prog.graph.losses:
        return
    from tessera.ir.check import canonical_shards

    c = canonical_shards(int(ctx.exp.task.batch), prog.options.canonical_shards)
    det = prog.deterministic_executor()
    for axis, key, what, chunks in (("tp", "tensor", "the attention, MLP and expert compute", prog.options.canonical_tp),
                                     ("ep", "experts", "the experts' compute", prog.options.canonical_ep)):
        record = det.tensor_record(c, state.opt_state, axis)  # deterministic tp / ep (lower/shard/det_tensor.py)
        if record is None:
            continue
        ctx.manifest.update(**{key: record})
        ctx.say(f"deterministic {axis}: {what} split over {axis}={record[axis]} ({chunks} canonical chunks)"
                if record["split_compute"] else
                f"deterministic {axis}: {axis} acts as a data axis: {record['why_not']}")
    record = det.pipeline_record(c, state.opt_state)
    if record is None:
        return
    ctx.manifest.update(pipeline=record)
    if record["split_compute"]:
        ctx.say(f"deterministic pp: the layers' compute split over {record['stages']} stages (1F1B over the "
                f"{c} canonical shards)")
    else:
        ctx.say(f"deterministic pp: pp acts as a data axis (every device runs every layer): {record['why_not']}")


def _throughput(exp) -> tuple[tuple[str, str], int]:
    """((progress label, manifest key), units a step): tokens (batch x seq_len), or samples for a model fitted to
    fields (`cost.task_dims`' batch: every collocation set's points, or the batch of data pairs)."""
    from tessera.ir.check_objectives import SCIENTIFIC_DATA
    from tessera.ir.cost import task_dims

    sizes = task_dims(exp)
    if getattr(getattr(exp.task, "data", None), "kind", None) in SCIENTIFIC_DATA:
        return ("samples/s", "samples_per_s"), int(sizes["batch"])
    return ("tok/s", "tokens_per_s"), int(sizes["batch"]) * int(sizes["seq"])
