"""Command line: ``python -m helpers {run, gate, bench, scale-report, methods, stage-kaggle}``."""

from __future__ import annotations

import argparse
import os
import sys

from helpers.cce.device import CARDS
from helpers.lab.profiles import PROFILES


def _at_least(least: int):
    """An argparse type: an int of at least ``least``, or argparse's own error naming the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
        return value
    return parse


def _known_methods(names: list[str] | None) -> None:
    """Exit with a message naming ``--methods``' unknown names and the registered ones (none: all)."""
    from helpers.compare.methods import METHODS

    unknown = [n for n in names or () if n not in METHODS]
    if unknown:
        sys.exit(f"--methods: no method {', '.join(map(repr, unknown))}; registered: {', '.join(METHODS)}")


def _pretend(args) -> None:
    """Under ``--pretend CARD`` this process (and what it starts) is that card (``helpers.cce.device``)."""
    if getattr(args, "pretend", None):
        from helpers.cce.device import pretend
        from helpers.cce.kernels.configs import tier_for_card

        try:
            card = pretend(args.pretend)
        except ValueError as refused:  # a GPU smaller than the card
            raise SystemExit(str(refused)) from None
        print(f"pretending to be {card.a_label} (configuration tier {tier_for_card(card).name})")


def _run(args) -> int:
    from helpers.suite.runner import parse_parameters, run_suite

    runs = run_suite(args.profile, args.output, args.only, args.timeout, args.pretend_t4, args.quick,
                     parse_parameters(args.parameter), pretend=args.pretend)
    return 0 if all(r.status == "ok" for r in runs) else 1


def _gate(args) -> int:
    import torch

    from helpers.compare.gate import gate_cases, run_gate
    from helpers.lab.profiles import get_profile

    _known_methods(args.methods)
    _pretend(args)
    profile = get_profile(args.profile)
    dtypes = tuple(getattr(torch, d) for d in (args.dtypes or profile.dtypes))
    settings = profile.section("01_correctness")
    cases = gate_cases(settings["shapes"], settings.get("realistic", ()))
    report = run_gate(args.methods, dtypes, cases, raise_on_failure=False, progress=True)
    print(report.markdown())
    if args.output:
        print(f"wrote {report.to_json(args.output)}")
    if report.failures:
        print(report.failure_message(), file=sys.stderr)
    return 1 if report.failures else 0


def _bench(args) -> int:
    import torch

    from helpers.compare.bench import bench_table, run_bench

    _known_methods(args.methods)
    _pretend(args)
    records = run_bench(
        args.methods, args.shapes, args.regimes, tuple(getattr(torch, d) for d in args.dtypes),
        args.N, args.output, args.warmup, args.repeats, args.time_failed,
    )
    print(bench_table(records))
    if args.output:
        print(f"results written to {args.output} (a fresh file: what was there is replaced)")
    return 1 if any(r.status == "error" for r in records) else 0


def _scale_report(args) -> int:
    from helpers.lab.scale import write_scale_report

    if not os.path.exists(args.bench) or os.path.isdir(args.bench):  # a pipe may be read
        print(f"bench: no results file at {args.bench!r} (make one with python -m helpers bench --output FILE)",
              file=sys.stderr)
        return 2
    try:
        table, figure = write_scale_report(args.bench, args.output_dir, args.shape, args.regime, args.dtype,
                                           args.matmul_tflops)
    except ValueError as wrong:  # the file holds no such slice: say what it holds
        print(wrong, file=sys.stderr)
        return 2
    print(table.read_text())
    print(f"wrote {table} and {figure}")
    return 0


def _methods(args) -> int:
    import torch

    from helpers.compare.methods import METHODS, primary_methods
    from helpers.compare.units import dtype_name
    from helpers.cce.device import default_device, device_info

    _pretend(args)
    device = default_device()
    print(device_info(device).describe())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        print(f"\n{dtype_name(dtype)}:")
        for name in primary_methods():
            method = METHODS[name]
            reason = method.why_unavailable(device, dtype)
            print(f"  {name:<16} {'runs here' if reason is None else 'unavailable: ' + reason}")
    return 0


def _stage_kaggle(args) -> int:
    from helpers.suite.kaggle import stage_from_args

    return stage_from_args(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    profiles = ["auto", *PROFILES]

    run = sub.add_parser("run", help="execute every notebook headless with papermill")
    run.add_argument("--profile", default="auto", choices=profiles, help="run size (default: for the hardware found)")
    run.add_argument("--output", default="results", help="folder for executed notebooks and results")
    run.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 02")
    run.add_argument("--timeout", type=_at_least(1), default=None, help="seconds a single cell may run")
    pretend_help = ("as the card would see it, on a bigger GPU: its memory cap, shared memory per block, compute "
                    "capability and configuration tier; not its speed (on a CPU: its configuration tier)")
    run.add_argument("--pretend", choices=list(CARDS), metavar="CARD",
                     help=f"run every notebook {pretend_help}; the T4 runs its fp16 profile, the others 'gpu'. "
                     f"CARD: {', '.join(CARDS)}")
    run.add_argument("--pretend-t4", action="store_true", help="--pretend t4 (a free Kaggle/Colab T4)")
    run.add_argument("--quick", action="store_true",
                     help="each notebook's short run (a coarser sweep, fewer steps): minutes, not the full picture")
    run.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                     help="a notebook parameter, for the notebooks that declare it, e.g. -p SOLUTIONS False "
                     "(the workshop as an attendee runs it); VALUE is read as a Python literal")
    run.set_defaults(func=_run)

    gate = sub.add_parser("gate", help="run the correctness gate and print its table")
    gate.add_argument("--profile", default="auto", choices=profiles)
    gate.add_argument("--methods", nargs="*", help="method names (default: all registered)")
    gate.add_argument("--dtypes", nargs="*", choices=["float32", "float16", "bfloat16"])
    gate.add_argument("--output", help="write the report as JSON here")
    gate.add_argument("--pretend", choices=list(CARDS), metavar="CARD", help=f"run {pretend_help}. CARD: "
                      f"{', '.join(CARDS)}")
    gate.set_defaults(func=_gate)

    from helpers.compare.bench import SHAPES
    from helpers.compare.inputs import REGIMES

    bench = sub.add_parser("bench", help="time and measure methods side by side (gate first)")
    bench.add_argument("--methods", nargs="+", default=["torch_compile", "liger", "apple_cce", "ours"])
    bench.add_argument("--shapes", nargs="+", default=["gemma2-2b"], choices=sorted(SHAPES))
    bench.add_argument("--regimes", nargs="+", default=["uniform"], choices=REGIMES)
    bench.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["float32", "float16", "bfloat16"])
    bench.add_argument("--N", nargs="+", type=_at_least(1), help="token counts (default: each shape's list)")
    bench.add_argument("--output", help="write results here, replacing the file, as they are measured: JSON Lines, a "
                       "meta record first (device, versions, command)")
    bench.add_argument("--warmup", type=_at_least(0), default=2)
    bench.add_argument("--repeats", type=_at_least(1), default=7)
    bench.add_argument("--time-failed", action="store_true", help="also time methods that fail the gate")
    bench.add_argument("--pretend", choices=list(CARDS), metavar="CARD", help=f"measure {pretend_help}; the "
                       f"results file's meta record names the card. CARD: {', '.join(CARDS)}")
    bench.set_defaults(func=_bench)

    scale = sub.add_parser("scale-report", help="from a bench results file: time against N for every method, and "
                           "ours against the four-product floor (scale.md, scale.png)")
    scale.add_argument("bench", help="a results file of `python -m helpers bench --output`")
    scale.add_argument("--output-dir", required=True, help="folder for scale.md and scale.png")
    scale.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES), help="the head (default: Qwen3's)")
    scale.add_argument("--regime", help="input regime (default: the shape's first in the file)")
    scale.add_argument("--dtype", help="dtype (default: the shape's first in the file)")
    scale.add_argument("--matmul-tflops", type=float,
                       help="the matmul rate the floor is drawn at (default: the one the bench measured)")
    scale.set_defaults(func=_scale_report)

    methods = sub.add_parser("methods", help="list the registered methods and whether each runs here")
    methods.add_argument("--pretend", choices=list(CARDS), metavar="CARD", help=f"list them {pretend_help}")
    methods.set_defaults(func=_methods)

    from helpers.suite.kaggle import add_stage_arguments

    stage = sub.add_parser(
        "stage-kaggle", help="stage one push-ready Kaggle folder per notebook, and the offline wheels"
    )
    add_stage_arguments(stage)
    stage.set_defaults(func=_stage_kaggle)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
