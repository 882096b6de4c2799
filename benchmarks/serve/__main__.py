from benchmarks.serve.run import main

main()
