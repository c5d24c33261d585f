"""The ``labkit`` command. One function per subcommand adds its parser and sets ``func``.

    labkit run                           # every notebook, profile picked from the device
    labkit run 01 03 --profile gpu-seed -p pool_tokens 262144 -p context_lens '[4096, 8192]'
    labkit run --dry-run                 # check and print the parameters, run nothing
    labkit profiles                      # the profiles and what they set
    labkit bench --grid gpu              # the benchmark (python -m labkit.bench)
    labkit targets data/reference/h200/20261206-044000-run17/17c/bench   # one bench run against the targets

A bad parameter ends with one line naming it and what is allowed (exit code 2), before any work;
a failed notebook (exit 1) or Ctrl-C (exit 130) ends with one line naming the kept run folder.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def parse_value(text: str):
    """A ``-p`` value as a YAML/JSON literal (``8``, ``null``, ``[1, 2]``, ``uniform:1:9``)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _fail(command: str, message: str, code: int = EXIT_USAGE) -> int:
    print(f"labkit {command}: error: {message}", file=sys.stderr)
    return code


# -- labkit run -------------------------------------------------------------------------------
def add_run(sub) -> None:
    p = sub.add_parser("run", help="execute the notebooks into a new run folder under data/runs/")
    p.add_argument("notebooks", nargs="*", help="numbers or names (01 03); default: all")
    p.add_argument("--profile", help="named parameter set (labkit profiles); default: from the device")
    p.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="override one parameter; VALUE is a YAML/JSON literal")
    p.add_argument("--out", help="folder that receives the run folder (default data/runs)")
    p.add_argument("--dry-run", action="store_true", help="check and print the parameters only")
    p.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    p.set_defaults(func=cmd_run)


def cmd_run(args, argv) -> int:
    from . import runner

    overrides = {name: parse_value(value) for name, value in args.param}
    try:
        plan = runner.plan(args.notebooks, args.profile, overrides)
    except ValueError as e:
        return _fail("run", str(e))
    plan.command = "labkit " + shlex.join(argv)
    if args.dry_run:
        print(json.dumps(dict(profile=plan.profile, notebooks=[nb.stem for nb in plan.notebooks],
                              params=plan.params), indent=1))
        return 0
    try:
        run_dir = runner.execute(plan, **({"base": args.out} if args.out else {}),
                                 progress=not args.no_progress)
    except runner.NotebookFailed as e:
        return _fail("run", str(e), code=1)
    except runner.RunInterrupted as e:
        return _fail("run", str(e), code=EXIT_INTERRUPTED)
    print(run_dir)
    return 0


# -- labkit profiles --------------------------------------------------------------------------
def add_profiles(sub) -> None:
    p = sub.add_parser("profiles", help="list the parameter profiles")
    p.set_defaults(func=cmd_profiles)


def cmd_profiles(args, argv) -> int:
    from . import profiles

    print(f"defaults (the notebooks' parameters cells): {json.dumps(profiles.DEFAULTS)}")
    for name, over in profiles.PROFILES.items():
        print(f"{name}: {json.dumps(over)}")
    return 0


# -- labkit bench ------------------------------------------------------------------------------
def add_bench(sub) -> None:
    # listed here for `labkit --help`; main() hands everything after `bench` to labkit.bench itself
    sub.add_parser("bench", help="the paths and peers side by side over a shape grid (labkit bench --help)")


# -- labkit targets ----------------------------------------------------------------------------
def add_targets(sub) -> None:
    p = sub.add_parser("targets", help="one benchmark run against FlashInfer's BF16 kernel and data/targets.json "
                                       "(and the 656-byte layout against the per-tensor one)")
    p.add_argument("records", help="a bench.parquet, or the folder that holds one")
    p.add_argument("--value", default="graph_us", choices=("graph_us", "median_ms"),
                   help="the timing compared (default: CUDA-graph medians)")
    p.add_argument("--targets", help="a targets file (default data/targets.json)")
    p.set_defaults(func=cmd_targets)


def cmd_targets(args, argv) -> int:
    from pathlib import Path

    import pandas as pd

    from . import tables

    path = Path(args.records)
    path = path / "bench.parquet" if path.is_dir() else path
    if not path.is_file():
        return _fail("targets", f"records={args.records!r}: no bench.parquet there")
    records, targets = pd.read_parquet(path), tables.load_targets(args.targets)
    ours = tables.against_flashinfer(records, args.value)
    gap = tables.layout_gap(records, args.value, targets["ds_mla_within"])
    if ours.empty and gap.empty:
        return _fail("targets", f"records={args.records!r}: no shape with both FlashInfer BF16 and fp8_native rows, "
                                "nor a sparse shape on both FP8 layouts")
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.3g}".format):
        if not ours.empty:
            met = tables.against_targets(ours, targets)
            print(f"{args.value}, ours against FlashInfer BF16 (fi/ours above 1: ours faster):\n{ours.to_string()}")
            print(f"\nagainst the targets ({sum(met.met) if len(met) else 0} of {len(met)} met):\n"
                  f"{met.to_string() if len(met) else '(no target shape in this run)'}")
        if not gap.empty:
            print(f"\n{args.value}, the 656-byte fp8_ds_mla layout against the per-tensor one (ratio <= "
                  f"{1 + targets['ds_mla_within']:.2f}: {sum(gap.met)} of {len(gap)} met):\n{gap.to_string()}")
    return 0


SUBCOMMANDS = [add_run, add_profiles, add_bench, add_targets]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from . import bench

        return bench.main(argv[1:])
    parser = argparse.ArgumentParser(prog="labkit", description="The FP8 KV-cache decode lab.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    return args.func(args, argv)


if __name__ == "__main__":
    sys.exit(main())
