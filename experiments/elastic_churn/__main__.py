"""``python -m experiments.elastic_churn``: the churn study on the simulator (:mod:`experiments.elastic_churn.study`);
``--real``: with real processes of the main job (:mod:`experiments.elastic_churn.real`)."""

import sys

if __name__ == "__main__":
    if "--real" in sys.argv[1:]:
        from experiments.elastic_churn.real import main

        sys.exit(main([a for a in sys.argv[1:] if a != "--real"]))
    from experiments.elastic_churn.study import main

    sys.exit(main())
