from benchmarks.floor.run import main

main()
