"""Whole programs on one GPU, as a user runs them (`tessera run`), against the plan and published peers.

    python -m bench.e2e [--only decode,prefill,train] [--rows NAME,...] [--set KEY=VALUE ...]

Each row runs a shipped spec through `run_experiment` (mesh: auto, Tessera's allocator setting), then
prints tokens/s, model FLOP utilisation or the share of the decode roofline, the first token's latency
and compile time apart, and the peak device memory measured (`peak_bytes_in_use`) against `tessera
plan`'s total. Each row runs in a process of its own, as a user's `tessera run` does (the device's peak
never resets within a process). The decode roofline is the plan's bytes a step must read over the copy
bandwidth measured in the row's process after the row (bench.timing.copy_bandwidth). Published figures are fixed reference
columns (issue 32's table). Rows with a PyTorch peer (bench/peers.py: the Llama train step in
`transformers`, eager and `torch.compile`) run it first, in a process of its own, on the same GPU and
shapes, and print it under the row with its MFU counted with Tessera's FLOPs per token (--no-peers skips).
`--set` overrides every row's spec after the row's own overrides, as `tessera run --set` (a variant of the whole
table, e.g. `--set parallel.remat=none`); each row prints the sets it ran with.
`measure` returns the rows as dicts: `python -m bench.results` takes them from there into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tessera.run.environment import configure_allocator

ALLOCATOR = configure_allocator()  # before JAX starts its backend, as `tessera run` does

import numpy as np  # noqa: E402

PROMPT = [200006, 17360, 200008, 3575, 553, 261, 10297, 29186, 13, 200007]
LONG = [int(t) for t in np.random.default_rng(0).integers(0, 200000, 2048)]
# gpt_oss_20b.yaml's rules with the attention projections held in fp8: q and o in 64 x 64 blocks (64 divides 2880
# and the 64 heads), k and v ([2880, 8 kv heads, 64]) in 8 x 8 blocks over their last two dims
FP8_ATTENTION = {"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "bf16",
                 "*/attention/[qo]": "fp8_e4m3 @scale(per_block(64))",
                 "*/attention/[kv]": "fp8_e4m3 @scale(per_block(8))"}
FP8_UNEMBED = "fp8_e4m3 @scale(per_tensor) @accum(fp32)"
FP8_DELAYED = "fp8_e4m3 @scale(delayed(16)) @accum(fp32)"
# name: (kind, spec, overrides, published peer)
ROWS = {
    "120b decode b1": ("decode", "specs/gpt_oss_120b.yaml", {},
                       "SGLang 1 GPU b1: 211 tok/s; vLLM H100 1-4 req: 511 tok/s"),
    "120b decode b8": ("decode", "specs/gpt_oss_120b.yaml", {"task.prompts": [PROMPT] * 8}, "-"),
    "20b decode b1": ("decode", "specs/gpt_oss_20b.yaml", {}, "SGLang 1 GPU b1: 305 tok/s"),
    "20b decode b8": ("decode", "specs/gpt_oss_20b.yaml", {"task.prompts": [PROMPT] * 8},
                      "SGLang 1 GPU b8: 1,351 tok/s"),
    "20b decode b1 fp8 attn": ("decode", "specs/gpt_oss_20b.yaml", {"numerics.rules": FP8_ATTENTION}, "-"),
    "20b prefill 2048": ("prefill", "specs/gpt_oss_20b.yaml", {"task.prompts": [LONG], "task.max_new_tokens": 4},
                         "-"),
    "llama-1b train": ("train", "specs/bench/llama_1b_train.yaml", {},
                       "MaxText ~50 % (Llama2-7B, 8xH100); torchtitan 33-39 % (8B)"),
    "llama-1b train deterministic": ("train", "specs/bench/llama_1b_train.yaml", {"parallel.deterministic": True},
                                     "-"),
    "llama-1b train fp8": ("train", "specs/bench/llama_1b_train.yaml",
                           {"numerics.default": "fp8_e4m3 @scale(per_tensor) @accum(fp32)"},
                           "torchtitan Float8: 1.28x bf16 tokens/s (Llama-3-8B)"),
    "llama-1b train fp8 delayed": ("train", "specs/bench/llama_1b_train.yaml",
                                   {"numerics.default": "fp8_e4m3 @scale(delayed(16)) @accum(fp32)"},
                                   "torchtitan Float8: 1.28x bf16 tokens/s (Llama-3-8B)"),
    "llama-1b train fp8 deterministic": ("train", "specs/bench/llama_1b_train.yaml",
                                         {"numerics.default": "fp8_e4m3 @scale(per_tensor) @accum(fp32)",
                                          "parallel.deterministic": True}, "-"),
    "llama-8b-layers train": ("train", "specs/bench/llama_8b_layers_train.yaml", {}, "-"),
    "llama-8b-layers train fp8": ("train", "specs/bench/llama_8b_layers_train.yaml",
                                  {"numerics.default": "fp8_e4m3 @scale(per_tensor) @accum(fp32)"},
                                  "torchtitan Float8: 1.28x bf16 tokens/s (Llama-3-8B)"),
    "llama-8b-layers train fp8 delayed": ("train", "specs/bench/llama_8b_layers_train.yaml",
                                          {"numerics.default": "fp8_e4m3 @scale(delayed(16)) @accum(fp32)"},
                                          "torchtitan Float8: 1.28x bf16 tokens/s (Llama-3-8B)"),
    # the unembedding's product in fp8 too (a numerics.compute rule; the default keeps it bf16, as torchtitan does)
    "llama-8b-layers train fp8 delayed unembedding": ("train", "specs/bench/llama_8b_layers_train.yaml",
                                                      {"numerics.default": FP8_DELAYED,
                                                       "numerics.compute": {"*unembed": FP8_DELAYED}}, "-"),
    "llama-1b train fp8 unembedding": ("train", "specs/bench/llama_1b_train.yaml",
                                       {"numerics.default": FP8_UNEMBED, "numerics.compute": {"*unembed": FP8_UNEMBED}},
                                       "-"),
    "llama-1b train fp8 delayed unembedding": ("train", "specs/bench/llama_1b_train.yaml",
                                               {"numerics.default": FP8_DELAYED,
                                                "numerics.compute": {"*unembed": FP8_DELAYED}}, "-"),
    "20b-layers train": ("train", "specs/bench/gpt_oss_20b_layers_train.yaml", {},
                         "NeMo AutoModel 20B: 28 %; torchtitan 20B: 16.5-19.5 %"),
    "20b-layers train deterministic": ("train", "specs/bench/gpt_oss_20b_layers_train.yaml",
                                       {"parallel.deterministic": True}, "-"),
}


# row name: the in-process peers run beside it (bench/peers.py name, extra flags)
PEERS = {"llama-1b train": [("llama_train", ["--eager"]), ("llama_train", [])],
         "20b decode b1": [("gpt_oss_generate", [])], "20b decode b8": [("gpt_oss_generate", [])]}


def run_peers(name: str) -> list[dict]:
    """The row's PyTorch peers, each in a subprocess (before this process starts JAX: it would hold the card)."""
    spec = ROWS[name][1]
    out = []
    for peer, flags in PEERS.get(name, []):
        cmd = [sys.executable, "-m", "bench.peers", peer, spec, *flags, *(f"--set={s}" for s in row_overrides(name))]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode == 0 and "RESULT " in done.stdout:
            out.append(json.loads(done.stdout.split("RESULT ", 1)[1]))
        else:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            out.append({"peer": f"{peer} {' '.join(flags)}".strip(), "error": tail[0][:300]})
    return out


def show_peer(peer: dict, row: dict) -> str:
    if "error" in peer:
        return f"{'':<18} peer {peer['peer']}: FAILED {peer['error']}"
    flops, peak = row.get("train_step_flops_per_token"), row.get("peak_flops")
    mfu = f", MFU {peer['tokens_per_s'] * flops / peak:.1%}" if flops and peak else ""
    mine = row.get("train_step_ms") or (1e3 / row["decode_tok_s"] * row["batch"] if row.get("decode_tok_s") else None)
    ratio = f"; Tessera {peer['step_ms'] / mine:.2f}x its speed" if mine else ""
    first = f", first token {peer['first_token_s'] * 1e3:.1f} ms" if peer.get("first_token_s") else ""
    mem = f", peak {_gib(peer['peak_bytes'])} GiB" if peer.get("peak_bytes") else ""
    return (f"{'':<18} peer {peer['peer']}: {peer['tokens_per_s']:,.0f} tok/s, step {peer['step_ms']:.1f} ms"
            f"{mfu}{first}{mem}{ratio}")


def _plan(manifest: dict, device: str) -> dict:
    """The plan of the spec the run resolved (its chosen mesh), on the device table's entry for this GPU."""
    from tessera.run.plan import build_plan
    from tessera.spec.schema import Experiment

    exp = Experiment.model_validate(manifest["spec"])
    return build_plan(exp, device)


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2 ** 30:.1f}"


def row_overrides(name: str, sets: list[str] = ()) -> list[str]:
    """Row `name`'s spec overrides as `--set` strings (values in JSON, which the spec's YAML reads), then `sets`."""
    return [*(f"{k}={json.dumps(v)}" for k, v in ROWS[name][2].items()), *sets]


def run_row(name: str, out: Path, sets: list[str] = ()) -> dict:
    from tessera.run.main import run_experiment
    from tessera.run.plan import pick_device
    from tessera.spec import load_experiment

    kind, spec, _, peer = ROWS[name]
    exp = load_experiment(spec, overrides=row_overrides(name, sets))
    log = io.StringIO()
    started = time.perf_counter()
    result = run_experiment(exp, out=out / name.replace(" ", "_"), stream=log, tensorboard=False)
    wall = time.perf_counter() - started
    m = result.manifest
    plan = _plan(m, pick_device(None)[0])
    planned = plan["memory_per_device"]["total"]
    peak = (m.get("device_memory") or {}).get("peak_bytes_in_use")
    row = {"row": name, "kind": kind, "wall_s": wall, "planned_bytes": planned, "peak_bytes": peak, "peer": peer,
           "mesh": (m.get("mesh_choice") or {}).get("mesh"), "log": log.getvalue().splitlines()[:3],
           "deterministic": bool(exp.parallel.deterministic), "sets": list(sets)}
    if kind in ("decode", "prefill"):
        s = m["speed"]
        batch = plan["shapes"]["batch"]
        row.update(batch=batch, decode_tok_s=s["decode_tokens_per_s"], prefill_tok_s=s["prefill_tokens_per_s"],
                   first_token_s=s.get("first_token_s"), compile_s=s.get("compile_s"),
                   step_bytes=plan["device"]["bytes_per_step"], roofline_tok_s=None, roofline_share=None)
    else:
        b = m["bench"]
        row.update({f"{p}_mfu": b[p].get("mfu") for p in ("forward", "train_step") if p in b})
        row.update({f"{p}_ms": b[p]["median_s"] * 1e3 for p in ("forward", "train_step") if p in b})
        row.update({f"{p}_compile_s": b[p]["compile_s"] for p in ("forward", "train_step") if p in b})
        row.update(peak_flops=m.get("peak_flops"),
                   train_step_flops_per_token=b.get("train_step", {}).get("flops_per_token"))
    return row


def show(row: dict) -> str:
    mem = f"peak {_gib(row['peak_bytes'])} GiB vs plan {_gib(row['planned_bytes'])} GiB"
    if row["peak_bytes"]:
        mem += f" ({row['peak_bytes'] / row['planned_bytes'] - 1:+.0%})"
    if "decode_tok_s" in row:
        share = f"{row['roofline_share']:.0%} of {row['roofline_tok_s']:,.0f}" if row.get("roofline_share") else "-"
        what = (f"decode {row['decode_tok_s']:,.1f} tok/s ({share} roofline), prefill {row['prefill_tok_s']:,.0f} "
                f"tok/s, first token {row['first_token_s'] * 1e3:.1f} ms, compile {row['compile_s']:.1f} s")
    else:
        what = ", ".join(f"{p} {row[p + '_ms']:.1f} ms MFU {row[p + '_mfu']:.1%} (compile {row[p + '_compile_s']:.0f} s)"
                         for p in ("forward", "train_step") if p + "_ms" in row)
    mode = "deterministic" if row.get("deterministic") else "fast"
    return (f"{row['row']:<18}{_sets_text(row.get('sets'))} {what}; {mem}; {mode}; mesh {row['mesh']}; wall "
            f"{row['wall_s']:.0f} s | peer: {row['peer']}")


def _sets_text(sets) -> str:
    """The `--set`s a row ran with, as its line prints them."""
    return "".join(f" --set {s}" for s in sets or ())


def select(kinds: str | None = None, rows: str | None = None) -> list[str]:
    """Row names to run: `rows` (comma-separated names) or all, then only those of `kinds` (decode, prefill, train)."""
    names = [n.strip() for n in rows.split(",")] if rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; rows are {list(ROWS)}")
    if kinds:
        names = [n for n in names if ROWS[n][0] in set(kinds.split(","))]
    return names


def measure_peers(names: list[str]) -> dict[str, list[dict]]:
    """{row name: its PyTorch peers' results}; run it before this process's JAX takes the card."""
    return {n: run_peers(n) for n in names if n in PEERS}


def measure(names: list[str], peers: dict[str, list[dict]] | None = None, sets: list[str] = ()) -> list[dict]:
    """Run the rows `names`, each in a process of its own, and return them (a dict a row, its peers under
    "peers"; a failed row holds "error"), printing each as it comes.

    A process per row, as a user runs `tessera run`: the device's `peak_bytes_in_use` never resets, so in one
    process a row would report an earlier row's (or a kernel suite's) peak, and compiled programs and caches
    would carry over."""
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, "-m", "bench.e2e", "--rows", name, "--no-peers", "--here", "--json", str(out),
                   *(f"--set={s}" for s in sets)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if done.returncode == 0 and out.exists():
                row = json.loads(out.read_text())[0]
                print("\n".join(line for line in done.stdout.splitlines() if line.startswith("# ")), flush=True)
            else:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                row = {"row": name, "kind": ROWS[name][0], "peer": ROWS[name][3],
                       "error": f"exit {done.returncode}: {tail[0][:400]}"}
        rows.append(row)
        print(f"{name:<18}{_sets_text(sets)} FAILED {row['error']}" if "error" in row else show(row), flush=True)
        row["peers"] = (peers or {}).get(name, [])
        for peer in row["peers"]:
            print(show_peer(peer, row), flush=True)
    for line in against_base(rows):
        print(line, flush=True)
    return rows


SPEEDS = {"train": ("train_step_ms", "train step", True), "decode": ("decode_tok_s", "decode", False),
          "prefill": ("prefill_tok_s", "prefill", False)}  # kind: (the figure, its name, whether lower is faster)


def against_base(rows: list[dict]) -> list[str]:
    """Each row that is a variant of another row measured in the same run (its name that row's and more: `llama-1b
    train fp8 delayed` of `llama-1b train`, `20b decode b1 fp8 attn` of `20b decode b1`) set against it: the speed
    ratio goes into the row as `vs_base` ({"row", "speedup"}: above 1 is faster) and a line for it is returned. Only
    rows of one call compare: another machine of the same kind differs by a few percent (bench/RESULTS.md)."""
    done = {r["row"]: r for r in rows if "error" not in r}
    lines = []
    for name, row in done.items():
        bases = [b for b in done if name.startswith(b + " ") and done[b].get("kind") == row.get("kind")]
        key, what, lower = SPEEDS.get(row.get("kind"), (None, None, None))
        if not bases or key is None:
            continue
        base = max(bases, key=len)
        mine, theirs = row.get(key), done[base].get(key)
        if not mine or not theirs:
            continue
        speedup = theirs / mine if lower else mine / theirs
        row["vs_base"] = {"row": base, "speedup": speedup}
        lines.append(f"# {name}: {what} {speedup:.3f}x the speed of {base}")
    return lines


def measure_here(names: list[str], sets: list[str] = ()) -> list[dict]:
    """The rows `names` run in this process (one row a process is what `measure` asks for), then the copy
    bandwidth their decode rooflines are held to (measured after the rows: its buffers would set the peak)."""
    import jax

    from bench.timing import copy_bandwidth

    rows = []  # JAX's backend starts in the row's run, after `tessera run`'s settings (allocator, XLA flags)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            gc.collect()
            jax.clear_caches()
            try:
                rows.append(run_row(name, Path(tmp), sets))
            except Exception as exc:  # one row's failure (out of memory) is a result, not the end of the table
                rows.append({"row": name, "kind": ROWS[name][0], "peer": ROWS[name][3],
                             "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
    gc.collect()
    jax.clear_caches()
    dev = jax.devices()[0]
    bandwidth = copy_bandwidth() * 1e9 if dev.platform == "gpu" else float("nan")  # bytes moved per s, as decode's
    print(f"# {dev.device_kind}, jax {jax.__version__}, allocator {ALLOCATOR}, copy bandwidth "
          f"{bandwidth / 1e9:,.0f} GB/s", flush=True)
    for row in rows:
        row.update(device=dev.device_kind, jax=jax.__version__)
        if row.get("step_bytes"):
            row["roofline_tok_s"] = row["batch"] * bandwidth / row["step_bytes"]
            row["roofline_share"] = row["decode_tok_s"] / row["roofline_tok_s"]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="kinds: decode, prefill, train")
    parser.add_argument("--rows", default=None, help="row names, comma-separated")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--no-peers", action="store_true", help="skip the PyTorch peers")
    parser.add_argument("--here", action="store_true", help="run the rows in this process (what each row's own "
                        "process does)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override every row's spec (after the row's own overrides), as `tessera run --set`")
    args = parser.parse_args(argv)
    try:
        names = select(args.only, args.rows)
    except ValueError as exc:
        parser.error(str(exc))
    if args.here:
        rows = measure_here(names, args.set)
    else:
        peers = {} if args.no_peers else measure_peers(names)  # before JAX takes the card
        rows = measure(names, peers, args.set)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
