"""Tessera: a declarative model compiler. Spec files in, fast reproducible JAX programs out.

    import tessera
    exp = tessera.load("specs/gpt_oss_tiny.yaml", overrides={"model.args.layers": 2})
    prog = tessera.compile(exp)
    params = prog.init(seed=0)
    logits = prog.forward(params, tokens)
    prog, params = tessera.load_run("runs/<run>")   # a finished run's program and newest checkpoint
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "compile", "load_run", "save_weights", "__version__"]


def load(path, overrides=None):
    """Load and validate an experiment spec (YAML), applying `overrides` ({"a.b": value} or ["a.b=v"])."""
    from tessera.spec import load_experiment

    return load_experiment(path, overrides=overrides or ())


def compile(exp):  # noqa: A001 - the public name is the verb users expect
    """Compile an experiment into a program (Graph IR → JAX) on the experiment's mesh."""
    from tessera.run.main import default_compile

    return default_compile(exp)


def load_run(run_dir, step=None):
    """(program, params) of a run directory: its spec compiled as the run compiled it, and the parameters of
    its newest checkpoint (or of checkpoint `step`)."""
    from tessera.run.load import load_run as _load_run

    return _load_run(run_dir, step)


def save_weights(params, directory, exp=None):
    """Write parameters as a Hugging Face checkpoint (config.json + safetensors)."""
    from tessera.lower.options import CompileOptions
    from tessera.lower.program import program_graph
    from tessera.lower.weights import save_weights as _save

    options = CompileOptions.of(exp)
    return _save(params, directory, options=options, graph=program_graph(exp) if options.mesh_size > 1 else None)
