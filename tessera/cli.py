"""The `tessera` command: check, ir, plan, run, profile, replay, diff.

Exit codes: 0 success, 2 bad input (diagnostics on stderr, no traceback), 1 failure while running.
Each handler is a thin shell over the library: it parses flags, calls one function, prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from tessera.diagnostics import RunError, TesseraError

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is a bad-input error (exit 2) in our format."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set mesh.tp=4 (value parsed as YAML)")


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a spec (and its model); print a summary or the resolved spec."""
    from tessera.spec import load_experiment, summary

    from tessera.ir.check import check_experiment
    from tessera.lower.options import CompileOptions
    from tessera.lower.storage import check_packed

    exp = load_experiment(args.spec, overrides=args.overrides)
    # packed storage's own limits (inference only, whole K groups)
    check_packed(CompileOptions.of(exp), check_experiment(exp))
    print(exp.to_yaml() if args.print_resolved else summary(exp), end="")
    return EXIT_OK


def cmd_ir(args: argparse.Namespace) -> int:
    """Print the spec's Graph IR after a pass, or check that it round-trips."""
    from tessera.ir.commands import ir_command

    if args.after != "lower":
        return ir_command(args.spec, overrides=args.overrides, after=args.after, roundtrip=args.roundtrip)
    code = ir_command(args.spec, overrides=args.overrides, after="shard", roundtrip=args.roundtrip)
    import jax

    import tessera

    report = tessera.compile(tessera.load(args.spec, overrides=args.overrides)).kernel_report()
    print(f"\n// lowering on backend {jax.default_backend()}: implementation per op")
    for label, choice in report.items():
        print(f"//   {label:<40} {choice}")
    return code


def cmd_plan(args: argparse.Namespace) -> int:
    """Parameters, memory, FLOPs and communication per device, from the spec alone."""
    from tessera.run.plan import plan_command

    return plan_command(args.spec, overrides=args.overrides, as_json=args.json, device=args.device,
                        compile_check=not args.no_compile, devices=args.devices)


def _before_jax(exp) -> None:
    """Set what XLA reads once, as JAX starts (the allocator's share, deterministic mode's flags, the autotuning
    cache: tessera/run/environment.py), before anything of this process imports JAX. The spec is loaded without JAX."""
    from tessera.run.environment import configure_process

    configure_process(exp)


def cmd_run(args: argparse.Namespace) -> int:
    """Run the spec's task and leave a reproducible run directory."""
    from tessera.spec import load_experiment

    _before_jax(load_experiment(args.spec, overrides=list(args.overrides or ())))
    from tessera.run.main import run_command

    return run_command(args.spec, overrides=args.overrides, out=args.out, weights=args.weights,
                       resume=args.resume)


def cmd_profile(args: argparse.Namespace) -> int:
    """Run a few steps of the spec's task under the profiler; print time per IR op, kernel, collective."""
    from tessera.spec import load_experiment

    _before_jax(load_experiment(args.spec, overrides=list(args.overrides or ())))
    from tessera.run.profile import profile_command

    return profile_command(args.spec, overrides=args.overrides, steps=args.steps, out=args.out, top=args.top)


def cmd_replay(args: argparse.Namespace) -> int:
    """Re-run a manifest's spec and say whether every number is bit-identical."""
    import json
    from pathlib import Path

    from tessera.run.environment import recorded_settings

    try:  # deterministic mode and whether the task trains; replay itself reports an unreadable manifest
        _before_jax(recorded_settings(json.loads(Path(args.manifest).read_text())["spec"]))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass
    from tessera.run.replay import replay_command

    return replay_command(args.manifest, out=args.out)


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two manifests: spec differences first, then metrics."""
    from tessera.run.replay import diff_command

    return diff_command(args.a, args.b)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera", description="A declarative model compiler for JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("check", help="validate a spec and its model")
    p.add_argument("spec")
    _add_set(p)
    p.add_argument("--print-resolved", action="store_true", help="print the resolved spec as YAML")
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("ir", help="print the Graph IR of a spec")
    p.add_argument("spec")
    _add_set(p)
    p.add_argument("--after", metavar="PASS", default=None,
                   help="show the graph after this pass (`lower`: and the implementation each op takes)")
    p.add_argument("--roundtrip", action="store_true", help="exit 0 only if print→parse→print is identical")
    p.set_defaults(handler=cmd_ir)

    p = sub.add_parser("plan", help="parameters, memory, FLOPs and communication per device")
    p.add_argument("spec")
    _add_set(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device", default=None, help="h100, h200, a100, cpu, ... (default: this machine)")
    p.add_argument("--no-compile", action="store_true", help="skip the ahead-of-time compile")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices `mesh: auto` chooses among (default: this machine's)")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("run", help="run the spec's task")
    p.add_argument("spec")
    _add_set(p)
    p.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>-<hash>)")
    p.add_argument("--weights", default=None, help="Hugging Face checkpoint directory to load")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("profile", help="time per Graph IR op, kernel and collective of the spec's task")
    p.add_argument("spec")
    _add_set(p)
    p.add_argument("--steps", type=_positive, default=3, metavar="N", help="steps timed as `tessera run` runs them, then traced (default 3)")
    p.add_argument("--out", default=None, help="run directory (default runs/<name>-profile-<time>-<hash>)")
    p.add_argument("--top", type=_positive, default=15, metavar="K", help="kernels listed (ops: twice as many)")
    p.set_defaults(handler=cmd_profile)

    p = sub.add_parser("replay", help="re-run a manifest and compare bit for bit")
    p.add_argument("manifest")
    p.add_argument("--out", default=None, help="where to put the replayed run")
    p.set_defaults(handler=cmd_replay)

    p = sub.add_parser("diff", help="compare two manifests")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(handler=cmd_diff)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tessera` console script."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except TesseraError as exc:
        print(exc.render(), file=sys.stderr)
        n = sum(d.severity == "error" for d in exc.diagnostics)  # notes say where, they are not more errors
        if n > 1:
            print(f"{n} errors", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tessera plan ... | head`: the reader left; that is not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
