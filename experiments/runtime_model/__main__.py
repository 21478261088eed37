"""``python -m experiments.runtime_model``: the runtime model's tables (:mod:`experiments.runtime_model.cli`)."""

from experiments.runtime_model.cli import main

if __name__ == "__main__":
    main()
