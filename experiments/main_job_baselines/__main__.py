from experiments.main_job_baselines.study import main

main()
