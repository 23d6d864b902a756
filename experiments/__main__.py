"""`python -m experiments` lists the experiments; `python -m experiments NAME [--tiny] [--output_dir DIR]
[--work_dir DIR] [--model DIR] [--start DIR] [--seed N]` runs one (from a checkout's root; `python -m
train.experiments` is the same command)."""
import argparse
import shlex
import sys

import experiments
from experiments.common import RESULTS_ROOT, ExperimentArgs
from livemoe.train.config import DEFAULT_STUDENT, run_cli


def main(argv=None, prog: str = "python -m experiments") -> int:
    """`prog`: the command as the user typed it, for --help and the reports (`python -m train.experiments` runs
    main with its own name)."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                 epilog="experiments:\n" + experiments.listing(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="the experiment to run (none: list them)")
    ap.add_argument("--tiny", action="store_true", help="the seconds-long configuration the test suite runs")
    ap.add_argument("--output_dir", default="", help=f"where the report goes (default: {RESULTS_ROOT}/NAME, "
                                                     "NAME/tiny with --tiny)")
    ap.add_argument("--work_dir", default="", help="where the trainers' runs go (default: runs/experiments/NAME)")
    ap.add_argument("--model", default=DEFAULT_STUDENT, help="the base student (default: livemoe/train/assets/student)")
    ap.add_argument("--start", default="", help="length_sweep, reward_ablation, rollout_mismatch: the RFT student GRPO "
                                                "starts from "
                                                "(default: run livemoe.train.rft first, into WORK_DIR/rft)")
    ap.add_argument("--seed", type=int, default=0, help="seed of every arm (default: 0)")
    ap.add_argument("--no_progress", action="store_true", help="no progress bars or per-step lines")
    a = ap.parse_args(argv)
    if a.name is None:
        print(f"experiments ({prog} NAME [--tiny]):\n" + experiments.listing())
        return 0

    def body():
        exp = experiments.get(a.name)
        if a.start and not exp.USES_START:
            raise experiments.ExperimentError(f"--start: {a.name} does not start from an RFT student "
                                              "(only length_sweep, reward_ablation and rollout_mismatch do)")
        args = ExperimentArgs(name=a.name, tiny=a.tiny, output_dir=a.output_dir, work_dir=a.work_dir, model=a.model,
                              start=a.start, seed=a.seed, progress=not a.no_progress,
                              command=" ".join([prog, shlex.join(argv)]).strip())
        exp.run(args)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
