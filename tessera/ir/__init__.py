"""Graph IR: typed named-dim tensors, SSA ops from one registry, regions for `repeat`, a text form,
a verifier, and named passes.

    from tessera.ir import build_graph, print_graph, parse_graph, verify
    from tessera.ir.passes import run_pipeline, PassContext
    g = build_graph("models/llama.tsl", {"vocab": 256, "d_model": 64, ...})
    print(print_graph(run_pipeline(g, upto="fuse")))
"""

from tessera.ir import ops_core, ops_nn  # noqa: F401  (fills the op registry)
from tessera.ir.elaborate import build_graph, check_experiment
from tessera.ir.flops import graph_flops, op_flops
from tessera.ir.parser import parse_graph
from tessera.ir.printer import print_graph
from tessera.ir.registry import OPS, AttrDef, OpDef, OpError, ParamDecl, get_op, register
from tessera.ir.types import Dim, DimName, Graph, Init, Op, Param, ParamRef, PerLayer, Region, Struct, TensorType, Value
from tessera.ir.verify import verify

__all__ = ["build_graph", "check_experiment", "parse_graph", "print_graph", "verify", "graph_flops",
           "op_flops",
           "OPS", "AttrDef", "OpDef", "OpError", "ParamDecl", "get_op", "register", "Dim", "DimName", "Graph",
           "Init", "Op", "Param", "ParamRef", "PerLayer", "Region", "Struct", "TensorType", "Value"]
