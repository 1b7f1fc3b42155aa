"""Read a JAX profiler trace back into Tessera's terms: time per Graph IR op, per kernel, per collective.

The lowering traces each IR op inside `jax.named_scope(op.label(...))` (interpret.py), and the program
adds `loss`, `optimizer`, `prefill` and `decode` around its phases, so every instruction of the compiled
HLO carries, in its `op_name` metadata, the IR op it came from. The trace names the HLO instruction that
each device event ran (`hlo_op`); the compiled program's text maps that instruction to its metadata.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path
from typing import Iterable

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
# bytes a device sends in a ring collective over n devices, as a multiple of the full tensor (cost._ring)
_RING = {"all-reduce": lambda n: 2 * (n - 1) / n}
_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32,
         "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64, "c64": 64, "c128": 128}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass
class HloOp:
    """One instruction of the compiled program: its opcode, the name stack it was traced under, its result
    shape's bytes (the largest array in it), the computation it calls and its collective's group size."""

    name: str
    opcode: str
    op_name: str
    bytes: float
    calls: str | None = None
    group: int = 1
    operands: tuple[str, ...] = ()
    inherited: bool = False  # op_name taken from a neighbour (`parse_hlo`)
    weight: str = ""  # and the argument it reads when that is named after a parameter (`params['a/b']`)


def _array_bytes(shape: str) -> list[float]:
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype, 8 if dtype.startswith(("f8", "s8", "u8")) else None)
        if bits is None:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * bits / 8)
    return out


def _group_size(line: str) -> int:
    """Devices in each group of a collective: `replica_groups={{0,1},{2,3}}` or the iota form `[4,2]<=[8]`."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return 2 if m else 1


def parse_hlo(text: str) -> dict[str, HloOp]:
    """{instruction name: HloOp} of every computation in a compiled program's text (`compiled.as_text()`).

    A fusion without metadata of its own takes its fused computation's first named instruction's."""
    ops: dict[str, HloOp] = {}
    by_computation: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line[:1] not in ("", " ") and line.rstrip().endswith("{"):  # a computation: `%name (params) -> shape {`
            c = _COMPUTATION.match(line)
            current = c.group(1) if c else line
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, rest = m.groups()
            op = _OPCODE.search(rest)
            if op is None:
                continue
            shape = rest[:op.start()]
            sizes = _array_bytes(shape)
            meta = re.search(r'op_name="((?:[^"\\]|\\.)*)"', rest)
            calls = re.search(r"calls=%?([\w.\-]+)", rest)
            ops[name] = HloOp(name, op.group(1), meta.group(1) if meta else "", max(sizes, default=0.0),
                              calls.group(1) if calls else None, _group_size(rest),
                              tuple(re.findall(r"%([\w.\-]+)", _arguments(rest, op.end()))))
            by_computation.setdefault(current, []).append(name)
            continue
        if line.strip() == "}":
            current = None
    for op in ops.values():
        if not op.op_name and op.calls:
            inner = [ops[n].op_name for n in by_computation.get(op.calls, ()) if ops[n].op_name]
            op.op_name = inner[-1] if inner else ""  # the root is last: what a fusion is named after
    _inherit_names(ops)
    return ops


def _arguments(rest: str, start: int) -> str:
    """The operand list of an instruction: from just after its opcode's `(` to the matching `)`."""
    depth = 1
    for i in range(start, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[start:i]
    return rest[start:]


_PLUMBING = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy", "transpose", "convert")


def _inherit_names(ops: dict[str, HloOp]) -> None:
    """Give an instruction that XLA made without metadata (a cuBLAS GEMM custom call, a layout copy) the name
    of a neighbour (the first that uses its result, else an operand), and note the weight it reads where an
    operand is an argument named after a parameter (`params['layers/attention/q'][3]`): `op_label` prefers
    the op that owns that parameter (an output projection's user is the residual add, its weight is
    attention's)."""
    users: dict[str, list[str]] = {}
    for op in ops.values():
        for o in op.operands:
            users.setdefault(o, []).append(op.name)

    def source(name: str, hops: int = 4) -> str:  # through plumbing to what the value came from
        op = ops.get(name)
        while op is not None and not op.op_name and op.opcode in _PLUMBING and op.operands and hops:
            op, hops = ops.get(op.operands[0]), hops - 1
        return op.op_name if op is not None else ""

    for op in ops.values():
        if op.op_name or op.opcode in _PLUMBING:
            continue
        found = [source(o) for o in op.operands]
        op.weight = next((n for n in found if n and not n.startswith("jit(")), "")
        used = next((ops[u].op_name for u in users.get(op.name, ()) if ops[u].op_name.startswith("jit(")), "")
        op.op_name = used or next((n for n in found if n.startswith("jit(")), "") or op.weight
        op.inherited = bool(op.op_name)


def module_name(text: str) -> str:
    """The compiled program's module name (`HloModule jit_step, ...`), which trace events carry."""
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", text)
    return m.group(1) if m else ""


# ---- attribution ------------------------------------------------------------------------------------------

PHASES = ("prefill", "decode", "optimizer")


def attribute(op_name: str, labels: Iterable[str], opcode: str = "") -> tuple[str, str]:
    """(phase, IR op label) of one instruction's name stack; labels longest first.

    Phases: `backward` under a transpose (the gradient, remat's recompute included), `optimizer`, `prefill`
    and `decode` from the program's scopes, else `forward`. The label is the innermost IR op scope in the
    stack, `loss` for the loss, `(other: <primitive>)` for what no IR op traced (the step's own glue)."""
    segments = re.split(r"[/()]", op_name)
    phase = "backward" if "transpose(" in op_name else next((p for p in PHASES if p in segments), "forward")
    best, at = "(other)", -1
    for label in labels:
        for m in re.finditer(r"(?:^|[/(])" + re.escape(label) + r"(?=$|[/)])", op_name):
            if m.start() > at or (m.start() == at and len(label) > len(best)):
                best, at = label, m.start()
    if best == "(other)" and "loss" in segments:
        best = "loss"
    if best == "(other)" and phase == "optimizer":
        best = "optimizer"
    if best == "(other)" and op_name and not op_name.startswith("jit("):  # named after a program argument
        best = "(other: inputs)"
    elif best == "(other)" and (op_name or opcode):  # the primitive (a dynamic slice), or what XLA added (a copy)
        best = f"(other: {op_name.rsplit('/', 1)[-1] if op_name else opcode})"
    return phase, best


def op_label(op: HloOp | None, labels: list[str], param_labels: dict[str, str] | None = None) -> tuple[str, str]:
    """(phase, IR op label) of one instruction (labels longest first): `attribute` on its name stack, and for
    an instruction that reads a parameter by its argument name, the label of the op that owns the parameter."""
    if op is None:
        return attribute("", labels)
    phase, label = attribute(op.op_name, labels, op.opcode)
    for name in (op.weight, op.op_name if not op.op_name.startswith("jit(") else ""):
        m = re.search(r"\['([^']+)'\]", name.replace("\\'", "'"))  # the metadata escapes its quotes
        if m and param_labels and m.group(1) in param_labels:
            return phase, param_labels[m.group(1)]
    return phase, label


# ---- the trace ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Event:
    """One device event of the profiled module: the kernel (or CPU thunk) name, its HLO op, its duration."""

    kernel: str
    hlo_op: str
    seconds: float
    device: str


def trace_file(trace_dir: Path) -> Path | None:
    """The Perfetto trace (`*.trace.json.gz` or `perfetto_trace.json.gz`) `jax.profiler.trace` wrote."""
    found = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz")) or sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    return found[-1] if found else None


def load(path: Path) -> tuple[list[dict], dict, dict]:
    """(events, {pid: process name}, {(pid, tid): thread name}) of a gzipped Chrome/Perfetto JSON trace."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    return events, processes, threads


CONTROL = ("while", "conditional", "call")  # on the CPU their events span their bodies' events: not counted


def read_events(path: Path, module: str, hlo: dict[str, HloOp] | None = None) -> list[Event]:
    """The device events of `module` in a Chrome/Perfetto JSON trace.

    On a GPU each kernel is an event on one of the device's `Stream` lines (the derived `XLA Ops` and
    `XLA Modules` lines repeat them and are skipped); on the CPU each thunk of the program is an event on
    a worker thread, and a loop's thunk spans its body's (skipped, given the program's `hlo`)."""
    events, processes, threads = load(path)
    devices = {pid for pid, name in processes.items() if name.startswith("/device:") and "CPU" not in name}
    streams = {key for key, name in threads.items() if key[0] in devices and name.lower().startswith("stream")}
    # a kernel replayed in a CUDA graph names the graph (`command_buffer_3`) as its op; an XLA fusion's kernel
    # is still named after its instruction, dots as underscores (`loop_add_fusion_7` for `loop_add_fusion.7`)
    by_kernel = {name.replace(".", "_"): name for name in hlo or ()}
    out = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or (module and args.get("hlo_module", module) != module):
            continue
        op = args["hlo_op"]
        if hlo and op not in hlo:
            op = by_kernel.get(e["name"], op)
        if hlo and op in hlo and hlo[op].opcode in CONTROL:
            continue
        key = (e["pid"], e.get("tid"))
        if devices and (e["pid"] not in devices or (streams and key not in streams)):
            continue
        device = str(e["pid"]) if devices else str(args.get("device_ordinal", e["pid"]))
        out.append(Event(e["name"], op, float(e.get("dur", 0.0)) * 1e-6, device))
    return out


def device_count(events: list[Event]) -> int:
    """Devices the events ran on: the tables average over them."""
    return len({e.device for e in events})


# ---- the tables ---------------------------------------------------------------------------------------------

def _labeled(events: list[Event], hlo: dict[str, HloOp], labels: list[str], param_labels: dict[str, str] | None):
    """(event, phase, IR op label) of each event; each instruction labelled once (`op_label`)."""
    labels = sorted(labels, key=len, reverse=True)
    cache: dict[str, tuple[str, str]] = {}
    for e in events:
        if e.hlo_op not in cache:
            cache[e.hlo_op] = op_label(hlo.get(e.hlo_op), labels, param_labels)
        yield (e, *cache[e.hlo_op])


def by_op(events: list[Event], hlo: dict[str, HloOp], labels: list[str], steps: int,
          param_labels: dict[str, str] | None = None) -> list[dict]:
    """Seconds per step per (phase, IR op) on one device (the mean over devices), most first."""
    devices = max(device_count(events), 1)
    rows: dict[tuple[str, str], dict] = {}
    for e, phase, label in _labeled(events, hlo, labels, param_labels):
        row = rows.setdefault((phase, label), {"op": label, "phase": phase, "seconds": 0.0, "events": 0})
        row["seconds"] += e.seconds
        row["events"] += 1
    return _per_step(rows.values(), steps * devices)


def by_kernel(events: list[Event], hlo: dict[str, HloOp], labels: list[str], steps: int,
              param_labels: dict[str, str] | None = None) -> list[dict]:
    """Seconds and calls per step of each kernel (a CPU thunk on the CPU) under each (phase, IR op) that ran it, on
    one device, most first: a kernel name shared by instructions of several ops or phases (Mosaic's
    `anonymous_mosaic_gpu_kernel` for prefill's and decode's attention, one cuBLAS kernel for the unembedding of
    the prompt and of each new token) is a row for each, with the first instruction's HLO name."""
    devices = max(device_count(events), 1)
    rows: dict[tuple[str, str, str], dict] = {}
    for e, phase, label in _labeled(events, hlo, labels, param_labels):
        row = rows.setdefault((e.kernel, phase, label), {"kernel": e.kernel, "op": label, "phase": phase,
                                                         "hlo_op": e.hlo_op, "seconds": 0.0, "events": 0})
        row["seconds"] += e.seconds
        row["events"] += 1
    return _per_step(rows.values(), steps * devices)


def by_collective(events: list[Event], hlo: dict[str, HloOp], steps: int) -> list[dict]:
    """Per collective kind: calls, bytes each device sends (ring algorithms) and seconds per step, and the
    achieved bandwidth (bytes sent over the time the collective's kernels ran)."""
    devices = max(device_count(events), 1)
    rows: dict[str, dict] = {}
    for e in events:
        op = hlo.get(e.hlo_op)
        if op is None:
            continue
        base = op.opcode.removesuffix("-start").removesuffix("-done")
        if base not in COLLECTIVES:
            continue
        row = rows.setdefault(base, {"kind": base, "seconds": 0.0, "events": 0, "bytes": 0.0})
        row["seconds"] += e.seconds
        if op.opcode.endswith("-done"):
            continue
        n = max(op.group, 1)
        full = op.bytes * (n if base == "reduce-scatter" else 1)
        row["bytes"] += full * _RING.get(base, lambda n: (n - 1) / n)(n)
        row["events"] += 1
    out = _per_step(rows.values(), steps * devices)
    for row in out:
        row["bytes_per_step"] = row.pop("bytes") / (steps * devices)
        row["bandwidth_bytes_per_s"] = row["bytes_per_step"] / row["seconds"] if row["seconds"] else None
    return out


def _per_step(rows: Iterable[dict], divisor: int) -> list[dict]:
    out = []
    for row in rows:
        row = dict(row)
        row["seconds"] /= divisor
        row["calls"] = row.pop("events") / divisor
        out.append(row)
    return sorted(out, key=lambda r: -r["seconds"])
