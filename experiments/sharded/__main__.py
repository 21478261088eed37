from experiments.sharded.study import main

main()
