"""Experiment specs: the Pydantic schema, the position-keeping YAML loader, and error reporting.

    from tessera.spec import load_experiment, summary
    exp = load_experiment("specs/gpt_oss_tiny.yaml", overrides=["mesh.tp=2"])
"""

from tessera.spec.load import load_experiment, summary
from tessera.spec.schema import (DEFAULT_RULES, LOGICAL_AXES, MESH_AXES, Checkpoint, Experiment, Mesh, Model,
                                 Numerics, Parallel, Pipeline)
from tessera.spec.tasks import (BenchTask, ForwardTask, GenerateTask, Optimizer, Sample, Sampling, Schedule,
                                SyntheticData, TokenData, TrainTask)

__all__ = [
    "load_experiment", "summary", "Experiment", "Model", "Mesh", "Parallel", "Pipeline", "Numerics", "Checkpoint",
    "TrainTask", "GenerateTask", "ForwardTask", "BenchTask", "Optimizer", "Schedule", "Sampling", "Sample",
    "SyntheticData", "TokenData", "MESH_AXES", "LOGICAL_AXES", "DEFAULT_RULES",
]
