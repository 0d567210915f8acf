"""Entry point of each rank started by :class:`app.strategies.launch.MPIRunLauncher` (not for direct use)."""

import pickle
import sys

import app  # noqa: F401  (registers the strategies before anything is unpickled)


def main(job_path: str, result_path: str) -> None:
    with open(job_path, "rb") as f:
        launcher, trainer, function, args, kwargs = pickle.load(f)  # written by our own launcher, mode 0700
    launcher.run_in_rank(trainer, function, args, kwargs, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
