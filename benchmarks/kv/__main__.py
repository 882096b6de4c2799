from benchmarks.kv.run import main

main()
